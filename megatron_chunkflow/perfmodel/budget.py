"""An activation-memory budget decides recompute and chunking, as it would for a user
(`chunkflow bench`).

Inputs are *measured* bytes per token (bench/systems.py probes a micro-batch through the real model
under every option of Megatron's recompute menu with runtime/meter.py's exact meter), so the rules
below hold for whatever the model saves. "Activation memory" is what that meter counts: bytes saved
for backward from their save until autograd frees them (weights excluded), plus ChunkFlow's K/V
state (K/V buffers, fp32 gradient accumulators, stage inputs kept for re-forwards),
per pipeline stage, the worst stage counting.

The modelled peak of a plan under a recompute option, on stage s: the plan replayed with each
micro-batch or chunk holding `held[s]` bytes per computed token between its forward and its
backward (core/simulate.py's peak of bytes held at once), plus the largest working set one
backward adds on top of that (`peak[s] - held[s]` per token, measured on a micro-batch alone),
plus for ChunkFlow an upper bound of the state of the longest sequence,
perfmodel/footprint.py's long_sequence_state_bytes on the measured K/V, accumulator and
hidden-state bytes per token of the stage:

    L u  +  (n - 1) C a  +  (n - K) C h

(the sequence's K/V buffer, the accumulator of its last chunk's prefix, the inputs kept for the
n - K re-forwarded chunks on stages > 0; n = ceil(L / C)): docs/exactness.md's exact peak.

The rule, the same for every system: among the configurations whose modelled peak fits in the
budget, the fastest by the simulator calibrated on this machine (`predict_s`); predictions within
3% of the fastest count as a tie (the simulator is no better than that) and a tie goes to the
smaller peak. Stock Megatron's configurations are the options of Megatron's recompute menu
(config.Recompute.menu) for each baseline; ChunkFlow's are (chunk size C, K, recompute option
inside its chunks), C a power of two from 1/32 of the context up to it, K a power of two below
the longest sequence's chunk count n, or n (no re-forward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron_chunkflow.config import Recompute
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.step import Baseline, RankPlans, plan_baseline, plan_chunkflow
from megatron_chunkflow.perfmodel.held import chunk_bytes_fn
from megatron_chunkflow.perfmodel.kvstate import long_sequence_state_bytes, longest_cut_sequence

TIE = 0.03  # predictions this close (relative) to the fastest are a tie


@dataclass(frozen=True)
class OptionRates:
    """One recompute option measured on a probe micro-batch alone: bytes per token per stage."""

    held: tuple[float, ...]
    """Live between the micro-batch's forward and its backward."""
    peak: tuple[float, ...]
    """The most live while it runs alone (what it holds plus what its backward adds)."""


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
    options: dict[str, OptionRates] = field(default_factory=dict)
    """str(Recompute) -> its measured rates; without an entry, no recompute: held = peak =
    per_token."""

    @property
    def num_stages(self) -> int:
        return len(self.per_token)

    def of(self, recompute: Recompute) -> OptionRates:
        """The rates of one recompute option (ValueError if it was not measured)."""
        if str(recompute) in self.options:
            return self.options[str(recompute)]
        if recompute.kind == "none":
            return OptionRates(self.per_token, self.per_token)
        raise ValueError(f"recompute {recompute} was not measured")


def _plan_peak(rp: RankPlans, rates: OptionRates) -> float:
    """Worst (DP rank, stage) of: bytes held at once (the replay) + the largest working set of
    one backward + the state."""
    worst = 0.0
    for r, chunks in enumerate(rp.chunks):
        held = rp.peak_memory_bytes(r)
        for s in range(len(held)):
            extra = rates.peak[s] - rates.held[s]
            work = max((c.computed_tokens * extra for c in chunks), default=0.0)
            worst = max(worst, held[s] + max(0.0, work))
    return worst


def _held_hook(rates: OptionRates):
    return lambda chunks, num_stages: chunk_bytes_fn(chunks, rates.held)


def baseline_peak(lengths: Sequence[int], seq_length: int, num_dp_ranks: int, shape: ModelShape,
                  rates: ActivationRates, recompute: Recompute = Recompute(),
                  baseline: Baseline = "megatron-packed") -> float:
    """Modelled peak activation memory of a stock baseline's 1F1B step under `recompute`."""
    option = rates.of(recompute)
    rp = plan_baseline(lengths, seq_length, rates.num_stages, num_dp_ranks, shape,
                       held_bytes_for=_held_hook(option), baseline=baseline)
    return _plan_peak(rp, option)


def state_bound(longest: int, chunk_size: int, num_kept: int, rates: ActivationRates,
                stage: int) -> float:
    """Upper bound of the K/V state (+ kept stage inputs) of a `longest`-token sequence on
    `stage`: footprint.long_sequence_state_bytes on the measured rates."""
    hidden = rates.hidden_per_token if stage > 0 else 0.0
    return long_sequence_state_bytes(longest, chunk_size, num_kept, rates.kv_per_token[stage],
                                     rates.acc_per_token[stage], hidden)


def chunkflow_peak(lengths: Sequence[int], chunk_size: int, num_kept: int, num_dp_ranks: int,
                   shape: ModelShape, rates: ActivationRates,
                   recompute: Recompute = Recompute()) -> float:
    """Modelled peak activation memory of ChunkFlow's plan: worst (DP rank, stage)."""
    option = rates.of(recompute)

    def state_for(chunks, num_stages):
        longest = longest_cut_sequence(chunks)
        return [state_bound(longest, chunk_size, num_kept, rates, s) for s in range(num_stages)]

    _, rp = plan_chunkflow(lengths, chunk_size, num_kept, rates.num_stages, num_dp_ranks, shape,
                           held_bytes_for=_held_hook(option), state_bytes_for=state_for)
    return _plan_peak(rp, option)


@dataclass(frozen=True)
class Candidate:
    """One configuration considered: its modelled peak and, if it fits, its predicted step."""

    recompute: Recompute
    peak_bytes: float
    predicted_s: float | None  # None when it does not fit (not simulated)
    chunk_size: int | None = None  # ChunkFlow only
    num_kept: int | None = None

    @property
    def fits(self) -> bool:
        return self.predicted_s is not None

    def to_json(self) -> dict:
        out = {"recompute": str(self.recompute), "peak_bytes": self.peak_bytes,
               "predicted_s": self.predicted_s}
        if self.chunk_size is not None:
            out.update(chunk_size=self.chunk_size, k=self.num_kept)
        return out


@dataclass(frozen=True)
class Choice:
    """The chosen configuration and every candidate considered."""

    best: Candidate
    candidates: list[Candidate]

    @property
    def recompute(self) -> Recompute:
        return self.best.recompute

    @property
    def chunk_size(self) -> int | None:
        return self.best.chunk_size

    @property
    def num_kept(self) -> int | None:
        return self.best.num_kept

    @property
    def peak_bytes(self) -> float:
        return self.best.peak_bytes

    @property
    def predicted_s(self) -> float:
        return self.best.predicted_s


def _choose(candidates: list[Candidate], budget: float, what: str, tie: float) -> Choice:
    fitting = [x for x in candidates if x.fits]
    if not fitting:
        best = min(candidates, key=lambda x: x.peak_bytes)
        raise ValueError(f"--budget-mib {budget / 2**20:.0f}: no {what} fits; the smallest "
                         f"modelled peak is {best.peak_bytes / 2**20:.0f} MiB ("
                         + ", ".join(f"{k}={v}" for k, v in best.to_json().items()
                                     if k not in ("peak_bytes", "predicted_s")) + ")")
    fastest = min(x.predicted_s for x in fitting)
    best = min((x for x in fitting if x.predicted_s <= fastest * (1 + tie)),
               key=lambda x: (x.peak_bytes, x.predicted_s))
    return Choice(best, candidates)


def choose_recompute(lengths: Sequence[int], seq_length: int, num_dp_ranks: int,
                     shape: ModelShape, rates: ActivationRates, budget: float,
                     predict_s: Callable[[Recompute], float],
                     options: Sequence[Recompute], baseline: Baseline = "megatron-packed",
                     tie: float = TIE) -> Choice:
    """A stock baseline's recompute: the fastest option by `predict_s(option)` whose modelled
    peak fits in `budget` bytes (near ties to the smaller peak); ValueError if none fits."""
    candidates = []
    for option in options:
        peak = baseline_peak(lengths, seq_length, num_dp_ranks, shape, rates, option, baseline)
        candidates.append(Candidate(option, peak, predict_s(option) if peak <= budget else None))
    return _choose(candidates, budget, f"recompute option for {baseline}", tie)


def chunk_size_candidates(seq_length: int) -> list[int]:
    """Powers of two from seq_length / 32 (at least 64) up to the context length."""
    out, c = [], 1 << max(6, (seq_length // 32).bit_length() - 1)
    while c <= seq_length:
        out.append(c)
        c *= 2
    return out or [seq_length]


def num_kept_candidates(num_chunks: int) -> list[int]:
    """K worth trying for a longest sequence of `num_chunks` chunks: the powers of two below it,
    and `num_chunks` itself (every chunk keeps its activations: no re-forward)."""
    out, num_kept = [], 1
    while num_kept < num_chunks:
        out.append(num_kept)
        num_kept *= 2
    return out + [max(1, num_chunks)]


def choose_chunking(lengths: Sequence[int], seq_length: int, num_dp_ranks: int,
                    shape: ModelShape, rates: ActivationRates, budget: float,
                    predict_s: Callable[[int, int, Recompute], float],
                    sizes: Sequence[int] | None = None, kept_counts: Sequence[int] | None = None,
                    options: Sequence[Recompute] = (Recompute(),),
                    tie: float = TIE) -> Choice:
    """ChunkFlow's (C, K, recompute): the fastest by `predict_s(C, K, option)` whose modelled
    peak fits in `budget` bytes (near ties to the smaller peak). K from `kept_counts`, by default
    num_kept_candidates of the longest sequence's chunk count at each C. ValueError when nothing
    fits, naming the smallest peak found."""
    longest = max(lengths)
    candidates = []
    for c in sizes or chunk_size_candidates(seq_length):
        for num_kept in kept_counts or num_kept_candidates(math.ceil(longest / c)):
            for option in options:
                peak = chunkflow_peak(lengths, c, num_kept, num_dp_ranks, shape, rates, option)
                candidates.append(Candidate(option, peak, predict_s(c, num_kept, option)
                                            if peak <= budget else None, c, num_kept))
    return _choose(candidates, budget, "(chunk size, K, recompute)", tie)
