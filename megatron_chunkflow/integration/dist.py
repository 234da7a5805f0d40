"""Process groups for one process or a torchrun job: torch.distributed + megatron parallel_state.

    init_distributed(tp=2, pp=1)          # under torchrun: env:// ; alone: a world of one

On CPU the backend is gloo and integration/cpu.py's shims are installed first.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(tp: int = 1, pp: int = 1, seed: int = 1234) -> None:
    """Initialise torch.distributed (if needed), megatron's model-parallel groups and RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_chunkflow.integration.cpu import install_cpu_shims

    on_cpu = install_cpu_shims()
    if not dist.is_initialized():
        backend = "gloo" if on_cpu else "nccl"
        if "WORLD_SIZE" in os.environ:
            if not on_cpu:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
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
