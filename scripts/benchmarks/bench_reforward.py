"""Re-forwards that skip attention on this CPU (--chunkflow-reforward-attention), three ways in one
job of 2 processes (CP 2; ~3 minutes on 2 cores):
- recompute (the default): a re-forwarded chunk's re-forward runs every layer whole again, its
  attention over the whole prefix and, under CP, the K/V exchange;
- keep: its first forward keeps each layer's attention output and log-sum-exp, the re-forward
  skips the attention core (runtime/reforward.py);
- offload: the same kept in host memory, copied out and back (on a CPU both are host memory:
  the copies are what is measured).

    python scripts/benchmarks/bench_reforward.py                  # table on stdout
    python scripts/benchmarks/bench_reforward.py --json out.json --steps 5

One global batch: one long sequence of --long tokens cut into chunks of --chunk-size, K = 1 (all
but its last chunk re-forwarded), and 16 short ones drawn from profile A at 1/4 scale (seed 0),
in float32 on the `tiny-bench` model, stepped as `chunkflow train` steps them (Megatron's Adam),
CP 2, ring attention, sharded state. Per system and step: wall time, the K/V and dK/dV bytes this
rank received (runtime/cp.py Traffic), the device bytes of the K/V state at its largest (stored
K/V, accumulators and kept attention: runtime/state.py nbytes) and the kept attention in host
memory at its largest. The systems take turns step by step (each its own model, built first), so
a change of load falls on all three. Medians over --steps steps after one warm-up step, with the
load average the run saw.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cp_kv import batch_lengths  # noqa: E402

MODES = ("recompute", "keep", "offload")


def _job(lengths, chunk_size: int, steps: int, model: str, threads: int) -> list[dict]:
    import torch

    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
    from megatron_chunkflow.mcore.step import build_training, training_step
    from megatron_chunkflow.runtime.observe import StatePeaks

    torch.set_num_threads(threads)
    shape = get_model_shape(model)
    sequences = make_sequences(lengths, shape.vocab_size, seed=7)
    runs, parallel = [], ParallelConfig(cp=2)
    job = init_distributed(parallel, 3)
    for mode in MODES:
        torch.manual_seed(3)
        config = ChunkFlowConfig(chunk_size, 1, reforward_attention=mode)
        s = TrainSettings(shape=shape, model_name=model, system="chunkflow", parallel=parallel,
                          chunkflow=config, train_iters=steps + 1,
                          global_batch_size=len(lengths), seq_length=max(lengths),
                          optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-5, lr_warmup_iters=0),
                          dtype="float32", seed=3)
        tr = build_training(s, job)
        runs.append((mode, s, tr, StatePeaks(tr.chunkflow_model.store), []))
    for it in range(steps + 1):  # the systems take turns, step by step: the same load for each
        for mode, s, tr, peaks, rows in runs:
            store = tr.chunkflow_model.store
            before = (store.cp_traffic.gathered, store.cp_traffic.reduce_scattered)
            peaks.reset()
            start = time.perf_counter()
            outcome = training_step(s, tr, sequences, it, observers=[peaks])
            seconds = time.perf_counter() - start
            if it:
                rows.append((seconds, store.cp_traffic.gathered - before[0],
                             store.cp_traffic.reduce_scattered - before[1], peaks.device,
                             peaks.host, outcome.grad_norm))
    out = []
    for mode, s, tr, peaks, rows in runs:
        out.append({"reforward_attention": mode,
                    "step_s": statistics.median(r[0] for r in rows),
                    "steps_s": [r[0] for r in rows], "gathered_bytes": rows[-1][1],
                    "reduce_scattered_bytes": rows[-1][2], "state_peak_bytes": rows[-1][3],
                    "host_peak_bytes": rows[-1][4], "grad_norms": [r[5] for r in rows]})
    shutdown()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    parser.add_argument("--long", type=int, default=16384,
                        help="tokens of the long sequence (default 16384)")
    parser.add_argument("--chunk-size", type=int, default=1024, help="C (default 1024)")
    parser.add_argument("--model", default="tiny-bench", help="model preset (default tiny-bench)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    from megatron_chunkflow.mcore.dist import run_processes

    lengths = batch_lengths(args.long)
    load = os.getloadavg()
    results = run_processes(_job, 2, lengths, args.chunk_size, args.steps, args.model, 1,
                            timeout=3600)[0]
    after = os.getloadavg()
    mib = 2.0**20
    print(f"# CP 2 on this CPU: {len(lengths)} sequences, {sum(lengths)} tokens (one of "
          f"{args.long}), model {args.model}, C {args.chunk_size}, K 1, float32; median of "
          f"{args.steps} steps; load average {load[0]:.2f} before, {after[0]:.2f} after")
    print("| re-forward attention | step (s) | K/V received (MiB / rank) | dK/dV received "
          "(MiB / rank) | state peak on the device (MiB / rank) | kept in host memory (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['reforward_attention']} | {r['step_s']:.3f} | "
              f"{r['gathered_bytes'] / mib:.1f} | {r['reduce_scattered_bytes'] / mib:.1f} | "
              f"{r['state_peak_bytes'] / mib:.1f} | {r['host_peak_bytes'] / mib:.1f} |")
    base = results[0]
    for r in results[1:]:
        print(f"{r['reforward_attention']} / recompute: step {r['step_s'] / base['step_s']:.2f}x,"
              f" K/V received {r['gathered_bytes'] / base['gathered_bytes']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "load_average": [load, after], "lengths": lengths},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
