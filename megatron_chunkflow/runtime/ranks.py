"""Ranks: where this process sits in the job, read once from Megatron's parallel state.

    ranks = Ranks.current()          # after mcore/dist.py's init_distributed (which returns it)
    plan_step(sequences, chunkflow, parallel, shape, ranks)

Code that needs this process's data-parallel, context-parallel or pipeline rank takes a Ranks
instead of asking parallel_state in place; Ranks() is a world of one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: size and rank along every axis of Megatron's groups, read
    once from parallel_state (`current`)."""

    tp: int = 1
    tp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    dp: int = 1
    dp_rank: int = 0

    @classmethod
    def current(cls) -> Ranks:
        """The ranks of the process groups Megatron's parallel_state holds now."""
        from megatron.core import parallel_state as ps

        return cls(tp=ps.get_tensor_model_parallel_world_size(),
                   tp_rank=ps.get_tensor_model_parallel_rank(),
                   cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                   pp=ps.get_pipeline_model_parallel_world_size(),
                   pp_rank=ps.get_pipeline_model_parallel_rank(),
                   dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank())
