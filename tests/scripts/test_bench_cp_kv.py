"""scripts/benchmarks/bench_cp_kv.py on a small batch: both K/V states train, replicated state moves
less and keeps CP times the state (the measured run is the script's job; its numbers are in
docs/benchmarks.md)."""

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
    shard, rep = json.loads(out.read_text())["results"]
    assert (shard["cp_kv"], rep["cp_kv"]) == ("sharded", "replicated")
    assert rep["gathered_bytes"] < shard["gathered_bytes"]
    assert rep["reduce_scattered_bytes"] < shard["reduce_scattered_bytes"]
    assert rep["state_peak_bytes"] == 2 * shard["state_peak_bytes"]  # CP 2
