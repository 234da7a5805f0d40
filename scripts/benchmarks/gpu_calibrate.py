"""Measure this GPU's GEMM, attention and memory efficiencies for `chunkflow simulate`.

    python scripts/benchmarks/gpu_calibrate.py --out h100_calibration.json   # on an H100 node
    chunkflow simulate --gpu h100 --calibration h100_calibration.json

Times bf16 GEMMs of the shapes Qwen2.5 layers run (forward, data- and weight-gradient) plus a few
awkward ones, the causal attention kernel (flash_attn's varlen function if installed, else
PyTorch SDPA) forward and backward at several lengths with Qwen2.5-7B heads (28 query, 4 K/V,
head dim 128), and a large device-to-device copy. CUDA events, after unlogged warm-up runs;
the median of --repeats.

Efficiencies are measured FLOP/s over the datasheet peak of --gpu (perfmodel/hardware.py). The file's
"hardware" object holds what the cost model reads: each measured efficiency divided by the
model's own shape factor for that shape (tile, wave and K quantization for GEMMs, tile
quantization for attention; perfmodel/roofline.py), median over shapes, so the model reproduces the
measurements where its shape factor is right; mem_eff is the copy bandwidth over the datasheet
bandwidth. Every measurement is also written, with the model's prediction beside it.

Exits with status 1 and a message when no CUDA GPU is present. `--device cpu --quick` runs the
same code on tiny fp32 shapes (a smoke test of the script, not a calibration).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_chunkflow.core.costs import attention_pairs  # noqa: E402
from megatron_chunkflow.perfmodel.hardware import GPUS, get_gpu  # noqa: E402
from megatron_chunkflow.perfmodel.roofline import (  # noqa: E402
    ATTN_BWD_FLOPS,
    computed_pairs,
    gemm_shape_factor,
)

# (m, n, k): Qwen2.5-7B at 8K and 32K tokens, TP 1 and 4 (QKV, projection, fc1, fc2; the
# weight-gradient shapes contract over tokens), Qwen2.5-0.5B, and awkward sizes.
GEMM_SHAPES = [
    (8192, 4608, 3584), (8192, 3584, 3584), (8192, 37888, 3584), (8192, 3584, 18944),
    (32768, 4608, 3584), (32768, 9472, 3584), (32768, 3584, 4736),
    (3584, 4608, 8192), (3584, 37888, 32768), (18944, 3584, 8192),
    (8192, 1152, 896), (8192, 9728, 896), (896, 1152, 8192),
    (4096, 4096, 4096), (1000, 1000, 1000), (8192, 8192, 8192), (3000, 5000, 777),
]
ATTN_LENGTHS = [2048, 8192, 32768]
QUICK_GEMMS = [(256, 192, 128), (128, 128, 384)]
QUICK_LENGTHS = [128, 256]


def gpu_type(name: str) -> str | None:
    for key in ("h200", "h100", "a100"):
        if key in name.lower():
            return key
    return None


class Timer:
    """Median seconds of fn() after warm-up: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, torch, device: str, warmup: int, repeats: int):
        self.torch, self.device, self.warmup, self.repeats = torch, device, warmup, repeats

    def __call__(self, fn) -> float:
        torch = self.torch
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


def measure_gemms(torch, timer, shapes, dtype, device, hw) -> list[dict]:
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


def attention_fn(torch, device, dtype):
    """(name, run(q, k, v) for one causal sequence) with q [T, Hq, D], k/v [T, Hkv, D]: the chunk
    attention backend training would run here (`auto`: flash-attn, else torch's varlen flash
    kernel for half precision on a GPU, the tiled torch backend for fp32; cpu_flash on CPU),
    grouped-query attention as that backend takes it. Never a kernel that materialises the
    [T x T] scores (sdpa's math path: 112 GiB at 32K on the H200 run)."""
    from megatron_chunkflow.attention import chunk_attention, resolve_backend
    from megatron_chunkflow.attention.backends import MATERIALISING

    backend = resolve_backend("auto", device, dtype)
    if backend in MATERIALISING.get(device, ()):
        raise SystemExit(f"gpu_calibrate: the attention backend here ({backend}) materialises "
                         "the scores; install flash-attn or use torch >= 2.10 (varlen)")

    def run(q, k, v):
        cu = [0, q.shape[0]]
        return chunk_attention(q, k, v, cu, cu, backend=backend)
    return f"chunk_attention backend {backend}", run


def measure_attention(torch, timer, lengths, dtype, device, hw, heads=28, kv_heads=4,
                      head_dim=128) -> tuple[str, list[dict]]:
    name, run = attention_fn(torch, device, dtype)
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
        factor = attention_pairs(0, n) / computed_pairs(0, n, hw.attn_block)
        fwd_eff = flops / fwd / hw.peak_flops
        bwd_eff = ATTN_BWD_FLOPS * flops / bwd / hw.peak_flops
        out.append({"seq_len": n, "fwd_seconds": fwd, "bwd_seconds": bwd, "fwd_efficiency": fwd_eff,
                    "bwd_efficiency": bwd_eff, "tile_factor": factor,
                    "implied_fwd_eff": fwd_eff / factor, "implied_bwd_eff": bwd_eff / factor})
    return name, out


def measure_copy(torch, timer, dtype, device, hw, numel: int) -> dict:
    src = torch.empty(numel, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src))
    gb_s = 2 * src.numel() * src.element_size() / seconds / 1e9
    return {"bytes": src.numel() * src.element_size(), "seconds": seconds, "gb_s": gb_s,
            "mem_eff": gb_s / hw.hbm_gb_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", choices=sorted(GPUS),
                    help="datasheet to measure against (default: from the device name)")
    ap.add_argument("--out", default=None, help="JSON file (default: <gpu>_calibration.json)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: smoke-test the script only (needs --gpu and --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    args = ap.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_calibrate.py: no CUDA GPU found (torch.cuda.is_available() is False); run it "
              "on a GPU node. Without a calibration file, chunkflow simulate uses the stated "
              "defaults of perfmodel/hardware.py.", file=sys.stderr)
        return 1
    if args.device == "cpu" and not (args.gpu and args.quick):
        ap.error("--device cpu is a smoke test: give --gpu and --quick")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    gpu = args.gpu or gpu_type(device_name)
    if gpu is None:
        ap.error(f"cannot tell the GPU type of {device_name!r}; pass --gpu")
    hw = get_gpu(gpu)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    timer = Timer(torch, args.device, args.warmup, args.repeats)

    gemms = measure_gemms(torch, timer, QUICK_GEMMS if args.quick else GEMM_SHAPES, dtype,
                          args.device, hw)
    backend, attn = measure_attention(torch, timer, QUICK_LENGTHS if args.quick else ATTN_LENGTHS,
                                      dtype, args.device, hw)
    copy = measure_copy(torch, timer, dtype, args.device, hw, 1 << (16 if args.quick else 29))
    large = [g["implied_max_eff"] for g in gemms if g["shape_factor"] >= 0.9] \
        or [g["implied_max_eff"] for g in gemms]
    calibrated = {
        "gemm_max_eff": min(1.0, statistics.median(large)),
        "attn_fwd_eff": min(1.0, statistics.median(a["implied_fwd_eff"] for a in attn)),
        "attn_bwd_eff": min(1.0, statistics.median(a["implied_bwd_eff"] for a in attn)),
        "mem_eff": min(1.0, copy["mem_eff"]),
    }
    result = {
        "gpu": gpu, "device_name": device_name, "torch": torch.__version__,
        "cuda": torch.version.cuda, "date": datetime.date.today().isoformat(),
        "dtype": str(dtype), "attention_backend": backend, "hardware": calibrated,
        "gemm": gemms, "attention": attn, "copy": copy,
    }
    out = Path(args.out or f"{gpu}_calibration.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{device_name} vs {gpu} datasheet ({hw.peak_tflops:g} TFLOP/s, {hw.hbm_gb_s:g} GB/s):")
    for g in gemms:
        print(f"  GEMM {g['m']:>6} x {g['n']:>6} x {g['k']:>6}: {g['tflops']:8.1f} TFLOP/s, "
              f"eff {g['efficiency']:.3f} (shape factor {g['shape_factor']:.3f})")
    for a in attn:
        print(f"  attention {a['seq_len']:>6}: fwd eff {a['fwd_efficiency']:.3f}, "
              f"bwd eff {a['bwd_efficiency']:.3f} ({backend})")
    print(f"  copy: {copy['gb_s']:.0f} GB/s")
    print("calibrated: " + ", ".join(f"{k}={v:.3f}" for k, v in calibrated.items()))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
