"""Measure many training configurations on one batch: the engine of scripts/benchmarks/sweep_*.py.

    rows = sweep(settings, job, [{"system": "chunkflow", "chunk_size": 1024, "k": 1},
                                 {"system": "megatron-packed", "recompute": "block:1"}])

Run in every process of a job (mcore/dist.py: run_processes). Each configuration is a
system of bench/systems.py (ChunkFlow with its (C, K), or a stock baseline of core/step.py
with a recompute option of Megatron's menu), stepped `warmup + repeats` times on the same batch
with the same meters as `chunkflow bench`; a row holds the median step time, the measured peaks
(activations and K/V state, per stage) and, for ChunkFlow, the budget model's modelled peak
(perfmodel/budget.py) beside the measured one.
"""

from __future__ import annotations

import statistics

import torch

from megatron_chunkflow.bench.instrument import cache_freed_memory
from megatron_chunkflow.bench.settings import BenchSettings
from megatron_chunkflow.bench.systems import (
    build_system,
    probe_rates,
    timed_step,
    train_settings,
)
from megatron_chunkflow.config import Recompute
from megatron_chunkflow.perfmodel.budget import chunkflow_peak

MIB = 2.0**20


def sweep(s: BenchSettings, job, configs: list[dict], log=lambda text: None) -> list[dict]:
    """One row per configuration on `job` (mcore/job.py; the same rows on every rank)."""
    from megatron_chunkflow.data.synthetic import make_sequences

    torch.set_num_threads(s.threads)
    if s.caching_malloc:
        cache_freed_memory()
    dp = job.ranks.dp
    sequences = make_sequences(s.lengths, s.shape.vocab_size, s.seed)
    systems = {}
    act = None
    rows = []
    for cfg in configs:
        if cfg["system"] == "chunkflow":
            key = "chunkflow"
            if key not in systems:
                systems[key] = build_system(key, train_settings(s, "chunkflow"), job)
                act = probe_rates(systems[key], s)
            system = systems[key]
            system.settings = train_settings(s, "chunkflow", cfg["chunk_size"], cfg["k"])
        else:
            baseline = cfg["system"]
            key = f"{baseline}-{cfg['recompute']}"
            if key not in systems:
                systems[key] = build_system(baseline, train_settings(
                    s, baseline, recompute=Recompute.parse(cfg["recompute"])), job)
            system = systems[key]
        records = [timed_step(system, sequences, trim=i < s.warmup or not s.warmup)
                   for i in range(s.warmup + s.repeats)]
        row = dict(cfg, **_summary(records[s.warmup:], s.parallel.pp))
        if cfg["system"] == "chunkflow":
            row["modelled_peak_bytes"] = chunkflow_peak(s.lengths, cfg["chunk_size"], cfg["k"],
                                                        dp, s.shape, act)
        log(_describe(row))
        rows.append(row)
    return rows


def _summary(repeats: list[list[dict]], pp: int) -> dict:
    steps = [max(r["elapsed"] for r in rows) for rows in repeats]
    act, state = [0] * pp, [0] * pp
    for rows in repeats:
        for r in rows:
            act[r["stage"]] = max(act[r["stage"]], r["peak_activation"])
            state[r["stage"]] = max(state[r["stage"]], r["peak_state"])
    total = max(max(r["peak_total"] for r in rows) for rows in repeats)
    return {"step_s": statistics.median(steps), "peak_bytes": total,
            "activation_bytes_per_stage": act, "state_bytes_per_stage": state,
            "num_microbatches": repeats[0][0]["count"]}


def _describe(row: dict) -> str:
    name = (f"ChunkFlow C={row['chunk_size']} K={row['k']}" if row["system"] == "chunkflow"
            else f"{row['system']}, recompute {row['recompute']}")
    return (f"{name}: {row['step_s']:.2f} s, peak {row['peak_bytes'] / MIB:.1f} MiB "
            f"(K/V state {max(row['state_bytes_per_stage']) / MIB:.1f} MiB)")


def markdown_table(rows: list[dict]) -> list[str]:
    """The rows as a markdown table (MiB, seconds)."""
    def mib(xs):
        return " / ".join(f"{x / MIB:.1f}" for x in xs)

    lines = ["| system | C | K | C x K | chunks / micro-batches | peak activations + state (MiB) "
             "| activations per stage (MiB) | K/V state per stage (MiB) | modelled peak (MiB) "
             "| step (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["system"] == "chunkflow":
            head = (f"| ChunkFlow | {r['chunk_size']} | {r['k']} | {r['chunk_size'] * r['k']} ")
            modelled = f"{r['modelled_peak_bytes'] / MIB:.1f}"
        else:
            head = f"| {r['system']}, recompute {r['recompute']} | - | - | - "
            modelled = "-"
        lines.append(f"{head}| {r['num_microbatches']} | {r['peak_bytes'] / MIB:.1f} "
                     f"| {mib(r['activation_bytes_per_stage'])} "
                     f"| {mib(r['state_bytes_per_stage'])} | {modelled} | {r['step_s']:.2f} |")
    return lines
