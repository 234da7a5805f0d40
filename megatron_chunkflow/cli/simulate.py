"""`chunkflow simulate`: predicted step time, MFU and peak memory per GPU, stock Megatron against
ChunkFlow, for a Qwen2.5 model on a cluster of named GPUs (roofline cost model, docs/benchmarks.md).

    chunkflow simulate                                       # qwen2.5-7b, 32K, 32 x h100, profile B
    chunkflow simulate --model qwen2.5-72b --seq-length 262144 --gpus 128 --auto
    chunkflow simulate --megatron-parallel 4,2,1,full --chunkflow-parallel 4,1,1,none \\
        --chunk-size 16384 --chunkflow-k 2 --gpu a100 --gpu-set network_gb_s=50 --json
    chunkflow simulate --gpu h100 --calibration h100_calibration.json

A layout is TP,CP,PP,RECOMPUTE (RECOMPUTE: none, selective or full); DP is what --gpus leaves.
"auto" (the default) picks the fastest layout that fits in memory. Sequences longer than
--seq-length are truncated to it for both systems (the context limit of the run).
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_chunkflow.cli.inputs import read_lengths_file
from megatron_chunkflow.cli.output import Output
from megatron_chunkflow.config import (
    ChunkFlowConfig,
    ParallelConfig,
    add_config_arguments,
    config_from_args,
)
from megatron_chunkflow.perfmodel.hardware import GPUS, apply_calibration, get_gpu, with_overrides
from megatron_chunkflow.perfmodel.layout import parse_layout
from megatron_chunkflow.core.models import MODEL_SHAPES, get_model_shape
from megatron_chunkflow.perfmodel.predict import GIB, Prediction
from megatron_chunkflow.perfmodel.search import best_chunkflow, best_megatron
from megatron_chunkflow.core.profiles import PROFILES, sample_lengths

DEFAULT_BATCH = 2048


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and cluster")
    g.add_argument("--model", default="qwen2.5-7b", choices=sorted(MODEL_SHAPES),
                   help="model shape (default: qwen2.5-7b)")
    g.add_argument("--seq-length", type=int, default=32768, metavar="N",
                   help="maximum context: stock Megatron's micro-batch length (default: 32768)")
    g.add_argument("--gpus", type=int, default=32, metavar="N",
                   help="GPUs in the job (default: 32)")
    g.add_argument("--gpu", default="h100", choices=sorted(GPUS),
                   help="GPU type, datasheet numbers in perfmodel/hardware.py (default: h100)")
    g.add_argument("--gpu-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one hardware parameter, e.g. nvlink_gb_s=400 or "
                        "gemm_max_eff=0.7 (repeatable; keys: perfmodel/hardware.py Hardware)")
    g.add_argument("--calibration", metavar="FILE",
                   help="efficiencies measured by scripts/benchmarks/gpu_calibrate.py")
    g = parser.add_argument_group("data")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--profile", choices=sorted(PROFILES), default="B",
                     help="seeded long-tailed length profile (docs/design.md; default: B)")
    src.add_argument("--lengths-file", metavar="PATH",
                     help="the global batch: one sequence length per line")
    g.add_argument("--global-batch-size", type=int, default=None, metavar="N",
                   help=f"sequences per step drawn from --profile (default: {DEFAULT_BATCH})")
    g.add_argument("--seed", type=int, default=0, help="profile seed (default: 0)")
    g.add_argument("--step", type=int, default=0, help="training step to draw (default: 0)")
    g = parser.add_argument_group("layouts")
    g.add_argument("--megatron-parallel", default="auto", metavar="TP,CP,PP,RECOMPUTE",
                   help="stock Megatron's layout, or auto (default: auto)")
    g.add_argument("--chunkflow-parallel", default="auto", metavar="TP,CP,PP,RECOMPUTE",
                   help="ChunkFlow's layout (CP must be 1), or auto (default: auto)")
    g = parser.add_argument_group("chunkflow")
    add_config_arguments(g, ChunkFlowConfig, fields=("chunk_size", "k"))
    g.add_argument("--auto", action="store_true",
                   help="choose (chunk size, K) instead: the fastest that fits in memory")
    g = parser.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _lengths(args: argparse.Namespace) -> tuple[list[int], str]:
    if args.lengths_file:
        if args.global_batch_size is not None:
            raise ValueError("--global-batch-size draws from --profile; with --lengths-file "
                             "the file is the global batch")
        return read_lengths_file(args.lengths_file), args.lengths_file
    n = DEFAULT_BATCH if args.global_batch_size is None else args.global_batch_size
    if n < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {n}")
    return (sample_lengths(args.profile, n, args.seed, args.step),
            f"profile {args.profile}, seed {args.seed}, step {args.step}")


def _row(name: str, p: Prediction, usable: float) -> str:
    lay = p.layout
    layout = f"{lay.tp} {lay.cp} {lay.pp} {lay.dp} {lay.recompute}"
    if p.system == "chunkflow":
        layout += f"  C={p.chunk_size} K={p.k}"
    return (f"{name:<15} {layout:<26} {p.step_s:>9.3f} {p.tokens_per_s:>11,.0f} "
            f"{p.mfu:>6.1%} {p.bubble:>7.1%} {p.peak_mem_bytes / GIB:>7.1f} / "
            f"{usable / GIB:<5.1f} {'yes' if p.fits else 'NO'}")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(ChunkFlowConfig, args)
    for flag, value in (("--gpus", args.gpus), ("--seq-length", args.seq_length)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    out = Output(args.json)
    shape = get_model_shape(args.model)
    hw = with_overrides(get_gpu(args.gpu), args.gpu_set)
    if args.calibration:
        hw = apply_calibration(hw, args.calibration)
    mg_layout = cf_layout = None
    if args.megatron_parallel != "auto":
        mg_layout = parse_layout(args.megatron_parallel, args.gpus, shape, "--megatron-parallel")
    if args.chunkflow_parallel != "auto":
        cf_layout = parse_layout(args.chunkflow_parallel, args.gpus, shape,
                                 "--chunkflow-parallel")
        if cf_layout.cp > 1:
            raise ValueError(f"--chunkflow-parallel {args.chunkflow_parallel}: CP must be 1 "
                             "(ChunkFlow refuses context parallelism)")
        if not args.auto:
            cfg.check_parallel(ParallelConfig(tp=cf_layout.tp,
                                              sequence_parallel=cf_layout.sequence_parallel))
    raw, source = _lengths(args)
    lengths = [min(n, args.seq_length) for n in raw]
    truncated = sum(n > args.seq_length for n in raw)

    mg = best_megatron(lengths, shape, hw, args.gpus, args.seq_length, mg_layout)
    cf = best_chunkflow(lengths, shape, hw, args.gpus, args.seq_length, cf_layout,
                        cfg.chunk_size, cfg.k, auto_chunking=args.auto)
    ratio = mg.step_s / cf.step_s
    speedup = ratio if mg.fits and cf.fits else None

    out.say(f"{args.model} on {args.gpus} x {hw.name} ({hw.hbm_gb:g} GB, "
            f"{hw.peak_tflops:g} TFLOP/s peak); {len(lengths)} sequences ({source}), "
            f"{sum(lengths):,} tokens, longest {max(lengths):,}"
            + (f", {truncated} truncated to --seq-length {args.seq_length}" if truncated else ""))
    out.say(f"\n{'system':<15} {'TP CP PP DP recompute':<26} {'step (s)':>9} {'tokens/s':>11} "
            f"{'MFU':>6} {'bubble':>7} {'peak / usable GiB':>15} fits")
    out.say(_row("stock Megatron", mg, hw.usable_bytes))
    out.say(_row("ChunkFlow", cf, hw.usable_bytes))
    if speedup is not None:
        out.say(f"\nChunkFlow speedup: {speedup:.2f}x")
    else:
        who = " and ".join(n for n, p in (("stock Megatron", mg), ("ChunkFlow", cf)) if not p.fits)
        out.say(f"\n{who} does not fit in {hw.usable_bytes / GIB:.1f} GiB per GPU; step-time "
                f"ratio ignoring memory: {ratio:.2f}x")
    chosen = [f"--megatron-parallel {mg.layout.to_flag()}"] if mg_layout is None else []
    if cf_layout is None:
        chosen.append(f"--chunkflow-parallel {cf.layout.to_flag()}")
    if args.auto:
        chosen.append(f"--chunk-size {cf.chunk_size} --chunkflow-k {cf.k}")
    if chosen:
        out.say("chosen by search (fastest that fits): " + " ".join(chosen))

    out.result({
        "megatron": mg.to_json(),
        "chunkflow": cf.to_json(),
        "speedup": speedup,
        "step_time_ratio": ratio,
        "chunk_size": cf.chunk_size,
        "k": cf.k,
        "setup": {
            "model": args.model, "gpu": hw.name, "gpus": args.gpus,
            "seq_length": args.seq_length, "global_batch_size": len(lengths),
            "tokens": sum(lengths), "truncated": truncated, "source": source,
            "usable_gib": hw.usable_bytes / GIB, "calibration": args.calibration,
            "hardware": dataclasses.asdict(hw),
        },
    })
    return 0
