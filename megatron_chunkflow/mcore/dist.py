"""Process groups for one process or a torchrun job: torch.distributed + Megatron's parallel_state.

    job = init_distributed(ParallelConfig(tp=2), seed=1234)   # under torchrun: env://
    job.ranks.dp, job.ranks.pp_rank, job.groups.cp            # mcore/job.py
    results = run_processes(fn, 4, arg)   # fn(arg) in 4 new processes forming one job

On CPU the backend is gloo and mcore/cpu.py's shims are installed first. Alone (no WORLD_SIZE in
the environment) a process forms a world of one. `shutdown` tears down what `init_distributed`
built; a job's default group that something else started (`start_job`, the tests' long-lived
workers) is left to it. run_processes is the one process harness: `chunkflow bench` and the
benchmark scripts use it.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.mcore.job import Job

_OWNS_DEFAULT_GROUP = False  # init_distributed started the default group, so shutdown ends it
_GROUPS: tuple | None = None  # (world, TP, PP, V, CP) of the model-parallel groups built


def free_port() -> int:
    """A TCP port free on this machine now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job() -> bool:
    """Join the job's default process group (gloo on CPU, with the CPU shims; NCCL on the
    LOCAL_RANK GPU): from torchrun's environment, or a world of one. Returns whether this call
    started it (False: it already existed)."""
    from megatron_chunkflow.mcore.cpu import install_cpu_shims

    on_cpu = install_cpu_shims()
    if dist.is_initialized():
        return False
    backend = "gloo" if on_cpu else "nccl"
    if "WORLD_SIZE" in os.environ:
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    return True


def init_distributed(parallel: ParallelConfig = ParallelConfig(), seed: int = 1234) -> Job:
    """Megatron's model-parallel groups for `parallel` (TP, CP, PP; DP is what the world leaves)
    in this job, started if needed, and its RNG seeded; the Job (the layout, this process's ranks
    and the groups). ValueError when the world is not a multiple of TP x CP x PP (or a given DP
    does not match)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    global _OWNS_DEFAULT_GROUP, _GROUPS
    _OWNS_DEFAULT_GROUP = start_job() or _OWNS_DEFAULT_GROUP
    parallel.with_world(dist.get_world_size())
    groups = (dist.get_world_size(), parallel.tp, parallel.pp, parallel.vpp, parallel.cp,
              parallel.ep, parallel.expert_tp)
    if parallel_state.model_parallel_is_initialized() and groups == _GROUPS:
        # the same groups (another layout of one shape: sequence parallelism and recompute are
        # the model's): kept, the virtual stage reset as Megatron's initialisation leaves it
        if parallel.vpp > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    else:
        if parallel_state.model_parallel_is_initialized():
            _destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
            virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
            context_parallel_size=parallel.cp, expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.expert_tp)
        _GROUPS = groups
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return Job.from_megatron(parallel)


def shutdown() -> None:
    """Tear down what init_distributed built: Megatron's groups and, if it started it, the default
    group."""
    global _OWNS_DEFAULT_GROUP
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        _destroy_model_parallel()
    if _OWNS_DEFAULT_GROUP and dist.is_initialized():
        dist.destroy_process_group()
        _OWNS_DEFAULT_GROUP = False


def _destroy_model_parallel() -> None:
    """Megatron's parallel state forgotten and its subgroups destroyed (parallel_state only drops
    its references; in a long-lived job every rebuild would otherwise leave gloo groups open)."""
    from megatron.core import parallel_state

    global _GROUPS
    _GROUPS = None
    parallel_state.destroy_model_parallel()
    default = dist.distributed_c10d._get_default_group()
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not default and group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)


# what every rank of a CPU job imports, imported once by process_context's forkserver
PRELOAD = ["torch", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.distributed", "megatron.core.pipeline_parallel",
           "megatron_chunkflow.mcore.step", "megatron_chunkflow.mcore.forkserver_ready"]


def process_context():
    """How run_processes starts its ranks. With a GPU, spawn (a fresh interpreter: CUDA must not
    be initialised in a process that forks). On CPU, forked from multiprocessing's forkserver,
    which imports PRELOAD once: a rank starts in a fraction of a second instead of importing
    torch and megatron-core again (~5 s each). The shims, process groups and threads are each
    rank's own, set up by the rank (mcore/cpu.py, init_distributed)."""
    import torch.multiprocessing as mp

    from megatron_chunkflow.mcore.cpu import has_real_cuda

    if has_real_cuda():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _spawned(rank: int, world_size: int, port: int, fn, args, queue, environ=None) -> None:
    import traceback

    if environ is not None:  # the caller's environment now, not the forkserver's at its start
        os.environ.clear()
        os.environ.update(environ)
        threads = environ.get("OMP_NUM_THREADS")
        if threads:  # read when torch loaded (in the server); a rank's own setting wins later
            torch.set_num_threads(int(threads))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        queue.put(("ok", rank, fn(*args)))
    except ValueError as e:  # bad input: every rank raises the same
        queue.put(("value", rank, str(e)))
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))
        raise


def run_processes(fn, world_size: int, *args, timeout: float | None = None) -> list:
    """Run fn(*args) in `world_size` new processes forming one job (torchrun's environment
    variables; spawned, or forked from a warm server on CPU: process_context); returns every rank's
    result, in rank order.

    A ValueError raised in the job (bad input) is re-raised here with its message; any other
    exception, a rank that dies, or `timeout` seconds passing ends every rank and raises
    RuntimeError (TimeoutError for the timeout) with the failing rank's traceback. `fn` and its
    arguments must be picklable; a rank's number is in os.environ["RANK"]."""
    import time

    ctx = process_context()
    queue = ctx.SimpleQueue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_spawned, args=(r, world_size, port, fn, args, queue, environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while len(results) < world_size:
            if not queue.empty():
                status, rank, value = queue.get()
                if status == "ok":
                    results[rank] = value
                    continue
                if status == "value":
                    raise ValueError(value)
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead and queue.empty():
                raise RuntimeError(f"rank {dead[0][0]} died with exit code {dead[0][1]} without "
                                   "reporting (killed?)")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the job did not finish in {timeout:.0f} s")
            time.sleep(0.05)
    finally:
        finished = len(results) == world_size
        for p in procs:
            p.join(timeout=60 if finished else 0.5)  # after a failure the others may be stuck
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    return [results[r] for r in range(world_size)]
