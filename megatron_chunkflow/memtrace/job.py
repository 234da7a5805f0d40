"""One rank of a job, alone in this process: torch's fake process group and Megatron's groups.

    with traced_rank(ParallelConfig(tp=2, pp=4), world=16, rank=5) as job:
        ...   # build and step as rank 5 of a 16-GPU job; every collective is a no-op

torch's fake backend (torch.testing._internal.distributed.fake_pg, the one torchtitan's memory
estimation uses) gives a world of any size in which this process is `rank` and no message is
sent or received. Megatron's parallel_state builds its groups on it as on NCCL (its gloo groups,
which only the distributed optimizer's checkpoints use, on the same fake backend), so every layout
a job can take runs here as that rank runs it. Refused inside a process that already has a
process group: a trace needs the process's torch.distributed to itself (cli/memory.py and
memtrace/guard.py run it in a child).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.mcore.job import Job
from megatron_chunkflow.runtime.ranks import Ranks


@contextlib.contextmanager
def _gloo_groups_fake():
    """Megatron asks for gloo groups beside the default backend's; here they are fake too."""
    original = dist.new_group

    def new_group(*args, **kwargs):
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = "fake"
        return original(*args, **kwargs)

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = original


@contextlib.contextmanager
def traced_rank(parallel: ParallelConfig, world: int, rank: int, seed: int = 0):
    """Rank `rank` of a `world`-process job with the layout `parallel` (DP = what the world
    leaves), on the fake process group; its Job (mcore/job.py). Everything is torn down on exit."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_chunkflow.mcore.cpu import install_cpu_shims

    install_cpu_shims()  # torch.cuda's RNG and device calls answered on a machine without one
    if dist.is_initialized():
        raise RuntimeError("a memory trace needs a process without a process group (it plays "
                           "one rank of a fake job); run it in a child process")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    parallel.with_world(world)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with _gloo_groups_fake():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=parallel.tp,
                pipeline_model_parallel_size=parallel.pp,
                virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
                context_parallel_size=parallel.cp)
        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        yield Job.from_megatron(parallel)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def ranks_of(parallel: ParallelConfig, world: int) -> list[Ranks]:
    """Every rank's place in a `world`-process job of `parallel`, without building it, in
    Megatron's order (tp-cp-ep-dp-pp: TP fastest, PP slowest)."""
    parallel.with_world(world)
    tp, cp, pp = parallel.tp, parallel.cp, parallel.pp
    dp = world // (tp * cp * pp)
    out = []
    for r in range(world):
        out.append(Ranks(tp=tp, tp_rank=r % tp, cp=cp, cp_rank=r // tp % cp, pp=pp,
                         pp_rank=r // (tp * cp * dp), dp=dp, dp_rank=r // (tp * cp) % dp))
    return out
