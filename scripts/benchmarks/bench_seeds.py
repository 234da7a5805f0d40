"""`chunkflow bench` over global batch sizes and seeds: median and range of ChunkFlow's speedup and
activation-memory ratio against every baseline (CPU; ~30 minutes on 2 cores with the defaults).

    python scripts/benchmarks/bench_seeds.py                      # out/bench/bench_seeds.*
    python scripts/benchmarks/bench_seeds.py --global-batch-sizes 128,256 --seeds 0,1 \\
        -- --baseline megatron-packed --chunkflow-budget-mib 400   # anything after -- goes to bench

Each (global batch size, seed) is one `chunkflow bench --json` run in a fresh process (the default
scenario with that batch: profile B drawn with that seed, scaled to the 32K context, at least one
sequence longer than 4K), so every row is a complete comparison with its own calibration and
budget choices. Before each run the script waits (up to --wait minutes) for the 1-minute load
average to fall below --max-load, and every row records the load it ran under. Writes
bench_seeds.json (every run's summary) and bench_seeds.md (a table per global batch size).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIB = 2.0**20


def parse(argv=None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--global-batch-sizes", default="64,128,256", metavar="N,N,...")
    p.add_argument("--seeds", default="0,1,2", metavar="S,S,...")
    p.add_argument("--out", default="out/bench", metavar="DIR")
    p.add_argument("--max-load", type=float, default=2.0,
                   help="wait for the 1-minute load average to fall below this (default: 2)")
    p.add_argument("--wait", type=float, default=10.0, metavar="MIN",
                   help="longest wait for the load before running anyway, said in the row")
    args = p.parse_args(argv)
    try:
        args.batches = [int(x) for x in args.global_batch_sizes.split(",")]
        args.seed_list = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        p.error("--global-batch-sizes and --seeds take comma-separated integers")
    if min(args.batches) < 1:
        p.error(f"--global-batch-sizes must be >= 1, got {args.global_batch_sizes}")
    return args, extra


def wait_for_load(max_load: float, minutes: float) -> float:
    deadline = time.monotonic() + 60 * minutes
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(15)
    return os.getloadavg()[0]


def run_one(batch: int, seed: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "megatron_chunkflow", "bench", "--json",
           "--global-batch-size", str(batch), "--seed", str(seed), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench_seeds: {' '.join(cmd[2:])} exited {done.returncode}:\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def summary(batch: int, seed: int, load_before: float, r: dict) -> dict:
    cf, st = r["chunkflow"], r["setup"]
    return {
        "global_batch_size": batch, "seed": seed, "tokens": st["tokens"],
        "longest": st["longest"], "load_before": load_before,
        "load_average_1min": st["load_average_1min"],
        "speedups": r["speedups"], "activation_memory_ratios": r["activation_memory_ratios"],
        "step_s": {b: x["step_s"] for b, x in r["baselines"].items()} | {
            "chunkflow": cf["step_s"]},
        "recompute": {b: x["recompute"] for b, x in r["baselines"].items()} | {
            "chunkflow": cf["recompute"]},
        "chunk_size": cf["chunk_size"], "k": cf["k"], "not_run": r.get("not_run", {}),
    }


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"
            if values else "-")


def markdown(rows: list[dict], extra: list[str]) -> list[str]:
    baselines = list(dict.fromkeys(b for r in rows for b in r["speedups"]))
    lines = [f"`chunkflow bench {' '.join(extra)}` per global batch size over seeds "
             f"{sorted({r['seed'] for r in rows})}: median (min-max)", "",
             "| global batch | tokens (median) | "
             + " | ".join(f"speedup vs {b} | memory ratio vs {b}" for b in baselines)
             + " | ChunkFlow C / K / recompute | load (max) |",
             "|---" * (4 + 2 * len(baselines)) + "|"]
    for batch in sorted({r["global_batch_size"] for r in rows}):
        mine = [r for r in rows if r["global_batch_size"] == batch]
        cells = []
        for b in baselines:
            cells.append(_spread([r["speedups"][b] for r in mine if b in r["speedups"]]))
            cells.append(_spread([r["activation_memory_ratios"][b] for r in mine
                                  if b in r["activation_memory_ratios"]]))
        choice = ", ".join(sorted({f"{r['chunk_size']}/{r['k']}/{r['recompute']['chunkflow']}"
                                   for r in mine}))
        load = max(max(r["load_average_1min"]) for r in mine)
        lines.append(f"| {batch} | {statistics.median(r['tokens'] for r in mine):,.0f} | "
                     + " | ".join(cells) + f" | {choice} | {load:.1f} |")
    lines += ["", "Recompute chosen per run: " + "; ".join(
        f"G={r['global_batch_size']} seed {r['seed']}: " + ", ".join(
            f"{b} {v}" for b, v in r["recompute"].items()) for r in rows)]
    not_run = [f"G={r['global_batch_size']} seed {r['seed']}: {b}"
               for r in rows for b in r["not_run"]]
    if not_run:
        lines.append("Not run (no recompute option fits the budget): " + "; ".join(not_run))
    return lines


def main(argv=None) -> int:
    args, extra = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for batch in args.batches:
        for seed in args.seed_list:
            load = wait_for_load(args.max_load, args.wait)
            print(f"bench_seeds: global batch {batch}, seed {seed} (load {load:.2f})",
                  file=sys.stderr, flush=True)
            rows.append(summary(batch, seed, load, run_one(batch, seed, extra)))
            print("bench_seeds:   " + ", ".join(f"{v:.2f}x vs {b}" for b, v in
                                                rows[-1]["speedups"].items()),
                  file=sys.stderr, flush=True)
    (out / "bench_seeds.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = markdown(rows, extra)
    (out / "bench_seeds.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
