"""An activation-memory budget decides recompute, as it would for a user (`chunkflow bench`).

Inputs are *measured* bytes per token (bench/systems.py probes a micro-batch through the
real model with the saved-tensor meter), so the rules below hold for whatever the model saves.
"Activation memory" is what checks/memory.py meters: bytes saved for backward (weights
excluded) plus ChunkFlow's K/V state (stored K/V, fp32 gradient accumulators, prefix copies, stage
inputs kept for re-forwards), per pipeline stage, the worst stage counting.

Stock Megatron: the cheapest configuration that fits. No recompute if its largest micro-batch's
activations fit in the budget on every stage, else Megatron's full recompute (each transformer
layer keeps only its input and re-runs in the backward).

ChunkFlow: among chunk sizes C (powers of two from 1/32 of the context up to it) and K, those
whose modelled peak fits in the budget; of these the fastest by the simulator (`predict_s`),
where predictions within 3% of the fastest count as a tie (the simulator is no better than that)
and a tie goes to the smaller peak. The modelled peak on stage s is the most activation bytes
the plan holds at once there (core/simulate.py replays the plan with per-token bytes) plus an
upper bound of the state of the longest sequence, perfmodel/footprint.py's
long_sequence_state_bytes (the simulator's formula) on the measured K/V, accumulator and
hidden-state bytes per token of the stage:

    L (u + a)  +  u * sum over the last K chunks j of min((j+1) C, L)  +  (n - K) C h

(stored K/V and accumulators, the cat(prefix, own) copies of the K chunks holding activations,
the inputs kept for the n - K re-forwarded chunks on stages > 0; n = ceil(L / C)). For K = 1
the K/V part is 2 L u + L a, above docs/exactness.md's exact peak.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.step import baseline_microbatches, plan_chunkflow
from megatron_chunkflow.perfmodel.footprint import (
    chunk_bytes_fn,
    long_sequence_state_bytes,
    longest_cut_sequence,
)


@dataclass(frozen=True)
class ActivationRates:
    """Measured bytes per token, one entry per pipeline stage."""

    per_token: tuple[float, ...]
    """Saved for backward by one micro-batch without recompute (the last stage adds the logits)."""
    kv_per_token: tuple[float, ...]
    """K/V of the stage's layers, as ChunkFlow's store keeps them."""
    acc_per_token: tuple[float, ...]
    """The K/V gradient accumulators (fp32; fp64 in fp64 runs)."""
    hidden_per_token: float
    """One token's stage input, kept on stages after the first for a re-forward."""

    @property
    def num_stages(self) -> int:
        return len(self.per_token)


def baseline_peak(lengths: Sequence[int], seq_length: int, num_dp_ranks: int,
                  rates: ActivationRates) -> float:
    """Activations of stock Megatron's largest micro-batch on its worst stage, no recompute."""
    mbs = baseline_microbatches(lengths, seq_length, num_dp_ranks)
    largest = max(c.num_tokens for c in mbs)
    return largest * max(rates.per_token)


def baseline_recompute(lengths: Sequence[int], seq_length: int, num_dp_ranks: int,
                       rates: ActivationRates, budget: float) -> str:
    """'none' when the largest micro-batch fits in `budget` bytes, else 'full'."""
    return "none" if baseline_peak(lengths, seq_length, num_dp_ranks, rates) <= budget else "full"


def state_bound(longest: int, chunk_size: int, k: int, rates: ActivationRates,
                stage: int) -> float:
    """Upper bound of the K/V state (+ kept stage inputs) of a `longest`-token sequence on
    `stage`: footprint.long_sequence_state_bytes on the measured rates."""
    hidden = rates.hidden_per_token if stage > 0 else 0.0
    return long_sequence_state_bytes(longest, chunk_size, k, rates.kv_per_token[stage],
                                     rates.acc_per_token[stage], hidden)


def chunkflow_peak(lengths: Sequence[int], chunk_size: int, k: int, num_dp_ranks: int,
                   shape: ModelShape, rates: ActivationRates) -> float:
    """Modelled peak activation memory of ChunkFlow's plan: worst (DP rank, stage)."""
    p = rates.num_stages

    def held_for(chunks, num_stages):
        return chunk_bytes_fn(chunks, rates.per_token)

    def state_for(chunks, num_stages):
        longest = longest_cut_sequence(chunks)
        return [state_bound(longest, chunk_size, k, rates, s) for s in range(num_stages)]

    _, rp = plan_chunkflow(lengths, chunk_size, k, p, num_dp_ranks, shape,
                           held_bytes_for=held_for, state_bytes_for=state_for)
    return max(max(rp.peak_memory_bytes(r)) for r in range(num_dp_ranks))


@dataclass(frozen=True)
class Candidate:
    chunk_size: int
    k: int
    peak_bytes: float
    predicted_s: float | None  # None when it does not fit (not simulated)

    @property
    def fits(self) -> bool:
        return self.predicted_s is not None


@dataclass(frozen=True)
class Chunking:
    """The chosen (chunk size, K) and every candidate considered."""

    chunk_size: int
    k: int
    peak_bytes: float
    predicted_s: float
    candidates: list[Candidate] = field(default_factory=list)


def chunk_size_candidates(seq_length: int) -> list[int]:
    """Powers of two from seq_length / 32 (at least 64) up to the context length."""
    out, c = [], 1 << max(6, (seq_length // 32).bit_length() - 1)
    while c <= seq_length:
        out.append(c)
        c *= 2
    return out or [seq_length]


def choose_chunking(lengths: Sequence[int], seq_length: int, num_dp_ranks: int,
                    shape: ModelShape, rates: ActivationRates, budget: float,
                    predict_s: Callable[[int, int], float],
                    sizes: Sequence[int] | None = None, ks: Sequence[int] = (1, 2, 4),
                    tie: float = 0.03) -> Chunking:
    """The fastest (C, K) by `predict_s(C, K)` whose modelled peak fits in `budget` bytes; those
    within `tie` (relative) of the fastest are equals, and the smallest peak among them wins.

    K values that change nothing (K >= the longest sequence's chunk count, other than K = 1) are
    skipped. ValueError when nothing fits, naming the smallest peak found."""
    longest = max(lengths)
    candidates = []
    for c in sizes or chunk_size_candidates(seq_length):
        n = math.ceil(longest / c)
        for k in ks:
            if k > 1 and k >= n:
                continue
            peak = chunkflow_peak(lengths, c, k, num_dp_ranks, shape, rates)
            candidates.append(Candidate(c, k, peak, predict_s(c, k) if peak <= budget else None))
    fitting = [x for x in candidates if x.fits]
    if not fitting:
        best = min(candidates, key=lambda x: x.peak_bytes)
        raise ValueError(f"--budget-mib {budget / 2**20:.0f}: no (chunk size, K) fits; the "
                         f"smallest modelled peak is {best.peak_bytes / 2**20:.0f} MiB "
                         f"(C={best.chunk_size}, K={best.k})")
    fastest = min(x.predicted_s for x in fitting)
    best = min((x for x in fitting if x.predicted_s <= fastest * (1 + tie)),
               key=lambda x: (x.peak_bytes, x.predicted_s))
    return Chunking(best.chunk_size, best.k, best.peak_bytes, best.predicted_s, candidates)
