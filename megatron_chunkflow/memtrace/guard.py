"""Before step 1 on a GPU: the plan's traced peak against what the GPUs can give, and a refusal
naming a plan that fits instead of an out-of-memory error an hour into the job.

    check_memory(settings, lengths)      # on every rank, after the build, before step 1

`chunkflow train` and Megatron-LM's pretrain_gpt.py --chunkflow call it (skipped on CPU and with
--chunkflow-skip-memory-check). Rank 0 traces the step on the first global batch (memtrace/:
the rank the model puts the peak on, every pipeline stage and CP rank of it) in a child process
that sees no GPU (a trace plays one rank of a fake job and needs the process to itself), while
every rank measures what its GPU can still give this process: free memory plus what PyTorch
already reserved. When the least of those is less than the trace needs, every rank raises the
same ValueError: what is needed on which rank, what there is, and what the model finds that fits
(a chunk size and K on the same layout, or a stock baseline's recompute option).

    python -m megatron_chunkflow.memtrace.guard IN.pkl OUT.json    # the child (internal)
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

GiB = 2**30
TIMEOUT_S = 900.0


def check_host_memory(shape, model_name: str, dtype: str, parallel, world: int,
                      local_ranks: int, available: float, copies: int = 1) -> None:
    """A CPU job whose weights, gradients and Adam's states alone (the largest pipeline stage,
    `copies` models per process: verify's reference beside the chunked model) on its
    `local_ranks` processes of a `world`-rank job exceed the host's `available` bytes: ValueError
    naming --model, before anything is built (it was an allocation failure or the kernel's OOM
    killer mid-build)."""
    from megatron_chunkflow.perfmodel.footprint import stage_params

    p = parallel
    shards = max(1, world // (p.tp * p.pp))  # Adam's states over DP x CP
    # bytes per parameter: weight, gradient buffer, Adam's states (bf16: an fp32 master too)
    weight, grad, states = {"float64": (8, 8, 16), "float32": (4, 4, 8)}.get(dtype, (2, 4, 12))
    per_rank = copies * max(stage_params(shape, p.pp)) / p.tp * (weight + grad
                                                                 + states / shards)
    needed = per_rank * local_ranks
    if needed > available:
        raise ValueError(
            f"--model {model_name} ({dtype}) needs {needed / GiB:.1f} GiB of host memory for "
            f"its weights, gradients and Adam's states on {local_ranks} process(es) here "
            f"({per_rank / GiB:.1f} GiB each at TP {p.tp}, PP {p.pp}"
            + (f", {copies} models each" if copies > 1 else "") + "), before any activation; "
            f"this machine has {available / GiB:.1f} GiB available: a smaller --model, a "
            "larger TP or PP over more machines, or a GPU")


def host_memory_of_job(world: int | None = None) -> tuple[int, int, float]:
    """(world, processes on this host, available host bytes) of the job this process is in (or
    will start: `world` processes here)."""
    import psutil

    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return world, local, psutil.virtual_memory().available


def check_memory(settings, lengths) -> None:
    """Refuse (ValueError on every rank) a run whose first step does not fit its GPUs (module
    docstring); call on every rank of an initialised CUDA job."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = torch.tensor([torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()],
                        dtype=torch.float64, device=torch.cuda.current_device())
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    available = float(mine.item())
    verdict = [None]
    if rank == 0:
        try:
            needed = traced_need(settings, list(lengths), world)
            worst = max(needed, key=needed.get)
            verdict[0] = refusal(settings, list(lengths), world, needed[worst], worst, available,
                                 torch.cuda.get_device_name())
        except Exception as e:  # noqa: BLE001  every rank must hear of it, not hang
            verdict[0] = f"the memory check could not trace the step: {e}"
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise ValueError(verdict[0])


def traced_need(settings, lengths: list[int], world: int,
                ranks: list[int] | None = None) -> dict[int, int]:
    """{rank: device memory the replayed caching allocator needs} of the step on `lengths`,
    traced in a child process that sees no GPU."""
    with tempfile.TemporaryDirectory(prefix="chunkflow_guard_") as tmp:
        src, dst = Path(tmp) / "in.pkl", Path(tmp) / "out.json"
        src.write_bytes(pickle.dumps((settings, lengths, world, ranks)))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run([sys.executable, "-m", "megatron_chunkflow.memtrace.guard",
                               str(src), str(dst)], env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        if done.returncode != 0 or not dst.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"the trace's process exited {done.returncode}: {tail[0]}")
        return {int(r): int(n) for r, n in json.loads(dst.read_text()).items()}


def refusal(settings, lengths: list[int], world: int, needed: int, rank: int, available: float,
            device_name: str = "") -> str | None:
    """The refusal when `needed` bytes (traced, on global rank `rank`) exceed `available` (the
    least any GPU of the job can give), with a plan the model finds that fits; None if it fits."""
    if needed <= available:
        return None
    text = (f"this run's first step needs {needed / GiB:.1f} GiB of GPU memory on rank {rank} "
            f"(traced: `chunkflow memory` prints where it goes), but a GPU of the job has "
            f"{available / GiB:.1f} GiB for it")
    plan = fitting_plan(settings, lengths, world, available, device_name)
    hint = (f"; the model finds that {plan} fits" if plan
            else "; the model finds no plan on this layout that fits: add GPUs or parallelism")
    return text + hint + " (--chunkflow-skip-memory-check runs it anyway)"


def fitting_plan(settings, lengths: list[int], world: int, available: float,
                 device_name: str = "") -> str | None:
    """The fastest plan on the same layout that the analytic model says fits in `available`
    bytes: ChunkFlow's chunk size, K and loss pieces, or a stock baseline's recompute option."""
    import dataclasses

    from megatron_chunkflow.memtrace.report import model_hardware
    from megatron_chunkflow.memtrace.stack import installed_stack
    from megatron_chunkflow.perfmodel.hardware import GPUS
    from megatron_chunkflow.perfmodel.search import best_chunkflow, best_megatron

    name = next((n for n in GPUS if n in device_name.lower()), "h100")
    gpu = dataclasses.replace(GPUS[name], memory_gib=available / GiB, reserve_gib=0.0)
    hw = model_hardware(gpu, settings, installed_stack())
    layout = dataclasses.replace(settings.parallel,
                                 dp=world // settings.parallel.model_parallel_size)
    if settings.uses_chunkflow:
        p = best_chunkflow(lengths, settings.shape, hw, world, settings.seq_length, layout,
                           auto_chunking=True, loss_piece=None)
        plan = f"--chunk-size {p.chunk_size} --chunkflow-k {p.num_kept}"
        if p.loss_piece:
            plan += f" --chunkflow-loss-piece {p.loss_piece}"
    else:
        layouts = [dataclasses.replace(layout, recompute=r) for r in ("selective:mlp", "full")]
        preds = [best_megatron(lengths, settings.shape, hw, world, settings.seq_length, lay,
                               settings.system) for lay in layouts]
        p = min((q for q in preds if q.fits), key=lambda q: q.step_s, default=preds[-1])
        plan = f"--recompute {p.layout.recompute}"
    return f"{plan} ({p.peak_mem_bytes / GiB:.1f} GiB modelled)" if p.fits else None


def _child(src: str, dst: str) -> None:
    from megatron_chunkflow.memtrace.report import predict_job, ranks_to_trace
    from megatron_chunkflow.memtrace.trace import trace_memory
    from megatron_chunkflow.perfmodel.hardware import get_gpu

    settings, lengths, world, ranks = pickle.loads(Path(src).read_bytes())
    if ranks is None:
        ranks = ranks_to_trace(settings, predict_job(settings, lengths, world, get_gpu("h100")),
                               world)
    needed = {r: trace_memory(settings, lengths, world=world, rank=r).needed for r in ranks}
    Path(dst).write_text(json.dumps(needed))


if __name__ == "__main__":
    _child(*sys.argv[1:3])
