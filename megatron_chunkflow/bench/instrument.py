"""Process-level instruments for comparing training steps (the per-op ones are observers,
runtime/observe.py and runtime/meter.py, which both systems' steps call: mcore/step.py).

- reset_peak_rss / peak_rss: the process's resident-set high-water mark (VmHWM), reset per step.
- cache_freed_memory: glibc malloc told to keep freed memory, like a GPU caching allocator.
"""

from __future__ import annotations

import contextlib
import re


def reset_peak_rss(trim: bool = True) -> None:
    """Reset VmHWM (Linux) to the current RSS; with `trim`, first give freed heap back to the OS
    so that the next step's high-water mark is its own."""
    import ctypes

    if trim:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def cache_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse, as PyTorch's CUDA caching allocator does:
    no mmap for large blocks (M_MMAP_MAX = 0) and no trimming (M_TRIM_THRESHOLD at its maximum).
    Otherwise every allocation above 32 MB is a fresh mmap whose pages fault in on first touch
    (about 0.25 ms per MB here), a cost that falls on big micro-batches and that a GPU does not
    have. False where it cannot be set (not glibc)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(
            libc.mallopt(m_trim_threshold, ctypes.c_int(2**31 - 1)))
    except (OSError, AttributeError):
        return False


def peak_rss() -> int:
    with contextlib.suppress(OSError):
        match = re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read())
        if match:
            return int(match.group(1)) * 1024
    from megatron_chunkflow.mcore.step import peak_memory_bytes

    return peak_memory_bytes()
