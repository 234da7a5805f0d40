"""mcore/job.py: the Job made from Megatron's process groups (on torch's fake process group, in
this process), another layout of the same groups, and which model chunk holds what."""

import pytest

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.mcore.job import Job
from megatron_chunkflow.runtime.ranks import Ranks


@pytest.mark.parametrize("rank", [0, 5, 7])
def test_job_is_read_from_the_groups_it_was_built_for(rank):
    """Rank `rank` of an 8-process TP 2 x PP 2 job (DP 2): its ranks as Megatron orders them,
    groups of the right sizes, DP filled in; the groups read for another layout are refused."""
    from megatron_chunkflow.memtrace.job import ranks_of, traced_rank

    parallel = ParallelConfig(tp=2, pp=2)
    with traced_rank(parallel, 8, rank) as job:
        assert job.ranks == ranks_of(parallel, 8)[rank]
        assert job.parallel.dp == 2
        assert (job.groups.tp.size(), job.groups.pp.size(), job.groups.dp.size(),
                job.groups.cp.size()) == (2, 2, 2, 1)
        assert job.groups.tp.rank() == job.ranks.tp_rank
        with pytest.raises(RuntimeError, match=r"process groups \(TP, CP, PP, VPP, DP\) = "
                                               r"\(2, 1, 2, 1, 2\) are not the layout's"):
            Job.from_megatron(ParallelConfig(tp=1, pp=2))


def _job(vpp: int = 1, pp_rank: int = 0) -> Job:
    parallel = ParallelConfig(tp=2, pp=2, vpp=vpp, dp=2)
    return Job(parallel, Ranks(tp=2, pp=2, pp_rank=pp_rank, dp=2), groups=None)


def test_another_layout_of_the_same_groups():
    """Recompute and sequence parallelism are the model's: a layout differing only there runs on
    the job's groups; other degrees are refused, naming both."""
    job = _job()
    other = job.for_layout(ParallelConfig(tp=2, pp=2, sequence_parallel=True, recompute="full"))
    assert other.parallel.sequence_parallel and other.parallel.recompute.kind == "full"
    assert other.parallel.dp == 2 and other.ranks == job.ranks
    for wrong in (ParallelConfig(tp=1, pp=2), ParallelConfig(tp=2, pp=2, vpp=2),
                  ParallelConfig(tp=2, pp=2, dp=1)):
        with pytest.raises(ValueError, match="are not the job's process groups'"):
            job.for_layout(wrong)


@pytest.mark.parametrize("vpp,pp_rank,vp_stage,first,last", [
    (1, 0, None, True, False), (1, 1, None, False, True),
    (2, 0, 0, True, False), (2, 0, 1, False, False), (2, 1, 0, False, False),
    (2, 1, 1, False, True)])
def test_embedding_and_loss_stages(vpp, pp_rank, vp_stage, first, last):
    """The embedding lives on the first pipeline rank's first model chunk, the output layer and
    the loss on the last rank's last one (Megatron's is_pipeline_first/last_stage)."""
    job = _job(vpp, pp_rank)
    assert (job.is_first_stage(vp_stage), job.is_last_stage(vp_stage)) == (first, last)


def test_which_model_chunk_must_be_said_with_virtual_stages():
    with pytest.raises(ValueError, match="holds 2 model chunks"):
        _job(vpp=2).is_last_stage()
    with pytest.raises(ValueError, match="DP filled in"):
        Job(ParallelConfig(tp=2), Ranks(tp=2), groups=None)
