"""SpaCO (sparse chunk back-propagation, approximate and opt-in): which chunks run backward.

    step = plan_step(..., sparse=SparseConfig(2), seed=seed, step_index=it)  # runtime/execute.py
    step = sparsify(step, t=2, seed=seed, step_index=it)   # what plan_step does with `sparse`

A long sequence of k dependent chunks back-propagates each chunk independently with probability
p = T / k (all of them when k <= T), so T chunks on average; standalone chunks always
back-propagate. A dropped chunk runs forward only (no graph, no re-forward, no backward): it still
gives its K/V to later chunks, and its tokens to the loss value and the token count. A
back-propagated chunk's whole backward, its own loss gradient and the gradient relayed into its
K/V from later chunks, is scaled by 1 / p (runtime/state.py applies the relay part).

Then E[gradient] = the exact gradient (docs/sparse.md): every gradient path runs through the
backwards of a set of distinct chunks, is kept when all of them are drawn, and then carries the
product of their 1 / p, so its expected weight is prod(p * 1/p) = 1 because the draws are
independent. (Drawing exactly T of k without replacement would not be: a path through m chunks
would get expected weight C(k-m, T-m) / C(k, T) * (k/T)^m, less than 1 for m >= 2.)

The draw is a function of (seed, step, the sequence's index in the global batch), so every rank of
a TP x PP replica, rebuilding the plan from the same batch, draws the same chunks, without
communication; the plan digest (schedules.check_same_plan) includes the weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_chunkflow.runtime.inputs import ChunkedStep

FLAG = "--chunkflow-sparse-backward"


@dataclass(frozen=True)
class SparseConfig:
    """SpaCO settings (`--chunkflow-sparse-backward` in every command)."""

    sparse_backward: int | None = field(default=None, metadata={
        "flag": FLAG, "deprecated": ("--sparse-backward",)})
    """APPROXIMATE (SpaCO): back-propagate each long sequence's dependent chunks at random,
    each with probability T/k (k: the sequence's chunk count; T per sequence on average), and
    scale each drawn chunk's backward by k/T, so the expected gradient is the exact one (unbiased,
    with variance; docs/sparse.md). Omit for exact training."""

    def __post_init__(self):
        if self.sparse_backward is not None and self.sparse_backward < 1:
            raise ValueError(f"{FLAG} must be >= 1, got {self.sparse_backward} "
                             "(omit it for exact training)")

    @property
    def enabled(self) -> bool:
        return self.sparse_backward is not None

    def check(self, max_chunks: int, chunkflow: bool = True, what: str = "") -> None:
        """ValueError when T cannot drop anything (T >= the most chunks a sequence can have,
        `max_chunks`, explained by `what`) or ChunkFlow is off."""
        if not self.enabled:
            return
        t = self.sparse_backward
        if not chunkflow:
            raise ValueError(f"{FLAG} needs ChunkFlow's chunked schedule; it cannot be used with "
                             "--no-chunkflow")
        if t >= max_chunks:
            raise ValueError(f"{FLAG} {t}: a sequence has at most {max_chunks} chunks{what}, so "
                             f"every chunk would be back-propagated; use T < {max_chunks}, or omit "
                             "the flag for exact training")


def inclusion_probability(num_chunks: int, t: int) -> float:
    """P(a dependent chunk of a k-chunk sequence is back-propagated) = min(1, T / k)."""
    return 1.0 if num_chunks <= t else t / num_chunks


def draw(seq_id: int, num_chunks: int, t: int, seed: int, step: int) -> tuple[bool, ...]:
    """Independent Bernoulli(min(1, T/k)) per chunk, a function of (seed, step, seq_id) only."""
    p = inclusion_probability(num_chunks, t)
    if p >= 1.0:
        return (True,) * num_chunks
    rng = np.random.default_rng([seed % 2 ** 63, step, seq_id, 0x5BAC0])
    return tuple(bool(u < p) for u in rng.random(num_chunks))


def sparsify(step: ChunkedStep, t: int, seed: int = 0, step_index: int = 0,
             selected: Mapping[int, Sequence[bool]] | None = None) -> ChunkedStep:
    """The step with SpaCO applied: dropped chunks' R and B removed from every stage's ops and
    their F run without a graph; weights and dropped sets on the dependent chunks' metas.

    `selected` (tests, enumeration): seq_id -> which of its chunks back-propagate, instead of a
    random draw for the sequences it names; the weights are still 1 / min(1, T/k)."""
    members: dict[int, list[int]] = {}
    for cid, meta in step.metas.items():
        if meta.dependent:
            members.setdefault(meta.seq_id, []).append(cid)
    metas = dict(step.metas)
    forward_only: set[int] = set()
    for seq, ids in members.items():
        ids.sort(key=lambda c: step.metas[c].index)
        k = step.metas[ids[0]].num_siblings
        assert len(ids) == k, "a sequence's dependent chunks must all be on this rank"
        mask = tuple(selected[seq]) if selected is not None and seq in selected else \
            draw(seq, k, t, seed, step_index)
        p = inclusion_probability(k, t)
        dropped = frozenset(i for i, s in enumerate(mask) if not s)
        for cid in ids:
            metas[cid] = dataclasses.replace(metas[cid], grad_weight=1.0 / p, dropped=dropped)
        forward_only.update(ids[i] for i in dropped)
    stages = tuple(tuple(op for op in ops if op.kind == "F" or op.chunk not in forward_only)
                   for ops in step.plan.stages)
    plan = dataclasses.replace(step.plan, stages=stages)
    return dataclasses.replace(step, plan=plan, metas=metas, forward_only=frozenset(forward_only))


def num_backward_chunks(step: ChunkedStep) -> tuple[int, int]:
    """(dependent chunks back-propagated, dependent chunks) in this step on this rank."""
    dep = [c for c, m in step.metas.items() if m.dependent]
    return sum(1 for c in dep if c not in step.forward_only), len(dep)
