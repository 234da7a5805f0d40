"""scripts/benchmarks/gain_map.py: its cells are `chunkflow simulate`'s comparison (the same
speedup against the same strongest stock baseline), drawn and tabulated.

    python -m pytest tests/scripts/test_gain_map.py -q
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from megatron_chunkflow.cli import main as cli_main

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BATCH = 32  # a small global batch: seconds a cell


def _script():
    spec = importlib.util.spec_from_file_location("gain_map",
                                                  REPO / "scripts/benchmarks/gain_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _simulate(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert cli_main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("device", ["h200"])  # the calibrated profile; h100 is the same code
def test_a_cell_is_what_simulate_says(device, tmp_path):
    gain = _script()
    c = gain.cell("qwen2.5-0.5b", 32768, device, BATCH)
    said = _simulate(gain.simulate_argv("qwen2.5-0.5b", 32768, device, BATCH))
    assert c["strongest"] == said["strongest"] is not None
    assert c["speedup"] == pytest.approx(said["speedup_vs_strongest"], rel=1e-9)
    assert c["verdict"] == said["verdict"]["text"]
    assert c["calibrated"] == (device == "h200")  # the H200 profile is the measured one
    assert c["command"] == "chunkflow " + " ".join(gain.simulate_argv("qwen2.5-0.5b", 32768,
                                                                       device, BATCH))
    # the table and the figure, from a resumed file
    resume = tmp_path / "cells.jsonl"
    resume.write_text(json.dumps(c) + "\n")
    png, md = tmp_path / "map.png", tmp_path / "map.md"
    assert gain.main(["--models", "qwen2.5-0.5b", "--seq-lengths", "32768", "--devices", device,
                      "--global-batch-size", str(BATCH), "--resume", str(resume), "--png",
                      str(png), "--markdown", str(md)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert f"| 0.5B (8) | {c['speedup']:.2f}x {c['strongest'].removeprefix('megatron-')} |" \
        in md.read_text()
    assert len(resume.read_text().splitlines()) == 1  # nothing searched again
