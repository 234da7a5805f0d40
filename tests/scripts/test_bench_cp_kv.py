"""scripts/benchmarks/bench_cp_kv.py on a small batch: the gather-first path, the ring and replicated
state train; the ring moves the gather's bytes, replicated state less, keeping CP times the state
(the measured run is the script's job; its numbers are in docs/benchmarks.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_small_run(tmp_path):
    out = tmp_path / "cp_kv.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/benchmarks/bench_cp_kv.py"),
                          "--steps", "1", "--long", "1024", "--chunk-size", "256",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| replicated |" in run.stdout
    shard, ring, rep = json.loads(out.read_text())["results"]
    assert [(r["cp_kv"], r["cp_attention"]) for r in (shard, ring, rep)] == [
        ("sharded", "gather"), ("sharded", "ring"), ("replicated", "ring")]
    for key in ("gathered_bytes", "reduce_scattered_bytes", "state_peak_bytes"):
        assert ring[key] == shard[key] > 0
    assert rep["gathered_bytes"] < shard["gathered_bytes"]
    assert rep["reduce_scattered_bytes"] < shard["reduce_scattered_bytes"]
    assert rep["state_peak_bytes"] == 2 * shard["state_peak_bytes"]  # CP 2
