"""Stock Megatron's per-sample ("hybrid") context parallelism, as megatron-core 0.16.1 runs it.

With `--hybrid-context-parallel --max-seqlen-per-dp-cp-rank M` Megatron-LM stops giving every
micro-batch the same CP group. Every step the global batch's sequences (unpacked from their packed
samples, gathered over DP: megatron/core/datasets/data_schedule.py) are scheduled over one pool,
the DP x CP ranks, by megatron-core's BalancedCPScheduler (pipeline_parallel/hybrid_cp_schedule.py):

- a sequence of L tokens gets 2^ceil(log2(L / M)) ranks (1 for L <= M) as its CP group, a power of
  two (the pool holds a process group of every power of two below its size, and the pool itself);
- sequences, longest first, are dealt into groups; in a group every rank runs its sequences one
  after another, each a micro-batch of its own (forward, then backward; no packing, no pipeline),
  with the ranks sharing it as its CP group (Megatron's ring attention over them); ranks left
  without work widen a CP group; a barrier ends every group;
- Megatron-LM refuses it with pipeline parallelism, CUDA graphs and FSDP, and requires
  --calculate-per-token-loss and the single dataloader (training/arguments.py).

`hybrid_schedule` reads the groups of megatron-core's own scheduler (not re-implemented: core/
stays free of Megatron, so the caller passes it in, mcore/hybrid_cp.py: balanced_cp_groups) back
into each group's sequences per rank and each sequence's CP size. Each sequence is then padded as its CP split needs,
to a multiple of 2 x its CP size (as core/step.py pads the other baselines under CP);
Megatron-LM documents a stricter rule (every sequence a multiple of 2 x DP x CP, x TP under
sequence parallelism), which would only add stock padding.
`hybrid_step_time` is the step under any per-op cost: groups in turn, each as long as its slowest
rank's forwards and backwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from megatron_chunkflow.core.packer import validate_lengths
from megatron_chunkflow.core.types import DataChunk, Segment

BASELINE = "megatron-hybrid-cp"
FLAG = "--max-seqlen-per-dp-cp-rank"


def cp_size_needed(length: int, max_seqlen_per_rank: int) -> int:
    """The CP group Megatron gives a sequence of `length` tokens: 2^ceil(log2(L / M)), at least 1."""
    return max(1, 2 ** math.ceil(math.log2(length / max_seqlen_per_rank)))


def check_pool(pool: int, where: str = "hybrid context parallelism") -> None:
    """ValueError unless `pool` (DP x CP ranks) is a power of two >= 2: Megatron needs an even
    pool and builds its CP groups as powers of two that tile it."""
    if pool < 2 or pool & (pool - 1):
        raise ValueError(f"{where}: the DP x CP pool of {pool} ranks must be a power of two >= 2 "
                         "(Megatron's hybrid CP groups are powers of two that tile the pool)")


def check_max_seqlen(lengths: Sequence[int], pool: int, max_seqlen_per_rank: int) -> None:
    """ValueError naming the flag unless the longest sequence fits the pool at `M`."""
    if max_seqlen_per_rank < 1:
        raise ValueError(f"{FLAG} must be >= 1, got {max_seqlen_per_rank}")
    longest = max(lengths)
    need = cp_size_needed(longest, max_seqlen_per_rank)
    if need > pool:
        raise ValueError(f"{FLAG} {max_seqlen_per_rank}: the longest sequence ({longest} tokens) "
                         f"would need a CP group of {need} ranks, more than the DP x CP pool of "
                         f"{pool}; raise it to at least {-(-longest // pool)}")


@dataclass(frozen=True)
class HybridSchedule:
    """Megatron's schedule of one global batch: per group, per rank of the pool, the sequence ids
    it runs in order; and each sequence's CP size (the ranks that run it)."""

    groups: tuple[tuple[tuple[int, ...], ...], ...]
    cp: tuple[int, ...]  # per sequence id

    @property
    def pool(self) -> int:
        return len(self.groups[0])


# (lengths, pool, M) -> per group, per rank of the pool, the sequence ids it runs in order:
# megatron-core's BalancedCPScheduler (mcore/hybrid_cp.py: balanced_cp_groups)
Scheduler = Callable[[tuple[int, ...], int, int], Sequence[Sequence[Sequence[int]]]]


@lru_cache(maxsize=64)
def _schedule(lengths: tuple[int, ...], pool: int, max_seqlen_per_rank: int,
              scheduler: Scheduler) -> HybridSchedule:
    id_groups = scheduler(lengths, pool, max_seqlen_per_rank)
    cp = [0] * len(lengths)
    groups = []
    for ranks in id_groups:
        ranks = [tuple(ids) for ids in ranks] + [()] * (pool - len(ranks))
        for ids in ranks:
            for i in set(ids):  # Megatron: partner_cp_size = the ranks listing the sequence
                cp[i] = sum(i in other for other in ranks)
        groups.append(tuple(ranks))
    missing = [i for i, c in enumerate(cp) if c == 0]
    if missing:
        raise RuntimeError(f"the scheduler left sequences {missing[:5]} unscheduled")
    return HybridSchedule(tuple(groups), tuple(cp))


def hybrid_schedule(lengths: Sequence[int], pool: int, max_seqlen_per_rank: int,
                    scheduler: Scheduler) -> HybridSchedule:
    """`scheduler` (megatron-core's BalancedCPScheduler) on `lengths` over a DP x CP pool of
    `pool` ranks with --max-seqlen-per-dp-cp-rank `max_seqlen_per_rank`, as a HybridSchedule;
    ValueError for what Megatron refuses."""
    validate_lengths(lengths)
    check_pool(pool)
    check_max_seqlen(lengths, pool, max_seqlen_per_rank)
    return _schedule(tuple(lengths), pool, max_seqlen_per_rank, scheduler)


def sequence_chunks(lengths: Sequence[int], schedule: HybridSchedule) -> list[DataChunk]:
    """Every sequence as the micro-batch Megatron runs (id = sequence id), padded to a multiple
    of 2 x its CP size under CP."""
    out = []
    for i, n in enumerate(lengths):
        c = schedule.cp[i]
        m = 2 * c if c > 1 else 1
        out.append(DataChunk(id=i, kind="standalone", dp_rank=0,
                             segments=(Segment(i, 0, n, -n % m),)))
    return out


@dataclass(frozen=True)
class HybridStep:
    """One step's time under a cost: the groups in turn."""

    group_times: tuple[float, ...]
    busy: tuple[float, ...]  # per rank of the pool, summed over groups
    last_backward: float  # the step's last backward (on the slowest rank of the last group)
    first_forward: float

    @property
    def step_time(self) -> float:
        return sum(self.group_times)

    @property
    def idle_ratio(self) -> float:
        """Pool time no rank computes in: 1 - busy / (pool x step), Megatron's imbalance."""
        total = self.step_time * len(self.busy)
        return 1 - sum(self.busy) / total if total else 0.0


def hybrid_step_time(schedule: HybridSchedule,
                     cost: Callable[[int], tuple[float, float]],
                     barrier_s: float = 0.0) -> HybridStep:
    """The step of `schedule` where cost(sequence id) = (forward, backward) seconds (or any unit)
    on each of its CP ranks; every group ends at its slowest rank plus a barrier."""
    times, busy = [], [0.0] * schedule.pool
    last_b, first_f = 0.0, None
    for g, ranks in enumerate(schedule.groups):
        per_rank = []
        for r, ids in enumerate(ranks):
            t = 0.0
            for i in ids:
                f, b = cost(i)
                first_f = f if first_f is None else first_f
                t += f + b
            busy[r] += t
            per_rank.append(t)
        slowest = max(range(len(per_rank)), key=per_rank.__getitem__)
        times.append(per_rank[slowest] + barrier_s)
        if g == len(schedule.groups) - 1 and ranks[slowest]:
            last_b = cost(ranks[slowest][-1])[1]
    return HybridStep(tuple(times), tuple(busy), last_b, first_f or 0.0)
