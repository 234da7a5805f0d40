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
The flags fill checks/settings.py's VerifySettings, which checks how they combine.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from megatron_chunkflow import compat
from megatron_chunkflow.checks.settings import VerifySettings
from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.console import Output
from megatron_chunkflow.core.lengths import LengthsConfig
from megatron_chunkflow.core.hf_config import load_model_shape
from megatron_chunkflow.core.models import MODEL_SHAPES
from megatron_chunkflow.flags import MAX_COUNT, Bounded, add_config_arguments, config_from_args
from megatron_chunkflow.mcore.lora import LoRAConfig
from megatron_chunkflow.mcore.settings import add_model_class_argument
from megatron_chunkflow.runtime.sparse import SparseConfig

DTYPES = {"float64": torch.float64, "float32": torch.float32}
# the embedded scenario (README, "Defaults"): a tiny model, 32 profile-B sequences scaled by 1/32
SCENARIO = dict(model="tiny", global_batch_size=32, scale=1 / 32, min_long=1, chunk_size=256,
                dtype="float64")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sequence lengths")
    add_config_arguments(g, LengthsConfig, defaults={k: SCENARIO[k] for k in (
        "scale", "min_long")}, default_help={"profile": "B", "global_batch_size":
                                            SCENARIO["global_batch_size"]})
    g = parser.add_argument_group("chunkflow")
    add_config_arguments(g, ChunkFlowConfig, defaults={"chunk_size": SCENARIO["chunk_size"]})
    g = parser.add_argument_group("model and layout")
    g.add_argument("--model", default=SCENARIO["model"], choices=sorted(MODEL_SHAPES),
                   help=f"model shape (default: {SCENARIO['model']}, Qwen2.5-shaped)")
    g.add_argument("--model-config", metavar="FILE",
                   help="JSON with ModelShape fields, or a Hugging Face config.json (Qwen2/2.5, "
                        "Qwen3, Llama 3.x, Mistral)")
    add_model_class_argument(g)
    g.add_argument("--dtype", choices=sorted(DTYPES), default=SCENARIO["dtype"],
                   help=f"precision of both runs (default: {SCENARIO['dtype']})")
    g.add_argument("--hf-reference", metavar="DIR",
                   help="compare with transformers' own model class loaded from this Hugging Face "
                        "checkpoint (float64; needs transformers) instead of megatron-core")
    add_config_arguments(g, ParallelConfig, fields=("tp", "pp", "vpp", "cp", "ep", "etp",
                                                    "sequence_parallel", "recompute"))
    g.add_argument("--steps", type=int, action=Bounded, bounds=(1, MAX_COUNT), default=1,
                   help="training steps to check, each a new batch (default: 1)")
    g = parser.add_argument_group("LoRA (adapters on a frozen model)")
    add_config_arguments(g, LoRAConfig, prefix="lora-", defaults={"rank": None},
                         dest_prefix="lora_")
    g = parser.add_argument_group("SpaCO sparse backward (approximate)")
    add_config_arguments(g, SparseConfig)
    g.add_argument("--draws", type=int, action=Bounded, bounds=(2, MAX_COUNT),
                   default=None, metavar="N",
                   help="with --chunkflow-sparse-backward: SpaCO gradients (random draws) to "
                        "average (default: 16)")
    g = parser.add_argument_group("memory")
    g.add_argument("--memory", action="store_true",
                   help="measure activation bytes for one sequence per --lengths value")
    g.add_argument("--lengths", default=None,
                   help="comma-separated lengths for --memory (default: 4096,16384)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def settings_from_args(args: argparse.Namespace) -> VerifySettings:
    if args.lengths is not None and not args.memory:
        raise ValueError(f"--lengths {args.lengths}: the sequences of the --memory check, and "
                         "this run has no --memory; add it, or give the checked batch's lengths "
                         "with --lengths-file FILE (one length per line)")
    return VerifySettings(
        shape=load_model_shape(args.model, args.model_config),
        lengths=config_from_args(LengthsConfig, args),
        chunkflow=config_from_args(ChunkFlowConfig, args),
        parallel=config_from_args(ParallelConfig, args), dtype=args.dtype, steps=args.steps,
        lora=LoRAConfig.from_args(args), sparse=config_from_args(SparseConfig, args),
        draws=args.draws, memory=(args.lengths or "4096,16384") if args.memory else None,
        hf_reference=args.hf_reference, default_batch=SCENARIO["global_batch_size"],
        model_class=args.model_class)


def run(args: argparse.Namespace) -> int:
    s = settings_from_args(args)
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.memtrace.guard import check_host_memory, host_memory_of_job

    # the chunked model and the unchunked reference, each with its gradients and Adam's states
    check_host_memory(s.shape, args.model_config or args.model, s.dtype, s.parallel,
                      *host_memory_of_job(), copies=2)

    job = init_distributed(s.parallel, s.lengths.seed)
    try:
        return {"hf": _run_hf, "memory": _run_memory, "memory_cp": _run_memory_cp,
                "sparse": _run_sparse, "exact": _run_check}[s.mode](s, job, args.json)
    finally:
        shutdown()


def _is_main() -> bool:
    return torch.distributed.get_rank() == 0


def _run_check(s: VerifySettings, job, as_json: bool) -> int:
    from megatron_chunkflow.checks.verify import BOUNDS, run_verify
    from megatron_chunkflow.runtime.meter import ActivationMeter

    cfg, parallel, lora, shape = s.chunkflow, s.parallel, s.lora, s.shape
    steps, source = s.step_lengths()
    common = dict(dtype=DTYPES[s.dtype], seed=s.lengths.seed, meter_cls=ActivationMeter,
                  lora=lora, model_class=s.model_class)
    results = run_verify(shape, steps, cfg, parallel, **common)
    longest = max(max(lengths) for lengths in steps)
    multiple = math.lcm(parallel.tp, parallel.chunk_multiple)  # one chunk per sequence
    whole = dataclasses.replace(cfg, chunk_size=longest + (-longest % multiple), num_kept=1)
    unchunked = run_verify(shape, steps, whole, parallel, **common)
    bound = BOUNDS[DTYPES[s.dtype]]
    ok = all(r.max_rel_grad_err <= bound
             and abs(r.loss_chunked - r.loss_ref) <= bound * max(1.0, abs(r.loss_ref))
             and _balance_agrees(r) for r in results)
    dp = job.ranks.dp
    worst = max(results, key=lambda r: r.max_rel_grad_err)
    out = Output(as_json, quiet=not _is_main())
    n_dep = sum(1 for n in steps[0] if n > cfg.chunk_size)
    out.say(f"{len(steps[0])} sequences ({source}), {sum(steps[0]):,} tokens, {n_dep} longer than "
            f"C={cfg.chunk_size}; K={cfg.num_kept}, {s.dtype}, TP={parallel.tp}"
            f"{' (sequence parallel)' if parallel.sequence_parallel else ''} CP={parallel.cp} "
            f"PP={parallel.pp} DP={dp}, attention {_backend(cfg)}, {_class_name(s)}; reference: "
            "stock Megatron at PP=1"
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
        if r.balance_ref is not None:  # MoE (runtime/moe.py); float32 in Megatron's tracker
            out.say(f"step {i}: balancing loss (seq_aux_loss / coefficient, over layers) "
                    f"unchunked {r.balance_ref:.7g} chunked {r.balance_chunked:.7g} (bound "
                    f"{BALANCE_BOUND:g} relative, Megatron computes it in float32)")
    out.say(f"max relative gradient error {worst.max_rel_grad_err:.2e} ({worst.worst_param}); "
            f"bound {bound:g}: {'PASS' if ok else 'FAIL'}")
    last, last_unchunked = results[-1], unchunked[-1]
    out.say(f"activation bytes (saved for backward + K/V state), peak over stages: chunked "
            f"{max(last.activation_bytes_per_stage):,} vs unchunked "
            f"{max(last_unchunked.activation_bytes_per_stage):,}")
    out.result({
        "dtype": s.dtype, "tp": parallel.tp, "cp": parallel.cp, "pp": parallel.pp,
        "vpp": parallel.vpp, "dp": dp, "sequence_parallel": parallel.sequence_parallel,
        "chunk_size": cfg.chunk_size, "k": cfg.num_kept, "lora": _lora_json(lora),
        "model_class": s.model_class, "megatron_core": compat.version_text(),
        "loss_ref": worst.loss_ref, "loss_chunked": worst.loss_chunked,
        "max_rel_grad_err": worst.max_rel_grad_err, "worst_param": worst.worst_param,
        "activation_bytes": {"chunked": max(last.activation_bytes_per_stage),
                             "unchunked": max(last_unchunked.activation_bytes_per_stage)},
        "activation_bytes_per_stage": last.activation_bytes_per_stage,
        "state_bytes_per_stage": last.state_bytes_per_stage,
        "bubble_ratio": {"measured": last.bubble_measured, "predicted": last.bubble_predicted},
        "steps": [{"num_chunks": r.num_chunks, "loss_ref": r.loss_ref,
                   "loss_chunked": r.loss_chunked, "max_rel_grad_err": r.max_rel_grad_err,
                   **({"balancing_loss_ref": r.balance_ref,
                       "balancing_loss_chunked": r.balance_chunked}
                      if r.balance_ref is not None else {})}
                  for r in results],
        "passed": ok,
    })
    return 0 if ok else 1


def _run_hf(s: VerifySettings, job, as_json: bool) -> int:
    from megatron_chunkflow.checks.hf_verify import run_hf_verify

    cfg, parallel = s.chunkflow, s.parallel
    steps, source = s.step_lengths()
    r = run_hf_verify(s.hf_reference, steps[0], cfg, parallel, s.lengths.seed, s.model_class)
    ok = r.max_rel_grad_err <= 1e-10
    out = Output(as_json, quiet=not _is_main())
    out.say(f"{len(steps[0])} sequences ({source}); C={cfg.chunk_size} K={cfg.num_kept}, float64, "
            f"TP={parallel.tp} PP={parallel.pp}; reference: transformers' model from "
            f"{s.hf_reference}, unchunked")
    for name, err in r.param_errors:
        out.say(f"{name:<58} {err:.2e}")
    out.say(f"loss: transformers {r.loss_ref:.12f}  chunked {r.loss_chunked:.12f}")
    out.say(f"max relative gradient error {r.max_rel_grad_err:.2e} ({r.worst_param}); bound 1e-10: "
            f"{'PASS' if ok else 'FAIL'}")
    out.result({"dtype": "float64", "tp": parallel.tp, "pp": parallel.pp,
                "dp": job.ranks.dp, "chunk_size": cfg.chunk_size,
                "k": cfg.num_kept, "loss_ref": r.loss_ref, "loss_chunked": r.loss_chunked,
                "max_rel_grad_err": r.max_rel_grad_err, "worst_param": r.worst_param,
                "reference": "transformers", "passed": ok})
    return 0 if ok else 1


def _class_name(s: VerifySettings) -> str:
    """"HybridModel of megatron-core 0.19.2"."""
    name = "HybridModel" if s.model_class == "hybrid" else "GPTModel"
    return f"{name} of megatron-core {compat.version_text()}"


BALANCE_BOUND = 1e-6  # MoE balancing loss: Megatron sums it in float32


def _balance_agrees(r) -> bool:
    """An MoE step's per-sequence balancing loss equals the reference's (dense: nothing to
    compare)."""
    if r.balance_ref is None:
        return True
    return abs(r.balance_chunked - r.balance_ref) <= BALANCE_BOUND * abs(r.balance_ref)


def _backend(cfg) -> str:
    """The attention kernel --attention-backend stands for on this machine's CPU."""
    from megatron_chunkflow.attention import resolve_backend

    return resolve_backend(cfg.attention_backend, "cpu")


def _lora_json(lora) -> dict | None:
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.target_names)}


def _run_memory(s: VerifySettings, job, as_json: bool) -> int:
    from megatron_chunkflow.checks.memory import measure_one_sequence

    cfg, shape, dtype, lora = s.chunkflow, s.shape, DTYPES[s.dtype], s.lora
    rc = s.parallel.recompute
    rows = []
    out = Output(as_json, quiet=not _is_main())
    out.say(f"one sequence per length; C={cfg.chunk_size}, K={cfg.num_kept}, {s.dtype}, "
            f"attention {_backend(cfg)}; bytes saved for backward (no weights) and K/V state"
            + (f"; LoRA rank {lora.rank} on {lora.targets}, base frozen" if lora else "")
            + _recompute_note(rc))
    out.say(f"{'length':>8} {'chunked':>14} {'unchunked':>14} {'state':>14} {'state formula':>14}")
    for n in s.memory_lengths:
        chunked = measure_one_sequence(job, shape, n, cfg, dtype, lora=lora,
                                       model_class=s.model_class)
        whole = dataclasses.replace(cfg, chunk_size=n, num_kept=1)
        unchunked = measure_one_sequence(job, shape, n, whole, dtype, lora=lora,
                                         model_class=s.model_class)
        row = {"length": n, "chunked_bytes": chunked.activation, "unchunked_bytes":
               unchunked.activation + unchunked.state, "state_bytes": chunked.state,
               "state_formula_bytes": chunked.state_formula}
        rows.append(row)
        formula = "n/a" if row["state_formula_bytes"] is None else \
            f"{row['state_formula_bytes']:,.0f}"
        out.say(f"{n:>8} {row['chunked_bytes']:>14,} {row['unchunked_bytes']:>14,} "
                f"{row['state_bytes']:>14,} {formula:>14}")
    out.result({"chunk_size": cfg.chunk_size, "k": cfg.num_kept, "dtype": s.dtype,
                "lora": _lora_json(lora), **_recompute_json(rc), "rows": rows})
    return 0


def _recompute_note(recompute) -> str:
    return "" if recompute.kind == "none" else f"; Megatron's recompute {recompute} in each chunk"


def _recompute_json(recompute) -> dict:
    """{"recompute": its text form} unless none (the memory JSON had no such key before)."""
    return {} if recompute.kind == "none" else {"recompute": str(recompute)}


def _run_memory_cp(s: VerifySettings, job, as_json: bool) -> int:
    """Per rank, peak activation + K/V state bytes of one sequence at CP = `cp` against CP = 1
    (each rank of the world runs it alone), same chunk size: the largest over the ranks."""
    from megatron_chunkflow.checks.memory import measure_one_sequence
    from megatron_chunkflow.mcore.dist import init_distributed
    from megatron_chunkflow.runtime.p2p import comm_device

    cfg, shape, dtype, cp = s.chunkflow, s.shape, DTYPES[s.dtype], s.parallel.cp
    seed = s.lengths.seed
    world = torch.distributed.get_world_size()
    if world != cp:
        raise ValueError(f"--memory --cp {cp} runs in {cp} processes (torchrun --nproc_per_node "
                         f"{cp}), got {world}")
    out = Output(as_json, quiet=not _is_main())
    out.say(f"one sequence per length; C={cfg.chunk_size}, K={cfg.num_kept}, {s.dtype}, attention "
            f"{_backend(cfg)}; peak bytes saved for backward (no weights) plus K/V state, the "
            f"largest rank's" + _recompute_note(s.parallel.recompute))
    out.say(f"{'length':>8} {'CP=1':>14} {f'CP={cp}':>14} {'ratio':>7} {'state CP=1':>14} "
            f"{f'state CP={cp}':>14} {'gathered':>14} {'reduce-scat.':>14}")
    rows = []
    for n in s.memory_lengths:
        measured = []
        for size in (1, cp):
            layout = ParallelConfig(cp=size, recompute=s.parallel.recompute)
            row = measure_one_sequence(init_distributed(layout, seed), shape, n, cfg, dtype,
                                       seed=seed, model_class=s.model_class)
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
    out.result({"chunk_size": cfg.chunk_size, "k": cfg.num_kept, "dtype": s.dtype, "cp": cp,
                **_recompute_json(s.parallel.recompute), "rows": rows})
    return 0


FACTOR = 4.0  # pass if rel_err_of_mean <= FACTOR * expected_rel_err


def _run_sparse(s: VerifySettings, job, as_json: bool) -> int:
    """SpaCO is approximate: each draw's gradient differs from the exact one; their expectation
    is the exact gradient (docs/sparse.md). The check prints the relative error of the mean after
    1, 4, 16, ... draws (it should fall like 1 / sqrt(draws)) and passes when the final error is
    within FACTOR x the error expected from the draws' own variance, sqrt(trace Var / N) / ||g||,
    and the loss value (every chunk runs forward) equals the exact loss."""
    from megatron_chunkflow.checks.sparse_verify import run_sparse_verify
    from megatron_chunkflow.checks.verify import BOUNDS

    cfg, parallel, lora, dtype = s.chunkflow, s.parallel, s.lora, DTYPES[s.dtype]
    steps, source = s.step_lengths()
    lengths = steps[0]
    t = s.sparse.sparse_backward
    r = run_sparse_verify(s.shape, lengths, cfg, t, s.draws, dtype, seed=s.lengths.seed,
                          parallel=parallel, lora=lora, model_class=s.model_class)
    bound = BOUNDS[dtype]
    loss_ok = abs(r.loss_sparse - r.loss_ref) <= bound * max(1.0, abs(r.loss_ref))
    ok = loss_ok and r.rel_err_of_mean <= FACTOR * r.expected_rel_err
    dp = job.ranks.dp
    out = Output(as_json, quiet=not _is_main())
    out.say(f"APPROXIMATE (SpaCO): {len(lengths)} sequences ({source}), {sum(lengths):,} tokens; "
            f"C={cfg.chunk_size} K={cfg.num_kept}, {s.dtype}, TP={parallel.tp} PP={parallel.pp} "
            f"DP={dp}"
            + (f", LoRA rank {lora.rank}" if lora else "")
            + f"; T={t}: each dependent chunk of a k-chunk sequence back-propagated with "
            f"probability min(1, {t}/k), weighted by its inverse")
    out.say(f"{r.num_dependent} dependent chunks per draw, {r.backward_fraction:.1%} "
            f"back-propagated on average; exact gradient: stock Megatron at PP=1")
    out.say(f"loss: exact {r.loss_ref:.12f}  SpaCO {r.loss_sparse:.12f} "
            f"({'equal' if loss_ok else 'DIFFERENT'}: every chunk runs forward)")
    out.say(f"one draw: relative RMS error {r.rel_std:.3f}")
    out.say(f"{'draws':>8} {'rel. error of the mean':>24}")
    for n, err in r.curve:
        out.say(f"{n:>8} {err:>24.4f}")
    out.say(f"rel. error of the mean {r.rel_err_of_mean:.4f}, expected from the draws' variance "
            f"{r.expected_rel_err:.4f}; bound {FACTOR:g} x expected: {'PASS' if ok else 'FAIL'}")
    out.result({
        "approximate": True, "dtype": s.dtype, "tp": parallel.tp, "pp": parallel.pp, "dp": dp,
        "chunk_size": cfg.chunk_size, "k": cfg.num_kept, "lora": _lora_json(lora),
        "model_class": s.model_class, "megatron_core": compat.version_text(),
        "loss_ref": r.loss_ref, "loss_sparse": r.loss_sparse,
        "sparse": {"t": t, "draws": r.draws, "rel_err_of_mean": r.rel_err_of_mean,
                   "expected_rel_err": r.expected_rel_err, "rel_std_one_draw": r.rel_std,
                   "curve": [{"draws": n, "rel_err_of_mean": e} for n, e in r.curve],
                   "backward_fraction": r.backward_fraction},
        "passed": ok,
    })
    return 0 if ok else 1
