"""`chunkflow calibrate`'s microbenchmarks: the rates of a device profile
(perfmodel/gpu_profiles.py) measured on the installed stack, each of exactly the work the cost
model charges to it.

- GEMMs: bf16 matmuls of the shapes Qwen2.5 layers run (forward, data- and weight-gradient) and a
  few awkward ones; gemm_max_eff = the median over the near-ideal shapes of measured / (peak x
  the model's shape factor: tile, wave and K quantization, perfmodel/gemm.py).
- Attention: the chunk attention backend training runs here (`auto`), one causal sequence with
  Qwen2.5-7B's heads (28 query, 4 K/V, head dim 128), forward and backward at a few lengths, over
  the model's computed pairs (tile quantization); never a backend that materialises the scores.
- Memory-bound kernels: the local layer's non-GEMM work as torch runs it (RMSNorm, the Q/K/V bias,
  rotary by slices and a cat, K/V repeated per head, SwiGLU, the residual adds, forward and
  backward) and Megatron's fp32 cross entropy over a Qwen vocabulary; bytes counted kernel by
  kernel as memtrace/census.py counts a traced step; mem_eff = bytes / seconds / datasheet
  bandwidth. A device copy is measured beside it (the ceiling).
- Kernel launch: one real training step (megatron-core, the local spec, 2 layers, a few hundred
  tokens: the GPU idles, the host sets the pace) over the kernels its trace launches (census):
  host seconds per kernel, Python, autograd and Megatron's modules included.

Each measurement is timed with CUDA events (perf_counter on a CPU) after warm-up runs, the median of
`repeats`. `dry_run` runs every benchmark at tiny sizes (on the CPU when there is no GPU) and writes
a valid profile marked not calibrated.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from megatron_chunkflow.core.costs import attention_pairs
from megatron_chunkflow.perfmodel.gemm import gemm_shape_factor
from megatron_chunkflow.perfmodel.hardware import Hardware
from megatron_chunkflow.perfmodel.layer import ATTN_BWD_FLOPS
from megatron_chunkflow.perfmodel.pairs import computed_pairs

# (m, n, k): Qwen2.5-7B at 8K and 32K tokens, TP 1 and 4 (QKV, projection, fc1, fc2; the
# weight-gradient shapes contract over tokens), Qwen2.5-0.5B, and awkward sizes
GEMM_SHAPES = [
    (8192, 4608, 3584), (8192, 3584, 3584), (8192, 37888, 3584), (8192, 3584, 18944),
    (32768, 4608, 3584), (32768, 9472, 3584), (32768, 3584, 4736),
    (3584, 4608, 8192), (3584, 37888, 32768), (18944, 3584, 8192),
    (8192, 1152, 896), (8192, 9728, 896), (896, 1152, 8192),
    (4096, 4096, 4096), (1000, 1000, 1000), (8192, 8192, 8192), (3000, 5000, 777),
]
ATTN_LENGTHS = [2048, 8192, 32768]
MIX_TOKENS, MIX_VOCAB = 8192, 151936  # the memory-bound mix: Qwen2.5-1.5B's widths (~25 GiB)
DRY_GEMMS, DRY_LENGTHS, DRY_TOKENS, DRY_VOCAB = [(256, 192, 128), (128, 128, 384)], [128, 256], \
    256, 1000
HOST_LENGTHS = [96, 64, 64, 32]  # the launch benchmark's batch: 256 tokens


class Timer:
    """Median seconds of fn() after warm-up: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: str, warmup: int, repeats: int):
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def __call__(self, fn) -> float:
        import torch

        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.device == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)


def measure_gemms(timer: Timer, shapes, dtype, device: str, hw: Hardware) -> list[dict]:
    import torch

    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        seconds = timer(lambda: torch.matmul(a, b))
        eff = 2.0 * m * n * k / seconds / hw.peak_flops
        factor = gemm_shape_factor(m, n, k, hw.num_sms)
        out.append({"m": m, "n": n, "k": k, "seconds": seconds, "tflops": eff * hw.peak_tflops,
                    "efficiency": eff, "shape_factor": factor, "implied_max_eff": eff / factor})
    return out


def attention_fn(device: str, dtype):
    """(backend, run(q, k, v) for one causal sequence): the chunk attention backend training
    would run here, grouped-query attention as it takes it; ValueError for a backend that
    materialises the [T x T] scores (sdpa's math path: 112 GiB at 32K on an H200)."""
    from megatron_chunkflow.attention import chunk_attention, resolve_backend
    from megatron_chunkflow.attention.backends import MATERIALISING

    backend = resolve_backend("auto", device, dtype)
    if backend in MATERIALISING.get(device, ()):
        raise ValueError(f"the attention backend here ({backend}) materialises the scores; "
                         "install flash-attn or use torch >= 2.10 (varlen)")

    def run(q, k, v):
        cu = [0, q.shape[0]]
        return chunk_attention(q, k, v, cu, cu, backend=backend)
    return backend, run


def measure_attention(timer: Timer, lengths, dtype, device: str, hw: Hardware, heads=28,
                      kv_heads=4, head_dim=128) -> tuple[str, list[dict]]:
    import torch

    backend, run = attention_fn(device, dtype)
    out = []
    for n in lengths:
        q = torch.randn(n, heads, head_dim, dtype=dtype, device=device, requires_grad=True)
        k = torch.randn(n, kv_heads, head_dim, dtype=dtype, device=device, requires_grad=True)
        v = torch.randn(n, kv_heads, head_dim, dtype=dtype, device=device, requires_grad=True)
        grad = torch.randn(n, heads, head_dim, dtype=dtype, device=device)
        fwd = timer(lambda: run(q, k, v))

        def fwd_bwd():
            q.grad = k.grad = v.grad = None
            run(q, k, v).backward(grad)
        bwd = max(timer(fwd_bwd) - fwd, 1e-9)
        flops = 4.0 * attention_pairs(0, n) * heads * head_dim
        factor = attention_pairs(0, n) / computed_pairs(0, n, hw.attn_block or 1)
        fwd_eff = flops / fwd / hw.peak_flops
        bwd_eff = ATTN_BWD_FLOPS * flops / bwd / hw.peak_flops
        out.append({"seq_len": n, "fwd_seconds": fwd, "bwd_seconds": bwd,
                    "fwd_efficiency": fwd_eff, "bwd_efficiency": bwd_eff, "tile_factor": factor,
                    "implied_fwd_eff": fwd_eff / factor, "implied_bwd_eff": bwd_eff / factor})
    return backend, out


def measure_copy(timer: Timer, dtype, device: str, hw: Hardware, numel: int) -> dict:
    import torch

    src = torch.empty(numel, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src))
    gb_s = 2 * src.numel() * src.element_size() / seconds / 1e9
    return {"bytes": 2 * src.numel() * src.element_size(), "seconds": seconds, "gb_s": gb_s,
            "mem_eff": gb_s / hw.hbm_gb_s}


def elementwise_mix(tokens: int, vocab: int, dtype, device: str, hidden=1536, heads=12,
                    groups=2, head_dim=128, ffn=8960):
    """A callable running the local layer's memory-bound work (module docstring) forward and
    backward on `tokens` tokens, and its inputs; no GEMM, no attention kernel."""
    import torch

    def leaf(*shape, dt=dtype):
        return torch.randn(*shape, dtype=dt, device=device, requires_grad=True)

    x, w1, w2 = leaf(tokens, hidden), leaf(hidden), leaf(hidden)
    qkv = leaf(tokens, (heads + 2 * groups) * head_dim)
    bias = leaf((heads + 2 * groups) * head_dim)
    fc1 = leaf(tokens, 2 * ffn)
    logits = leaf(tokens, vocab)
    freqs = torch.randn(tokens, 1, head_dim, device=device)  # fp32, as Megatron's rotary
    target = torch.randint(0, vocab, (tokens,), device=device)

    def rotary(t):
        cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
        x1, x2 = torch.chunk(t, 2, dim=-1)
        return t * cos + torch.cat((-x2, x1), dim=-1) * sin

    def run():
        h1 = torch.rms_norm(x, (hidden,), w1, 1e-6)
        y = (qkv + bias).view(tokens, heads + 2 * groups, head_dim)
        q, k, v = y.split([heads, groups, groups], dim=1)
        q, k = rotary(q), rotary(k)
        k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
        r1 = x + h1 + (q.sum() + k.sum() + v.sum()) * 0  # the residual add, the branch kept
        h2 = torch.rms_norm(r1, (hidden,), w2, 1e-6)
        a, b = torch.chunk(fc1, 2, dim=-1)
        act = torch.nn.functional.silu(a) * b
        out = h2 + r1 + act[:, :hidden]
        lf = logits.float()
        lf = lf - lf.max(dim=-1, keepdim=True)[0]
        loss = lf.exp().sum(-1).log() - lf.gather(1, target[:, None]).squeeze(1)
        (out.float().sum() + loss.sum()).backward()
        for t in (x, w1, w2, qkv, bias, fc1, logits):
            t.grad = None
    return run


def count_kernels(fn, device: str):
    """fn() run once with memtrace/census.py counting its kernels on `device`: the Census."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_chunkflow.memtrace.census import Census

    census = Census()

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            census.op(func, args, kwargs, out, phase, lambda t: t.device.type == device)
            return out

    with Counting():
        fn()
    return census


def measure_elementwise(timer: Timer, tokens: int, vocab: int, dtype, device: str,
                        hw: Hardware) -> dict:
    run = elementwise_mix(tokens, vocab, dtype, device)
    census = count_kernels(run, device)
    nbytes = sum(p.memory_bytes for p in census.phases.values())
    seconds = timer(run)
    gb_s = nbytes / seconds / 1e9
    return {"tokens": tokens, "vocab": vocab, "kernels": census.kernels, "bytes": nbytes,
            "seconds": seconds, "gb_s": gb_s, "mem_eff": gb_s / hw.hbm_gb_s,
            "by_op": {k: v for p in census.phases.values() for k, v in p.by_op.items()}}


def measure_launch(timer: Timer, device: str, model: str = "qwen2.5-0.5b") -> dict:
    """Host seconds per kernel of a real training step at a negligible token count (module
    docstring): the step's kernels counted as it runs (count_kernels), then the step timed. The
    build's fusions off: every kernel an ATen op the count sees."""
    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
    from megatron_chunkflow.mcore.step import build_training, training_step

    shape = dataclasses.replace(get_model_shape(model), num_layers=2, vocab_size=2048)
    lengths = HOST_LENGTHS
    settings = TrainSettings(
        shape=shape, model_name=model, dtype="bfloat16" if device == "cuda" else "float32",
        seq_length=128, global_batch_size=len(lengths), train_iters=1000,
        chunkflow=ChunkFlowConfig(128, 1, "auto"), optimizer=OptimizerConfig(lr_warmup_iters=0),
        device=device, fusions=False, memory_check=False)
    sequences = make_sequences(lengths, shape.vocab_size, 0)
    job = init_distributed(seed=0)
    try:
        tr = build_training(settings, job)
        step = [0]

        def one():
            training_step(settings, tr, sequences, step[0])
            step[0] += 1
            if device == "cuda":
                import torch

                torch.cuda.synchronize()
        one()  # Adam's states made, as a run's first step makes them
        kernels = count_kernels(one, device).kernels
        seconds = Timer("cpu", timer.warmup, timer.repeats)(one)  # wall clock: the host's pace
    finally:
        shutdown()
    return {"model": f"{model}, 2 layers", "tokens": sum(lengths), "kernels": kernels,
            "seconds": seconds, "kernel_launch_us": seconds / kernels * 1e6}


FAMILIES = (("attention", ("attn", "attention", "flash", "fmha")),
            ("gemm", ("::mm", "::addmm", "::bmm", "::baddbmm", "::_scaled_mm", "gemm")),
            ("optimizer", ("foreach", "adam", "multi_tensor")),
            ("communication", ("c10d", "nccl", "allreduce", "all_gather", "reduce_scatter",
                               "broadcast", "send", "recv")),
            ("loss", ("cross_entropy", "nll_loss", "log_softmax")))


def kernel_family(op: str) -> str:
    """The family (FAMILIES, else "elementwise") an ATen or c10d op's kernels belong to."""
    name = op.lower()
    for family, marks in FAMILIES:
        if any(m in name for m in marks):
            return family
    return "elementwise"


def profile_families(fn, device: str) -> dict:
    """fn() run once under torch.profiler: seconds by kernel family (self time of every ATen and
    c10d op: the device's on a GPU, the host's on a CPU) and the ten costliest ops. Megatron's
    cross entropy is pointwise ops (max, exp, sum, log): its time counts as elementwise."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    families: dict[str, float] = {}
    ops = []
    for e in prof.key_averages():
        if not e.key.startswith(("aten::", "c10d::")):
            continue  # ranges (record_function) and Python: not kernels
        us = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
              if device == "cuda" else e.self_cpu_time_total)
        family = kernel_family(e.key)
        families[family] = families.get(family, 0.0) + us * 1e-6
        ops.append((us * 1e-6, e.key, e.count, family))
    ops.sort(reverse=True)
    return {"device": device, "seconds": families, "total_s": sum(families.values()),
            "top": [{"op": k, "seconds": t, "calls": n, "family": f} for t, k, n, f in ops[:10]]}
