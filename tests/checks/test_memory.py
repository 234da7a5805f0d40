"""Activation memory follows the chunk size (checks/memory.py through `chunkflow verify --memory`).

    python -m pytest tests/checks/test_memory.py -q

Bad `chunkflow verify` input is tests/cli/test_verify.py's; the memory bound per pipeline stage is
tests/runtime/test_pipeline.py's.
"""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

C = 64


def run_cli(*argv, check=True):
    proc = subprocess.run([sys.executable, "-m", "megatron_chunkflow", *argv],
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr[-3000:])
    return proc


def test_memory_flat_in_length():
    """K=1, C fixed, L from 4C to 16C: activations other than K/V-sized terms stay flat (< 1.25x),
    unchunked grows >= 3x, and the K/V-sized bytes match the documented formula within 10%."""
    proc = run_cli("verify", "--memory", "--lengths", f"{4 * C},{8 * C},{16 * C}",
                   "--chunk-size", str(C), "--chunkflow-k", "1", "--json")
    rows = json.loads(proc.stdout)["rows"]
    first, last = rows[0], rows[-1]
    assert last["chunked_bytes"] / first["chunked_bytes"] < 1.25
    assert last["unchunked_bytes"] / first["unchunked_bytes"] >= 3
    for row in rows:
        assert row["state_bytes"] == pytest.approx(row["state_formula_bytes"], rel=0.10)
        assert row["chunked_bytes"] < row["unchunked_bytes"]
