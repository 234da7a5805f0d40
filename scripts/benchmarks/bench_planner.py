"""Planner speed and packing quality on seeded long-tailed profiles (CPU, seconds).

    python scripts/benchmarks/bench_planner.py                      # 100,000 sequences of profile B
    python scripts/benchmarks/bench_planner.py --global-batch-size 20000 --profile A --json

Reports, per (chunk size, PP, DP): time to cut+pack+distribute the whole global batch, time to plan
and simulate one DP rank (what each rank does per step), standalone chunks against the lower bound
ceil(short tokens / C), padding, and the simulated bubble ratio. Best of --repeats runs; one process,
one core (set OMP/MKL threads to 1 if numpy is threaded).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_chunkflow.core.costs import OpCosts  # noqa: E402
from megatron_chunkflow.core.models import get_model_shape  # noqa: E402
from megatron_chunkflow.core.packer import build_chunks  # noqa: E402
from megatron_chunkflow.core.profiles import sample_lengths  # noqa: E402
from megatron_chunkflow.core.schedule import state_aware_plan  # noqa: E402
from megatron_chunkflow.core.simulate import simulate  # noqa: E402


def best_of(repeats, fn):
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="B")
    ap.add_argument("--global-batch-size", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunkflow-k", type=int, default=1, dest="num_kept")
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    shape = get_model_shape(args.model)
    lengths = sample_lengths(args.profile, args.global_batch_size, args.seed)
    rows = []
    for chunk_size, pp, dp in [(8192, 1, 1), (8192, 4, 1), (8192, 4, 8), (32768, 4, 8)]:
        t_pack, batch = best_of(args.repeats,
                                lambda: build_chunks(lengths, chunk_size, dp, args.num_kept, shape))
        chunks = batch.chunks_for_rank(0)

        def plan_rank():
            costs = OpCosts.from_model(chunks, shape, pp)
            plan = state_aware_plan(chunks, pp, args.num_kept, costs)
            return simulate(plan, costs)

        t_plan, sim = best_of(args.repeats, plan_rank)
        rows.append({
            "chunk_size": chunk_size, "pp": pp, "dp": dp, "chunks": len(batch.chunks),
            "chunks_rank0": len(chunks), "standalone": batch.num_standalone,
            "bins_lower_bound": batch.bins_lower_bound, "padding": batch.padding_fraction,
            "bubble_rank0": sim.bubble_ratio, "pack_s": t_pack, "plan_rank0_s": t_plan,
            "total_s": t_pack + t_plan,
        })
    header = (f"{args.global_batch_size} sequences of profile {args.profile} (seed {args.seed}), "
              f"{sum(lengths):,} tokens, longest {max(lengths):,}; K={args.num_kept}, {args.model}")
    lines = [header, "",
             "| C | PP | DP | chunks | standalone / bound | padding | bubble (rank 0) "
             "| pack+distribute s | plan+simulate rank 0 s | total s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['chunk_size']} | {r['pp']} | {r['dp']} | {r['chunks']} | {r['standalone']} / "
            f"{r['bins_lower_bound']} | {r['padding']:.2%} | {r['bubble_rank0']:.1%} | "
            f"{r['pack_s']:.3f} | {r['plan_rank0_s']:.3f} | {r['total_s']:.3f} |")
    print("\n".join(lines), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"setup": header, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
