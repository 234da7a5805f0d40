"""`chunkflow verify`: ChunkFlow's chunked training step against unchunked megatron-core.

    chunkflow verify                                   # tiny Qwen2.5-shaped model, float64, CPU
    chunkflow verify --chunk-size 128 --chunkflow-k 2 --dtype float32 --json
    torchrun --nproc_per_node 4 -m megatron_chunkflow verify --tp 2     # TP=2 x DP=2 (gloo on CPU)
    torchrun --nproc_per_node 2 -m megatron_chunkflow verify --pp 2 --steps 3
    torchrun --nproc_per_node 2 -m megatron_chunkflow verify --cp 2   # context parallelism
    chunkflow verify --memory --lengths 4096,16384 --chunk-size 1024 --chunkflow-k 1
    torchrun --nproc_per_node 2 -m megatron_chunkflow verify --memory --cp 2  # per rank vs CP=1
    chunkflow verify --hf-reference /models/Qwen2.5-0.5B    # against transformers, float64
    chunkflow verify --lora-rank 8                     # LoRA adapters: chunked == unchunked
    chunkflow verify --chunkflow-sparse-backward 2 --draws 64   # SpaCO (approximate)

Exit 1 when the largest relative gradient error exceeds the dtype's bound (float64 1e-10,
float32 1e-4). With --memory: activation bytes for one sequence per length, chunked and unchunked; with --cp N
(world N): per rank at CP=N against CP=1, same chunk size.
With --chunkflow-sparse-backward T: exit 1 when the mean of --draws SpaCO gradients is further from the exact
gradient than 4 x its expected error (estimated from the draws' variance), or the loss differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import torch

from megatron_chunkflow.cli.inputs import add_length_arguments, lengths_from_args
from megatron_chunkflow.cli.output import Output
from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.flags import add_config_arguments, config_from_args
from megatron_chunkflow.core.models import MODEL_SHAPES, get_model_shape, model_shape_from_dict
from megatron_chunkflow.mcore.lora import LoRAConfig
from megatron_chunkflow.runtime.sparse import SparseConfig

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_length_arguments(parser, default_sequences=32, default_scale=1 / 32)
    parser.add_argument("--min-long", type=int, default=1, metavar="N",
                        help="make sure at least N sequences are longer than the chunk size by "
                             "redrawing the last ones from the profile's tail (default: 1)")
    g = parser.add_argument_group("chunkflow")
    add_config_arguments(g, ChunkFlowConfig, defaults={"chunk_size": 256})
    g = parser.add_argument_group("model and layout")
    g.add_argument("--model", default="tiny", choices=sorted(MODEL_SHAPES),
                   help="model shape (default: tiny, Qwen2.5-shaped)")
    g.add_argument("--model-config", metavar="FILE",
                   help="JSON with ModelShape fields, or a Hugging Face Qwen2 config.json")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    g.add_argument("--hf-reference", metavar="DIR",
                   help="compare with transformers' Qwen2ForCausalLM loaded from this Hugging Face "
                        "checkpoint (float64; needs transformers) instead of megatron-core")
    add_config_arguments(g, ParallelConfig, fields=("tp", "pp", "cp", "sequence_parallel"))
    g.add_argument("--steps", type=int, default=1,
                   help="training steps to check, each a new batch (default: 1)")
    g = parser.add_argument_group("LoRA (adapters on a frozen model)")
    add_config_arguments(g, LoRAConfig, prefix="lora-", defaults={"rank": None},
                         dest_prefix="lora_")
    g = parser.add_argument_group("SpaCO sparse backward (approximate)")
    add_config_arguments(g, SparseConfig)
    g.add_argument("--draws", type=int, default=None, metavar="N",
                   help="with --chunkflow-sparse-backward: SpaCO gradients (random draws) to "
                        "average (default: 16)")
    g = parser.add_argument_group("memory")
    g.add_argument("--memory", action="store_true",
                   help="measure activation bytes for one sequence per --lengths value")
    g.add_argument("--lengths", default="4096,16384",
                   help="comma-separated lengths for --memory (default: 4096,16384)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def load_shape(args):
    """The --model preset, or --model-config FILE (our field names or an HF config.json)."""
    if not args.model_config:
        return get_model_shape(args.model)
    from megatron_chunkflow.flags import read_json_file

    path = Path(args.model_config)
    data = read_json_file(path, f"--model-config {path}")
    return model_shape_from_dict(data, f"--model-config {path}")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(ChunkFlowConfig, args)
    parallel = config_from_args(ParallelConfig, args)
    shape = load_shape(args)
    dtype = DTYPES[args.dtype]
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    parallel.check_chunk_size(cfg.chunk_size)
    parallel.check_model(shape)
    if args.memory:
        _memory_lengths(args.lengths)  # bad input stops before any process group starts
        if parallel.tp > 1 or parallel.pp > 1:
            raise ValueError("--memory measures at TP = PP = 1 (with --cp N: under torchrun "
                             "with N processes)")
    if parallel.cp > 1:
        from megatron_chunkflow.attention.backends import check_context_parallel

        check_context_parallel(cfg.attention_backend, "cpu")  # verify runs on the CPU
        for dest, flag in (("hf_reference", "--hf-reference"), ("lora_rank", "--lora-rank"),
                           ("sparse_backward", "--chunkflow-sparse-backward")):
            if getattr(args, dest, None):
                raise ValueError(f"{flag} is not checked with --context-parallel-size "
                                 f"{parallel.cp} yet; give --context-parallel-size 1")
    lora = LoRAConfig.from_args(args)
    sparse = config_from_args(SparseConfig, args)
    if sparse.enabled:
        args.draws = 16 if args.draws is None else args.draws
        _check_sparse_args(args, cfg, sparse)
    elif args.draws is not None:
        raise ValueError("--draws needs --chunkflow-sparse-backward")
    if lora is not None and args.hf_reference:
        raise ValueError("--lora-rank cannot be combined with --hf-reference")
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown

    init_distributed(parallel, args.seed)
    try:
        if args.hf_reference:
            return _run_hf(args, cfg, parallel)
        if args.memory:
            if parallel.cp > 1:
                return _run_memory_cp(args, cfg, shape, dtype, parallel.cp)
            return _run_memory(args, cfg, shape, dtype, lora)
        if sparse.enabled:
            from megatron_chunkflow.cli.verify_sparse import run_sparse_check

            return run_sparse_check(args, cfg, parallel, shape, dtype, lora,
                                    _step_lengths(args, cfg))
        return _run_check(args, cfg, parallel, shape, dtype, lora)
    finally:
        shutdown()


def _is_main() -> bool:
    return torch.distributed.get_rank() == 0


def _step_lengths(args, cfg) -> tuple[list[list[int]], str]:
    """One list of lengths per step: a lengths file repeats; a profile draws step, step+1, ..."""
    from megatron_chunkflow.core.profiles import ensure_long

    steps, source = [], ""
    for i in range(args.steps):
        args_i = argparse.Namespace(**{**vars(args), "step": args.step + i})
        lengths, source_i = lengths_from_args(args_i)
        if not args.lengths_file:
            lengths = ensure_long(lengths, args.profile, cfg.chunk_size, args.min_long,
                                  args.seed + i, args.scale)
        steps.append(lengths)
        source = source or source_i
    return steps, source + (f", {args.steps} steps" if args.steps > 1 else "")


def _check_sparse_args(args, cfg, sparse) -> None:
    """--chunkflow-sparse-backward T: one batch, checked against the exact gradient, T below its
    longest sequence's chunk count; no --memory or --hf-reference."""
    for flag in ("--memory", "--hf-reference"):
        if getattr(args, flag[2:].replace("-", "_")):
            raise ValueError(f"--chunkflow-sparse-backward cannot be combined with {flag}")
    if args.steps != 1:
        raise ValueError("--chunkflow-sparse-backward checks one batch; --steps must be 1, got "
                         f"{args.steps}")
    if args.draws < 2:
        raise ValueError(f"--draws must be >= 2 (the variance needs two draws), got {args.draws}")
    steps, _ = _step_lengths(args, cfg)
    longest = max(steps[0])
    sparse.check(-(-longest // cfg.chunk_size),
                 what=f" in this batch (longest {longest} tokens, --chunk-size {cfg.chunk_size})")


def _run_check(args, cfg, parallel, shape, dtype, lora=None) -> int:
    from megatron.core import parallel_state

    from megatron_chunkflow.runtime.meter import ActivationMeter
    from megatron_chunkflow.checks.verify import BOUNDS, run_verify

    steps, source = _step_lengths(args, cfg)
    common = dict(dtype=dtype, seed=args.seed, meter_cls=ActivationMeter, lora=lora)
    results = run_verify(shape, steps, cfg, parallel, **common)
    longest = max(max(s) for s in steps)
    multiple = math.lcm(parallel.tp, parallel.segment_multiple)
    whole = dataclasses.replace(cfg, chunk_size=longest + (-longest % multiple), k=1)
    unchunked = run_verify(shape, steps, whole, parallel, **common)
    bound = BOUNDS[dtype]
    ok = all(r.max_rel_grad_err <= bound
             and abs(r.loss_chunked - r.loss_ref) <= bound * max(1.0, abs(r.loss_ref))
             for r in results)
    dp = parallel_state.get_data_parallel_world_size()
    worst = max(results, key=lambda r: r.max_rel_grad_err)
    out = Output(args.json, quiet=not _is_main())
    n_dep = sum(1 for n in steps[0] if n > cfg.chunk_size)
    out.say(f"{len(steps[0])} sequences ({source}), {sum(steps[0]):,} tokens, {n_dep} longer than "
            f"C={cfg.chunk_size}; K={cfg.k}, {args.dtype}, TP={parallel.tp}"
            f"{' (sequence parallel)' if parallel.sequence_parallel else ''} CP={parallel.cp} "
            f"PP={parallel.pp} DP={dp}, attention {_backend(cfg)}; reference: stock Megatron at PP=1"
            + (f"; LoRA rank {lora.rank} on {lora.targets} (adapter gradients compared, base "
               "frozen)" if lora else ""))
    out.say(f"{'parameter':<58} rel. grad error (worst step)")
    for name, err in worst.param_errors:
        out.say(f"{name:<58} {err:.2e}")
    for i, r in enumerate(results):
        out.say(f"step {i}: {r.num_chunks} chunks, loss unchunked {r.loss_ref:.12f} chunked "
                f"{r.loss_chunked:.12f}, max rel. grad error {r.max_rel_grad_err:.2e}, bubble "
                f"measured {r.bubble_measured:.1%} / predicted {r.bubble_predicted:.1%}, peak "
                f"bytes per stage {r.activation_bytes_per_stage}")
    out.say(f"max relative gradient error {worst.max_rel_grad_err:.2e} ({worst.worst_param}); "
            f"bound {bound:g}: {'PASS' if ok else 'FAIL'}")
    last, last_unchunked = results[-1], unchunked[-1]
    out.say(f"activation bytes (saved for backward + K/V state), peak over stages: chunked "
            f"{max(last.activation_bytes_per_stage):,} vs unchunked "
            f"{max(last_unchunked.activation_bytes_per_stage):,}")
    out.result({
        "dtype": args.dtype, "tp": parallel.tp, "cp": parallel.cp, "pp": parallel.pp, "dp": dp,
        "sequence_parallel": parallel.sequence_parallel,
        "chunk_size": cfg.chunk_size, "k": cfg.k, "lora": _lora_json(lora),
        "loss_ref": worst.loss_ref, "loss_chunked": worst.loss_chunked,
        "max_rel_grad_err": worst.max_rel_grad_err, "worst_param": worst.worst_param,
        "activation_bytes": {"chunked": max(last.activation_bytes_per_stage),
                             "unchunked": max(last_unchunked.activation_bytes_per_stage)},
        "activation_bytes_per_stage": last.activation_bytes_per_stage,
        "state_bytes_per_stage": last.state_bytes_per_stage,
        "bubble_ratio": {"measured": last.bubble_measured, "predicted": last.bubble_predicted},
        "steps": [{"num_chunks": r.num_chunks, "loss_ref": r.loss_ref,
                   "loss_chunked": r.loss_chunked, "max_rel_grad_err": r.max_rel_grad_err}
                  for r in results],
        "passed": ok,
    })
    return 0 if ok else 1


def _run_hf(args, cfg, parallel) -> int:
    from megatron.core import parallel_state

    from megatron_chunkflow.checks.hf_verify import run_hf_verify

    steps, source = _step_lengths(args, cfg)
    r = run_hf_verify(args.hf_reference, steps[0], cfg, parallel, args.seed)
    ok = r.max_rel_grad_err <= 1e-10
    out = Output(args.json, quiet=not _is_main())
    out.say(f"{len(steps[0])} sequences ({source}); C={cfg.chunk_size} K={cfg.k}, float64, "
            f"TP={parallel.tp} PP={parallel.pp}; reference: transformers Qwen2ForCausalLM from "
            f"{args.hf_reference}, unchunked")
    for name, err in r.param_errors:
        out.say(f"{name:<58} {err:.2e}")
    out.say(f"loss: transformers {r.loss_ref:.12f}  chunked {r.loss_chunked:.12f}")
    out.say(f"max relative gradient error {r.max_rel_grad_err:.2e} ({r.worst_param}); bound 1e-10: "
            f"{'PASS' if ok else 'FAIL'}")
    out.result({"dtype": "float64", "tp": parallel.tp, "pp": parallel.pp,
                "dp": parallel_state.get_data_parallel_world_size(), "chunk_size": cfg.chunk_size,
                "k": cfg.k, "loss_ref": r.loss_ref, "loss_chunked": r.loss_chunked,
                "max_rel_grad_err": r.max_rel_grad_err, "worst_param": r.worst_param,
                "reference": "transformers", "passed": ok})
    return 0 if ok else 1


def _backend(cfg) -> str:
    """The attention kernel --attention-backend stands for on this machine's CPU."""
    from megatron_chunkflow.attention import resolve_backend

    return resolve_backend(cfg.attention_backend, "cpu")


MEMORY_MAX_LENGTH = 1 << 20


def _memory_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lengths {text!r}: expected comma-separated integers") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths {text!r}: lengths must be positive")
    if max(lengths) > MEMORY_MAX_LENGTH:  # each runs through the real model on this machine
        raise ValueError(f"--lengths {text!r}: {max(lengths):,} tokens is more than the "
                         f"{MEMORY_MAX_LENGTH:,} the memory check runs")
    return lengths


def _lora_json(lora) -> dict | None:
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.target_names)}


def _run_memory(args, cfg, shape, dtype, lora=None) -> int:
    from megatron_chunkflow.checks.memory import measure_one_sequence

    lengths = _memory_lengths(args.lengths)
    rows = []
    out = Output(args.json, quiet=not _is_main())
    out.say(f"one sequence per length; C={cfg.chunk_size}, K={cfg.k}, {args.dtype}, "
            f"attention {_backend(cfg)}; bytes saved for backward (no weights) and K/V state"
            + (f"; LoRA rank {lora.rank} on {lora.targets}, base frozen" if lora else ""))
    out.say(f"{'length':>8} {'chunked':>14} {'unchunked':>14} {'state':>14} {'state formula':>14}")
    for n in lengths:
        chunked = measure_one_sequence(shape, n, cfg, dtype, lora=lora)
        unchunked = measure_one_sequence(shape, n, dataclasses.replace(cfg, chunk_size=n, k=1),
                                         dtype, lora=lora)
        row = {"length": n, "chunked_bytes": chunked.activation, "unchunked_bytes":
               unchunked.activation + unchunked.state, "state_bytes": chunked.state,
               "state_formula_bytes": chunked.state_formula}
        rows.append(row)
        formula = "n/a (K > 1)" if row["state_formula_bytes"] is None else \
            f"{row['state_formula_bytes']:,.0f}"
        out.say(f"{n:>8} {row['chunked_bytes']:>14,} {row['unchunked_bytes']:>14,} "
                f"{row['state_bytes']:>14,} {formula:>14}")
    out.result({"chunk_size": cfg.chunk_size, "k": cfg.k, "dtype": args.dtype,
                "lora": _lora_json(lora), "rows": rows})
    return 0


def _run_memory_cp(args, cfg, shape, dtype, cp: int) -> int:
    """Per rank, peak activation + K/V state bytes of one sequence at CP = `cp` against CP = 1
    (each rank of the world runs it alone), same chunk size: the largest over the ranks."""
    from megatron_chunkflow.checks.memory import measure_one_sequence
    from megatron_chunkflow.runtime.p2p import comm_device
    from megatron_chunkflow.mcore.dist import init_distributed

    lengths = _memory_lengths(args.lengths)
    world = torch.distributed.get_world_size()
    if world != cp:
        raise ValueError(f"--memory --cp {cp} runs in {cp} processes (torchrun --nproc_per_node "
                         f"{cp}), got {world}")
    out = Output(args.json, quiet=not _is_main())
    out.say(f"one sequence per length; C={cfg.chunk_size}, K={cfg.k}, {args.dtype}, attention "
            f"{_backend(cfg)}; peak bytes saved for backward (no weights) plus K/V state, the "
            f"largest rank's")
    out.say(f"{'length':>8} {'CP=1':>14} {f'CP={cp}':>14} {'ratio':>7} {'state CP=1':>14} "
            f"{f'state CP={cp}':>14} {'gathered':>14} {'reduce-scat.':>14}")
    rows = []
    for n in lengths:
        measured = []
        for size in (1, cp):
            init_distributed(ParallelConfig(cp=size), args.seed)
            row = measure_one_sequence(shape, n, cfg, dtype, seed=args.seed, cp=size)
            peaks = torch.tensor([row.total, row.state, row.cp_gathered,
                                  row.cp_reduce_scattered], dtype=torch.float64,
                                 device=comm_device())
            torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
            measured.append([int(x) for x in peaks.tolist()])
        (one, one_state, _, _), (many, many_state, gathered, scattered) = measured
        rows.append({"length": n, "cp1_bytes": one, f"cp{cp}_bytes": many,
                     "ratio": many / one, "cp1_state_bytes": one_state,
                     f"cp{cp}_state_bytes": many_state, "cp_gathered_bytes": gathered,
                     "cp_reduce_scattered_bytes": scattered})
        out.say(f"{n:>8} {one:>14,} {many:>14,} {many / one:>7.3f} {one_state:>14,} "
                f"{many_state:>14,} {gathered:>14,} {scattered:>14,}")
    out.say(f"gathered / reduce-scat.: bytes one CP={cp} rank received in the step's K/V "
            "all-gathers and dK/dV reduce-scatters (every layer, forwards and backwards)")
    out.result({"chunk_size": cfg.chunk_size, "k": cfg.k, "dtype": args.dtype, "cp": cp,
                "rows": rows})
    return 0
