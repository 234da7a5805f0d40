"""Job: one process's view of the distributed job it belongs to, made once where the process
groups are made (mcore/dist.py init_distributed; memtrace/job.py traced_rank for a memory trace).

    job = init_distributed(ParallelConfig(tp=2, pp=2), seed=1234)
    job.parallel      # the layout this job runs (DP filled in from the world)
    job.ranks         # this process's size and rank along every axis (runtime/ranks.py Ranks)
    job.groups        # megatron-core's ProcessGroupCollection: .tp .pp .cp .dp .mp .dp_cp ...
    cm = build_chunkflow_model(shape, dtype, job)

The build, the step, the loss and the CP/PP exchanges take their degrees and groups from the Job
they are handed, never from Megatron's global parallel_state: this module is the one place of
ours that reads it (Job.from_megatron, where the groups are built, or, in the Megatron-LM plugin,
where Megatron-LM built them). megatron-core's own DDP, optimizer and stock schedules, which this
project calls without groups, take the same groups from parallel_state themselves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.runtime.ranks import Ranks


@dataclass(frozen=True)
class Job:
    """The layout `parallel`, this process's `ranks` in it and Megatron's process groups for it
    (`groups`, a megatron.core.process_groups_config.ProcessGroupCollection)."""

    parallel: ParallelConfig
    ranks: Ranks
    groups: object = field(repr=False)

    def __post_init__(self):
        if self.parallel.dp is None:
            raise ValueError("a Job's layout has its DP filled in (ParallelConfig.with_world)")

    @classmethod
    def from_megatron(cls, parallel: ParallelConfig) -> Job:
        """The Job of the groups Megatron's parallel_state holds now, built for `parallel`
        (RuntimeError when their degrees are not `parallel`'s: the two must be one layout)."""
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

        ranks = Ranks(tp=ps.get_tensor_model_parallel_world_size(),
                      tp_rank=ps.get_tensor_model_parallel_rank(),
                      cp=ps.get_context_parallel_world_size(),
                      cp_rank=ps.get_context_parallel_rank(),
                      pp=ps.get_pipeline_model_parallel_world_size(),
                      pp_rank=ps.get_pipeline_model_parallel_rank(),
                      dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank())
        vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
        built = (ranks.tp, ranks.cp, ranks.pp, vpp, ranks.dp)
        wanted = _degrees(parallel, built)
        if built != wanted:
            raise RuntimeError(f"Megatron's process groups (TP, CP, PP, VPP, DP) = {built} are "
                               f"not the layout's {wanted}")
        ep = ps.get_expert_model_parallel_world_size()
        if ep != parallel.ep:
            raise RuntimeError(f"Megatron's expert-parallel group has {ep} ranks, the layout "
                               f"{parallel.ep}")
        if ep > 1:
            ranks = dataclasses.replace(ranks, expert_dp_ranks=_group_dp_ranks(
                ps.get_expert_model_parallel_group(), ranks.dp_rank))
        return cls(parallel.with_world(ranks.tp * ranks.cp * ranks.pp * ranks.dp), ranks,
                   ProcessGroupCollection.use_mpu_process_groups())

    def for_layout(self, parallel: ParallelConfig) -> Job:
        """This job running `parallel`, another layout of the same process groups (its sequence
        parallelism or recompute may differ: they are the model's, not the groups'); ValueError
        when its degrees are not the job's."""
        mine = _degrees(self.parallel)
        theirs = _degrees(parallel, mine)
        if mine != theirs:
            raise ValueError(f"the layout's (TP, CP, PP, VPP, DP) = {theirs} are not the job's "
                             f"process groups' {mine}")
        return Job(parallel.with_world(self.parallel.num_gpus), self.ranks, self.groups)

    def is_first_stage(self, vp_stage: int | None = None) -> bool:
        """Whether model chunk `vp_stage` of this rank (None: its only one) holds the
        embedding: the first pipeline stage's first model chunk."""
        return self.ranks.pp_rank == 0 and self._chunk(vp_stage) == 0

    def is_last_stage(self, vp_stage: int | None = None) -> bool:
        """Whether model chunk `vp_stage` of this rank (None: its only one) holds the output
        layer and the loss: the last pipeline stage's last model chunk."""
        last = self._chunk(vp_stage) == self.parallel.vpp - 1
        return self.ranks.pp_rank == self.ranks.pp - 1 and last

    def _chunk(self, vp_stage: int | None) -> int:
        if vp_stage is None and self.parallel.vpp > 1:
            raise ValueError(f"this rank holds {self.parallel.vpp} model chunks (virtual "
                             "stages): say which (vp_stage)")
        return vp_stage or 0


def tensor_parallel_of(gpt) -> tuple[int, int, object]:
    """(TP size, this rank's TP rank, the TP group) of a built megatron-core GPTModel: from the
    process groups it was built on (its pg_collection, the job's: mcore/build.py)."""
    group = getattr(getattr(gpt, "pg_collection", None), "tp", None)
    if group is None:
        raise ValueError(f"{type(gpt).__name__} has no tensor-parallel group: build it on the "
                         "job's process groups (mcore/build.py build_gpt_model)")
    return group.size(), group.rank(), group


def _group_dp_ranks(group, dp_rank: int) -> tuple[int, ...]:
    """The distinct DP ranks of the members of `group` (an all-gather over it)."""
    import torch
    import torch.distributed as dist

    from megatron_chunkflow.runtime.p2p import comm_device

    mine = torch.tensor([dp_rank], dtype=torch.int64, device=comm_device())
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return tuple(sorted({int(t) for t in everyone}))


def _degrees(parallel: ParallelConfig, of_groups: tuple | None = None) -> tuple:
    """(TP, CP, PP, VPP, DP) of `parallel`; a DP it leaves open is the one of `of_groups`."""
    dp = parallel.dp if parallel.dp is not None or of_groups is None else of_groups[-1]
    return parallel.tp, parallel.cp, parallel.pp, parallel.vpp, dp
