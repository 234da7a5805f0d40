"""Measure this machine's rates for the cost model: a `cpu` device for perfmodel/hardware.py.

    rates = measure_cpu_rates(shape, backend="cpu_flash")   # every rank, a few seconds
    hw = cpu_hardware(rates, memory_bytes)                  # kernels only
    hw, scale, host = model_hardware(rates, memory_bytes, shape, pp, probe_times, segment)

What is timed is what a training step runs, on this rank's threads:
- GEMMs: the transformer layer's four weight shapes (QKV, projection, fc1, fc2) for a micro-batch
  of `tokens` tokens, forward (x W^T), data gradient and weight gradient, as in a linear layer's
  backward; the rate is their FLOPs over their time.
- attention: the chunk-attention backend on one causal segment and on one chunk after a prefix,
  forward and backward, FLOPs counted as perfmodel/roofline.py counts them (4 * pairs * heads * head
  dim forward, 2.5x that backward), so the roofline's efficiencies are the measured ones.
- memory: an elementwise a * b + c over tensors far larger than the caches (bytes moved / s).
- pipeline point-to-point: a gloo send of 16 MB to the next stage, and the latency of one element.
Each is the median of a few repetitions after one unrecorded run.

Isolated kernels run faster than the same work inside the model, and each op of a pipeline stage
pays host time (Python, Megatron's forward_step, autograd) that a GPU hides behind its kernels.
model_hardware fits both from two timed probe micro-batches of the real model (512 and 4096
tokens; bench/systems.py: probe_step_times): measured = scale * roofline + host per
op, so the simulator's CPU device has GEMM and memory rates / scale and op_overhead_us = host.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from megatron_chunkflow.bench.gpu_profile import Timer
from megatron_chunkflow.core.costs import attention_flops_per_pair_per_layer, attention_pairs
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.perfmodel.hardware import Hardware, hardware_from_measurements
from megatron_chunkflow.perfmodel.roofline import ATTN_BWD_FLOPS


@dataclass(frozen=True)
class CpuRates:
    gemm_flops: float
    attn_fwd_flops: float
    attn_bwd_flops: float
    mem_bytes_per_s: float
    p2p_bytes_per_s: float
    p2p_latency_s: float

    def to_json(self) -> dict:
        return asdict(self)


def _median_time(fn, repeats: int = 3) -> float:
    return Timer("cpu", warmup=1, repeats=repeats)(fn)


def gemm_rate(shape: ModelShape, tokens: int, dtype=torch.float32) -> float:
    h, f = shape.hidden_size, shape.ffn_hidden_size
    attn = shape.num_attention_heads * shape.head_dim
    weights = [(attn + 2 * shape.kv_dim, h), (h, attn), (2 * f, h), (h, f)]  # (out, in)
    xs = {n_in: torch.randn(tokens, n_in, dtype=dtype) for _, n_in in weights}
    ws = [torch.randn(n_out, n_in, dtype=dtype) for n_out, n_in in weights]
    gs = {n_out: torch.randn(tokens, n_out, dtype=dtype) for n_out, _ in weights}

    def run():
        for w in ws:
            n_out, n_in = w.shape
            torch.nn.functional.linear(xs[n_in], w)  # forward
            gs[n_out] @ w  # data gradient
            gs[n_out].t() @ xs[n_in]  # weight gradient

    flops = sum(3 * 2.0 * tokens * n_out * n_in for n_out, n_in in weights)
    return flops / _median_time(run)


def attention_rates(shape: ModelShape, backend: str, tokens: int, dtype=torch.float32):
    """(forward FLOP/s, backward FLOP/s) of the chunk-attention backend: a causal segment of
    `tokens` and a chunk of tokens // 2 queries after a prefix of 2 * tokens keys."""
    from megatron_chunkflow.attention import chunk_attention

    nh, ng, hd = shape.num_attention_heads, shape.num_query_groups, shape.head_dim
    cases = [(tokens, 0), (tokens // 2, 2 * tokens)]  # (queries, prefix)
    fwd_t = bwd_t = flops = 0.0
    for lq, prefix in cases:
        q = torch.randn(lq, nh, hd, dtype=dtype, requires_grad=True)
        k = torch.randn(prefix + lq, ng, hd, dtype=dtype, requires_grad=True)
        v = torch.randn(prefix + lq, ng, hd, dtype=dtype, requires_grad=True)
        cu_q, cu_kv = [0, lq], [0, prefix + lq]

        def forward():
            with torch.no_grad():
                chunk_attention(q, k, v, cu_q, cu_kv, backend=backend)

        def both():
            out = chunk_attention(q, k, v, cu_q, cu_kv, backend=backend)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

        f = _median_time(forward)
        fwd_t += f
        bwd_t += max(_median_time(both) - f, 1e-9)
        flops += attention_pairs(prefix, lq) * attention_flops_per_pair_per_layer(shape)
    return flops / fwd_t, ATTN_BWD_FLOPS * flops / bwd_t


def memory_rate(num_elements: int = 1 << 24) -> float:
    a, b, c = (torch.rand(num_elements) for _ in range(3))
    out = torch.empty_like(a)
    seconds = _median_time(lambda: torch.addcmul(c, a, b, out=out))
    return 4 * 4.0 * num_elements / seconds  # read a, b, c; write out


def p2p_rates(group, num_elements: int = 1 << 22, repeats: int = 5) -> tuple[float, float]:
    """(bytes/s, latency s) of a send from the first to the second rank of `group` (gloo): half
    a one-element round trip, and a 16 MB message's time beyond it; (inf, 0) without a second
    rank. Every rank of the group must call this."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) < 2:
        return float("inf"), 0.0
    me, ranks = dist.get_rank(group), dist.get_process_group_ranks(group)
    big, small = torch.empty(num_elements), torch.empty(1)

    def transfer(x) -> float:
        dist.barrier(group=group)
        t = time.perf_counter()
        if me == 0:
            dist.send(x, ranks[1], group=group)
            dist.recv(small, ranks[1], group=group)
        elif me == 1:
            dist.recv(x, ranks[0], group=group)
            dist.send(small, ranks[0], group=group)
        return time.perf_counter() - t

    transfer(big)
    latency = statistics.median(transfer(small) for _ in range(repeats)) / 2
    seconds = statistics.median(transfer(big) for _ in range(repeats)) - latency
    times = torch.tensor([latency, seconds], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)  # the sender's view wins
    return big.numel() * big.element_size() / max(float(times[1]), 1e-9), float(times[0])


def measure_cpu_rates(shape: ModelShape, backend: str, pp_group=None,
                      tokens: int = 2048) -> CpuRates:
    attn_fwd, attn_bwd = attention_rates(shape, backend, tokens)
    bw, latency = p2p_rates(pp_group)
    return CpuRates(gemm_rate(shape, tokens), attn_fwd, attn_bwd, memory_rate(), bw, latency)


def average_rates(rates: CpuRates, group=None) -> CpuRates:
    """The mean of every rank's measurement (ranks are the same cores' time shares)."""
    import torch.distributed as dist

    values = torch.tensor(list(asdict(rates).values()), dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(values, group=group)
        values /= dist.get_world_size(group)
    return CpuRates(*values.tolist())


def cpu_hardware(rates: CpuRates, memory_bytes: float, dtype_bytes: int = 4,
                 op_overhead_s: float = 0.0) -> Hardware:
    """perfmodel/hardware.py's device for these rates (the GEMM rate is usually the peak), with the
    host time per pipeline-stage op measured on the real model (bench/compare.py)."""
    return hardware_from_measurements(
        rates.gemm_flops, rates.attn_fwd_flops, rates.attn_bwd_flops, memory_bytes,
        min(rates.p2p_bytes_per_s, 1e15), p2p_latency_s=rates.p2p_latency_s,
        mem_bytes_per_s=rates.mem_bytes_per_s, dtype_bytes=dtype_bytes,
        op_overhead_s=op_overhead_s)


def fit_model_costs(hw: Hardware, shape: ModelShape, num_stages: int,
                    measured: dict[int, float], segment: int) -> tuple[float, float]:
    """(dense scale, host seconds per op) such that measured = scale * roofline + 2 * host for
    the probe micro-batches (perfmodel/roofline.py's forward + backward per stage, stages averaged).
    The kernel rates come from isolated kernels; in the model the same work runs slower (layers
    of small ops between them) and every op pays a fixed host cost: two probe sizes separate
    the two. The scale applies to GEMM and memory rates (attention is a few % of the probes)."""
    from megatron_chunkflow.config import ParallelConfig
    from megatron_chunkflow.core.types import DataChunk, Segment
    from megatron_chunkflow.perfmodel.roofline import Roofline

    model = Roofline(shape, ParallelConfig.layout(pp=num_stages), hw)

    def predicted(tokens: int) -> float:
        segs = tuple(Segment(i, 0, segment) for i in range(tokens // segment))
        fwd, bwd = model.chunk_costs(DataChunk(id=0, kind="standalone", segments=segs),
                                     num_stages)
        return (sum(fwd) + sum(bwd)) / num_stages

    (t1, m1), (t2, m2) = sorted(measured.items())
    r1, r2 = predicted(t1), predicted(t2)
    scale = max((m2 - m1) / (r2 - r1), 1e-3)
    return scale, max(0.0, (m1 - scale * r1) / 2)


def model_hardware(rates: CpuRates, memory_bytes: float, shape: ModelShape, num_stages: int,
                   measured: dict[int, float], segment: int) -> tuple[Hardware, float, float]:
    """The CPU device for the simulator: kernel rates, with GEMM and memory rates divided by the
    fitted dense scale and the fitted host time per op (fit_model_costs)."""
    kernels = cpu_hardware(rates, memory_bytes)
    scale, host = fit_model_costs(kernels, shape, num_stages, measured, segment)
    fitted = CpuRates(rates.gemm_flops / scale, rates.attn_fwd_flops, rates.attn_bwd_flops,
                      rates.mem_bytes_per_s / scale, rates.p2p_bytes_per_s, rates.p2p_latency_s)
    return cpu_hardware(fitted, memory_bytes, op_overhead_s=host), scale, host
