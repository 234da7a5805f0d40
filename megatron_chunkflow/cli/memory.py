"""`chunkflow memory`: one job's GPU memory per GPU, traced from the real step on this machine (no
GPU needed) and modelled, with the verdict on a named GPU: what to run before a SLURM job.

    chunkflow memory                         # Qwen2.5-1.5B, 32K, C 16384 on one H200 (profile B)
    chunkflow memory --model qwen2.5-7b --seq-length 131072 --chunk-size 16384 --chunkflow-k 2 \\
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --world 16 --gpu h100
    chunkflow memory --no-chunkflow --baseline megatron-packed --recompute full --json
    chunkflow memory --stack torch-2.11 --lengths-file batch.txt --chunkflow-loss-piece 2048

The step is the one `chunkflow train` and the Megatron-LM launcher take (memtrace/trace.py: the
build, Adam's states, one training step on the global batch), on meta tensors standing for the
GPU; the analytic model (perfmodel/) gives its prediction beside it and names the rank it puts
the peak on, which is traced (with its other pipeline stages and CP ranks). Exit 0 when the job
fits, 1 when it does not (with a plan the model finds that fits), 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig, Recompute
from megatron_chunkflow.console import Output
from megatron_chunkflow.core.lengths import AS_DRAWN, LengthsConfig
from megatron_chunkflow.core.models import MODEL_SHAPES
from megatron_chunkflow.core.step import BASELINES
from megatron_chunkflow.flags import (
    MAX_GPUS,
    MAX_TOKENS,
    add_config_arguments,
    Bounded,
    config_from_args,
)
from megatron_chunkflow.perfmodel.gpu_profiles import (
    add_device_arguments,
    describe,
    device_from_args,
)

# the default job: the H200 runs of docs/benchmarks-appendix.md, "Memory"
SCENARIO = dict(model="qwen2.5-1.5b", seq_length=32768, global_batch_size=128, chunk_size=16384,
                min_long=1, gpu="h200")
GiB = 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and job")
    g.add_argument("--model", default=SCENARIO["model"], choices=sorted(MODEL_SHAPES),
                   help=f"model shape (default: {SCENARIO['model']})")
    g.add_argument("--model-config", metavar="FILE",
                   help="JSON with ModelShape fields, or a Hugging Face config.json")
    g.add_argument("--seq-length", type=int, action=Bounded, bounds=(1, MAX_TOKENS),
                   default=SCENARIO["seq_length"], metavar="N",
                   help=f"the longest context, checked: a drawn batch whose longest sequence is "
                        f"shorter gets one sequence of this length in its place (--as-drawn "
                        f"keeps the draw); longer sequences are truncated to it as stock "
                        f"Megatron does (default: {SCENARIO['seq_length']})")
    g.add_argument("--world", type=int, action=Bounded, bounds=(1, MAX_GPUS),
                   default=None, metavar="N",
                   help="GPUs in the job (default: TP x CP x PP, one DP rank)")
    g.add_argument("--rank", type=int, action="append", default=None, metavar="R",
                   help="trace this global rank (repeatable; default: the model's worst DP rank, "
                        "every pipeline stage and CP rank of it)")
    add_config_arguments(g, ParallelConfig, fields=("tp", "pp", "vpp", "cp",
                                                    "sequence_parallel", "recompute"),
                         defaults={"recompute": None}, default_help={"recompute": "none"})
    g.add_argument("--no-fusions", dest="fusions", action="store_false",
                   help="Megatron's bias-SwiGLU and bias-dropout-add fusions off (Megatron-LM's "
                        "--no-bias-swiglu-fusion --no-bias-dropout-fusion)")
    g = p.add_argument_group("sequence lengths")
    add_config_arguments(g, LengthsConfig, fields=(*AS_DRAWN, "min_long"),
                         defaults={"min_long": SCENARIO["min_long"]}, default_help={
                             "profile": "B", "global_batch_size": SCENARIO["global_batch_size"]})
    g.add_argument("--as-drawn", action="store_true",
                   help="check the drawn batch as it is, even when its longest sequence is "
                        "shorter than --seq-length")
    g = p.add_argument_group("system")
    g.add_argument("--chunkflow", action=argparse.BooleanOptionalAction, default=True,
                   help="ChunkFlow (default) or --no-chunkflow for a stock baseline")
    g.add_argument("--baseline", choices=BASELINES, default=None,
                   help="with --no-chunkflow: megatron-sft, megatron-packed or megatron-unpacked "
                        "(default: megatron-packed)")
    add_config_arguments(g, ChunkFlowConfig, defaults={"chunk_size": SCENARIO["chunk_size"]})
    g = p.add_argument_group("GPU")
    add_device_arguments(g, SCENARIO["gpu"])  # the GPU the verdict is for
    g.add_argument("--stack", default="installed", metavar="NAME",
                   help="the GPU software stack whose kernels' memory to trace: torch-2.11, "
                        "torch-2.13 or installed (default: the torch installed here)")
    g.add_argument("--fast", action="store_true",
                   help="Adam's states made without a first step: the same allocated peak in a "
                        "quarter of the time, the allocator's fragmentation from another history")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def settings_from_args(args):
    """A GPU run's TrainSettings (bf16) from the flags; ValueError naming them."""
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings, model_of

    parallel = config_from_args(ParallelConfig, args, recompute=args.recompute or Recompute())
    shape, hf_shape, name = model_of(args.model, args.model_config, None, parallel.tp)
    shape.require_dense(name, "memory")
    system = TrainSettings.system_of(args.chunkflow, args.baseline)
    return TrainSettings(shape=shape, model_name=name, system=system, hf_shape=hf_shape,
                         chunkflow=config_from_args(ChunkFlowConfig, args), parallel=parallel,
                         seq_length=args.seq_length, global_batch_size=1, train_iters=2,
                         optimizer=OptimizerConfig(lr_warmup_iters=0), dtype="bfloat16",
                         device="cuda", fusions=args.fusions)


def run(args) -> int:
    from megatron_chunkflow.memtrace.report import memory_report

    out = Output(args.json)
    settings = settings_from_args(args)
    drawn = config_from_args(LengthsConfig, args)
    raw, source = drawn.lengths(SCENARIO["global_batch_size"], long_above=settings.chunkflow.chunk_size)
    lengths = [min(n, args.seq_length) for n in raw]
    lengths, raised = at_seq_length(lengths, args.seq_length,
                                    keep=args.as_drawn or args.lengths_file is not None)
    world = args.world or settings.parallel.model_parallel_size
    settings.parallel.with_world(world)
    for r in args.rank or ():
        if not 0 <= r < world:
            raise ValueError(f"--rank {r} is not a rank of this job's {world:,} GPU(s) (0 to "
                             f"{world - 1:,}; --world sets how many)")
    gpu = device_from_args(args)
    settings = dataclasses.replace(settings, global_batch_size=len(lengths))
    out.progress(f"chunkflow memory: tracing {_ranks_traced(args.rank)} of {world:,} GPU(s) on "
                 "the meta device" + (" (Megatron's process groups for a world this large "
                                      "take a minute or more)" if world > 8192 else ""))
    report = memory_report(settings, lengths, world=world, gpu=gpu, stack=args.stack,
                           ranks=args.rank, seed=drawn.seed,
                           warm_optimizer=args.fast)
    truncated = sum(n > args.seq_length for n in raw)
    out.say(f"{settings.model_name}, {_system(settings)}, {world} GPU(s), {len(lengths)} "
            f"sequences ({source}), {sum(lengths):,} tokens, longest {max(lengths):,}"
            + (f", {truncated} truncated to --seq-length" if truncated else ""))
    if raised:
        out.say(f"  the drawn batch's longest sequence, {raised:,} tokens, replaced by one of "
                f"--seq-length {args.seq_length:,} to check that length (--as-drawn: the draw)")
    elif max(lengths) < args.seq_length:
        out.say(f"  note: the longest sequence here is {max(lengths):,} tokens, shorter than "
                f"--seq-length {args.seq_length:,}: a {args.seq_length:,}-token sequence is not "
                "checked (leave out --as-drawn, or add it to --lengths-file)")
    for rank, trace in report.traced.items():
        _say_trace(out, rank, trace)
    rank, worst = report.worst
    pred = report.predicted
    out.say(f"model: {pred.peak_mem_bytes / GiB:.1f} GiB at its worst rank "
            f"({pred.peak_mem_bytes / worst.peak_allocated - 1:+.1%} of the traced peak)")
    spare = (report.capacity - report.needed) / GiB
    out.say(f"{gpu.name} ({gpu.memory_gib:g} GiB, {gpu.reserve_gib:g} outside PyTorch; "
            f"{describe(gpu)}): "
            + (f"fits, {spare:.1f} GiB to spare" if report.fits
               else f"does NOT fit: rank {rank} needs {report.needed / GiB:.1f} GiB of "
                    f"{report.capacity / GiB:.1f}"))
    if not report.fits:
        suggestion = _fitting_plan(settings, lengths, world, gpu, args.stack,
                                   lambda text: out.progress(f"chunkflow memory: {text}"))
        out.say(f"the nearest plan the model finds that fits: {suggestion}" if suggestion else
                f"nothing fits on up to {64 * world:,} GPUs by the model: a shorter "
                "--seq-length, a smaller --chunk-size or a larger device")
    out.result({"model": settings.model_name, "system": settings.system, "world": world,
              "lengths": source, "num_sequences": len(lengths), "truncated": truncated,
              "longest": max(lengths), "raised_from": raised or None,
              **report.to_json()})
    return 0 if report.fits else 1


def at_seq_length(lengths: list[int], seq_length: int, keep: bool) -> tuple[list[int], int]:
    """The lengths with their longest set to `seq_length` when it is shorter (the job's worst
    case: a sequence of the full context), and the length it had (0: unchanged, or `keep`)."""
    longest = max(lengths)
    if keep or longest >= seq_length:
        return lengths, 0
    i = lengths.index(longest)
    return lengths[:i] + [seq_length] + lengths[i + 1:], longest


def _ranks_traced(ranks) -> str:
    if not ranks:
        return "the model's worst DP rank (every pipeline stage and CP rank)"
    return "rank " + ", ".join(map(str, ranks))


def _system(s) -> str:
    if not s.uses_chunkflow:
        return f"{s.system}, recompute {s.parallel.recompute}"
    c = s.chunkflow
    text = f"ChunkFlow C={c.chunk_size} K={c.num_kept}, recompute {s.parallel.recompute}"
    return text + (f", loss in pieces of {c.loss_piece}" if c.loss_piece else "")


def _say_trace(out: Output, rank: int, t) -> None:
    r = t.ranks
    out.say(f"rank {rank} (TP {r.tp_rank}/{r.tp}, CP {r.cp_rank}/{r.cp}, PP {r.pp_rank}/{r.pp}, "
            f"DP {r.dp_rank}/{r.dp}): peak {t.peak_allocated / GiB:.1f} GiB allocated, at the "
            f"{t.peak_phase} ({t.peak_where}); needs {t.needed / GiB:.1f} GiB with the caching "
            "allocator")
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in sorted(t.at_peak.items(),
                                                              key=lambda kv: -kv[1])
                      if v >= GiB / 20)
    out.say(f"  at the peak (GiB): {parts}")
    static = ", ".join(f"{k} {v / GiB:.1f}" for k, v in t.static.items() if v >= GiB / 20)
    out.say(f"  static (GiB): {static}")
    terms = ", ".join(f"{name} {b / GiB:.2f}" for name, b in t.terms[:6])
    out.say(f"  largest activations (GiB, every layer): {terms}")


def _flags(p, world: int, given_world: int) -> str:
    """The memory command's flags for prediction `p`'s plan."""
    lay = p.layout
    text = (f"--tp {lay.tp} --cp {lay.cp} --pp {lay.pp}" + (f" --vpp {lay.vpp}" if lay.vpp > 1
                                                           else "")
            + f" --recompute {lay.recompute}")
    if p.system == "chunkflow":
        text += f" --chunk-size {p.chunk_size} --chunkflow-k {p.num_kept}"
    return text + (f" --world {world}" if world != given_world else "")


def _fitting_plan(settings, lengths, world, gpu, stack, progress) -> str | None:
    """The nearest plan the analytic model says fits, from the simulator's searches: ChunkFlow's
    chunk size and K on this layout, else every layout and recompute option (and chunking) on
    these GPUs, else on twice as many, up to 64 times; a stock baseline's layout and recompute
    the same way. None when nothing fits on 64 times the GPUs."""
    from megatron_chunkflow.memtrace.report import model_hardware
    from megatron_chunkflow.memtrace.stack import get_stack
    from megatron_chunkflow.perfmodel.search import best_chunkflow, best_megatron

    hw = model_hardware(gpu, settings, get_stack(stack))
    layout = dataclasses.replace(settings.parallel,
                                 dp=world // settings.parallel.model_parallel_size)
    tries = [(world, layout)] if settings.uses_chunkflow else []
    tries += [(world * 2**i, None) for i in range(7)]
    for gpus, lay in tries:
        progress(f"searching for a plan that fits on {gpus:,} GPU(s)"
                 + (" with this layout" if lay is not None else ""))
        try:
            if settings.uses_chunkflow:
                p = best_chunkflow(lengths, settings.shape, hw, gpus, settings.seq_length, lay,
                                   auto_chunking=True, loss_piece=settings.chunkflow.loss_piece)
            else:
                p = best_megatron(lengths, settings.shape, hw, gpus, settings.seq_length,
                                  baseline=settings.system)
        except ValueError:
            continue  # no candidate layout on this many GPUs
        if p.fits:
            return (f"{_flags(p, gpus, world)} ({p.peak_mem_bytes / GiB:.1f} GiB modelled, "
                    f"{p.step_s:.2f} s a step predicted; check it with these flags)")
    return None
