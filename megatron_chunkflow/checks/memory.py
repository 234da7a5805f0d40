"""Activation and K/V state bytes of one sequence through ChunkFlow's schedule, measured with the
exact meter (runtime/meter.py), and the K/V state formula they are checked against
(`chunkflow verify --memory`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_chunkflow.config import ChunkFlowConfig
from megatron_chunkflow.runtime.meter import ActivationMeter
from megatron_chunkflow.runtime.ranks import Ranks


def kv_state_formula(length: int, chunk_size: int, kv_bytes_per_token: float,
                     acc_bytes_per_token: float) -> float:
    """Peak K/V-sized bytes for one sequence (docs/exactness.md, "Memory"), any K.

    N = ceil(L / C) chunks, u = K/V bytes per token (2 x kv heads x head dim x layers x dtype),
    a = the same for the gradient accumulators (fp32, or fp64 in fp64 runs). Chunk 0's forward
    allocates the sequence's K/V buffer of L tokens (runtime/state.py), the first backward the
    accumulator over the prefix of the last chunk, (N - 1) C tokens; chunk 0's backward drops both:
    L u + (N - 1) C a.
    """
    n = -(-length // chunk_size)
    if n <= 1:
        return 0.0
    return length * kv_bytes_per_token + (n - 1) * chunk_size * acc_bytes_per_token


@dataclass
class MemoryRow:
    activation: int  # peak bytes saved for backward, views of the K/V buffers excluded
    state: int  # peak K/V state: K/V buffers, gradient accumulators
    state_formula: float | None  # CP = 1 only
    total: int = 0  # peak of activation + state together
    cp_gathered: int = 0  # context parallelism: bytes this rank received in K/V all-gathers
    cp_reduce_scattered: int = 0  # and in dK/dV reduce-scatters


def measure_one_sequence(job, shape, length: int, chunkflow: ChunkFlowConfig, dtype,
                         seed: int = 0, lora=None, model_class: str = "gpt") -> MemoryRow:
    """One training step of one sequence through ChunkFlow's schedule, metered, on this rank of
    `job` (mcore/job.py; PP 1): with CP > 1 this CP rank's share, with the job's recompute
    Megatron's recompute inside each chunk; with `lora` (mcore/lora.py LoRAConfig) the base is
    frozen and only adapters train."""
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.build import build_chunkflow_model
    from megatron_chunkflow.mcore.step import forward_backward
    from megatron_chunkflow.perfmodel.kvstate import kv_state_bytes_per_token
    from megatron_chunkflow.runtime.execute import plan_step
    from megatron_chunkflow.runtime.loss import make_forward_step

    parallel, ranks, cp = job.parallel, job.ranks, job.parallel.cp
    alone = Ranks(tp=ranks.tp, tp_rank=ranks.tp_rank, cp=ranks.cp, cp_rank=ranks.cp_rank)
    cm = build_chunkflow_model(shape, dtype, job, lora=lora, lora_seed=seed,
                               attention_backend=chunkflow.attention_backend,
                               model_class=model_class)
    store = cm.store
    sequences = make_sequences([length], shape.vocab_size, seed)
    step = plan_step(sequences, chunkflow, parallel, shape, alone)  # whole on every DP rank
    meter = ActivationMeter(cm.ddp, store)
    forward_backward(job, cm, step, make_forward_step(job.groups.tp, exact_loss=True), [meter])
    kv, acc = (kv_state_bytes_per_token(shape, shape.num_layers, nbytes, ranks.tp,
                                        with_grad=False)
               for nbytes in (torch.finfo(dtype).bits // 8, 8 if dtype == torch.float64 else 4))
    formula = (kv_state_formula(length, chunkflow.chunk_size, kv, acc)
               if cp == 1 and chunkflow.reforward_attention != "keep"
               else None)
    return MemoryRow(meter.peak_activation, meter.peak_state, formula, meter.peak_total,
                     store.cp_traffic.gathered, store.cp_traffic.reduce_scattered)
