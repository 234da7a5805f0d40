"""Whether a chunk attention backend can train a run, checked before any model is built: the
launcher (megatron_lm/args.py) and `chunkflow train` (mcore/settings.py) call check_trainable with
the run's device, dtype, heads per rank, chunk and longest sequence."""

from __future__ import annotations

import os

import torch

from megatron_chunkflow.attention import backends


def check_trainable(name: str, device_type: str, dtype: torch.dtype, flag: str, *,
                    heads: int, chunk: int, keys: int, memory_bytes: int | None) -> str:
    """The backend `name` resolves to, after checking, before any model is built, that it can
    train a chunk of `chunk` queries over up to `keys` keys with `heads` query heads per rank:
    installed, on its device and dtype, with a backward, and (for a backend that materialises the
    scores) fitting `memory_bytes`. ValueError naming `flag` otherwise."""
    backend = backends.resolve_backend(name, device_type, dtype)
    shown = name if name == backend else f"{name} ({backend})"
    if backend not in backends.BACKENDS:
        known = ", ".join(sorted(backends.BACKENDS))
        raise ValueError(f"{flag} {name}: unknown; choose from {known} or auto")
    if backend in backends.CUDA_ONLY and device_type != "cuda":
        raise ValueError(f"{flag} {shown} needs a CUDA GPU; this run is on {device_type} (use "
                         "auto)")
    if backend == "cpu_flash" and device_type != "cpu":
        raise ValueError(f"{flag} {shown} is ATen's CPU kernel; this run is on {device_type} "
                         "(use auto)")
    if backend == "flex" and device_type == "cuda" and dtype == torch.float64:
        raise ValueError(f"{flag} {shown} takes fp16, bf16 and fp32 on CUDA (use auto)")
    if backend in backends.HALF_ONLY and dtype not in backends.HALF_DTYPES:
        raise ValueError(f"{flag} {shown} runs fp16/bf16 only; this run is {dtype} (use auto)")
    if not backends._installed(backends._REQUIRES[backend]):
        raise ValueError(f"{flag} {shown}: {backends._REQUIRES[backend]} is not installed here")
    if backend in backends.NO_BACKWARD.get(device_type, ()):
        raise ValueError(f"{flag} {shown} has no {device_type.upper()} backward (torch "
                         f"{torch.__version__}); use auto")
    if backend in backends.MATERIALISING.get(device_type, ()) and memory_bytes:
        need = heads * chunk * keys * 4 + chunk * keys  # float32 scores and a boolean mask
        if need > memory_bytes:
            raise ValueError(
                f"{flag} {shown} materialises each chunk's [queries x keys] scores: {heads} "
                f"heads x {chunk} x {keys} keys = {need / 2**30:.1f} GiB for one layer, more "
                f"than this {device_type}'s {memory_bytes / 2**30:.1f} GiB; use auto (fused or "
                "tiled kernels hold O(chunk x head dim))")
    return backend


def device_memory_bytes(device_type: str) -> int | None:
    """Total memory of the device this process trains on (the current CUDA device's, or the
    host's)."""
    if device_type == "cuda":
        if not torch.cuda.is_available():  # a memory trace's GPU (memtrace/): no device here
            return None
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
