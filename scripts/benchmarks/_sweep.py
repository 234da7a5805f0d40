"""Shared by sweep_chunk_size.py and sweep_chunk_k.py: flags, the job, the table files."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_chunkflow.bench.sweep import MIB, markdown_table  # noqa: E402


def parse(description: str, argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--long", type=int, default=16384,
                    help="the long sequence's length (default: 16384)")
    ap.add_argument("--num-short", type=int, default=63,
                    help="profile-B sequences beside it (default: 63)")
    ap.add_argument("--scale", type=float, default=1 / 8,
                    help="profile-B length scale (default: 1/8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="tiny-bench")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages = processes (default: 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--attention-backend", default="auto",
                    help="both systems' kernel (default: auto, cpu_flash on CPU)")
    ap.add_argument("--out", default="out/bench", help="directory for .md, .csv, .json, .png")
    return ap.parse_args(argv)


def lengths(args) -> list[int]:
    from megatron_chunkflow.core.profiles import sample_lengths

    return [args.long] + sample_lengths("B", args.num_short, args.seed, scale=args.scale)


def _job(settings, configs):
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    import torch.distributed as dist

    from megatron_chunkflow.bench.sweep import sweep
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown

    job = init_distributed(settings.parallel, settings.seed)
    rank0 = dist.get_rank() == 0
    try:
        return sweep(settings, job, configs,
                     lambda text: rank0 and print(text, file=sys.stderr, flush=True))
    finally:
        shutdown()


def run(args, configs: list[dict], name: str, title: str) -> tuple[list[dict], Path]:
    """Measure `configs` on a PP = args.pp job; write NAME.md, .csv, .json; return the rows."""
    from megatron_chunkflow.bench.settings import BenchSettings
    from megatron_chunkflow.config import ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.mcore.dist import run_processes

    seqs = lengths(args)
    settings = BenchSettings(
        shape=get_model_shape(args.model), model_name=args.model, lengths=seqs,
        seq_length=max(seqs + [c.get("chunk_size") or 0 for c in configs]),
        budget_bytes=float("inf"),
        parallel=ParallelConfig(pp=args.pp, dp=1), warmup=args.warmup, repeats=args.repeats,
        attention_backend=args.attention_backend, seed=args.seed,
        threads=max(1, (os.cpu_count() or 1) // args.pp))
    rows = run_processes(_job, args.pp, settings, configs)[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"{title}: {args.model}, PP={args.pp}, float32, {args.attention_backend} attention; "
              f"one sequence of {args.long} tokens + {args.num_short} profile-B sequences (scale "
              f"{args.scale:g}, seed {args.seed}), {sum(seqs):,} tokens; median of "
              f"{args.repeats} step(s) after {args.warmup} warm-up")
    table = [header, "", *markdown_table(rows)]
    (out / f"{name}.md").write_text("\n".join(table) + "\n")
    (out / f"{name}.json").write_text(json.dumps({"setup": header, "rows": rows}, indent=1))
    keys = ["system", "chunk_size", "k", "recompute", "num_microbatches", "peak_bytes",
            "modelled_peak_bytes", "step_s"]
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys + [f"activation_bytes_stage{s}" for s in range(args.pp)]
                   + [f"state_bytes_stage{s}" for s in range(args.pp)])
        for r in rows:
            w.writerow([r.get(k, "") for k in keys] + r["activation_bytes_per_stage"]
                       + r["state_bytes_per_stage"])
    print("\n".join(table))
    return rows, out


def stacked(ax, labels, rows) -> None:
    """Bars: activations and K/V state (worst stage) per row, in MiB."""
    act = [max(r["activation_bytes_per_stage"]) / MIB for r in rows]
    state = [max(r["state_bytes_per_stage"]) / MIB for r in rows]
    ax.bar(labels, act, color="#4c78a8", label="activations (saved for backward)")
    ax.bar(labels, state, bottom=act, color="#f58518", label="K/V state")
    ax.set_ylabel("peak per rank (MiB)")
