"""scripts/benchmarks/bench_cp_kv.py on a small batch: the gather-first path, the ring, replicated
state and the ring with every segment split train; the ring moves the gather's bytes, replicated
state less, keeping CP times the state, and the hybrid placement less than splitting every
segment (the measured run is the script's job; its numbers are in docs/benchmarks-appendix.md)."""

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
                          "--steps", "1", "--long", "2048", "--chunk-size", "1024",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| replicated |" in run.stdout
    shard, ring, rep, split = json.loads(out.read_text())["results"]
    assert [(r["cp_kv"], r["cp_attention"], r["cp_placement"]) for r in (shard, ring, rep, split)
            ] == [("sharded", "gather", "hybrid"), ("sharded", "ring", "hybrid"),
                  ("replicated", "ring", "hybrid"), ("sharded", "ring", "split")]
    for key in ("gathered_bytes", "reduce_scattered_bytes", "state_peak_bytes"):
        assert ring[key] == shard[key] > 0
    assert rep["gathered_bytes"] < shard["gathered_bytes"]
    assert rep["reduce_scattered_bytes"] < shard["reduce_scattered_bytes"]
    assert rep["state_peak_bytes"] == 2 * shard["state_peak_bytes"]  # CP 2
    # the hybrid placement keeps packed short sequences whole: only the split ones move
    assert split["gathered_bytes"] > ring["gathered_bytes"]
    assert split["reduce_scattered_bytes"] > ring["reduce_scattered_bytes"]
    assert split["state_peak_bytes"] == ring["state_peak_bytes"]
    assert "hybrid placement: sharded, ring / sharded, ring, every segment split" in run.stdout
