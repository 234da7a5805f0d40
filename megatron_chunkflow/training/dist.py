"""Process groups for one process or a torchrun job: torch.distributed + megatron parallel_state.

    init_distributed(tp=2, pp=1)          # under torchrun: env:// ; alone: a world of one

On CPU the backend is gloo and training/cpu.py's shims are installed first.
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


def init_distributed(tp: int = 1, pp: int = 1, seed: int = 1234) -> None:
    """Initialise torch.distributed (if needed), megatron's model-parallel groups and RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_chunkflow.training.cpu import install_cpu_shims

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
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by --tp {tp} x --pp {pp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
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
        result = fn(*args)
        if rank == 0:
            queue.put(("ok", rank, result))
    except ValueError as e:  # bad input: every rank raises the same, rank 0 reports it
        queue.put(("value", rank, str(e)))
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))
        raise


def run_processes(fn, world_size: int, *args):
    """Run fn(*args) in `world_size` fresh processes forming one job (torchrun's environment
    variables, torch.multiprocessing spawn); returns rank 0's result. A ValueError raised in the
    job is re-raised here; any other failure, or a rank that dies, ends every rank and raises
    RuntimeError with the rank's traceback."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_spawned, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    finished = False
    try:
        while True:
            if not queue.empty():
                status, rank, value = queue.get()
                if status == "ok":
                    finished = True
                    return value
                if status == "value":
                    raise ValueError(value)
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead and queue.empty():
                raise RuntimeError(f"rank {dead[0][0]} died with exit code {dead[0][1]}")
            if all(p.exitcode == 0 for p in procs) and queue.empty():
                raise RuntimeError("every rank exited without a result from rank 0")
            time.sleep(0.05)
    finally:
        for p in procs:
            p.join(timeout=60 if finished else 0.5)  # after a failure the others are stuck
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
