"""`chunkflow simulate`: predicted step time, MFU and peak memory per GPU, stock Megatron (four
baselines) against ChunkFlow, for a Qwen2.5 model on a cluster of named GPUs (roofline cost
model, docs/benchmarks-appendix.md).

    chunkflow simulate                                       # qwen2.5-7b, 32K, 32 x h100, profile B
    chunkflow simulate --model qwen2.5-72b --seq-length 262144 --gpus 128
    chunkflow simulate --chunk-size 8192 --chunkflow-k 1     # ChunkFlow's chunking fixed
    chunkflow simulate --baseline megatron-sft --megatron-parallel 4,2,1,block:4 \\
        --chunkflow-parallel 4,1,1,selective:mlp --chunk-size 16384 --chunkflow-k 2 --json
    chunkflow simulate --gpu-profile h200-torch2.11-local --model qwen2.5-1.5b --gpus 1
    chunkflow simulate --gpu-profile h100.json --gpu-set cp_overlap=1   # `chunkflow calibrate`'s

The baselines (core/step.py BASELINES): megatron-sft (Megatron-LM's SFT: lines packed first-fit in
data order and padded to --seq-length, fixed-shape pipeline sends), megatron-packed (best fit, no
padding, variable shapes), megatron-unpacked (one sequence per micro-batch), and
megatron-hybrid-cp (Megatron's per-sample CP, perfmodel/hybrid_cp.py: PP 1, each sequence alone
on a power-of-two CP group from its length and --max-seqlen-per-dp-cp-rank, searched unless
given); under CP every sequence is padded to a multiple of 2 x CP. The strongest is the fastest
that fits, named with ChunkFlow's speedup against it, and a verdict line says whether ChunkFlow
helps, which plan to run and why (perfmodel/comparison.py verdict). A plan that does not fit gets
no ratio. `--baseline all` (the default) predicts each on its own fastest layout and recompute;
ChunkFlow is searched the same way, over its layout, recompute, chunk size, K and re-forward mode
(giving --chunk-size or --chunkflow-k fixes the chunking; --chunkflow-reforward-attention the
re-forward). A layout is TP,CP,PP,RECOMPUTE with RECOMPUTE one of Megatron's menu (none, selective, selective:mlp+layernorm, full, block:N) and PP optionally PPxV,
V virtual stages per pipeline rank (Megatron's interleaved 1F1B for the baselines, ChunkFlow's
interleaved plan; "4,1,4x2,full"); DP is what --gpus leaves; "auto" (the default) searches every
layout (V included, for both systems) and recompute option for the fastest that fits.
ChunkFlow's CP (runtime/cp.py) pads every segment of a chunk to 2 x CP (the chunk to 2 x CP x TP
under sequence parallelism), all-gathers K/V in every layer, behind the attention over the keys a
rank holds, forward and again backward, where the kernel's
backward runs from the saved log-sum-exp (perfmodel/layer.py); a long sequence's K/V state is
sharded over the CP ranks, or replicated on each so that a chunk gathers only its own K/V, once
(--chunkflow-cp-kv; auto tries both); its --chunk-size must be a multiple of 2 x CP (x TP).
Every stock prediction is repeated with CP overlap 0 and 1 (Hardware.cp_overlap's range,
searched again when the layout was), ChunkFlow's too (its ring hides its K/V the same way).
Sequences
longer than --seq-length are truncated to it for every system (the context limit of the run).
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.console import Output
from megatron_chunkflow.core.hybrid_cp import BASELINE as HYBRID
from megatron_chunkflow.core.hybrid_cp import FLAG as MAX_SEQLEN_FLAG
from megatron_chunkflow.core.lengths import AS_DRAWN, LengthsConfig, check_length
from megatron_chunkflow.core.models import MODEL_SHAPES, get_model_shape
from megatron_chunkflow.core.step import BASELINES
from megatron_chunkflow.flags import (
    MAX_GPUS,
    MAX_TOKENS,
    add_config_arguments,
    Bounded,
    config_from_args,
    given,
)
from megatron_chunkflow.mcore.hybrid_cp import balanced_cp_groups
from megatron_chunkflow.perfmodel.gpu_profiles import (
    add_device_arguments,
    describe,
    device_from_args,
)
from megatron_chunkflow.perfmodel.comparison import CP_OVERLAP_ENDS, compare, verdict
from megatron_chunkflow.perfmodel.predict import GIB, Prediction
from megatron_chunkflow.perfmodel.search import CP_KV, LOSS_PIECES, REFORWARD

SCENARIO = dict(model="qwen2.5-7b", global_batch_size=2048)  # README, "Defaults"
STRONGEST = "megatron-packed"  # what the JSON's "megatron" and "speedup" keep reporting
NAMES = (*BASELINES, HYBRID)  # every stock baseline the simulator predicts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and cluster")
    g.add_argument("--model", default=SCENARIO["model"], choices=sorted(MODEL_SHAPES),
                   help=f"model shape (default: {SCENARIO['model']})")
    g.add_argument("--seq-length", type=int, action=Bounded, bounds=(1, MAX_TOKENS),
                   default=32768, metavar="N",
                   help="maximum context: stock Megatron's micro-batch length (default: 32768)")
    g.add_argument("--gpus", type=int, action=Bounded, bounds=(1, MAX_GPUS),
                   default=32, metavar="N",
                   help="GPUs in the job (default: 32)")
    add_device_arguments(g, "h100")
    g = parser.add_argument_group("sequence lengths")
    add_config_arguments(g, LengthsConfig, fields=AS_DRAWN, default_help={
        "profile": "B", "global_batch_size": SCENARIO["global_batch_size"]})
    g = parser.add_argument_group("stock Megatron and layouts")
    g.add_argument("--baseline", choices=[*NAMES, "all"], default="all",
                   help="the stock system(s) to predict (default: all four)")
    g.add_argument("--megatron-parallel", default="auto", metavar="TP,CP,PP,RECOMPUTE",
                   help="stock Megatron's layout (every baseline's), or auto (default: auto); "
                        f"{HYBRID} takes PP 1 and its DP x CP as the pool")
    g.add_argument(MAX_SEQLEN_FLAG, type=int, action=Bounded, bounds=(1, MAX_TOKENS),
                   default=None, metavar="M",
                   help=f"{HYBRID}: Megatron's tokens per rank before a sequence gets a CP "
                        "group (default: searched, powers of two)")
    g.add_argument("--chunkflow-parallel", default="auto", metavar="TP,CP,PP,RECOMPUTE",
                   help="ChunkFlow's layout (under CP, --chunk-size a multiple of 2 x CP, x TP "
                        "when TP > 1), or auto (default: auto)")
    g = parser.add_argument_group("chunkflow")
    add_config_arguments(g, ChunkFlowConfig, fields=("chunk_size", "num_kept", "cp_placement"))
    g.add_argument("--auto", action="store_true",
                   help="search (chunk size, K) for the fastest that fits: the default unless "
                        "--chunk-size or --chunkflow-k is given")
    g.add_argument("--chunkflow-cp-kv", choices=["auto", *CP_KV], default="auto",
                   help="under CP, a long sequence's K/V state: sharded over the CP ranks or "
                        "replicated on each (runtime/cp.py); auto tries both (default: auto)")
    g.add_argument("--chunkflow-loss-piece", default="0", metavar="N",
                   help="ChunkFlow's output layer and cross entropy in pieces of N tokens (0: "
                        "whole, as stock Megatron), or auto: whole or in pieces of "
                        f"{LOSS_PIECES[1]}, the faster that fits. The stock baselines are "
                        "predicted as shipped and, where ChunkFlow pieces its loss, with the "
                        "same loss too (default: 0)")
    g.add_argument("--chunkflow-reforward-attention", choices=["auto", *REFORWARD],
                   default="auto",
                   help="a re-forwarded chunk's attention: recompute it (`train`'s default), keep "
                        "its output from the first forward on the GPU, or offload it to host "
                        "memory; auto tries all three (default: auto)")
    g = parser.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _row(name: str, p: Prediction, usable: float) -> str:
    lay = p.layout
    pp = f"{lay.pp}x{lay.vpp}" if lay.vpp > 1 else f"{lay.pp}"
    cp = "h" if p.max_seqlen_per_rank else lay.cp  # hybrid: a CP size per sequence
    layout = f"{lay.tp} {cp} {pp} {lay.dp} {lay.recompute}"
    if p.system == "chunkflow":
        layout += f"  C={p.chunk_size} K={p.num_kept}"
        if p.reforward_attention != "recompute":
            layout += f" {p.reforward_attention}"
        if lay.cp > 1:
            layout += f" kv={p.cp_kv}"
    if p.max_seqlen_per_rank:
        layout += f"  M={p.max_seqlen_per_rank}"
    return (f"{name:<17} {layout:<44} {p.step_s:>9.3f} {p.tokens_per_s:>11,.0f} "
            f"{p.mfu:>6.1%} {p.bubble:>7.1%} {p.padding_fraction:>6.1%} "
            f"{p.peak_mem_bytes / GIB:>7.1f} / {usable / GIB:<5.1f} {'yes' if p.fits else 'NO'}")


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "n/a"


def _loss_piece(text: str) -> int | None:
    """--chunkflow-loss-piece: tokens (0: whole), or None for auto; ValueError naming it."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--chunkflow-loss-piece {text!r}: give a number of tokens (0: the "
                         "whole loss) or auto") from None
    if value < 0:
        raise ValueError(f"--chunkflow-loss-piece must be >= 0 (0: whole) or auto, got {value}")
    return value


def searched_chunking(args: argparse.Namespace) -> bool:
    """(chunk size, K) searched: unless --chunk-size or --chunkflow-k is given (then both are
    fixed, the other at its default); --auto with either is a contradiction, refused."""
    fixed = [f for f, dest in (("--chunk-size", "chunk_size"), ("--chunkflow-k", "num_kept"))
             if given(args, dest)]
    if args.auto and fixed:
        raise ValueError(f"--auto searches the chunk size and K: leave out {' and '.join(fixed)}, "
                         "or --auto to keep them")
    return not fixed


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(ChunkFlowConfig, args)
    auto = searched_chunking(args)
    piece = _loss_piece(args.chunkflow_loss_piece)
    check_length(args.seq_length, "--seq-length")
    out = Output(args.json)
    shape = get_model_shape(args.model)
    shape.require_dense(args.model, "simulate")
    hw = device_from_args(args)
    mg_layout = cf_layout = None
    if args.megatron_parallel != "auto":
        mg_layout = ParallelConfig.parse(args.megatron_parallel, args.gpus, shape,
                                         "--megatron-parallel")
    if args.chunkflow_parallel != "auto":
        cf_layout = ParallelConfig.parse(args.chunkflow_parallel, args.gpus, shape,
                                 "--chunkflow-parallel")
        if not auto:
            cf_layout.check_chunk_size(cfg.chunk_size, naming="axes")
    raw, source = config_from_args(LengthsConfig, args).lengths(SCENARIO["global_batch_size"])
    lengths = [min(n, args.seq_length) for n in raw]
    truncated = sum(n > args.seq_length for n in raw)
    names = list(NAMES) if args.baseline == "all" else [args.baseline]
    if args.max_seqlen_per_dp_cp_rank is not None and HYBRID not in names:
        raise ValueError(f"{MAX_SEQLEN_FLAG} applies to --baseline {HYBRID} (or all)")
    notes = []
    if args.baseline == "all" and args.gpus < 2:
        names.remove(HYBRID)
        notes.append(f"{HYBRID} not predicted: its DP x CP pool needs at least 2 GPUs")
    elif args.baseline == "all" and mg_layout is not None and mg_layout.pp > 1:
        names.remove(HYBRID)
        notes.append(f"{HYBRID} not predicted: --megatron-parallel {args.megatron_parallel} has "
                     "PP > 1, which Megatron-LM refuses with --hybrid-context-parallel")

    result = compare(
        lengths, shape, hw, args.gpus, args.seq_length, names, balanced_cp_groups,
        megatron_layout=mg_layout, chunkflow_layout=cf_layout, chunk_size=cfg.chunk_size,
        num_kept=cfg.num_kept, auto_chunking=auto,
        cp_kv=None if args.chunkflow_cp_kv == "auto" else args.chunkflow_cp_kv,
        cp_placement=cfg.cp_placement,
        reforward=(None if args.chunkflow_reforward_attention == "auto"
                   else args.chunkflow_reforward_attention), loss_piece=piece,
        max_seqlen=args.max_seqlen_per_dp_cp_rank,
        progress=lambda text: out.progress(f"chunkflow simulate: {text}"))
    preds, cf, same_loss, ends = (result.baselines, result.chunkflow, result.same_loss,
                                  result.cp_overlap_ends)
    speedups, speedups_same_loss = result.speedups, result.speedups_same_loss
    judged = verdict(result, args.gpus)

    out.say(f"{args.model} on {args.gpus} x {hw.name} ({hw.memory_gib:g} GiB, "
            f"{hw.peak_tflops:g} TFLOP/s peak; {describe(hw)}); {len(lengths)} sequences "
            f"({source}), "
            f"{sum(lengths):,} tokens, longest {max(lengths):,}"
            + (f", {truncated} truncated to --seq-length {args.seq_length}" if truncated else ""))
    for note in notes:
        out.say(note)
    out.say(f"\n{'system':<17} {'TP CP PP[xV] DP recompute':<44} {'step (s)':>9} {'tokens/s':>11} "
            f"{'MFU':>6} {'bubble':>7} {'pad':>6} {'peak / usable GiB':>15} fits")
    for name, p in preds.items():
        out.say(_row(name.removeprefix("megatron-") if len(name) > 17 else name, p,
                     hw.usable_bytes))
    for name, p in same_loss.items():
        out.say(_row(name.removeprefix("megatron-") + " +piece", p, hw.usable_bytes))
    out.say(_row("ChunkFlow", cf, hw.usable_bytes))
    out.say("")
    for name in names:
        lo, hi = (ends[f"{e:g}"][name]["speedup"] for e in CP_OVERLAP_ENDS)
        if speedups[name] is not None:
            same = (f"; {_x(speedups_same_loss[name])} given the same loss in pieces of "
                    f"{cf.loss_piece}" if name in same_loss else "")
            out.say(f"ChunkFlow speedup vs {name}: {speedups[name]:.2f}x (CP overlap "
                    f"{hw.cp_overlap:g}; at 0: {_x(lo)}, at 1: {_x(hi)}){same}")
        else:
            for who, p in ((name, preds[name]), ("ChunkFlow", cf)):
                if not p.fits:
                    out.say(f"vs {name}: {who} does not fit on {args.gpus} GPUs: its best plan "
                            f"needs {p.peak_mem_bytes / GIB:.1f} GiB of "
                            f"{hw.usable_bytes / GIB:.1f} per GPU (no ratio)")
    strongest = result.strongest
    if strongest is not None and len(names) > 1:
        out.say(f"strongest stock baseline: {strongest}; ChunkFlow against it: "
                f"{_x(speedups[strongest])}")
    chosen = [f"--megatron-parallel {p.layout.to_flag()}"
              + (f" {MAX_SEQLEN_FLAG} {p.max_seqlen_per_rank}" if p.max_seqlen_per_rank else "")
              + f" ({n})" for n, p in preds.items() if mg_layout is None]
    if cf_layout is None:
        chosen.append(f"--chunkflow-parallel {cf.layout.to_flag()}")
    if auto:
        chosen.append(f"--chunk-size {cf.chunk_size} --chunkflow-k {cf.num_kept}")
    if cf.layout.cp > 1 and args.chunkflow_cp_kv == "auto":
        chosen.append(f"--chunkflow-cp-kv {cf.cp_kv}")
    if args.chunkflow_reforward_attention == "auto":
        chosen.append(f"--chunkflow-reforward-attention {cf.reforward_attention}")
    if piece is None:
        chosen.append(f"--chunkflow-loss-piece {cf.loss_piece}")
    if chosen:
        out.say("chosen by search (fastest that fits): " + "; ".join(chosen))
    out.say(judged["text"] + f" [{hw.name}, {describe(hw)}]")

    main = STRONGEST if STRONGEST in preds else names[0]
    out.result({
        "megatron": preds[main].to_json(),
        "chunkflow": cf.to_json(),
        "speedup": speedups[main],
        "baselines": {name: p.to_json() for name, p in preds.items()},
        "speedups": speedups,
        "loss_piece": cf.loss_piece,
        "baselines_same_loss": {name: p.to_json() for name, p in same_loss.items()},
        "speedups_same_loss": speedups_same_loss,
        "strongest": strongest,
        "speedup_vs_strongest": speedups[strongest] if strongest else None,
        "verdict": judged,
        "cp_overlap": {"value": hw.cp_overlap, "range": ends},
        "chunk_size": cf.chunk_size,
        "k": cf.num_kept,
        "setup": {
            "model": args.model, "gpu": hw.name, "gpus": args.gpus,
            "seq_length": args.seq_length, "global_batch_size": len(lengths),
            "tokens": sum(lengths), "longest": max(lengths), "truncated": truncated,
            "source": source,
            "usable_gib": hw.usable_bytes / GIB, "gpu_profile": hw.profile,
            "calibrated": hw.calibrated,
            "baseline": args.baseline, "hardware": dataclasses.asdict(hw),
            "searched_chunking": auto,
        },
    })
    return 0
