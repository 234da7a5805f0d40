"""`chunkflow calibrate`: measure this GPU's rates and write a device profile for the simulator.

    chunkflow calibrate --out h100.json                    # on a GPU node, about 2 minutes
    chunkflow simulate --gpu-profile h100.json
    chunkflow calibrate --dry-run --out dry.json           # every benchmark at tiny sizes

Microbenchmarks of exactly the work the cost model charges to each rate (bench/gpu_profile.py): bf16
GEMMs (gemm_max_eff), the attention kernel training runs here, forward and backward (attn_fwd_eff,
attn_bwd_eff), the local layer's memory-bound kernels with their bytes counted as a traced step
counts them (mem_eff), and a real training step at a negligible token count over its traced
kernels (kernel_launch_us). Each rate is labelled measured, with the benchmark beside it; the rest
of the device (peak, bandwidths, links) is its datasheet (--gpu). The build the profile is for is
the installed one: megatron-core's local spec (perfmodel/kernels.py), fusions as --no-fusions
says, K/V repeated per head where the installed varlen attention has no grouped-query attention.

Without a GPU it exits 1 and says so, unless --dry-run: then every benchmark runs at tiny sizes on
the CPU and the profile it writes is valid but marked not calibrated.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
from pathlib import Path

from megatron_chunkflow.console import Output
from megatron_chunkflow.flags import MAX_COUNT, Bounded, check_output_file
from megatron_chunkflow.perfmodel.gpu_profiles import profile_hardware, profile_json
from megatron_chunkflow.perfmodel.hardware import GPUS, get_gpu


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="FILE",
                   help="the profile to write (JSON); required but for --dry-run")
    p.add_argument("--gpu", choices=sorted(GPUS), default=None,
                   help="the datasheet to measure against (default: from the device's name)")
    p.add_argument("--name", default=None,
                   help="the profile's name (default: GPU, torch version and 'local')")
    p.add_argument("--no-fusions", dest="fusions", action="store_false",
                   help="the build runs with Megatron's SwiGLU and bias-dropout-add fusions off")
    p.add_argument("--repeats", type=int, action=Bounded, bounds=(1, MAX_COUNT),
                   default=10, help="timed runs per benchmark (median)")
    p.add_argument("--warmup", type=int, action=Bounded, bounds=(0, MAX_COUNT),
                   default=3, help="untimed runs before them")
    p.add_argument("--dry-run", action="store_true",
                   help="every benchmark at tiny sizes (on the CPU without a GPU): a valid "
                        "profile, not a calibration")
    p.add_argument("--json", action="store_true", help="print the profile as JSON on stdout")


def gpu_type(name: str) -> str | None:
    for key in ("h200", "h100", "a100"):
        if key in name.lower():
            return key
    return None


def run(args: argparse.Namespace) -> int:
    import torch

    from megatron_chunkflow.bench import gpu_profile as gp
    from megatron_chunkflow.memtrace.stack import installed_stack

    if args.out is None and not args.dry_run:
        raise ValueError("--out FILE: where to write the profile (a calibration takes minutes "
                         "of GPU time; its result is kept)")
    check_output_file("--out", args.out)
    out = Output(args.json)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.dry_run:
        print("chunkflow calibrate: no CUDA GPU here (torch.cuda.is_available() is False); run "
              "it on a GPU node, or give --dry-run to exercise every benchmark at tiny sizes",
              file=sys.stderr)
        return 1
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    gpu = args.gpu or gpu_type(device_name) or ("h200" if args.dry_run else None)
    if gpu is None:
        raise ValueError(f"--gpu: cannot tell the GPU type of {device_name!r}; name its datasheet "
                         f"({', '.join(GPUS)})")
    hw = get_gpu(gpu)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    timer = gp.Timer(device, args.warmup, args.repeats)
    dry = args.dry_run
    out.say(f"calibrating {device_name} against the {gpu} datasheet ({hw.peak_tflops:g} TFLOP/s, "
            f"{hw.hbm_gb_s:g} GB/s){' (dry run: tiny sizes)' if dry else ''}")
    gemms = gp.measure_gemms(timer, gp.DRY_GEMMS if dry else gp.GEMM_SHAPES, dtype, device, hw)
    backend, attn = gp.measure_attention(timer, gp.DRY_LENGTHS if dry else gp.ATTN_LENGTHS, dtype,
                                         device, hw)
    copy = gp.measure_copy(timer, dtype, device, hw, 1 << (16 if dry else 29))
    mix = gp.measure_elementwise(timer, gp.DRY_TOKENS if dry else gp.MIX_TOKENS,
                                 gp.DRY_VOCAB if dry else gp.MIX_VOCAB, dtype, device, hw)
    launch = gp.measure_launch(timer, device)
    large = [g["implied_max_eff"] for g in gemms if g["shape_factor"] >= 0.9] \
        or [g["implied_max_eff"] for g in gemms]
    stack = installed_stack()
    values = {
        "gemm_max_eff": min(1.0, statistics.median(large)),
        "attn_fwd_eff": min(1.0, statistics.median(a["implied_fwd_eff"] for a in attn)),
        "attn_bwd_eff": min(1.0, statistics.median(a["implied_bwd_eff"] for a in attn)),
        "mem_eff": min(1.0, mix["mem_eff"]),
        "kernel_launch_us": launch["kernel_launch_us"],
        "spec": "local", "fused_swiglu": bool(args.fusions),
        "kv_repeat": backend == "varlen" and not stack.varlen_gqa,
    }
    if device == "cuda":
        values["memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    name = args.name or (f"{gpu}-torch{'.'.join(torch.__version__.split('.')[:2])}-local"
                         + ("-dry-run" if dry else ""))
    measured = dataclasses.replace(hw, profile=name, **values)
    how = "dry run on the CPU at tiny sizes: not a calibration; " if dry else ""
    sources = {
        "gemm_max_eff": ("measured", f"{how}median over near-ideal shapes of the measured bf16 "
                                     "GEMM rate over peak x the model's shape factor"),
        "attn_fwd_eff": ("measured", f"{how}the {backend} attention kernel forward, causal, "
                                     "28/4 heads of 128, over peak x tile quantization"),
        "attn_bwd_eff": ("measured", f"{how}the {backend} attention kernel backward, likewise"),
        "mem_eff": ("measured", f"{how}the local layer's memory-bound kernels and the cross "
                                f"entropy at {mix['tokens']} tokens, {mix['bytes']:,} bytes "
                                f"counted kernel by kernel (a device copy: "
                                f"{copy['mem_eff']:.3f})"),
        "kernel_launch_us": ("measured", f"{how}a real 2-layer training step of "
                                         f"{launch['tokens']} tokens over the "
                                         f"{launch['kernels']} kernels it launched"),
        "spec": ("build", "megatron-core's local spec (perfmodel/kernels.py)"),
        "fused_swiglu": ("build", "--no-fusions" if not args.fusions else "fusions on"),
        "kv_repeat": ("build", f"attention backend {backend}, {stack.name}"),
    }
    if "memory_gib" in values:
        sources["memory_gib"] = ("measured", "torch.cuda.get_device_properties(0).total_memory")
    profile = profile_json(
        measured, sources, stack=f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                                 f"attention {backend}, megatron-core local spec",
        calibrated=not dry, device=device_name, date=datetime.date.today().isoformat(),
        checked="microbenchmarks (bench/gpu_profile.py), below",
        benchmarks={"gemm": gemms, "attention": attn, "copy": copy, "elementwise": mix,
                    "launch": launch})
    profile_hardware(profile, f"--out {args.out}")  # what simulate will read back
    if args.out is not None:
        Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
    for key, value in values.items():
        out.say(f"  {key} = {value:.4g}" if isinstance(value, float) else f"  {key} = {value}")
    out.say(f"written to {args.out} (chunkflow simulate --gpu-profile {args.out})"
            if args.out is not None else "a dry run: not written (give --out FILE to keep it)")
    out.result(profile)
    return 0
