"""Stock Megatron's baselines against ChunkFlow: one model, batch, layout and memory budget
(`chunkflow bench`).

Run in every process of a job (cli/bench.py spawns them, or torchrun). Per run:
1. Calibrate: this CPU's GEMM, attention, memory and point-to-point rates and two timed probe
   micro-batches of the real model (bench/calibrate.py: kernel rates, then the model's dense
   efficiency and host time per op fitted) make a `cpu` device for the simulator, re-measured
   before every measured round (medians). Probe micro-batches measure the activation bytes per
   token of each stage under every option of Megatron's recompute menu (bench/systems.py,
   runtime/meter.py's exact meter).
2. Budget (bench/choose.py, perfmodel/budget.py): each stock baseline gets the fastest recompute
   option whose modelled peak fits; ChunkFlow the fastest (chunk size, K, recompute) that fits.
   A baseline that no option fits is not run (the JSON's "not_run" says why).
3. Every system is built (bench/systems.py: same model shape and seed, Megatron's DDP, Adam and
   scheduler, the same attention kernel) and stepped on the same global batch, in turn: warm-up
   rounds, then measured rounds, each step mcore/step.py's training_step (as `chunkflow train`
   steps): a stock baseline (core/step.py: megatron-sft, megatron-packed, megatron-unpacked) on
   Megatron's get_forward_backward_func, ChunkFlow runtime/execute.py on the planner's plan.
   glibc malloc keeps freed memory (bench/instrument.py: cache_freed_memory), as a GPU caching
   allocator would.
Measured per step: wall time of forward, backward and optimizer (slowest rank); per-op compute
intervals (bubble = 1 - busy / (p x span)); activation bytes (the exact meter: a saved tensor from
its save until autograd frees it, plus ChunkFlow's K/V state, the same meter for every system);
peak RSS (VmHWM after returning freed heap to the OS, in the first round).
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import torch
import torch.distributed as dist

from megatron_chunkflow.attention import resolve_backend
from megatron_chunkflow.bench.choose import Plan, choose_all, menu, recompute_flops
from megatron_chunkflow.bench.instrument import cache_freed_memory
from megatron_chunkflow.bench.settings import BenchSettings
from megatron_chunkflow.bench.systems import (
    PROBE_SEGMENT,
    PROBE_SIZES,
    build_system,
    probe_rates,
    probe_step_times,
    timed_step,
    train_settings,
)
from megatron_chunkflow.config import ParallelConfig, Recompute
from megatron_chunkflow.core.costs import sequence_model_flops
from megatron_chunkflow.data.synthetic import make_sequences
from megatron_chunkflow.perfmodel.budget import ActivationRates
from megatron_chunkflow.perfmodel.predict import predict_chunkflow, predict_megatron


def run_bench(s: BenchSettings, job, log=lambda text: None) -> dict:
    """The whole comparison on `job` (mcore/job.py; every rank); the same result on every
    rank."""
    from megatron_chunkflow.bench.calibrate import (
        CpuRates,
        average_rates,
        measure_cpu_rates,
        model_hardware,
    )
    torch.set_num_threads(s.threads)
    caching = s.caching_malloc and cache_freed_memory()
    dp = job.ranks.dp
    load = [os.getloadavg()[0]]
    pp = s.parallel.pp
    chunkflow = build_system("chunkflow", train_settings(s, "chunkflow"), job)
    calibrations, fit = [], {}

    def calibrate():
        """Kernel rates and probe step times, measured now (the machine may be shared, so this
        runs again before every measured round and the simulator takes the medians)."""
        rates = average_rates(measure_cpu_rates(
            s.shape, s.attention_backend, job.groups.pp,
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
    options = {str(o): o for o in menu(s, s.megatron_recompute) + menu(s, s.chunkflow_recompute)}
    log(f"probing activation bytes per token under {len(options)} recompute option(s)")
    act = probe_rates(chunkflow, s, [Recompute()] + [o for o in options.values()
                                                      if o.kind != "none"])
    plans, unfit = choose_all(s, dp, act, hw)
    for name, why in unfit.items():
        log(f"{name} is not run: {why}")
    s = dataclasses.replace(s, baselines=tuple(b for b in s.baselines if b in plans))
    cf_plan = plans["chunkflow"]
    chunkflow.settings = train_settings(s, "chunkflow", cf_plan.choice.chunk_size,
                                        cf_plan.choice.num_kept, cf_plan.recompute)
    chunkflow = build_system("chunkflow", chunkflow.settings, job) \
        if cf_plan.recompute.kind != "none" else chunkflow
    systems = [build_system(b, train_settings(s, b, recompute=plans[b].recompute), job)
               for b in s.baselines] + [chunkflow]
    for name, plan in plans.items():
        what = (f"C={plan.choice.chunk_size} K={plan.choice.num_kept} " if name == "chunkflow"
                else "")
        budget = s.chunkflow_budget if name == "chunkflow" else s.budget_bytes
        log(f"budget {budget / 2**20:.0f} MiB: {name} {what}recompute {plan.recompute} "
            f"(modelled peak {plan.choice.peak_bytes / 2**20:.0f} MiB)")

    sequences = make_sequences(s.lengths, s.shape.vocab_size, s.seed)
    # Peak RSS comes from the first round, each step after a malloc_trim; later warm-up rounds
    # grow the heap back to the largest system's peak, so the measured steps reuse it (as a
    # caching allocator would) instead of paying its page faults in the first measured step.
    measured: dict[str, list[list[dict]]] = {x.name: [] for x in systems}
    rss = {x.name: 0 for x in systems}
    for i in range(s.warmup + s.repeats):
        warm = i < s.warmup
        phase = f"warm-up {i + 1}/{s.warmup}" if warm else f"repeat {i - s.warmup + 1}/{s.repeats}"
        if not warm:
            rates, hw = calibrate()
        for system in systems:
            first = i == 0 or not s.warmup
            rows = timed_step(system, sequences, trim=first)
            if not warm:
                measured[system.name].append(rows)
            if first:
                rss[system.name] = max(rss[system.name], max(r["rss"] for r in rows))
            log(f"{phase}  {system.name:<18} {max(r['elapsed'] for r in rows):7.2f} s")
        load.append(os.getloadavg()[0])

    out = {x.name: _system_result(x.name, plans[x.name], measured[x.name], rss[x.name], s, dp,
                                  hw, act) for x in systems}
    result = _result(out, s, dp, act, rates, hw, plans, caching, load, fit,
                     [dataclasses.asdict(r) | {"probe_step_s": p} for r, p in calibrations])
    result["not_run"] = unfit
    return result


def _system_result(name: str, plan: Plan, repeats: list[list[dict]], rss: int,
                   s: BenchSettings, dp: int, hw, act: ActivationRates) -> dict:
    """One system's summary, prediction and configuration."""
    layout = ParallelConfig.layout(tp=s.parallel.tp, pp=s.parallel.pp, dp=dp,
                                   recompute=plan.recompute)
    if name == "chunkflow":
        pred = predict_chunkflow(s.lengths, s.shape, hw, layout, plan.choice.chunk_size,
                                 plan.choice.num_kept)
    else:
        pred = predict_megatron(s.lengths, s.shape, hw, layout, s.seq_length, name)
    re_flops = recompute_flops(name, s.lengths, s.shape, s.seq_length, dp, s.parallel.pp, plan)
    out = summarize(repeats, s, pred, re_flops)
    out.update(peak_rss_bytes=rss, recompute=str(plan.recompute),
               modelled_peak_activation_bytes=plan.choice.peak_bytes,
               recompute_candidates=[c.to_json() for c in plan.choice.candidates])
    if name == "chunkflow":
        out.update(chunk_size=plan.choice.chunk_size, k=plan.choice.num_kept)
    return out


def _result(out: dict, s: BenchSettings, dp: int, act, rates, hw, plans, caching, load, fit,
            calibrations) -> dict:
    """The JSON object: every system, and ChunkFlow against each baseline. "baseline" and the
    unsuffixed ratios are against megatron-packed (the strongest) when it ran."""
    cf = out["chunkflow"]
    names = list(s.baselines)
    ref = "megatron-packed" if "megatron-packed" in names else names[0]

    def per(fn):
        return {b: fn(out[b]) for b in names}

    speedups = per(lambda mg: mg["step_s"] / cf["step_s"])
    memory = per(lambda mg: cf["peak_activation_bytes"] / mg["peak_activation_bytes"])
    return {
        "baseline": out[ref], "baseline_name": ref, "chunkflow": cf,
        "baselines": {b: out[b] for b in names},
        "speedup": speedups[ref], "speedups": speedups,
        "speedup_factors": speedup_factors(out[ref], cf),
        "speedup_factors_per_baseline": per(lambda mg: speedup_factors(mg, cf)),
        "activation_memory_ratio": memory[ref], "activation_memory_ratios": memory,
        "rss_ratio": cf["peak_rss_bytes"] / out[ref]["peak_rss_bytes"],
        "predicted_speedup": out[ref]["predicted_step_s"] / cf["predicted_step_s"],
        "predicted_speedups": per(lambda mg: mg["predicted_step_s"] / cf["predicted_step_s"]),
        "setup": _setup(s, dp, act, rates, hw, caching, load, fit, calibrations),
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


def _setup(s: BenchSettings, dp: int, act: ActivationRates, rates, hw, caching: bool,
           load: list[float], fit: dict, calibrations: list[dict]) -> dict:
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
        "chunkflow_budget_bytes": s.chunkflow_budget,
        "warmup": s.warmup, "repeats": s.repeats, "seed": s.seed,
        "activation_bytes_per_token": list(act.per_token),
        "kv_bytes_per_token": list(act.kv_per_token),
        "cpu_rates": rates.to_json(), "model_fit": fit,
        "hardware": dataclasses.asdict(hw),
        "activation_bytes_per_token_by_recompute": {
            name: {"held": list(r.held), "peak": list(r.peak)} for name, r in act.options.items()},
        "baselines": list(s.baselines),
        "calibrations": calibrations, "load_average_1min": load, "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
    }
