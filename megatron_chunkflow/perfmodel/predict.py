"""Predicted step time, MFU and peak memory per GPU of one training step, for stock Megatron (one
of core/step.py's BASELINES) and for ChunkFlow, on a named device (perfmodel/hardware.py) with the
roofline cost model.

Both systems go through core/step.py (plan_baseline: megatron-sft, -packed or -unpacked
micro-batches, every sequence padded to a multiple of 2 x CP under CP, run with Megatron's 1F1B,
interleaved over V model chunks per rank when the layout has virtual stages (ParallelConfig.vpp);
plan_chunkflow: chunks with state-aware 1F1B, interleaved the same way; under CP every segment
padded to a multiple of 2 x CP and every chunk to 2 x CP x TP under sequence parallelism, as
core/packer pads them, and ChunkFlow's ring CP attention, perfmodel/layer.py) and
core/simulate.py, with per-op seconds
from perfmodel/roofline.py (recompute, launch floor, each system's pipeline sends) and bytes
(activations held, per virtual stage, and the long sequence's state, as core/step.py's memory
hooks) from perfmodel/footprint.py; memory and the step end are per pipeline rank.
Padding is computed like the sequence's own tokens (core/types.py Segment.padding), so it costs
time and memory but is not model FLOPs.

Step time = the slowest (DP rank, stage) of: its last backward, or the distributed optimizer's
gradient reduce-scatter if longer (Megatron's --overlap-grad-reduce launches it during the last
micro-batch's backward, so only the excess over that backward is exposed), then the optimizer
step; plus the parameter all-gather's excess over the first forward (--overlap-param-gather).
MFU = model FLOPs (core/costs.py: sequence_model_flops: attention per sequence, no recompute,
padding not counted) / (step time * GPUs * peak). Both systems train the same sequences, so
speedup = ratio of step times = ratio of MFUs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from megatron_chunkflow.config import ParallelConfig, Recompute
from megatron_chunkflow.core.costs import sequence_model_flops
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.step import (
    Baseline,
    RankPlans,
    plan_baseline,
    plan_chunkflow,
)
from megatron_chunkflow.core.types import DataChunk, Segment
from megatron_chunkflow.perfmodel.footprint import stage_params, static_bytes
from megatron_chunkflow.perfmodel.hardware import Hardware
from megatron_chunkflow.perfmodel.held import memory_hooks
from megatron_chunkflow.perfmodel.moments import op_bytes_fn
from megatron_chunkflow.perfmodel.roofline import Roofline

GIB = 2.0**30


@dataclass(frozen=True)
class Prediction:
    """One system's predicted step on one layout."""

    system: str  # "megatron" or "chunkflow"
    layout: ParallelConfig
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
    num_kept: int | None = None
    baseline: str | None = None  # stock Megatron: which of core/step.py's BASELINES
    padding_fraction: float = 0.0  # computed tokens that are padding, all DP ranks
    max_seqlen_per_rank: int | None = None  # megatron-hybrid-cp: --max-seqlen-per-dp-cp-rank
    cp_kv: str = "sharded"  # ChunkFlow under CP: where a long sequence's K/V state lives
    cp_placement: str = "hybrid"  # ChunkFlow under CP: standalone chunks' segments (cp_place.py)
    reforward_attention: str = "recompute"  # ChunkFlow: a re-forward's attention (reforward.py)
    memory_rank: int | None = None  # the DP rank and pipeline stage of the peak
    memory_stage: int | None = None
    loss_piece: int = 0  # the loss in token pieces (0: whole)

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
        """Times in seconds, memory in GiB, the layout with its recompute's text form."""
        out = {
            "step_s": self.step_s, "mfu": self.mfu, "peak_mem_gib": self.peak_mem_bytes / GIB,
            "fits": self.fits, "tokens_per_s": self.tokens_per_s, "bubble": self.bubble,
            "layout": self.layout.to_json(), "pipeline_s": self.pipeline_s,
            "step_end_s": self.step_s - self.pipeline_s, "optimizer_s": self.optimizer_s,
            "num_microbatches": self.num_microbatches,
            "memory_gib": {k: v / GIB for k, v in self.memory.items()},
            "padding_fraction": self.padding_fraction,
        }
        if self.loss_piece:
            out["loss_piece"] = self.loss_piece
        if self.baseline is not None:
            out["baseline"] = self.baseline
        if self.max_seqlen_per_rank is not None:
            out["max_seqlen_per_dp_cp_rank"] = self.max_seqlen_per_rank
        if self.system == "chunkflow":
            out.update(chunk_size=self.chunk_size, k=self.num_kept,
                       recompute_chunks=self.recompute_chunks,
                       reforward_attention=self.reforward_attention)
            if self.layout.cp > 1:
                out.update(cp_kv=self.cp_kv, cp_placement=self.cp_placement)
        return out


def _finish(system: str, rp: RankPlans, model: Roofline, shape: ModelShape, hw: Hardware,
            lengths: Sequence[int], rank_chunks=None, **extra) -> Prediction:
    """`rank_chunks`: each DP rank's chunks as computed, when they differ from rp.chunks
    (ChunkFlow's CP padding, with_padding). Memory per (DP rank, stage): static bytes plus the
    replay's peak (held activations, state, the running op's working memory: moments.py)."""
    layout = model.layout
    params = stage_params(shape, layout.pp)  # per rank: its V model chunks' layers
    dp = [model.dp_times(p) for p in params]
    opt = [model.optimizer_time(p) for p in params]
    rank_chunks = rp.chunks if rank_chunks is None else rank_chunks
    step, worst_mem, memory, where = 0.0, -1.0, {}, (None, None)
    for r, sim in enumerate(rp.sims):
        for s in range(layout.pp):
            rs, ag = dp[s]
            ops = sim.timeline[s]
            end = max(ops[-1].end, ops[-1].start + rs) if ops else rs
            first_f = (ops[0].end - ops[0].start) if ops else 0.0
            step = max(step, end + opt[s] + max(0.0, ag - first_f))
            held, state, running = sim.peak_parts[s] if sim.peak_parts else (0.0, 0.0, 0.0)
            mem = {"static": static_bytes(params[s], layout, hw.dtype_bytes),
                   "activations": held, "kv_state": state, "transient": running}
            if sum(mem.values()) > worst_mem:
                worst_mem, memory, where = sum(mem.values()), mem, (r, s)
    slowest = max(range(len(rp.sims)), key=lambda r: rp.sims[r].step_time)
    chunks = [c for rank in rank_chunks for c in rank]
    computed = sum(c.computed_tokens for c in chunks)
    return Prediction(
        system=system, layout=layout, step_s=step, pipeline_s=rp.step_time,
        optimizer_s=max(opt), model_flops=sequence_model_flops(lengths, shape),
        num_tokens=sum(lengths), num_gpus=layout.num_gpus, peak_flops=hw.peak_flops,
        peak_mem_bytes=worst_mem, usable_bytes=hw.usable_bytes, memory=memory,
        bubble=rp.sims[slowest].bubble_ratio, num_microbatches=len(chunks),
        recompute_chunks=sum(s.num_recompute for s in rp.sims),
        padding_fraction=1 - sum(c.num_tokens for c in chunks) / max(computed, 1),
        memory_rank=where[0], memory_stage=where[1], **extra)


@lru_cache(maxsize=2048)
def roofline(shape: ModelShape, layout: ParallelConfig, hw: Hardware,
             loss_piece: int = 0) -> Roofline:
    """One Roofline per (model, layout, device, loss piece), so searches reuse its per-chunk
    cost cache."""
    return Roofline(shape, layout, hw, loss_piece)


def predict_megatron(lengths: Sequence[int], shape: ModelShape, hw: Hardware,
                     layout: ParallelConfig, seq_length: int,
                     baseline: Baseline = "megatron-packed", loss_piece: int = 0) -> Prediction:
    """Stock Megatron: whole sequences in micro-batches of at most `seq_length` as `baseline`
    builds them (core/step.py), padded to 2 x CP under CP, Megatron's 1F1B (interleaved with
    layout.vpp > 1: ValueError where Megatron refuses the micro-batch count); megatron-sft sends
    fixed seq_length shapes, the others each micro-batch's own after a shape handshake;
    `loss_piece`: the same loss in token pieces as ChunkFlow's (0: Megatron's own, as shipped)."""
    model = roofline(shape, layout, hw, loss_piece)
    build = dataclasses.replace(hw.build, loss_piece=loss_piece)
    held_for, _ = memory_hooks(shape, layout, hw.dtype_bytes, build=build, chunkflow=False)
    sends = "fixed" if baseline == "megatron-sft" else "variable"
    rp = plan_baseline(lengths, seq_length, layout.pp, layout.dp, shape,
                       lambda chunks, p: model.stage_costs(chunks, p, seq_length, sends),
                       held_for, baseline=baseline, cp=layout.cp, num_model_chunks=layout.vpp,
                       op_bytes_for=lambda chunks, p: op_bytes_fn(
                           chunks, shape, layout, hw.dtype_bytes, p, build, chunkflow=False))
    return _finish("megatron", rp, model, shape, hw, lengths, baseline=baseline,
                   loss_piece=loss_piece)


def cp_padded_lengths(lengths: Sequence[int], multiple: int) -> list[int]:
    """Each length rounded up to `multiple` (ParallelConfig.segment_multiple). Cut and packed at
    these lengths, ChunkFlow's chunks are core/packer's under CP: a short sequence packed by its
    padded length, a long one's last chunk padded (the chunk size being a multiple, its other cuts
    stay where they were); with_padding turns the rounding back into Segment.padding."""
    return [n + -n % multiple for n in lengths]


def with_padding(chunks: Sequence[DataChunk], lengths: Sequence[int]) -> list[DataChunk]:
    """`chunks` built from cp_padded_lengths(lengths, m), each segment's tokens beyond its
    sequence's real length made padding (computed tokens unchanged)."""
    out = []
    for c in chunks:
        segs = tuple(Segment(s.seq_id, s.start, min(s.end, lengths[s.seq_id]),
                             s.padding + s.end - min(s.end, lengths[s.seq_id]))
                     for s in c.segments)
        out.append(c if segs == c.segments else dataclasses.replace(c, segments=segs))
    return out


def predict_chunkflow(lengths: Sequence[int], shape: ModelShape, hw: Hardware,
                      layout: ParallelConfig, chunk_size: int, num_kept: int,
                      cp_kv: str = "sharded", cp_placement: str = "hybrid",
                      reforward: str = "recompute", loss_piece: int = 0) -> Prediction:
    """ChunkFlow: chunks of `chunk_size`, K chunks of a long sequence holding activations; under
    CP every segment padded to ParallelConfig.segment_multiple, every chunk to chunk_padding, and
    ChunkFlow's CP attention
    (all-gathered K/V, gathered again in the backward; perfmodel/layer.py), the long sequence's
    K/V state `cp_kv`: "sharded", or "replicated" (whole on every CP rank, only a chunk's own
    K/V gathered, not again in the backward; --chunkflow-cp-kv), standalone chunks' segments
    placed `cp_placement` (--chunkflow-cp-placement: "hybrid" keeps them whole on one rank where
    core/cp_place.py can, "split" cuts every one), re-forwarded chunks' attention `reforward`
    (--chunkflow-reforward-attention: "recompute", or "keep" / "offload", whose re-forwards skip
    the attention core, keep holding its output on the GPU, offload copying it to the host and
    back: roofline.kept_attention_costs), the loss in pieces of `loss_piece` tokens (0: whole;
    --chunkflow-loss-piece)."""
    layout.check_chunk_size(chunk_size, naming="axes")
    asked, layout = layout, runtime_layout(layout)
    model = roofline(shape, layout, hw, loss_piece)
    build = dataclasses.replace(hw.build, loss_piece=loss_piece)
    held_for, _ = memory_hooks(shape, layout, hw.dtype_bytes, chunk_size, num_kept, cp_kv,
                               cp_placement, reforward, build)
    m, gather = layout.segment_multiple, (cp_kv if layout.cp > 1 else False)
    if m == 1:
        padded, real = lengths, (lambda chunks: chunks)
    else:
        padded, real = cp_padded_lengths(lengths, m), (lambda chunks: with_padding(chunks, lengths))
    _, rp = plan_chunkflow(
        padded, chunk_size, num_kept, layout.pp, layout.dp, shape,
        lambda chunks, p: model.stage_costs(real(chunks), p, chunk_size, "async", gather,
                                            cp_placement, (reforward, num_kept)),
        lambda chunks, p: held_for(real(chunks), p), num_model_chunks=layout.vpp,
        chunk_multiple=layout.chunk_padding,
        op_bytes_for=lambda chunks, p: op_bytes_fn(
            real(chunks), shape, layout, hw.dtype_bytes, p, build, num_kept=num_kept,
            cp_kv=cp_kv, reforward=reforward, hybrid=cp_placement == "hybrid"))
    out = _finish("chunkflow", rp, model, shape, hw, lengths,
                  [real(c) for c in rp.chunks] if m > 1 else None,
                  chunk_size=chunk_size, num_kept=num_kept, cp_kv=cp_kv,
                  cp_placement=cp_placement, reforward_attention=reforward,
                  loss_piece=loss_piece)
    return dataclasses.replace(out, layout=asked)


def runtime_layout(layout: ParallelConfig) -> ParallelConfig:
    """The layout ChunkFlow's runtime runs for `layout`: under CP its core attention runs its own
    backward and Megatron's selective core_attn checkpoint is switched off (runtime/model.py), so
    core_attn leaves the recompute option (selective alone becomes none)."""
    rc = layout.recompute
    if layout.cp == 1 or "core_attn" not in rc.modules:
        return layout
    rest = tuple(m for m in rc.modules if m != "core_attn")
    return dataclasses.replace(layout, recompute=Recompute("selective", rest) if rest
                               else Recompute())
