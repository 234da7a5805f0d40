"""scripts/benchmarks/bench_reforward.py on a small batch: the three ways of running a re-forward's
attention train alike (the same gradient norms); keep and offload receive no K/V in the
re-forwards, keep holds the kept attention on the device, offload in host memory (the measured run
is the script's job; its numbers are in docs/benchmarks-appendix.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_small_run(tmp_path):
    out = tmp_path / "reforward.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/benchmarks/bench_reforward.py"),
                          "--steps", "1", "--long", "2048", "--chunk-size", "512",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "keep / recompute: step" in run.stdout
    recompute, keep, offload = json.loads(out.read_text())["results"]
    assert [r["reforward_attention"] for r in (recompute, keep, offload)] == [
        "recompute", "keep", "offload"]
    for r in (keep, offload):
        assert r["grad_norms"] == pytest.approx(recompute["grad_norms"], rel=1e-5)
        assert 0 < r["gathered_bytes"] < recompute["gathered_bytes"]
        assert r["reduce_scattered_bytes"] == recompute["reduce_scattered_bytes"]
    assert keep["state_peak_bytes"] > recompute["state_peak_bytes"] == offload["state_peak_bytes"]
    assert keep["host_peak_bytes"] == recompute["host_peak_bytes"] == 0
    assert offload["host_peak_bytes"] == keep["state_peak_bytes"] - recompute["state_peak_bytes"]
