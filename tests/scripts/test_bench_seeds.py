"""scripts/benchmarks/bench_seeds.py (make bench-cpu): one real `chunkflow bench` per (global
batch, seed), summarised as median and range per baseline. Numbers asserted are the runs' own
ratios, never speeds."""

import json
import runpy
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = runpy.run_path(str(ROOT / "scripts/benchmarks/bench_seeds.py"), run_name="bench_seeds")
TINY = ["--model", "tiny", "--seq-length", "1024", "--scale", "0.0625", "--warmup", "0",
        "--repeats", "1", "--budget-mib", "8", "--threads", "1"]


@pytest.mark.slow
def test_two_seeds_summarised_per_baseline(tmp_path, capsys):
    assert SCRIPT["main"](["--global-batch-sizes", "8", "--seeds", "0,1", "--out",
                           str(tmp_path), "--wait", "0", "--", *TINY,
                           "--baseline", "megatron-packed"]) == 0
    rows = json.loads((tmp_path / "bench_seeds.json").read_text())
    assert [(r["global_batch_size"], r["seed"]) for r in rows] == [(8, 0), (8, 1)]
    assert rows[0]["tokens"] != rows[1]["tokens"]  # two different batches
    for r in rows:
        assert list(r["speedups"]) == ["megatron-packed"]
        assert r["speedups"]["megatron-packed"] == pytest.approx(
            r["step_s"]["megatron-packed"] / r["step_s"]["chunkflow"])
        assert r["load_average_1min"]  # every row says the load it ran under
    table = (tmp_path / "bench_seeds.md").read_text().splitlines()
    row = next(line for line in table if line.startswith("| 8 |"))
    speedups = [r["speedups"]["megatron-packed"] for r in rows]
    assert f"{statistics.median(speedups):.2f}x ({min(speedups):.2f}-{max(speedups):.2f})" in row
    assert table[3].count("|") == row.count("|")  # the separator matches the header


def test_bad_lists_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        SCRIPT["main"](["--seeds", "0,x"])
    assert e.value.code == 2 and "--seeds" in capsys.readouterr().err
