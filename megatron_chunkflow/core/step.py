"""One training step planned end to end, for ChunkFlow and for the stock-Megatron baselines.

ChunkFlow: build_chunks (cut, pack, distribute over DP) -> state_aware_plan per DP rank.
Stock Megatron, every sequence whole, in one of three ways (BASELINES), micro-batches dealt
round-robin over DP ranks as Megatron splits a global batch and run with Megatron's 1F1B order:
- megatron-sft: Megatron-LM's SFT path as shipped. The sequences are packed offline into lines of
  `seq_length` by first fit in data order (Megatron-Bridge's / NeMo's first_fit_shuffle on
  shuffled data) and each line is padded to `seq_length`, the padding computed as part of the
  line's last sequence (megatron/training/datasets/sft_dataset.py attaches it there); the
  pipeline sends fixed `seq_length` shapes.
- megatron-packed: best-fit-decreasing packing into micro-batches of at most `seq_length` with no
  padding computed (THD), variable shapes: the strongest stock option.
- megatron-unpacked: one sequence per micro-batch (micro-batch size 1), variable shapes.
With context parallelism Megatron pads every sequence to a multiple of 2 x CP (its load-balanced
THD split needs it); the padding is computed as part of the sequence.
Both systems replay through the same simulator and cost model. A DP step ends when its slowest
rank ends, so step_time is the maximum over ranks.

The planner works on time only: memory enters through optional hooks (perfmodel/footprint.py's
memory_hooks model it; perfmodel/budget.py passes measured rates), so core stays free of a
memory model. Without them every byte count below is zero.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.packer import (
    best_fit_decreasing,
    build_chunks,
    first_fit,
    validate_lengths,
)
from megatron_chunkflow.core.schedule import megatron_interleaved_plan, state_aware_plan
from megatron_chunkflow.core.simulate import SimResult, simulate
from megatron_chunkflow.core.types import ChunkBatch, DataChunk, PipelinePlan, Segment

Baseline = Literal["megatron-sft", "megatron-packed", "megatron-unpacked"]
BASELINES: tuple[str, ...] = typing.get_args(Baseline)


@dataclass(frozen=True)
class RankPlans:
    """Plans and their simulation for every DP rank of one step."""

    chunks: tuple[tuple[DataChunk, ...], ...]  # per DP rank
    plans: tuple[PipelinePlan, ...]
    sims: tuple[SimResult, ...]
    state_bytes: tuple[tuple[float, ...], ...]  # per DP rank, per stage: long-sequence state

    @property
    def step_time(self) -> float:
        """The slowest DP rank's step."""
        return max(s.step_time for s in self.sims)

    def peak_memory_bytes(self, dp_rank: int) -> tuple[float, ...]:
        """Modelled peak per stage: activations of the chunks held at once plus the state of the
        long sequence (both zero unless the plan was given memory hooks)."""
        return tuple(a + b for a, b in zip(self.sims[dp_rank].peak_bytes,
                                           self.state_bytes[dp_rank]))


# Optional hooks, all called with (one DP rank's chunks, num_stages): `costs_for` returns the
# per-op costs to plan and replay with (OpCosts or any callable (kind, chunk, stage) with a `comm`
# attribute; default: FLOPs), `held_bytes_for` a callable (chunk id, stage) -> activation bytes the
# chunk holds (default: none), `state_bytes_for` the bytes per stage of the rank's long-sequence
# state (K/V, gradient accumulators, kept stage inputs; default: none), `op_bytes_for` a callable
# (op, stage) -> (state allocated as it starts, released as it ends, working memory while it
# runs), replayed op by op (core/simulate.py; then the state is in the replay, not in
# state_bytes). perfmodel/predict.py passes the roofline model's seconds and
# perfmodel/footprint.py's and perfmodel/moments.py's bytes.
CostHook = Callable[[Sequence[DataChunk], int], Callable]
StateHook = Callable[[Sequence[DataChunk], int], Sequence[float]]


def _flop_costs(shape: ModelShape) -> CostHook:
    return lambda chunks, num_stages: OpCosts.from_model(chunks, shape, num_stages)


def _replay(chunks: Sequence[DataChunk], plan: PipelinePlan, costs, held_bytes_for: CostHook | None,
            num_stages: int, op_bytes_for: CostHook | None = None) -> SimResult:
    held = held_bytes_for(chunks, num_stages) if held_bytes_for else None
    moments = op_bytes_for(chunks, num_stages) if op_bytes_for else None
    return simulate(plan, costs, held_bytes=held, op_bytes=moments)


def plan_chunkflow(seq_lengths: Sequence[int], chunk_size: int, num_kept: int, num_stages: int,
                   num_dp_ranks: int, shape: ModelShape, costs_for: CostHook | None = None,
                   held_bytes_for: CostHook | None = None,
                   state_bytes_for: StateHook | None = None,
                   segment_multiple: int = 1,
                   num_model_chunks: int = 1,
                   chunk_multiple: int = 1,
                   op_bytes_for: CostHook | None = None) -> tuple[ChunkBatch, RankPlans]:
    """ChunkFlow's step: chunks built, distributed and planned with state-aware 1F1B per DP rank
    (interleaved over `num_model_chunks` virtual stages per rank), each plan replayed; bytes
    only from the hooks (see CostHook; costs and held bytes are asked for the PP x V virtual
    stages). `segment_multiple`, `chunk_multiple`: context parallelism's padding of every
    segment and chunk (core/packer.build_chunks)."""
    batch = build_chunks(seq_lengths, chunk_size, num_dp_ranks, num_kept, shape, segment_multiple,
                         chunk_multiple)
    per_rank = tuple(tuple(batch.chunks_for_rank(r)) for r in range(num_dp_ranks))
    plans, sims, state = [], [], []
    for chunks in per_rank:
        virtual = num_stages * num_model_chunks
        costs = (costs_for or _flop_costs(shape))(chunks, virtual)
        plan = state_aware_plan(chunks, num_stages, num_kept, costs, num_model_chunks)
        plans.append(plan)
        sims.append(_replay(chunks, plan, costs, held_bytes_for, virtual, op_bytes_for))
        state.append(tuple(state_bytes_for(chunks, num_stages)) if state_bytes_for
                     else (0.0,) * num_stages)
    return batch, RankPlans(per_rank, tuple(plans), tuple(sims), tuple(state))


def baseline_microbatches(seq_lengths: Sequence[int], seq_length: int, num_dp_ranks: int,
                          baseline: Baseline = "megatron-packed", cp: int = 1) -> list[DataChunk]:
    """A stock baseline's micro-batches (see the module docstring), dealt round-robin over DP
    ranks; ValueError for a sequence longer than `seq_length` (Megatron would truncate it)."""
    validate_lengths(seq_lengths)
    if baseline not in BASELINES:
        raise ValueError(f"unknown baseline {baseline!r}; choose from {', '.join(BASELINES)}")
    multiple = 2 * cp if cp > 1 else 1
    padded = [-(-n // multiple) * multiple for n in seq_lengths]
    for i, (n, p) in enumerate(zip(seq_lengths, padded)):
        if p > seq_length:
            what = f" ({p} padded to a multiple of 2 x CP)" if p != n else ""
            raise ValueError(f"sequence {i} has {n} tokens{what}, more than --seq-length "
                             f"{seq_length}; stock Megatron would truncate it")
    ids = list(range(len(seq_lengths)))
    if baseline == "megatron-packed":
        bins = best_fit_decreasing(padded, ids, seq_length)
    elif baseline == "megatron-unpacked":
        bins = [[i] for i in ids]
    else:
        bins = first_fit(padded, ids, seq_length)
    out = []
    for b, members in enumerate(bins):
        segments = [Segment(i, 0, seq_lengths[i], padded[i] - seq_lengths[i]) for i in members]
        if baseline == "megatron-sft":  # the line's padding, computed with its last sequence
            last = segments[-1]
            line = sum(padded[i] for i in members)
            segments[-1] = Segment(last.seq_id, 0, last.end, last.padding + seq_length - line)
        out.append(DataChunk(id=b, kind="standalone", dp_rank=b % num_dp_ranks,
                             segments=tuple(segments)))
    return out


def plan_baseline(seq_lengths: Sequence[int], seq_length: int, num_stages: int,
                  num_dp_ranks: int, shape: ModelShape, costs_for: CostHook | None = None,
                  held_bytes_for: CostHook | None = None, baseline: Baseline = "megatron-packed",
                  cp: int = 1, num_model_chunks: int = 1,
                  op_bytes_for: CostHook | None = None) -> RankPlans:
    """A stock baseline's step: baseline_microbatches run with 1F1B per DP rank (Megatron's
    interleaved 1F1B with `num_model_chunks` virtual stages per rank; ValueError where Megatron
    refuses the micro-batch count), replayed. Whole sequences keep no state between
    micro-batches, so state_bytes is zero."""
    mbs = baseline_microbatches(seq_lengths, seq_length, num_dp_ranks, baseline, cp)
    per_rank = tuple(tuple(c for c in mbs if c.dp_rank == r) for r in range(num_dp_ranks))
    plans, sims = [], []
    for chunks in per_rank:
        virtual = num_stages * num_model_chunks
        costs = (costs_for or _flop_costs(shape))(chunks, virtual)
        plan = megatron_interleaved_plan(chunks, num_stages, num_model_chunks)
        plans.append(plan)
        sims.append(_replay(chunks, plan, costs, held_bytes_for, virtual, op_bytes_for))
    no_state = tuple((0.0,) * num_stages for _ in per_rank)
    return RankPlans(per_rank, tuple(plans), tuple(sims), no_state)

