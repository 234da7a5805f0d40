"""One training step planned end to end, for ChunkFlow and for the stock-Megatron baseline.

ChunkFlow: build_chunks (cut, pack, distribute over DP) -> state_aware_plan per DP rank.
Baseline (stock Megatron): every sequence whole, packed (THD) into micro-batches of `seq_length`
tokens with the same best-fit-decreasing packer (kinder to the baseline than Megatron's in-order
packing), micro-batches dealt round-robin over DP ranks as Megatron splits a global batch, run with
Megatron's 1F1B order. Both replay through the same simulator and cost model. A DP step ends when its
slowest rank ends, so step_time is the maximum over ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_chunkflow.core.costs import (
    OpCosts,
    activation_bytes_per_token,
    kv_state_bytes_per_token,
    layers_per_stage,
)
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.packer import best_fit_decreasing, build_chunks, validate_lengths
from megatron_chunkflow.core.schedule import megatron_1f1b_plan, state_aware_plan
from megatron_chunkflow.core.simulate import SimResult, simulate
from megatron_chunkflow.core.types import ChunkBatch, DataChunk, Segment, StagePlan


@dataclass(frozen=True)
class RankPlans:
    """Plans and their simulation for every DP rank of one step."""

    chunks: tuple[tuple[DataChunk, ...], ...]  # per DP rank
    plans: tuple[StagePlan, ...]
    sims: tuple[SimResult, ...]
    state_bytes: tuple[tuple[float, ...], ...]  # per DP rank, per stage: K/V state (+ grad) peak

    @property
    def step_time(self) -> float:
        return max(s.step_time for s in self.sims)

    def peak_memory_bytes(self, dp_rank: int) -> tuple[float, ...]:
        """Modelled peak per stage: activations of the chunks held at once plus the K/V state."""
        return tuple(a + b for a, b in zip(self.sims[dp_rank].peak_bytes,
                                           self.state_bytes[dp_rank]))


def _held_bytes(chunks, shape: ModelShape, num_stages: int):
    """Activation bytes a chunk holds on each stage (bf16, the memory model of core/costs.py)."""
    per_token = [activation_bytes_per_token(shape, n) for n in layers_per_stage(shape.num_layers,
                                                                                 num_stages)]
    tokens = {c.id: c.num_tokens for c in chunks}
    return lambda chunk, stage: per_token[stage] * tokens[chunk]


def _flop_costs(shape: ModelShape) -> CostHook:
    return lambda chunks, num_stages: OpCosts.from_model(chunks, shape, num_stages)


def _default_held(shape: ModelShape) -> CostHook:
    return lambda chunks, num_stages: _held_bytes(chunks, shape, num_stages)


def _state_bytes(chunks, shape: ModelShape, num_stages: int) -> tuple[float, ...]:
    """One long sequence's state lives at a time: its K/V (bf16) and relayed grads (fp32), plus
    the stage inputs saved for re-forwards on stages after the first."""
    longest = max((c.segments[0].end for c in chunks if c.is_dependent), default=0)
    out = []
    for s, n in enumerate(layers_per_stage(shape.num_layers, num_stages)):
        saved_input = 2 * shape.hidden_size if s > 0 else 0
        out.append(longest * (kv_state_bytes_per_token(shape, n) + saved_input))
    return tuple(out)


# Optional cost hooks, both called with (one DP rank's chunks, num_stages): `costs_for` returns
# the per-op costs to plan and replay with (OpCosts or any callable (kind, chunk, stage) with a
# `comm` attribute; default: FLOPs), `held_bytes_for` the activation bytes a chunk holds per
# stage (default: _held_bytes). perfmodel/predict.py passes the roofline model's seconds and bytes.
CostHook = Callable[[Sequence[DataChunk], int], Callable]


def plan_chunkflow(seq_lengths: Sequence[int], chunk_size: int, k: int, num_stages: int,
                   num_dp_ranks: int, shape: ModelShape, costs_for: CostHook | None = None,
                   held_bytes_for: CostHook | None = None) -> tuple[ChunkBatch, RankPlans]:
    batch = build_chunks(seq_lengths, chunk_size, num_dp_ranks, k, shape)
    per_rank = tuple(tuple(batch.chunks_for_rank(r)) for r in range(num_dp_ranks))
    plans, sims = [], []
    for chunks in per_rank:
        costs = (costs_for or _flop_costs(shape))(chunks, num_stages)
        held = (held_bytes_for or _default_held(shape))(chunks, num_stages)
        plan = state_aware_plan(chunks, num_stages, k, costs)
        plans.append(plan)
        sims.append(simulate(plan, costs, held_bytes=held))
    state = tuple(_state_bytes(c, shape, num_stages) for c in per_rank)
    return batch, RankPlans(per_rank, tuple(plans), tuple(sims), state)


def baseline_microbatches(seq_lengths: Sequence[int], seq_length: int,
                          num_dp_ranks: int) -> list[DataChunk]:
    validate_lengths(seq_lengths)
    for i, n in enumerate(seq_lengths):
        if n > seq_length:
            raise ValueError(f"sequence {i} has {n} tokens, more than --seq-length {seq_length}; "
                             "stock Megatron would truncate it")
    bins = best_fit_decreasing(list(seq_lengths), list(range(len(seq_lengths))), seq_length)
    return [
        DataChunk(id=b, kind="standalone", dp_rank=b % num_dp_ranks,
                  segments=tuple(Segment(i, 0, seq_lengths[i]) for i in members))
        for b, members in enumerate(bins)
    ]


def plan_baseline(seq_lengths: Sequence[int], seq_length: int, num_stages: int,
                  num_dp_ranks: int, shape: ModelShape, costs_for: CostHook | None = None,
                  held_bytes_for: CostHook | None = None) -> RankPlans:
    mbs = baseline_microbatches(seq_lengths, seq_length, num_dp_ranks)
    per_rank = tuple(tuple(c for c in mbs if c.dp_rank == r) for r in range(num_dp_ranks))
    plans, sims = [], []
    for chunks in per_rank:
        costs = (costs_for or _flop_costs(shape))(chunks, num_stages)
        held = (held_bytes_for or _default_held(shape))(chunks, num_stages)
        plan = megatron_1f1b_plan(chunks, num_stages)
        plans.append(plan)
        sims.append(simulate(plan, costs, held_bytes=held))
    no_state = tuple((0.0,) * num_stages for _ in per_rank)
    return RankPlans(per_rank, tuple(plans), tuple(sims), no_state)

