"""scripts/benchmarks/data_memory.py runs end to end on a small corpus and reports both modes."""

import json
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_data_memory_script_reports_both_modes(capsys):
    script = runpy.run_path(str(ROOT / "scripts/benchmarks/data_memory.py"), run_name="data_memory")
    assert script["main"](["--tokens", "30000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for mode in ("memory-mapped", "in-memory"):
        assert out[mode]["sequences"] > 1 and out[mode]["open_s"] > 0
    assert out["memory-mapped"]["sequences"] == out["in-memory"]["sequences"]
    assert {"memory_ratio", "private_memory_ratio", "open_time_ratio", "load_avg_1m"} <= set(out)
