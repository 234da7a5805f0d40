"""The fourth stock baseline, megatron-hybrid-cp: Megatron's per-sample context parallelism
(core/hybrid_cp.py) predicted on a named device, and searched.

Megatron's own scheduler deals the sequences (core/hybrid_cp.py: hybrid_schedule; the caller
passes megatron-core's in, mcore/hybrid_cp.py: balanced_cp_groups, so this stays pure); every
sequence is then one micro-batch on its CP group, costed by the roofline model exactly as a
stock micro-batch of that length on a TP x CP layout of that CP size (perfmodel/roofline.py:
Megatron's ring attention and its overlap, TP collectives, recompute, launch floor), PP = 1. A
group lasts its slowest rank's forwards and backwards plus one barrier (the link's latency);
the step is the groups in turn, then the step end of perfmodel/predict.py: the gradient
reduce-scatter over the pool (DP x CP) beyond the last backward, the optimizer, and the parameter
all-gather beyond the first forward. Memory per GPU: weights, gradients and the optimizer
sharded over the pool, plus the largest micro-batch's activations and backward working set on
its rank (one micro-batch in flight, no pipeline).

The layout is TP x pool (pool = DP x CP, a power of two, PP = 1): Prediction.layout reads
TP,1,1,pool (the CP size is per sequence) and Prediction.max_seqlen_per_rank gives
--max-seqlen-per-dp-cp-rank. The search tries every TP in a node, every recompute option of the
menu and every power of two M from 1K up to the longest sequence's that fits the pool, and keeps
the fastest that fits, as for the other baselines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_chunkflow.config import NO_RECOMPUTE, ParallelConfig, Recompute
from megatron_chunkflow.core.costs import sequence_model_flops
from megatron_chunkflow.core.hybrid_cp import (
    BASELINE,
    Scheduler,
    check_max_seqlen,
    check_pool,
    cp_size_needed,
    hybrid_schedule,
    hybrid_step_time,
    sequence_chunks,
)
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.perfmodel.footprint import (
    per_token_bytes,
    stage_params,
    static_bytes,
)
from megatron_chunkflow.perfmodel.hardware import Hardware
from megatron_chunkflow.perfmodel.moments import running_bytes
from megatron_chunkflow.perfmodel.predict import Prediction, roofline
from megatron_chunkflow.perfmodel.search import recompute_dominates

MIN_SEQLEN_PER_RANK = 1024


def hybrid_layout(tp: int, pool: int, recompute: Recompute | str, cp: int = 1) -> ParallelConfig:
    """The TP x CP layout one micro-batch runs on (CP = its CP size; cp = 1: the pool as DP)."""
    return ParallelConfig.layout(tp=tp, cp=cp, pp=1, dp=pool // cp, recompute=recompute)


def predict_hybrid_cp(lengths: Sequence[int], shape: ModelShape, hw: Hardware,
                      layout: ParallelConfig, max_seqlen_per_rank: int,
                      scheduler: Scheduler) -> Prediction:
    """megatron-hybrid-cp on `layout` (TP, PP = 1, its DP x CP the pool) at
    --max-seqlen-per-dp-cp-rank `max_seqlen_per_rank`, `scheduler` dealing the sequences;
    ValueError for what Megatron refuses."""
    where = layout.describe()
    if layout.pp > 1:
        raise ValueError(f"{where}: Megatron-LM refuses --hybrid-context-parallel with pipeline "
                         "parallelism")
    pool = layout.dp * layout.cp
    check_pool(pool, where)
    schedule, chunks = _sequences(lengths, pool, max_seqlen_per_rank, scheduler)
    rc = layout.recompute
    models = {c: roofline(shape, hybrid_layout(layout.tp, pool, rc, c), hw)
              for c in set(schedule.cp)}
    costs = {}

    def cost(i: int) -> tuple[float, float]:
        if i not in costs:
            (f,), (b,) = models[schedule.cp[i]].chunk_costs(chunks[i], 1)
            costs[i] = (f, b)
        return costs[i]

    flat = roofline(shape, hybrid_layout(layout.tp, pool, rc), hw)
    step = hybrid_step_time(schedule, cost, barrier_s=flat.dp_link[1])
    params = stage_params(shape, 1)[0]
    rs, ag = flat.dp_times(params)
    opt = flat.optimizer_time(params)
    total = (step.step_time + max(0.0, rs - step.last_backward) + opt
             + max(0.0, ag - step.first_forward))
    worst, memory = _peak_memory(shape, hw, layout, schedule, chunks)
    computed = sum(c.computed_tokens for c in chunks)
    return Prediction(
        system="megatron", layout=flat.layout, step_s=total, pipeline_s=step.step_time,
        optimizer_s=opt, model_flops=sequence_model_flops(lengths, shape),
        num_tokens=sum(lengths), num_gpus=flat.layout.num_gpus, peak_flops=hw.peak_flops,
        peak_mem_bytes=worst, usable_bytes=hw.usable_bytes, memory=memory,
        bubble=step.idle_ratio, num_microbatches=len(lengths), baseline=BASELINE,
        padding_fraction=1 - sum(lengths) / computed, max_seqlen_per_rank=max_seqlen_per_rank)


def _sequences(lengths, pool: int, max_seqlen_per_rank: int, scheduler: Scheduler):
    schedule = hybrid_schedule(lengths, pool, max_seqlen_per_rank, scheduler)
    return schedule, sequence_chunks(lengths, schedule)


def _peak_memory(shape: ModelShape, hw: Hardware, layout: ParallelConfig, schedule,
                 chunks) -> tuple[float, dict]:
    """(bytes, by kind) on the GPU whose largest micro-batch needs the most (module docstring)."""
    pool = layout.dp * layout.cp
    static = static_bytes(stage_params(shape, 1)[0], hybrid_layout(layout.tp, pool, NO_RECOMPUTE),
                          hw.dtype_bytes)
    worst, memory = -1.0, {}
    for c in sorted(set(schedule.cp)):  # the largest micro-batch of each CP size
        lay = hybrid_layout(layout.tp, pool, layout.recompute, c)
        tokens = max(math.ceil(chunks[i].computed_tokens / c)
                     for i in range(len(chunks)) if schedule.cp[i] == c)
        build = hw.build
        mem = {"static": static,
               "activations": per_token_bytes(shape, lay, hw.dtype_bytes, 1, build)[0] * tokens,
               "kv_state": 0.0,
               "transient": max(running_bytes(kind, tokens, shape, lay, hw.dtype_bytes,
                                              shape.num_layers, True, build)
                                for kind in ("F", "B"))}
        if sum(mem.values()) > worst:
            worst, memory = sum(mem.values()), mem
    return worst, memory


def seqlen_candidates(lengths: Sequence[int], pool: int) -> list[int]:
    """Powers of two M from MIN_SEQLEN_PER_RANK (or the least the pool allows) up to the first
    that holds the longest sequence on one rank (larger M change nothing)."""
    longest = max(lengths)
    m = max(MIN_SEQLEN_PER_RANK, 2 ** math.ceil(math.log2(-(-longest // pool))))
    out = [m]
    while out[-1] < longest:
        out.append(out[-1] * 2)
    return out


def best_hybrid_cp(lengths: Sequence[int], shape: ModelShape, hw: Hardware, num_gpus: int,
                   scheduler: Scheduler, layout: ParallelConfig | None = None,
                   max_seqlen_per_rank: int | None = None) -> Prediction:
    """megatron-hybrid-cp on `layout` (or every TP and recompute option) at
    `max_seqlen_per_rank` (or every candidate M): the fastest that fits; if none fits, the one
    needing the least memory. ValueError when no layout can run it on `num_gpus` GPUs."""
    if max_seqlen_per_rank is not None:
        check_max_seqlen(lengths, (layout.dp * layout.cp) if layout else num_gpus,
                         max_seqlen_per_rank)
    if layout is not None:
        if layout.pp > 1:
            raise ValueError(f"Megatron-LM refuses --hybrid-context-parallel with pipeline "
                             f"parallelism ({layout.describe()})")
        check_pool(layout.dp * layout.cp, layout.describe())
        layouts = [layout]
    else:
        heads = math.gcd(shape.num_attention_heads, shape.num_query_groups)
        layouts = []
        for tp in range(1, min(hw.gpus_per_node, num_gpus) + 1):
            pool = num_gpus // tp
            if heads % tp or num_gpus % tp or pool < 2 or pool & (pool - 1):
                continue
            layouts += [hybrid_layout(tp, pool, rc) for rc in Recompute.menu(shape.num_layers)]
    if not layouts:
        raise ValueError(f"no TP inside a node leaves a power-of-two DP x CP pool of "
                         f"at least 2 ranks on {num_gpus} GPUs")
    best, least = None, None
    for degrees in dict.fromkeys(lay.degrees for lay in layouts):
        pool = degrees.dp * degrees.cp
        if max_seqlen_per_rank is None:
            ms = seqlen_candidates(lengths, pool)
        elif cp_size_needed(max(lengths), max_seqlen_per_rank) <= pool:
            ms = [max_seqlen_per_rank]
        else:
            continue  # a larger TP leaves a pool too small for the longest sequence at this M
        for m in ms:
            fitting: list[Recompute] = []
            for lay in (x for x in layouts if x.degrees == degrees):
                if any(recompute_dominates(a, lay.recompute) for a in fitting):
                    continue  # a fitting option no slower exists
                schedule, chunks = _sequences(lengths, pool, m, scheduler)
                need, _ = _peak_memory(shape, hw, lay, schedule, chunks)
                if need <= hw.usable_bytes:
                    fitting.append(lay.recompute)
                    p = predict_hybrid_cp(lengths, shape, hw, lay, m, scheduler)
                    if best is None or p.step_s < best.step_s:
                        best = p
                elif least is None or need < least[0]:
                    least = (need, lay, m)
    if best is None:
        _, lay, m = least
        best = predict_hybrid_cp(lengths, shape, hw, lay, m, scheduler)
    return best

