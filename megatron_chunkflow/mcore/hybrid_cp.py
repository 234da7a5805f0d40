"""megatron-core's BalancedCPScheduler, the scheduler of Megatron's per-sample ("hybrid") context
parallelism, run on a batch's lengths alone for the planner and the simulator (core/hybrid_cp.py,
perfmodel/hybrid_cp.py), which stay free of Megatron and take it as an argument.
"""

from __future__ import annotations


class _Pool:
    """The DP x CP process group as BalancedCPScheduler reads it: its size, nothing else."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def balanced_cp_groups(lengths: tuple[int, ...], pool: int,
                       max_seqlen_per_rank: int) -> list[list[list[int]]]:
    """Per group, per rank of a pool of `pool` ranks, the ids (indices into `lengths`) of the
    sequences it runs, in order: megatron-core 0.16.1's BalancedCPScheduler with
    --max-seqlen-per-dp-cp-rank `max_seqlen_per_rank`, as Megatron-LM calls it every step
    (datasets/data_schedule.py: get_groups_and_subsamples on (id, length) pairs). The caller
    checks that the longest sequence fits the pool (core/hybrid_cp.py: check_max_seqlen); the
    scheduler would not return otherwise."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    scheduler = BalancedCPScheduler(max_seqlen_per_rank, _Pool(pool))
    _, id_groups = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)
    return id_groups
