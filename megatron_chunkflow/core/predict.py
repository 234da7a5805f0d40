"""Predicted step time, MFU and peak memory per GPU of one training step, for stock Megatron and
for ChunkFlow, on a named device (core/hardware.py) with the roofline cost model.

Both systems go through core/step.py (plan_baseline: sequences packed into micro-batches of
seq_length run with Megatron's 1F1B; plan_chunkflow: chunks with state-aware 1F1B) and
core/simulate.py, with per-op seconds from core/roofline.py and bytes from core/footprint.py.

Step time = the slowest (DP rank, stage) of: its last backward, or the distributed optimizer's
gradient reduce-scatter if longer (Megatron's --overlap-grad-reduce launches it during the last
micro-batch's backward, so only the excess over that backward is exposed), then the optimizer
step; plus the parameter all-gather's excess over the first forward (--overlap-param-gather).
MFU = model FLOPs (core/costs.py: sequence_model_flops: attention per sequence, no recompute,
padding not counted) / (step time * GPUs * peak). Both systems train the same sequences, so
speedup = ratio of step times = ratio of MFUs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron_chunkflow.core.costs import sequence_model_flops
from megatron_chunkflow.core.footprint import (
    chunkflow_memory_floor,
    chunkflow_state_bytes,
    held_bytes_fn,
    stage_params,
    static_bytes,
    transient_bytes,
)
from megatron_chunkflow.core.hardware import Hardware
from megatron_chunkflow.core.layout import Layout, make_layout
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.roofline import Roofline
from megatron_chunkflow.core.step import RankPlans, plan_baseline, plan_chunkflow

GIB = 2.0**30


@dataclass(frozen=True)
class Prediction:
    """One system's predicted step on one layout."""

    system: str  # "megatron" or "chunkflow"
    layout: Layout
    step_s: float
    pipeline_s: float  # forward/backward of the slowest DP rank (plan replayed)
    optimizer_s: float
    model_flops: float
    num_tokens: int
    num_gpus: int
    peak_flops: float  # per GPU
    peak_mem_bytes: float
    usable_bytes: float
    memory: dict = field(default_factory=dict)  # bytes at the peak (rank, stage), by kind
    bubble: float = 0.0  # slowest DP rank
    num_microbatches: int = 0  # all DP ranks; chunks for ChunkFlow
    recompute_chunks: int = 0  # ChunkFlow re-forwards, all DP ranks
    chunk_size: int | None = None
    k: int | None = None

    @property
    def fits(self) -> bool:
        return self.peak_mem_bytes <= self.usable_bytes

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.num_gpus * self.peak_flops)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.step_s

    def to_json(self) -> dict:
        out = {
            "step_s": self.step_s, "mfu": self.mfu, "peak_mem_gib": self.peak_mem_bytes / GIB,
            "fits": self.fits, "tokens_per_s": self.tokens_per_s, "bubble": self.bubble,
            "layout": self.layout.to_json(), "pipeline_s": self.pipeline_s,
            "step_end_s": self.step_s - self.pipeline_s, "optimizer_s": self.optimizer_s,
            "num_microbatches": self.num_microbatches,
            "memory_gib": {k: v / GIB for k, v in self.memory.items()},
        }
        if self.system == "chunkflow":
            out.update(chunk_size=self.chunk_size, k=self.k,
                       recompute_chunks=self.recompute_chunks)
        return out


def _finish(system: str, rp: RankPlans, model: Roofline, shape: ModelShape, hw: Hardware,
            lengths: Sequence[int], state: list[list[float]], **extra) -> Prediction:
    layout = model.layout
    params = stage_params(shape, layout.pp)
    dp = [model.dp_times(p) for p in params]
    opt = [model.optimizer_time(p) for p in params]
    step, worst_mem, memory = 0.0, -1.0, {}
    for r, sim in enumerate(rp.sims):
        max_tokens = max((math.ceil(c.num_tokens / layout.cp) for c in rp.chunks[r]), default=0)
        for s in range(layout.pp):
            rs, ag = dp[s]
            ops = sim.timeline[s]
            end = max(ops[-1].end, ops[-1].start + rs) if ops else rs
            first_f = (ops[0].end - ops[0].start) if ops else 0.0
            step = max(step, end + opt[s] + max(0.0, ag - first_f))
            mem = {"static": static_bytes(params[s], layout, hw),
                   "activations": sim.peak_bytes[s], "kv_state": state[r][s],
                   "transient": transient_bytes(max_tokens, shape, layout, hw,
                                                s == layout.pp - 1)}
            if sum(mem.values()) > worst_mem:
                worst_mem, memory = sum(mem.values()), mem
    slowest = max(range(len(rp.sims)), key=lambda r: rp.sims[r].step_time)
    return Prediction(
        system=system, layout=layout, step_s=step, pipeline_s=rp.step_time,
        optimizer_s=max(opt), model_flops=sequence_model_flops(lengths, shape),
        num_tokens=sum(lengths), num_gpus=layout.num_gpus, peak_flops=hw.peak_flops,
        peak_mem_bytes=worst_mem, usable_bytes=hw.usable_bytes, memory=memory,
        bubble=rp.sims[slowest].bubble_ratio, num_microbatches=sum(len(c) for c in rp.chunks),
        recompute_chunks=sum(s.num_recompute for s in rp.sims), **extra)


def _hooks(model: Roofline, p2p_tokens: int):
    shape, layout, hw = model.shape, model.layout, model.hw
    return (lambda chunks, p: model.stage_costs(chunks, p, p2p_tokens),
            lambda chunks, p: held_bytes_fn(chunks, shape, layout, hw, p))


def predict_megatron(lengths: Sequence[int], shape: ModelShape, hw: Hardware, layout: Layout,
                     seq_length: int) -> Prediction:
    """Stock Megatron: whole sequences packed into micro-batches of `seq_length`, 1F1B."""
    model = Roofline(shape, layout, hw)
    costs_for, held_for = _hooks(model, seq_length)
    rp = plan_baseline(lengths, seq_length, layout.pp, layout.dp, shape, costs_for, held_for)
    no_state = [[0.0] * layout.pp for _ in rp.chunks]
    return _finish("megatron", rp, model, shape, hw, lengths, no_state)


def predict_chunkflow(lengths: Sequence[int], shape: ModelShape, hw: Hardware, layout: Layout,
                      chunk_size: int, k: int) -> Prediction:
    """ChunkFlow: chunks of `chunk_size`, K chunks of a long sequence holding activations."""
    if layout.cp > 1:
        raise ValueError(f"ChunkFlow runs with CP 1 (the plugin refuses context parallelism), "
                         f"got CP {layout.cp}")
    if layout.sequence_parallel and chunk_size % layout.tp:
        raise ValueError(f"--chunk-size {chunk_size} is not a multiple of the tensor-parallel "
                         f"size {layout.tp}, which sequence parallelism requires")
    model = Roofline(shape, layout, hw)
    costs_for, held_for = _hooks(model, chunk_size)
    _, rp = plan_chunkflow(lengths, chunk_size, k, layout.pp, layout.dp, shape, costs_for,
                           held_for)
    state = [chunkflow_state_bytes(c, shape, layout, hw, layout.pp) for c in rp.chunks]
    return _finish("chunkflow", rp, model, shape, hw, lengths, state, chunk_size=chunk_size, k=k)


# ---- searches --------------------------------------------------------------------------------


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidate_layouts(shape: ModelShape, hw: Hardware, num_gpus: int, allow_cp: bool,
                      max_pp: int = 16, max_cp: int = 32) -> list[tuple[int, int, int]]:
    """(TP, CP, PP) that Megatron accepts: TP inside a node and dividing heads and K/V groups."""
    heads = math.gcd(shape.num_attention_heads, shape.num_query_groups)
    out = []
    for tp in _divisors(math.gcd(heads, num_gpus), hw.gpus_per_node):
        for cp in (_divisors(num_gpus // tp, max_cp) if allow_cp else [1]):
            for pp in _divisors(num_gpus // (tp * cp), min(max_pp, shape.num_layers)):
                out.append((tp, cp, pp))
    return out


def best_of(predictions: list[Prediction]) -> Prediction:
    """The fastest that fits; if none fits, the one needing the least memory."""
    fitting = [p for p in predictions if p.fits]
    if fitting:
        return min(fitting, key=lambda p: p.step_s)
    return min(predictions, key=lambda p: p.peak_mem_bytes)


def layout_trials(predict: Callable[[Layout], Prediction], shape: ModelShape, hw: Hardware,
                  num_gpus: int, allow_cp: bool,
                  tp_ok: Callable[[int], bool] = lambda tp: True) -> list[Prediction]:
    """Every candidate (TP, CP, PP) without recompute, and with full recompute where that does
    not fit. Selective recompute is not tried: with a fused attention kernel it saves only the
    log-sum-exp (core/footprint.py) and costs an attention forward."""
    tried = []
    for tp, cp, pp in candidate_layouts(shape, hw, num_gpus, allow_cp):
        if not tp_ok(tp):
            continue
        for recompute in ("none", "full"):
            pred = predict(make_layout(tp, cp, pp, recompute, num_gpus, shape))
            tried.append(pred)
            if pred.fits:
                break
    if not tried:
        raise ValueError(f"no parallel layout of {num_gpus} GPUs suits this model and chunk size")
    return tried


def search_layout(predict: Callable[[Layout], Prediction], shape: ModelShape, hw: Hardware,
                  num_gpus: int, allow_cp: bool,
                  tp_ok: Callable[[int], bool] = lambda tp: True) -> Prediction:
    """The fastest layout that fits (layout_trials)."""
    return best_of(layout_trials(predict, shape, hw, num_gpus, allow_cp, tp_ok))


def chunking_candidates(lengths: Sequence[int], seq_length: int, tp: int,
                        sizes: Sequence[int] = (2048, 4096, 8192, 16384, 32768, 65536, 131072,
                                                262144),
                        ks: Sequence[int] = (1, 2, 4, 8)) -> list[tuple[int, int]]:
    """(chunk size, K) pairs worth simulating: C up to seq_length, K only while it changes
    something (K below the longest sequence's number of chunks)."""
    longest = max(lengths)
    out = []
    for c in sizes:
        if c > max(seq_length, sizes[0]) or c % tp:
            continue
        n = math.ceil(longest / c)
        out.extend((c, k) for k in ks if k == 1 or k < n)
    return out


def search_chunking(predict: Callable[[int, int], Prediction], lengths: Sequence[int],
                    seq_length: int, tp: int, floor: Callable[[int, int], float] | None = None,
                    budget: float = math.inf) -> Prediction:
    """Choose (chunk size, K) for the memory budget: the fastest that fits. Candidates whose
    memory `floor` (a lower bound) exceeds `budget` are not simulated, unless none is left."""
    candidates = chunking_candidates(lengths, seq_length, tp)
    if not candidates:
        raise ValueError(f"--auto: no candidate chunk size is a multiple of TP {tp}")
    if floor is not None:
        bounds = {ck: floor(*ck) for ck in candidates}
        hopeful = [ck for ck in candidates if bounds[ck] <= budget]
        candidates = hopeful or [min(candidates, key=bounds.__getitem__)]
    return best_of([predict(c, k) for c, k in candidates])


def best_megatron(lengths: Sequence[int], shape: ModelShape, hw: Hardware, num_gpus: int,
                  seq_length: int, layout: Layout | None = None) -> Prediction:
    """Stock Megatron on `layout`, or on the fastest layout that fits (search_layout)."""
    def predict(lay: Layout) -> Prediction:
        return predict_megatron(lengths, shape, hw, lay, seq_length)

    if layout is not None:
        return predict(layout)
    return search_layout(predict, shape, hw, num_gpus, allow_cp=True)


def best_chunkflow(lengths: Sequence[int], shape: ModelShape, hw: Hardware, num_gpus: int,
                   seq_length: int, layout: Layout | None = None, chunk_size: int = 8192,
                   k: int = 1, auto_chunking: bool = False) -> Prediction:
    """ChunkFlow on `layout` (or the fastest fitting one, CP 1) with (chunk_size, k), or with
    the fastest fitting (chunk size, K) when `auto_chunking`."""
    def fixed(lay: Layout) -> Prediction:
        return predict_chunkflow(lengths, shape, hw, lay, chunk_size, k)

    def floor(lay: Layout, c: int, kk: int) -> float:
        return chunkflow_memory_floor(lengths, shape, lay, hw, c, kk)

    def searched(lay: Layout) -> Prediction:
        return search_chunking(lambda c, kk: predict_chunkflow(lengths, shape, hw, lay, c, kk),
                               lengths, seq_length, lay.tp, lambda c, kk: floor(lay, c, kk),
                               hw.usable_bytes)

    if layout is not None:
        return searched(layout) if auto_chunking else fixed(layout)
    if auto_chunking:  # every layout, every (chunk size, K) whose memory floor fits
        return search_layout(searched, shape, hw, num_gpus, allow_cp=False)
    return search_layout(fixed, shape, hw, num_gpus, allow_cp=False,
                         tp_ok=lambda tp: chunk_size % tp == 0)
