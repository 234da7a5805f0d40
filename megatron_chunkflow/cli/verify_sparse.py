"""`chunkflow verify --chunkflow-sparse-backward T --draws N`: SpaCO's mean gradient against the
exact one.

    chunkflow verify --chunkflow-sparse-backward 2 --draws 64 --json
    torchrun --nproc_per_node 2 -m megatron_chunkflow verify --tp 2 --sequence-parallel \
        --chunkflow-sparse-backward 2 --draws 16

SpaCO is approximate: each draw's gradient differs from the exact one; their expectation is the
exact gradient (docs/sparse.md). The check prints the relative error of the mean after 1, 4, 16,
... draws (it should fall like 1 / sqrt(draws)) and passes when the final error is within 4x the
error expected from the draws' own variance, sqrt(trace Var / N) / ||g||, and the loss value
(every chunk runs forward) equals the exact loss.
"""

from __future__ import annotations

from megatron_chunkflow.cli.output import Output

FACTOR = 4.0  # pass if rel_err_of_mean <= FACTOR * expected_rel_err


def run_sparse_check(args, cfg, parallel, shape, dtype, lora, step_lengths) -> int:
    import torch

    from megatron_chunkflow.checks.sparse_verify import run_sparse_verify
    from megatron_chunkflow.checks.verify import BOUNDS

    steps, source = step_lengths
    lengths = steps[0]
    t = args.sparse_backward
    r = run_sparse_verify(shape, lengths, cfg, t, args.draws, dtype, seed=args.seed,
                          parallel=parallel, lora=lora)
    bound = BOUNDS[dtype]
    loss_ok = abs(r.loss_sparse - r.loss_ref) <= bound * max(1.0, abs(r.loss_ref))
    ok = loss_ok and r.rel_err_of_mean <= FACTOR * r.expected_rel_err
    dp = torch.distributed.get_world_size() // parallel.model_parallel_size
    out = Output(args.json, quiet=torch.distributed.get_rank() != 0)
    out.say(f"APPROXIMATE (SpaCO): {len(lengths)} sequences ({source}), {sum(lengths):,} tokens; "
            f"C={cfg.chunk_size} K={cfg.k}, {args.dtype}, TP={parallel.tp} PP={parallel.pp} DP={dp}"
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
        "approximate": True, "dtype": args.dtype, "tp": parallel.tp, "pp": parallel.pp, "dp": dp,
        "chunk_size": cfg.chunk_size, "k": cfg.k,
        "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha,
                                           "targets": list(lora.target_names)},
        "loss_ref": r.loss_ref, "loss_sparse": r.loss_sparse,
        "sparse": {"t": t, "draws": r.draws, "rel_err_of_mean": r.rel_err_of_mean,
                   "expected_rel_err": r.expected_rel_err, "rel_std_one_draw": r.rel_std,
                   "curve": [{"draws": n, "rel_err_of_mean": e} for n, e in r.curve],
                   "backward_fraction": r.backward_fraction},
        "passed": ok,
    })
    return 0 if ok else 1
