"""Memory soak test of the training loop: RSS after every step, and its slope.

    python scripts/benchmarks/soak_train.py                  # 60 steps, ChunkFlow, CPU
    python scripts/benchmarks/soak_train.py --steps 100 --no-chunkflow --json

Runs the real loop (training/loop.py: planner, ChunkFlow or stock schedule, Megatron optimizer)
on the tiny model with profile-B lengths scaled for CPU, and fits a line to the resident set size over
the second half of the run (after allocator warm-up). A leak shows as a steady positive slope.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--chunkflow", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import numpy as np
    import psutil

    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.core.profiles import ensure_long, sample_lengths
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
    from megatron_chunkflow.training.loop import train

    lengths = ensure_long(sample_lengths("B", 256, seed=0, scale=1 / 16), "B", 256, 8, 0, 1 / 16)
    dataset = make_sequences([max(n, 2) for n in lengths], 1000, seed=0)
    s = TrainSettings(shape=get_model_shape("tiny"), model_name="tiny", train_iters=args.steps,
                      global_batch_size=16, seq_length=max(lengths),
                      system="chunkflow" if args.chunkflow else "megatron-packed",
                      chunkflow=ChunkFlowConfig(256), optimizer=OptimizerConfig(lr_warmup_iters=2))
    job = init_distributed(seed=s.seed)
    proc, rss = psutil.Process(), []
    train(s, job, dataset, on_step=lambda m: rss.append(proc.memory_info().rss))
    shutdown()
    half = rss[len(rss) // 2:]
    slope = float(np.polyfit(np.arange(len(half)), np.array(half, dtype=float), 1)[0])
    result = {"steps": args.steps, "path": "chunkflow" if args.chunkflow else "megatron",
              "rss_first_mib": rss[0] / 2**20, "rss_last_mib": rss[-1] / 2**20,
              "rss_slope_kib_per_step_second_half": slope / 1024}
    print(f"{result['path']}: {args.steps} steps, RSS {result['rss_first_mib']:.0f} -> "
          f"{result['rss_last_mib']:.0f} MiB; slope over the second half "
          f"{result['rss_slope_kib_per_step_second_half']:.1f} KiB/step",
          file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
