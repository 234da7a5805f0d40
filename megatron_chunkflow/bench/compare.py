"""Stock Megatron against ChunkFlow: one model, batch, layout and memory budget (`chunkflow bench`).

Run in every process of a job (cli/bench.py spawns them, or torchrun). Per run:
1. Calibrate: this CPU's GEMM, attention, memory and point-to-point rates and two timed probe
   micro-batches of the real model (bench/calibrate.py: kernel rates, then the model's dense
   efficiency and host time per op fitted) make a `cpu` device for the simulator, re-measured
   before every measured pair (medians); a probe micro-batch measures the activation bytes per
   token of each stage (saved-tensor hooks, checks/memory.py).
2. Budget (perfmodel/budget.py): stock Megatron gets no recompute when its largest micro-batch fits,
   else Megatron's full recompute; ChunkFlow the fastest (chunk size, K) whose modelled peak fits.
3. Both systems are built (bench/systems.py: same model shape and seed, Megatron's
   DDP, Adam and scheduler, the same attention kernel) and stepped on the same global batch,
   alternately: warm-up pairs, then measured pairs. Stock Megatron is training/loop.py's path
   (sequences packed THD into micro-batches of --seq-length, Megatron's get_forward_backward_func);
   ChunkFlow is forward_backward_chunkflow on the core planner's plan. glibc malloc keeps freed
   memory (bench/instrument.py: cache_freed_memory), as a GPU caching allocator would.
Measured per step: wall time of forward, backward and optimizer (slowest rank); per-op compute
intervals (bubble = 1 - busy / (p x span)); activation bytes (ActivationMeter: bytes saved for
backward plus K/V state; for Megatron the meter wraps its forward_step and is released at its
backward_step, and the tensors that full recompute saves *during* the backward are counted while
they are alive); peak RSS (VmHWM after returning freed heap to the OS, in the first pair).
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import torch
import torch.distributed as dist

from megatron_chunkflow.perfmodel.budget import (
    ActivationRates,
    Chunking,
    baseline_peak,
    baseline_recompute,
    chunkflow_peak,
    choose_chunking,
)
from megatron_chunkflow.core.costs import chunk_flops, sequence_model_flops
from megatron_chunkflow.perfmodel.layout import Layout
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.schedule import is_reforwarded
from megatron_chunkflow.perfmodel.predict import predict_chunkflow, predict_megatron
from megatron_chunkflow.core.step import baseline_microbatches
from megatron_chunkflow.bench.systems import (
    PROBE_SEGMENT,
    PROBE_SIZES,
    BenchSettings,
    build_system,
    probe_rates,
    probe_step_times,
    timed_step,
    train_settings,
)
from megatron_chunkflow.attention import resolve_backend
from megatron_chunkflow.bench.instrument import cache_freed_memory
from megatron_chunkflow.data.synthetic import make_sequences


def recompute_flops(system: str, lengths, shape: ModelShape, seq_length: int, dp: int,
                    chunk_size: int = 0, k: int = 1, recompute: str = "none") -> float:
    """FLOPs re-run in one step: Megatron's full recompute re-runs every transformer layer's
    forward; ChunkFlow re-forwards (whole stage, logits included) every dependent chunk but the
    last K of its sequence."""
    if system == "megatron":
        if recompute != "full":
            return 0.0
        mbs = baseline_microbatches(lengths, seq_length, dp)
        return sum(chunk_flops(c, shape).per_layer * shape.num_layers for c in mbs)
    chunks = build_chunks(lengths, chunk_size, dp, k, shape).chunks
    return sum(chunk_flops(c, shape).forward(shape.num_layers) for c in chunks
               if is_reforwarded(c, k))


def run_bench(s: BenchSettings, log=lambda text: None) -> dict:
    """The whole comparison on an initialised job (every rank); the same result on every rank."""
    from megatron.core import parallel_state

    from megatron_chunkflow.bench.calibrate import (
        CpuRates,
        average_rates,
        measure_cpu_rates,
        model_hardware,
    )
    torch.set_num_threads(s.threads)
    caching = s.caching_malloc and cache_freed_memory()
    dp = parallel_state.get_data_parallel_world_size()
    load = [os.getloadavg()[0]]
    pp, tp = s.parallel.pp, s.parallel.tp
    chunkflow = build_system("chunkflow", train_settings(s, "chunkflow"))
    calibrations, fit = [], {}

    def calibrate():
        """Kernel rates and probe step times, measured now (the machine may be shared, so this
        runs again before every measured pair and the simulator takes the medians)."""
        rates = average_rates(measure_cpu_rates(
            s.shape, s.attention_backend, parallel_state.get_pipeline_model_parallel_group(),
            tokens=min(2048, max(128, s.seq_length // 16))))
        calibrations.append((rates, probe_step_times(chunkflow, s)))
        rates = CpuRates(*(statistics.median(col) for col in zip(
            *(dataclasses.astuple(r) for r, _ in calibrations))))
        times = {t: statistics.median(p[t] for _, p in calibrations) for t in PROBE_SIZES}
        hw, scale, host = model_hardware(
            rates, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), s.shape, pp,
            times, PROBE_SEGMENT)
        fit.update(dense_scale=scale, op_overhead_s=host, probe_step_s=times)
        return rates, hw

    log("calibrating: GEMM, attention, memory and point-to-point rates, host time per op")
    rates, hw = calibrate()
    act = probe_rates(chunkflow, s)
    recompute = s.megatron_recompute
    if recompute == "auto":
        recompute = baseline_recompute(s.lengths, s.seq_length, dp, act, s.budget_bytes)
    layout = Layout(tp, 1, pp, dp, "none")
    if s.chunk_size is None:
        chunking = choose_chunking(
            s.lengths, s.seq_length, dp, s.shape, act, s.budget_bytes,
            lambda c, k: predict_chunkflow(s.lengths, s.shape, hw, layout, c, k).step_s,
            ks=(s.k,) if s.k else (1, 2, 4))
    else:
        k = s.k or 1
        peak = chunkflow_peak(s.lengths, s.chunk_size, k, dp, s.shape, act)
        chunking = Chunking(s.chunk_size, k, peak, predict_chunkflow(
            s.lengths, s.shape, hw, layout, s.chunk_size, k).step_s)
    chunkflow.settings = train_settings(s, "chunkflow", chunking.chunk_size, chunking.k)
    megatron = build_system("megatron", train_settings(
        s, "megatron", recompute=None if recompute == "none" else recompute))
    log(f"budget {s.budget_bytes / 2**20:.0f} MiB: stock Megatron recompute {recompute} "
        f"(largest micro-batch {baseline_peak(s.lengths, s.seq_length, dp, act) / 2**20:.0f} "
        f"MiB without); ChunkFlow C={chunking.chunk_size} K={chunking.k} (modelled peak "
        f"{chunking.peak_bytes / 2**20:.0f} MiB)")

    sequences = make_sequences(s.lengths, s.shape.vocab_size, s.seed)
    # Peak RSS comes from the first pair of steps, each after a malloc_trim; later warm-up steps
    # grow the heap back to the larger system's peak, so the measured steps reuse it (as a
    # caching allocator would) instead of paying its page faults in the first measured step.
    measured: dict[str, list[list[dict]]] = {"megatron": [], "chunkflow": []}
    rss = {"megatron": 0, "chunkflow": 0}
    for i in range(s.warmup + s.repeats):
        warm = i < s.warmup
        phase = f"warm-up {i + 1}/{s.warmup}" if warm else f"repeat {i - s.warmup + 1}/{s.repeats}"
        if not warm:
            rates, hw = calibrate()
        for system in (megatron, chunkflow):
            first = i == 0 or not s.warmup
            rows = timed_step(system, sequences, trim=first)
            if not warm:
                measured[system.name].append(rows)
            if first:
                rss[system.name] = max(rss[system.name], max(r["rss"] for r in rows))
            log(f"{phase}  {system.name:<9}  {max(r['elapsed'] for r in rows):7.2f} s")
        load.append(os.getloadavg()[0])

    preds = {"megatron": predict_megatron(s.lengths, s.shape, hw,
                                          dataclasses.replace(layout, recompute=recompute),
                                          s.seq_length),
             "chunkflow": predict_chunkflow(s.lengths, s.shape, hw, layout, chunking.chunk_size,
                                            chunking.k)}
    out = {}
    for name, system in (("megatron", megatron), ("chunkflow", chunkflow)):
        re_flops = recompute_flops(name, s.lengths, s.shape, s.seq_length, dp,
                                   chunking.chunk_size, chunking.k, recompute)
        out[name] = summarize(measured[name], s, preds[name], re_flops)
        out[name]["peak_rss_bytes"] = rss[name]
    out["megatron"].update(recompute=recompute, modelled_peak_activation_bytes=(
        baseline_peak(s.lengths, s.seq_length, dp, act) if recompute == "none" else None))
    out["chunkflow"].update(chunk_size=chunking.chunk_size, k=chunking.k,
                            modelled_peak_activation_bytes=chunking.peak_bytes)
    mg, cf = out["megatron"], out["chunkflow"]
    return {
        "baseline": mg, "chunkflow": cf,
        "speedup": mg["step_s"] / cf["step_s"],
        "speedup_factors": speedup_factors(mg, cf),
        "activation_memory_ratio": cf["peak_activation_bytes"] / mg["peak_activation_bytes"],
        "rss_ratio": cf["peak_rss_bytes"] / mg["peak_rss_bytes"],
        "predicted_speedup": mg["predicted_step_s"] / cf["predicted_step_s"],
        "setup": _setup(s, dp, act, rates, hw, chunking, caching, load, fit,
                        [dataclasses.asdict(r) | {"probe_step_s": p} for r, p in calibrations]),
    }


def summarize(repeats: list[list[dict]], s: BenchSettings, pred, re_flops: float) -> dict:
    """One system's numbers from its measured repeats (each a list of every rank's record)."""
    steps = [max(r["elapsed"] for r in rows) for rows in repeats]
    step_s = statistics.median(steps)
    median_rows = repeats[steps.index(sorted(steps)[(len(steps) - 1) // 2])]
    replica = sorted((r for r in median_rows if r["dp_rank"] == 0 and r["tp_rank"] == 0),
                     key=lambda r: r["stage"])
    bubbles = [_bubble(rows) for rows in repeats]
    busy = [sum(end - start for _, _, start, end in r["ops"]) for r in replica]
    span = max(r["span"] for r in replica)
    flops = sequence_model_flops(s.lengths, s.shape)
    peak = [max(rows[i]["peak_total"] for rows in repeats) for i in range(len(repeats[0]))]
    stage_peak = [0] * s.parallel.pp
    stage_state = [0] * s.parallel.pp
    for i, r in enumerate(repeats[0]):
        stage_peak[r["stage"]] = max(stage_peak[r["stage"]], peak[i])
        stage_state[r["stage"]] = max(stage_state[r["stage"]],
                                      max(rows[i]["peak_state"] for rows in repeats))
    return {
        "step_s": step_s, "step_s_repeats": steps,
        "tokens_per_s": sum(s.lengths) / step_s, "model_tflops": flops / step_s / 1e12,
        "peak_activation_bytes": max(peak), "peak_activation_bytes_per_stage": stage_peak,
        "kv_state_bytes_per_stage": stage_state,
        "recompute_working_set_bytes": max(r["peak_recompute"] for rows in repeats
                                           for r in rows),
        "bubble": statistics.median(bubbles), "bubble_repeats": bubbles,
        "busy_s_per_stage": busy, "span_s": span,
        "busy_flops_per_s": (flops + re_flops) / sum(busy),  # per rank, while computing
        "recompute_fraction": re_flops / flops, "recompute_flops": re_flops,
        "model_flops": flops, "num_microbatches": repeats[0][0]["count"],
        "predicted_step_s": pred.step_s, "predicted_bubble": pred.bubble,
        "prediction_error": pred.step_s / step_s - 1.0,
        "timeline": [{"stage": r["stage"], "span": r["span"],
                      "ops": [list(op) for op in r["ops"]]} for r in replica],
    }


def speedup_factors(mg: dict, cf: dict) -> dict:
    """Where the time goes: the speedup as a product of less work (model + recompute FLOPs), work
    done faster while busy, less idle time (the median step's bubble), and the rest of the step
    outside the pipeline (optimizer, planning, waits for the last sends)."""
    def parts(x):
        work = x["model_flops"] + x["recompute_flops"]
        busy = sum(x["busy_s_per_stage"])
        p = len(x["busy_s_per_stage"])
        return work, work / busy, busy / (p * x["span_s"]), x["step_s"] / x["span_s"]

    (w_mg, r_mg, u_mg, o_mg), (w_cf, r_cf, u_cf, o_cf) = parts(mg), parts(cf)
    return {"work": w_mg / w_cf, "busy_rate": r_cf / r_mg, "utilization": u_cf / u_mg,
            "outside_pipeline": o_mg / o_cf}


def _bubble(rows: list[dict]) -> float:
    """1 - busy / (p x span) over the first model replica's stages."""
    replica = [r for r in rows if r["dp_rank"] == 0 and r["tp_rank"] == 0]
    span = max(r["span"] for r in replica)
    busy = sum(end - start for r in replica for _, _, start, end in r["ops"])
    return 1.0 - busy / (len(replica) * span) if span > 0 else 0.0


def _setup(s: BenchSettings, dp: int, act: ActivationRates, rates, hw, chunking,
           caching: bool, load: list[float], fit: dict, calibrations: list[dict]) -> dict:
    import megatron.core

    lengths = s.lengths
    return {
        "model": s.model_name, "shape": dataclasses.asdict(s.shape), "caching_malloc": caching,
        "layout": {"tp": s.parallel.tp, "pp": s.parallel.pp, "dp": dp,
                   "world": dist.get_world_size()},
        "threads_per_rank": s.threads, "dtype": "float32",
        "backend": resolve_backend(s.attention_backend,
                                   "cuda" if torch.cuda.is_available() else "cpu"),
        "num_sequences": len(lengths), "tokens": sum(lengths), "longest": max(lengths),
        "seq_length": s.seq_length, "budget_bytes": s.budget_bytes,
        "warmup": s.warmup, "repeats": s.repeats, "seed": s.seed,
        "activation_bytes_per_token": list(act.per_token),
        "kv_bytes_per_token": list(act.kv_per_token),
        "cpu_rates": rates.to_json(), "model_fit": fit,
        "hardware": dataclasses.asdict(hw),
        "chunking_candidates": [dataclasses.asdict(c) for c in chunking.candidates],
        "calibrations": calibrations, "load_average_1min": load, "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
    }
