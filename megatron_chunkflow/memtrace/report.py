"""A job's GPU memory, traced and modelled side by side: what `chunkflow memory` prints and the
start guard (memtrace/guard.py) checks.

    report = memory_report(settings, lengths, world=8, gpu=get_gpu("h200"), stack="torch-2.11")
    report.traced[0].peak_allocated, report.needed, report.fits, report.predicted.peak_mem_bytes

The analytic model (perfmodel/predict.py) is asked for the same job and names the rank where it
puts the peak (the DP rank holding the longest sequence, the pipeline stage); the tracer
(memtrace/trace.py) then runs that DP rank's first rank of every pipeline stage (and of every CP
rank), unless told which ranks. A job fits when the replayed caching allocator never fails in the
GPU's memory less what a job uses outside PyTorch (perfmodel/hardware.py reserve_gib): the
allocator's fragmentation is in the replay, not a margin.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_chunkflow.memtrace.stack import Stack, get_stack
from megatron_chunkflow.memtrace.trace import GiB, MemoryTrace, trace_memory
from megatron_chunkflow.perfmodel.hardware import Hardware
from megatron_chunkflow.perfmodel.predict import Prediction, predict_chunkflow, predict_megatron


@dataclass
class MemoryReport:
    """One job's traced ranks, the model's prediction for it, and the verdict on `gpu`."""

    traced: dict[int, MemoryTrace]  # global rank -> its trace
    predicted: Prediction
    gpu: Hardware
    capacity: float  # bytes PyTorch may reserve on the GPU: memory_gib less reserve_gib

    @property
    def worst(self) -> tuple[int, MemoryTrace]:
        """The traced rank that needs the most device memory."""
        return max(self.traced.items(), key=lambda kv: kv[1].needed)

    @property
    def needed(self) -> int:
        return self.worst[1].needed

    @property
    def fits(self) -> bool:
        return all(t.fits for t in self.traced.values())

    def to_json(self) -> dict:
        return {"gpu": self.gpu.name, "capacity_gib": self.capacity / GiB,
                "fits": self.fits, "needed_gib": self.needed / GiB,
                "predicted": self.predicted.to_json(),
                "ranks": {str(r): t.to_json() for r, t in self.traced.items()}}


def model_hardware(gpu: Hardware, settings, stack: Stack) -> Hardware:
    """`gpu` with the memory choices of this run's build and stack (perfmodel/footprint.py
    Build): Megatron's fusions as the settings have them, K/V repeated per query head where the
    attention kernel lacks grouped-query attention (varlen on a stack without it)."""
    from megatron_chunkflow.attention import resolve_backend

    backend = resolve_backend(settings.chunkflow.attention_backend, "cuda")
    return dataclasses.replace(gpu, fused_swiglu=settings.fusions,
                               kv_repeat=backend == "varlen" and not stack.varlen_gqa)


def predict_job(settings, lengths, world: int, hw: Hardware) -> Prediction:
    """The analytic model's prediction of `settings` on `world` GPUs of `hw`."""
    p = settings.parallel
    layout = dataclasses.replace(p, dp=world // p.model_parallel_size)
    c, piece = settings.chunkflow, settings.chunkflow.loss_piece
    if settings.uses_chunkflow:
        return predict_chunkflow(lengths, settings.shape, hw, layout, c.chunk_size, c.num_kept,
                                 c.cp_kv, c.cp_placement, c.reforward_attention, piece)
    return predict_megatron(lengths, settings.shape, hw, layout, settings.seq_length,
                            settings.system, piece)


def ranks_to_trace(settings, prediction: Prediction, world: int) -> list[int]:
    """The DP rank where the model puts the peak, its first rank of every pipeline stage and
    CP rank (Megatron's order: TP fastest, then CP, DP, PP)."""
    p = settings.parallel
    tp, cp, pp = p.tp, p.cp, p.pp
    dp = world // (tp * cp * pp)
    dp_rank = prediction.memory_rank if prediction.memory_rank is not None else 0
    return sorted(stage * tp * cp * dp + dp_rank * tp * cp + cp_rank * tp
                  for stage in range(pp) for cp_rank in range(cp))


def memory_report(settings, lengths, *, world: int | None = None, gpu: Hardware,
                  stack: Stack | str | None = None, ranks: list[int] | None = None,
                  seed: int = 0, warm_optimizer: bool = False) -> MemoryReport:
    """Trace and model `settings` (a GPU run: device "cuda") on `world` GPUs of `gpu` on one
    global batch of `lengths` (module docstring)."""
    stack = stack if isinstance(stack, Stack) else get_stack(stack)
    world = world or settings.parallel.model_parallel_size
    predicted = predict_job(settings, lengths, world, model_hardware(gpu, settings, stack))
    capacity = (gpu.memory_gib - gpu.reserve_gib) * GiB
    traced = {r: trace_memory(settings, lengths, world=world, rank=r, stack=stack,
                              capacity=capacity, seed=seed, warm_optimizer=warm_optimizer)
              for r in (ranks if ranks is not None else ranks_to_trace(settings, predicted, world))}
    return MemoryReport(traced, predicted, gpu, capacity)
