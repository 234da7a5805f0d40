"""scripts/gpu/device_check.sh --dry-run: the GPU machine's one prepared run, on CPU with a tiny
model (every step's plumbing, JSON and PNG); the real run needs a GPU (docs/benchmarks-appendix.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_chunkflow import compat

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_reports_every_step(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(ROOT / "scripts/gpu/device_check.sh"), "--out", str(out),
                          "--dry-run"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHON": sys.executable,
                              "DEVICE_CHECK_SIMULATE_OOM": "chunkflow,megatron-packed"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "device_check.json").read_text())
    assert report["dry_run"] and set(report["steps"]) == {"tests", "calibrate", "exactness",
                                                          "bench", "launcher"}
    launcher = report["steps"]["launcher"]  # pretrain_gpt.py --chunkflow, where a checkout is
    megatron_lm = Path(os.environ.get(
        "MEGATRON_LM_DIR", ROOT / "third_party" / f"Megatron-LM-{compat.megatron_lm_tag()}"))
    if (megatron_lm / "pretrain_gpt.py").is_file():
        assert launcher["status"] == "ok" and len(launcher["losses"]) == 4, launcher
    else:
        assert launcher["status"] == "skipped" and "no Megatron-LM checkout" in launcher["skipped"]
    assert all(step["status"] == "ok" for name, step in report["steps"].items()
               if name != "launcher")
    rows = {(r["backend"], r["dtype"]): r for r in report["steps"]["exactness"]["rows"]}
    assert rows["cpu_flash", "float64"]["max_rel_grad_err"] <= 1e-10
    assert rows["cpu_flash", "bfloat16"]["max_rel_grad_err"] <= 5e-2
    assert rows["flex", "float64"]["passed"] is None  # forward-only on CPU: said, not hidden
    bench = report["steps"]["bench"]
    assert bench["attention_backend"] == "cpu_flash"  # the fastest backend found exact
    assert set(bench["systems"]) == {"chunkflow", "megatron-sft", "megatron-packed",
                                     "megatron-unpacked"}
    assert all(r["tokens_per_s"] > 0 for r in bench["systems"].values())
    assert bench["systems"]["chunkflow"]["chunk_size"] and bench["systems"]["chunkflow"]["k"]
    # the back-off: an out-of-memory first attempt recorded with the allocator's message, then the
    # next smaller plan (ChunkFlow half the chunk, stock the next recompute option) measured
    cf, packed = bench["systems"]["chunkflow"]["attempts"], bench["systems"]["megatron-packed"]
    assert [a["status"] for a in cf] == ["oom", "ok"] and "Tried to allocate" in cf[0]["error"]
    assert cf[1]["chunk_size"] == cf[0]["chunk_size"] // 2 == bench["systems"]["chunkflow"][
        "chunk_size"]
    assert [a["status"] for a in packed["attempts"]] == ["oom", "ok"]
    assert packed["recompute"] == packed["attempts"][1]["recompute"] != \
        packed["attempts"][0]["recompute"]
    assert [a["status"] for a in bench["systems"]["megatron-sft"]["attempts"]] == ["ok"]
    assert bench["step1_loss_rel_spread"] < 1e-6  # the same weights and data everywhere
    # one profiled step per system: its time by kernel family, GEMMs and attention among them
    for r in bench["systems"].values():
        assert {"gemm", "attention", "elementwise"} <= set(r["profile"]["seconds"]), r["profile"]
        assert r["profile"]["total_s"] > 0 and len(r["profile"]["top"]) == 10
    calibrate = report["steps"]["calibrate"]  # the reference H200 steps re-predicted with it
    assert len(calibrate["reference_steps"]) == 4 and calibrate["rates"]["spec"] == "local"
    assert (out / "device_check.png").stat().st_size > 0
    assert (out / "calibration.json").is_file()
    # what a GPU machine returns: at most 8 files, the steps' logs folded into one
    assert sorted(p.name for p in out.iterdir()) == ["calibration.json", "device_check.json",
                                                     "device_check.log", "device_check.png"]
    assert "==== bench.log ====" in (out / "device_check.log").read_text()


@pytest.mark.slow
def test_a_step_runs_in_a_new_interpreter_as_on_the_gpu(tmp_path):
    """Without --dry-run each step is a new Python (`device_check.py --step NAME`), not a fork of
    the dry run's warm process: the tests step, whose GPU tests all skip on CPU."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/device_check.py"), "--out",
                          str(tmp_path), "--steps", "tests"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[device_check] torch " in run.stdout and " megatron-core " in run.stdout
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert not report["dry_run"] and list(report["steps"]) == ["tests"]
    assert report["steps"]["tests"]["status"] == "ok"
    assert "skipped" in report["steps"]["tests"]["summary"]


def test_unknown_step_is_refused(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/device_check.py"), "--out",
                          str(tmp_path), "--steps", "tests,warp"], capture_output=True, text=True)
    assert run.returncode == 2 and "--steps: unknown step(s) warp" in run.stderr
