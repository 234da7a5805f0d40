"""GPU memory of a real training step, traced on a CPU (memtrace/trace.py)."""
