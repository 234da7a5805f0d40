"""Process groups for one process or a torchrun job: torch.distributed + megatron parallel_state.

    init_distributed(tp=2, pp=1)          # under torchrun: env:// ; alone: a world of one
    init_distributed(tp=1, pp=1, cp=2)    # context parallelism (Megatron's rank order tp-cp-ep-dp-pp)
    results = run_processes(fn, 4, arg)   # fn(arg) in 4 spawned processes forming one job

On CPU the backend is gloo and mcore/cpu.py's shims are installed first. run_processes is the
one process harness: `chunkflow bench`, the benchmark scripts and the tests all use it.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port free on this machine now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(tp: int = 1, pp: int = 1, seed: int = 1234, cp: int = 1) -> None:
    """Initialise torch.distributed (if needed), megatron's model-parallel groups and RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_chunkflow.mcore.cpu import install_cpu_shims

    on_cpu = install_cpu_shims()
    if not dist.is_initialized():
        backend = "gloo" if on_cpu else "nccl"
        if "WORLD_SIZE" in os.environ:
            if not on_cpu:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * cp * pp):
        with_cp = f" x --cp {cp}" if cp > 1 else ""
        raise ValueError(f"world size {world} is not divisible by --tp {tp}{with_cp} x --pp {pp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def shutdown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawned(rank: int, world_size: int, port: int, fn, args, queue) -> None:
    import traceback

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
    """Run fn(*args) in `world_size` fresh processes forming one job (torchrun's environment
    variables, torch.multiprocessing spawn); returns every rank's result, in rank order.

    A ValueError raised in the job (bad input) is re-raised here with its message; any other
    exception, a rank that dies, or `timeout` seconds passing ends every rank and raises
    RuntimeError (TimeoutError for the timeout) with the failing rank's traceback. `fn` and its
    arguments must be picklable; a rank's number is in os.environ["RANK"]."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_spawned, args=(r, world_size, port, fn, args, queue))
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
