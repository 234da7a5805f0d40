"""tests/workers.py, the long-lived gloo jobs every slow test runs in: what a call leaves behind,
and which failures end a job.

    python -m pytest tests/test_workers.py -q
"""

import os

import pytest

pytestmark = pytest.mark.slow


def _state():
    """This rank's pid, default dtype, CHUNKFLOW_TEST_MARK and thread count; then change them."""
    import torch

    out = (os.getpid(), str(torch.get_default_dtype()), os.environ.get("CHUNKFLOW_TEST_MARK"),
           torch.get_num_threads())
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    os.environ["CHUNKFLOW_TEST_MARK"] = "left behind"
    print(f"rank {os.environ['RANK']} says hello")
    return out


def _groups():
    """Megatron's groups for TP 2, then the number of process groups c10d knows."""
    import torch.distributed as dist

    from megatron_chunkflow.config import ParallelConfig
    from megatron_chunkflow.mcore.dist import init_distributed

    job = init_distributed(ParallelConfig(tp=2))
    return job.ranks.tp, len(dist.distributed_c10d._world.pg_map)


def _bad_input():
    raise ValueError("--flag 0 must be >= 1")


def _crash():
    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 breaks")
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a partner that never comes
    return "unreachable"


def test_each_call_finds_the_process_as_the_job_started(gloo, capfd):
    first = gloo.run(_state, 2)
    second = gloo.run(_state, 2)
    assert [p for p, *_ in first] == [p for p, *_ in second]  # the same processes
    for _, dtype, mark, threads in second:
        assert (dtype, mark) == ("torch.float32", None)
        assert threads == first[0][3]
    assert "rank 0 says hello" in capfd.readouterr().err  # what the ranks print reaches the test


def test_megatron_groups_are_torn_down_after_every_call(gloo):
    (tp, before), _ = gloo.run(_groups, 2)
    (_, after), _ = gloo.run(_groups, 2)
    assert tp == 2 and after == before  # rebuilt, not accumulated


def test_bad_input_keeps_the_job_a_crash_ends_it(gloo):
    pids = [p for p, *_ in gloo.run(_state, 2)]
    with pytest.raises(ValueError, match="--flag 0 must be >= 1"):
        gloo.run(_bad_input, 2)
    assert [p for p, *_ in gloo.run(_state, 2)] == pids
    with pytest.raises(RuntimeError, match="rank 1 failed(.|\n)*rank 1 breaks"):
        gloo.run(_crash, 2, timeout=60)
    assert set(p for p, *_ in gloo.run(_state, 2)).isdisjoint(pids)  # a new job


def _hang():
    if os.environ["RANK"] == "0":
        import torch
        import torch.distributed as dist

        print("rank 0 waits for a partner that never comes", flush=True)
        dist.all_reduce(torch.ones(1))
    return "done"


def test_a_hung_rank_ends_its_job_and_its_output_is_kept(gloo, capfd):
    with pytest.raises(TimeoutError, match="did not finish in 5 s"):
        gloo.run(_hang, 2, timeout=5)
    assert "rank 0 waits for a partner that never comes" in capfd.readouterr().err
    assert gloo.run(_state, 2)  # a new job answers
