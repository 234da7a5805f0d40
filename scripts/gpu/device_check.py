"""One prepared run on a GPU machine: the GPU tests, a calibration, exactness per attention
backend, and ChunkFlow against the stock baselines; everything as JSON and PNG under --out.

    bash scripts/gpu/device_check.sh --out DIR            # on a bare GPU machine (wheels first)
    python scripts/gpu/device_check.py --out DIR --dry-run   # the same plumbing on CPU, tiny

Each step runs in its own process with its own time limit (what one step breaks, the others
still report; the dry run forks them from one process that imported torch and megatron-core), in
a scratch folder; DIR gets four files (a GPU machine returns at most 8):
device_check.json (every step's result), device_check.log (every step's output),
device_check.png and calibration.json. The steps:

1. tests: `pytest tests/gpu -m gpu` (kernel error budgets of every installed backend).
2. calibrate: `chunkflow calibrate` -> DIR/calibration.json, a device profile (--gpu-profile).
3. exactness: chunked vs unchunked megatron-core gradients for each attention backend installed:
   float32 (max relative gradient error <= 1e-5 on a GPU) and bfloat16 (<= BF16_BUDGET: bf16 keeps
   8 mantissa bits, eps 7.8e-3, and chunking reorders its sums).
4. bench: qwen2.5-1.5b (0.5b when the GPU has under 60 GiB), --seq-length 32768, profile B
   lengths clipped to it with at least one sequence near it, bfloat16: ChunkFlow and each stock
   baseline with the (chunk size, K, recompute) / recompute the simulator picks for this GPU,
   on the fastest backend step 3 found exact; tokens/s, MFU, max_memory_allocated. A system that
   runs out of memory is recorded with the allocator's message (what it asked, what was free) and
   tried again with the next smaller plan (ChunkFlow: half the chunk; stock: the next recompute
   option), each attempt in the JSON; DEVICE_CHECK_SIMULATE_OOM=system,... makes the first
   attempt of those systems fail so, for the dry run.
5. launcher: Megatron-LM's own pretrain_gpt.py with --chunkflow through `python -m
   megatron_chunkflow.launch`: qwen2.5-0.5b (tiny on the dry run), bf16, the distributed optimizer,
   mock data, 4 steps; its losses and iteration times (scripts/gpu/device_launcher.py). The checkout is
   MEGATRON_LM_DIR or third_party/Megatron-LM (on a GPU machine: `make megatron-lm-slim` here, carry
   third_party/megatron-lm-slim, MEGATRON_LM_DIR pointing at it); without one the step says so and
   is skipped.
6. report: DIR/device_check.json, .log and .png.

The dry run (CPU, gloo): the same steps with a tiny model, float64 instead of float32 (CPU
exactness bound 1e-10), a short bench; it is what the test suite runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import device_launcher  # noqa: E402  step 5
from device_launcher import step_launcher  # noqa: E402, F401  (run by name: step_<name>)

STEPS = ("tests", "calibrate", "exactness", "bench", "launcher")
TIMEOUT_S = {"tests": 90, "calibrate": 90, "exactness": 90, "bench": 180, "launcher": device_launcher.TIMEOUT_S}
FP32_BOUND, FP64_BOUND, BF16_BUDGET = 1e-5, 1e-10, 5e-2
BACKENDS = ("flash", "te", "varlen", "flex", "cpu_flash", "sdpa", "torch")  # fastest first
SEQ_LENGTH, GLOBAL_BATCH, PEAK_BF16_TFLOPS = 32768, 128, 989.4  # H100/H200 dense bf16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSON, PNG and logs")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model (the test suite's)")
    ap.add_argument("--steps", default=",".join(STEPS),
                    help=f"comma-separated subset of {','.join(STEPS)} (default: all)")
    ap.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.step:
        result = globals()[f"step_{args.step}"](out, args.dry_run)
        (out / f"{args.step}.json").write_text(json.dumps(result, indent=2))
        return 0
    wanted = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(STEPS))
    if unknown:
        ap.error(f"--steps: unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    out.mkdir(parents=True, exist_ok=True)
    import megatron.core
    import torch

    print("[device_check] torch", torch.__version__, "cuda", torch.cuda.is_available(),
          "megatron-core", megatron.core.__version__, flush=True)
    report = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "load_avg_1m": os.getloadavg()[0], "steps": {}}
    # the steps' own files in a scratch folder, folded into four under --out (a GPU machine
    # returns at most 8): device_check.json, .log, .png and calibration.json
    work = Path(tempfile.mkdtemp(prefix="device_check_"))
    if args.dry_run:
        _warm()
    try:
        with (out / "device_check.log").open("w") as log:
            for step in wanted:
                report["steps"][step] = _run_child(step, work, args.dry_run)
                print(f"[device_check] {step}: {report['steps'][step]['status']} "
                      f"({report['steps'][step]['wall_s']:.0f} s)", flush=True)
                extra = {"tests": "tests_pytest.txt", "launcher": "launcher.log"}.get(step)
                for part in (f"{step}.log", extra):
                    if part and (work / part).is_file():
                        text = (work / part).read_text(errors="replace")
                        log.write(f"==== {part} ====\n{text}\n")
        if (work / "calibration.json").is_file():
            shutil.copyfile(work / "calibration.json", out / "calibration.json")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out / "device_check.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "device_check.png")
    failed = [s for s, r in report["steps"].items() if r["status"] not in ("ok", "skipped")]
    print(f"[device_check] wrote {out / 'device_check.json'}; "
          + (f"not ok: {', '.join(failed)}" if failed else "all steps ok"), flush=True)
    return 1 if failed else 0


def _run_child(step: str, out: Path, dry_run: bool) -> dict:
    """`step` in a fresh process under its time limit: its JSON, or why there is none. On the
    GPU a new interpreter (no CUDA state shared); the CPU dry run forks this one, which has
    imported torch and megatron-core once for every step."""
    t0 = time.perf_counter()
    log = out / f"{step}.log"
    timeout = TIMEOUT_S[step] * (3 if dry_run else 1)
    if dry_run and hasattr(os, "fork"):
        rc = _forked(step, out, log, timeout)
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--step", step]
        cmd += ["--dry-run"] if dry_run else []
        try:
            with log.open("w") as f:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                    timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    result_file = out / f"{step}.json"
    if rc == 0 and result_file.is_file():
        result = json.loads(result_file.read_text())
        status = ("skipped" if result.get("skipped") else
                  "ok" if result.get("passed", True) else "failed")
        return {"status": status, "wall_s": wall, **result}
    tail = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
    return {"status": "error", "returncode": rc, "wall_s": wall, "log_tail": tail}


def _warm() -> None:
    """What every step imports, once, before the dry run forks its steps (no CUDA is touched:
    a forked child starts as a fresh one would, without the imports)."""
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    import megatron_chunkflow.checks.verify  # noqa: F401
    import megatron_chunkflow.cli  # noqa: F401


def _forked(step: str, out: Path, log: Path, timeout: float) -> int | str:
    """`step` in a child forked from this process, its output in `log`: its exit code, or
    "timeout" (the child killed) after `timeout` seconds."""
    import multiprocessing

    sys.stdout.flush()
    sys.stderr.flush()
    child = multiprocessing.get_context("fork").Process(target=_step_in_child,
                                                         args=(step, out, log))
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        return "timeout"
    return child.exitcode


def _step_in_child(step: str, out: Path, log: Path) -> None:
    """A forked step: its output to `log`, its result to STEP.json (a traceback: exit code 1)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(ROOT)
    result = globals()[f"step_{step}"](out, True)
    (out / f"{step}.json").write_text(json.dumps(result, indent=2))
    sys.stdout.flush()


def step_tests(out: Path, dry_run: bool) -> dict:
    """pytest tests/gpu (on CPU every test skips: the plumbing alone)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs",
                          "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True)
    (out / "tests_pytest.txt").write_text(run.stdout[-20000:] + run.stderr[-5000:])
    last = (run.stdout.strip().splitlines() or [""])[-1]
    return {"passed": run.returncode in (0, 5), "returncode": run.returncode, "summary": last}


def step_calibrate(out: Path, dry_run: bool) -> dict:
    import contextlib
    import io

    from megatron_chunkflow.cli import main as chunkflow

    argv = ["calibrate", "--gpu", "h200", "--no-fusions", "--out", str(out / "calibration.json")]
    argv += ["--dry-run", "--repeats", "2", "--warmup", "1"] if dry_run else []
    stdout, stderr = io.StringIO(), io.StringIO()  # `chunkflow ARGV`, in this step's process
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = chunkflow(argv)
        except SystemExit as e:  # a refused flag
            code = e.code if isinstance(e.code, int) else 1
    ok = code == 0 and (out / "calibration.json").is_file()
    result = {"passed": ok, "returncode": code, "log_tail": stdout.getvalue()[-2000:]
              + stderr.getvalue()[-2000:]}
    if ok:
        from megatron_chunkflow.perfmodel.gpu_profiles import (
            REFERENCE_STEPS,
            load_profile,
            reference_predictions,
        )

        profile = json.loads((out / "calibration.json").read_text())
        result["rates"] = {k: v["value"] for k, v in profile["rates"].items()}
        # the measured H200 steps the built-in profile was set against, predicted with this one
        predicted = reference_predictions(load_profile(str(out / "calibration.json")))
        result["reference_steps"] = [
            {"row": list(row), "measured_s": REFERENCE_STEPS[row], "predicted_s": seconds}
            for row, seconds in predicted.items()]
    return result


def step_exactness(out: Path, dry_run: bool) -> dict:
    """run_verify (chunked vs unchunked megatron-core, every gradient) per backend and dtype."""
    import torch

    from megatron_chunkflow.attention.backends import available_backends
    from megatron_chunkflow.checks.verify import run_verify
    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.core.models import get_model_shape

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32
    torch.backends.cudnn.allow_tf32 = False
    shape = get_model_shape("tiny" if dry_run else "qwen2.5-tiny")
    lengths = [[300, 37, 129, 64, 5], [260, 90]] if dry_run else [[3000, 700, 1200, 64, 9]]
    chunk = 64 if dry_run else 512
    exact = torch.float64 if dry_run else torch.float32
    bounds = {"float64": FP64_BOUND, "float32": FP32_BOUND, "bfloat16": BF16_BUDGET}
    device = "cpu" if dry_run else "cuda"
    rows = []
    for backend in [b for b in BACKENDS if b in available_backends()]:
        for dtype in (exact, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            row = {"backend": backend, "dtype": name, "bound": bounds[name]}
            try:
                results = run_verify(shape, lengths, ChunkFlowConfig(chunk, 1, backend),
                                     dtype=dtype)
                row["max_rel_grad_err"] = max(r.max_rel_grad_err for r in results)
                row["worst_param"] = max(results, key=lambda r: r.max_rel_grad_err).worst_param
                row["loss_rel_err"] = max(abs(r.loss_chunked - r.loss_ref) / abs(r.loss_ref)
                                          for r in results)
                row["passed"] = row["max_rel_grad_err"] <= row["bound"]
            except Exception as e:  # noqa: BLE001  a backend that cannot run here: say why
                row.update(passed=None, error=f"{type(e).__name__}: {str(e)[:400]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    # exact: every row that ran passed, and at least one did (flash and varlen are half-precision
    # kernels: their bfloat16 row is all they can show)
    exact_backends = [b for b in BACKENDS if [r for r in rows if r["backend"] == b
                                              and r["passed"] is not None]
                      and all(r["passed"] for r in rows
                              if r["backend"] == b and r["passed"] is not None)]
    ran = [r for r in rows if r["passed"] is not None]
    return {"passed": bool(ran) and all(r["passed"] for r in ran), "device": device,
            "model": dataclasses.asdict(shape),
            "lengths": lengths, "chunk_size": chunk, "rows": rows,
            "fastest_exact_backend": exact_backends[0] if exact_backends else None}


def step_bench(out: Path, dry_run: bool) -> dict:
    """ChunkFlow and the stock baselines, each as the simulator configures it for this GPU."""
    import torch

    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.core.profiles import ensure_long, sample_lengths
    from megatron_chunkflow.core.step import BASELINES
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
    from megatron_chunkflow.memtrace.stack import installed_stack
    from megatron_chunkflow.perfmodel.gpu_profiles import load_profile
    from megatron_chunkflow.perfmodel.search import best_chunkflow, best_megatron

    exactness = out / "exactness.json"
    backend = (json.loads(exactness.read_text()).get("fastest_exact_backend")
               if exactness.is_file() else None) or ("cpu_flash" if dry_run else "torch")
    if dry_run:
        model, seq_length, gbs, dtype, steps = "tiny", 512, 4, "float32", 1  # plumbing only
    else:
        big = torch.cuda.get_device_properties(0).total_memory >= 60 * 2**30
        model, seq_length, gbs, dtype, steps = (
            "qwen2.5-1.5b" if big else "qwen2.5-0.5b", SEQ_LENGTH, GLOBAL_BATCH, "bfloat16", 3)
    shape = get_model_shape(model)
    lengths = [min(n, seq_length) for n in sample_lengths("B", gbs, seed=0)]
    lengths = ensure_long(lengths, "B", seq_length // 2, 1, 0)
    lengths = [max(2, min(n, seq_length)) for n in lengths]
    # the rates this run measured (step 2's profile), else the built-in H200 profile; the
    # memory PyTorch sees here; the kernel's K/V repeated per head where the installed varlen
    # has no grouped-query attention; Megatron's fusions on, as the bench builds
    measured = out / "calibration.json"
    hw = load_profile(str(measured) if measured.is_file() and not dry_run
                      else "h200-torch2.11-local")
    hw = dataclasses.replace(hw, fused_swiglu=True, kv_repeat=backend == "varlen"
                             and not installed_stack().varlen_gqa)
    if torch.cuda.is_available():
        hw = dataclasses.replace(
            hw, memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
    plans = {"chunkflow": best_chunkflow(lengths, shape, hw, 1, seq_length, auto_chunking=True)}
    plans.update({b: best_megatron(lengths, shape, hw, 1, seq_length, baseline=b)
                  for b in BASELINES})
    sequences = make_sequences(lengths, shape.vocab_size, seed=0)
    simulated = {x for x in os.environ.get("DEVICE_CHECK_SIMULATE_OOM", "").split(",") if x}
    systems = {}
    for name, plan in plans.items():
        row = {"predicted_step_s": plan.step_s, "predicted_fits": plan.fits, "attempts": []}
        for chunk_size, k, recompute in _attempts(name, plan, seq_length, dry_run):
            attempt = {"recompute": recompute, **({"chunk_size": chunk_size, "k": k}
                                                   if name == "chunkflow" else {})}
            try:
                if name in simulated and not row["attempts"]:  # the back-off path, on CPU
                    raise torch.cuda.OutOfMemoryError(
                        "CUDA out of memory (simulated by DEVICE_CHECK_SIMULATE_OOM). Tried to "
                        "allocate 18.55 GiB.")
                chunkflow = ChunkFlowConfig(chunk_size, k, backend)
                s = TrainSettings(shape=shape, model_name=model, system=name, dtype=dtype,
                                  seq_length=seq_length, global_batch_size=gbs, train_iters=steps + 1,
                                  chunkflow=chunkflow, optimizer=OptimizerConfig(lr_warmup_iters=0),
                                  parallel=ParallelConfig(recompute=recompute))
                row.update(attempt, **_measure(s, sequences, lengths, steps))
                row["attempts"].append({**attempt, "status": "ok"})
                break
            except Exception as e:  # noqa: BLE001  one system failing must not hide the others
                oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
                if not oom:
                    import traceback

                    traceback.print_exc()
                # the allocator's own words: what was asked, what was free, what PyTorch held
                row["attempts"].append({**attempt, "status": "oom" if oom else "error",
                                        "error": f"{type(e).__name__}: {str(e)[:400]}"})
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                if not oom:
                    break
        if row["attempts"][-1]["status"] != "ok":
            row["error"] = row["attempts"][-1]["error"]
        systems[name] = row
        print(json.dumps({name: row}), flush=True)
    cf = systems["chunkflow"]
    for b in BASELINES:
        if "step_s" in cf and "step_s" in systems[b]:
            systems[b]["chunkflow_speedup"] = systems[b]["step_s"] / cf["step_s"]
            systems[b]["chunkflow_memory_ratio"] = (cf["max_memory_allocated"]
                                                    / systems[b]["max_memory_allocated"])
    first = [r["loss"][0] for r in systems.values() if "loss" in r]
    spread = (max(first) - min(first)) / abs(min(first)) if first else None
    return {"passed": all("error" not in r for r in systems.values()), "model": model,
            "step1_loss_rel_spread": spread,  # same weights and data: the systems must agree
            "seq_length": seq_length, "global_batch_size": gbs, "tokens": sum(lengths),
            "longest": max(lengths), "dtype": dtype, "attention_backend": backend,
            "systems": systems}


def _attempts(name: str, plan, seq_length: int, dry_run: bool):
    """(chunk size, K, recompute) to try for one system, the plan first: after an OOM, ChunkFlow
    halves its chunk size (K kept; down to 1K tokens, 64 in the dry run) and a stock baseline
    climbs the recompute menu (none, selective, full), each the next smaller plan."""
    recompute = str(plan.layout.recompute)
    if name == "chunkflow":
        # the search's smallest chunk (2K) is above the dry run's 512-token context
        chunk, floor = min(plan.chunk_size or seq_length, seq_length), 64 if dry_run else 1024
        while chunk >= floor:
            yield chunk, plan.num_kept or 1, recompute
            chunk //= 2
        return
    menu = ["none", "selective", "full"]
    later = (menu[menu.index(recompute) + 1:] if recompute in menu
             else [] if recompute == "full" else ["full"])  # block:N, selective:...: then full
    for option in [recompute, *later]:
        yield seq_length, 1, option


def _measure(s, sequences, lengths, steps) -> dict:
    """Build and run `steps` steps of settings `s` from the same weights as every system."""
    import torch

    from megatron_chunkflow.bench.gpu_profile import profile_families
    from megatron_chunkflow.mcore.dist import init_distributed
    from megatron_chunkflow.mcore.step import build_training
    from megatron_chunkflow.training.loop import train_step

    gc.collect()  # the last system's model and DDP reference each other
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    job = init_distributed(seed=0)  # every system starts from the same weights
    tr = build_training(s, job)
    try:
        metrics = [train_step(s, tr, sequences, i) for i in range(steps)]
        # one more step under torch.profiler: time by kernel family, for the next calibration
        families = profile_families(lambda: train_step(s, tr, sequences, steps),
                                    "cuda" if torch.cuda.is_available() else "cpu")
    finally:
        del tr
    timed = metrics[1:] or metrics
    step_s = sum(m["step_s"] for m in timed) / len(timed)
    return {"step_s": step_s, "tokens_per_s": sum(lengths) / step_s,
            "model_tflops": timed[-1]["model_tflops"],
            "mfu": timed[-1]["model_tflops"] / PEAK_BF16_TFLOPS,
            # CUDA: torch.cuda.max_memory_allocated since this system's build; CPU (dry run): the
            # process's peak RSS, which only grows
            "max_memory_allocated": metrics[-1]["peak_mem_bytes"],
            "loss": [m["loss"] for m in metrics], "profile": families}


def _plot(report: dict, path: Path) -> None:
    """Tokens/s and memory per system (bench), and exactness per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    bench = report["steps"].get("bench", {}).get("systems", {})
    names = [n for n, r in bench.items() if "step_s" in r]
    axes[0].bar(names, [bench[n]["tokens_per_s"] for n in names])
    axes[0].set_title("tokens/s")
    axes[1].bar(names, [bench[n]["max_memory_allocated"] / 2**30 for n in names])
    axes[1].set_title("peak memory (GiB)")
    rows = [r for r in report["steps"].get("exactness", {}).get("rows", [])
            if "max_rel_grad_err" in r]
    axes[2].bar([f"{r['backend']}\n{r['dtype']}" for r in rows],
                [max(r["max_rel_grad_err"], 1e-18) for r in rows])
    axes[2].set_yscale("log")
    axes[2].set_title("max relative gradient error")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("device check" + (" (dry run, CPU)" if report["dry_run"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
