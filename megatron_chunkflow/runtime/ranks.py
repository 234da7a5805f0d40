"""Ranks: where this process sits in the job: its size and rank along every axis.

    job = init_distributed(parallel)     # mcore/dist.py; job.ranks (mcore/job.py)
    plan_step(sequences, chunkflow, parallel, shape, job.ranks)

Code that needs this process's data-parallel, context-parallel or pipeline rank takes a Ranks
(the planner needs nothing else of the job); Ranks() is a world of one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: size and rank along every axis of Megatron's groups (made
    with them: mcore/job.py Job.from_megatron)."""

    tp: int = 1
    tp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    dp: int = 1
    dp_rank: int = 0
    # mixture of experts: the DP ranks of this rank's expert-parallel group, which run their
    # chunks in step where there are several (core/ep_align.py); empty without expert
    # parallelism
    expert_dp_ranks: tuple[int, ...] = ()
