"""`chunkflow plan`'s result without its report: one global batch cut, packed and scheduled for
ChunkFlow and planned as each stock baseline, with FLOPs per GPU for op costs and the footprint
model's bytes (cli/plan.py prints it, draws it and writes its JSON).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.hybrid_cp import BASELINE as HYBRID
from megatron_chunkflow.core.hybrid_cp import (
    cp_size_needed,
    hybrid_schedule,
    hybrid_step_time,
    sequence_chunks,
)
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.step import BASELINES, plan_baseline, plan_chunkflow
from megatron_chunkflow.perfmodel.footprint import (
    per_token_bytes,
    stage_params,
    static_bytes,
    total_params,
)
from megatron_chunkflow.perfmodel.held import memory_hooks

GIB = 2.0**30
BF16_BYTES = 2  # the printed memory model's element size


@dataclass
class BatchPlans:
    """ChunkFlow's chunks and plans, each stock baseline's, and megatron-hybrid-cp's summary
    (None with the note saying why where Megatron cannot run it)."""

    batch: object  # core/packer.py ChunkBatch
    chunkflow: object  # core/step.py RankPlans
    baselines: dict
    hybrid: dict | None
    note: str | None


def per_gpu_flops(shape, cp: int):
    """core/step.py's FLOP costs per GPU: a micro-batch's FLOPs split evenly over its CP ranks
    (the zigzag pieces balance causal attention)."""
    def costs(chunks, num_stages):
        flops = OpCosts.from_model(chunks, shape, num_stages)
        if cp > 1:
            flops.forward = {c: [f / cp for f in per_stage]
                             for c, per_stage in flops.forward.items()}
        return flops

    return costs


def static_per_stage(shape: ModelShape, layout: ParallelConfig) -> list[float]:
    """Each pipeline rank's weights, gradient buffer and optimizer states (bf16 weights, the
    distributed optimizer over DP x CP: perfmodel/footprint.py static_bytes), what the printed
    activations come on top of."""
    return [static_bytes(p, layout, BF16_BYTES) for p in stage_params(shape, layout.pp)]


def hybrid_static(shape: ModelShape, pool: int) -> float:
    """megatron-hybrid-cp's weights, gradients and states per GPU: PP 1, sharded over its pool."""
    return static_bytes(total_params(shape), ParallelConfig.layout(dp=pool), BF16_BYTES)


def baseline_summary(rp, dp_rank: int) -> dict:
    """One stock baseline's plan in numbers (the JSON's "baselines" entries)."""
    chunks = [c for rank in rp.chunks for c in rank]
    computed = sum(c.computed_tokens for c in chunks)
    return {"num_microbatches": len(chunks),
            "padding_fraction": 1 - sum(c.num_tokens for c in chunks) / max(computed, 1),
            "bubble_ratio": rp.sims[dp_rank].bubble_ratio, "step_time": rp.step_time,
            "peak_memory_gib": [round(b / GIB, 3) for b in rp.peak_memory_bytes(dp_rank)]}


def hybrid_summary(lengths, shape, num_gpus: int, max_seqlen: int | None, chunk_size: int,
                   cp_groups: Callable):
    """megatron-hybrid-cp on all `num_gpus` GPUs as its pool (PP 1), FLOPs per GPU as for the
    other systems (a sequence's FLOPs / its CP size on each of its ranks); (summary, note): the
    summary None and the note saying why where Megatron cannot run it."""
    if num_gpus < 2 or num_gpus & (num_gpus - 1):
        return None, (f"{HYBRID} not planned: its DP x CP pool ({num_gpus} GPUs here) must be a "
                      "power of two >= 2")
    if max_seqlen is None:  # ChunkFlow's tokens per GPU, or the least that fits the pool
        max_seqlen = chunk_size
        while cp_size_needed(max(lengths), max_seqlen) > num_gpus:
            max_seqlen *= 2
    schedule = hybrid_schedule(lengths, num_gpus, max_seqlen, cp_groups)
    chunks = sequence_chunks(lengths, schedule)
    flops = OpCosts.from_model(chunks, shape, 1)
    step = hybrid_step_time(schedule, lambda i: (flops("F", i, 0) / schedule.cp[i],
                                                 flops("B", i, 0) / schedule.cp[i]))
    per_token = per_token_bytes(shape, ParallelConfig.layout(), BF16_BYTES, 1)[0]
    peak = max(per_token * -(-c.computed_tokens // schedule.cp[c.id]) for c in chunks)
    computed = sum(c.computed_tokens for c in chunks)
    return {"num_microbatches": len(chunks), "max_seqlen_per_dp_cp_rank": max_seqlen,
            "pool": num_gpus, "num_groups": len(schedule.groups),
            "cp_sizes": sorted(set(schedule.cp)),
            "padding_fraction": 1 - sum(lengths) / max(computed, 1),
            "bubble_ratio": step.idle_ratio, "step_time": step.step_time,
            "peak_memory_gib": [round(peak / GIB, 3)]}, None


def plan_batch(lengths: Sequence[int], shape: ModelShape, cfg: ChunkFlowConfig,
               layout: ParallelConfig, seq_length: int, cp_groups: Callable,
               max_seqlen: int | None = None) -> BatchPlans:
    """The plans of `lengths` on `layout` (PP, V, CP, DP); the stock baselines' micro-batches of
    up to `seq_length` tokens; megatron-hybrid-cp on all the layout's GPUs as its pool, its
    scheduler's groups from `cp_groups`. ValueError where Megatron's interleaving refuses a
    baseline's micro-batch count."""
    cp, vpp, pp, dp = layout.cp, layout.vpp, layout.pp, layout.dp
    held_for, _ = memory_hooks(shape, layout, BF16_BYTES)  # the baselines' micro-batches
    cf_held_for, state_for = memory_hooks(shape, layout, BF16_BYTES, cfg.chunk_size, cfg.num_kept,
                                          cp_placement="hybrid")  # the runtime's default
    costs = per_gpu_flops(shape, cp)
    batch, cf = plan_chunkflow(lengths, cfg.chunk_size, cfg.num_kept, pp, dp, shape,
                               costs_for=costs, held_bytes_for=cf_held_for,
                               state_bytes_for=state_for,
                               segment_multiple=layout.segment_multiple,
                               num_model_chunks=vpp, chunk_multiple=layout.chunk_padding)
    try:
        bases = {b: plan_baseline(lengths, seq_length, pp, dp, shape, costs_for=costs,
                                  held_bytes_for=held_for, baseline=b, cp=cp,
                                  num_model_chunks=vpp) for b in BASELINES}
    except ValueError as e:  # a sequence past --seq-length, or the interleaving's refusal
        blame = "" if "--seq-length" in str(e) or vpp == 1 else f"--vpp {vpp}: "
        raise ValueError(f"{blame}stock Megatron: {e}") from None
    hybrid, note = hybrid_summary(lengths, shape, pp * dp * cp, max_seqlen, cfg.chunk_size,
                                  cp_groups)
    return BatchPlans(batch, cf, bases, hybrid, note)
