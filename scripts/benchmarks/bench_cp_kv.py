"""ChunkFlow's CP attention on this CPU, CP 2, four ways in one job (~4 minutes on 2 cores):
- sharded, gather first (--chunkflow-cp-attention gather): every chunk all-gathers [prefix ++
  chunk] K/V in every layer, then attends; again in the backward;
- sharded, ring (the default): the same bytes, each rank's K/V block passed around the CP ranks
  while the kernel attends over the block at hand, partial results merged by log-sum-exp, the
  gradient blocks passed back around the ring;
- replicated (--chunkflow-cp-kv replicated): every CP rank keeps the whole prefix; a chunk gathers
  only its own K/V, once, and reduce-scatters only its gradient;
- sharded, ring, every segment split (--chunkflow-cp-placement split): the ring without the
  hybrid placement, which the three above use (a packed chunk's short sequences held whole on
  one rank each, attended there with no traffic).
With --chunk-size >= --long the long sequence is one chunk (no prefix: replicated state is then
the sharded ring).

    python scripts/benchmarks/bench_cp_kv.py                  # table on stdout
    python scripts/benchmarks/bench_cp_kv.py --json out.json --steps 5

One job of 2 processes (CP 2, DP 1), one global batch: one long sequence of --long tokens cut
into chunks of --chunk-size, K = 1, and 16 short ones drawn from profile A at 1/4 scale (seed 0), in
float32 on the `tiny-bench` model, stepped as `chunkflow train` steps them (mcore/step.py, Megatron's
Adam). Per system and step: the step's wall time, the bytes this rank received of K/V and of dK/dV
(all-gathers and reduce-scatters, or the ring's sends: runtime/cp.py Traffic, the count NCCL's
ring would move), and the bytes
of the long sequence's K/V state at its largest (runtime/state.py, stored K/V and accumulators).
The systems take turns step by step (each its own model, built first), so a change of load
falls on all four. Medians over --steps steps after one warm-up step, with the load average the
run saw. The
simulator's prediction for the same batch and layout on this CPU is not printed: its CPU device is
fitted by `chunkflow bench`, not here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SYSTEMS = (("sharded", "gather", "hybrid"), ("sharded", "ring", "hybrid"),
           ("replicated", "ring", "hybrid"), ("sharded", "ring", "split"))
NAMES = ("sharded, gather first", "sharded, ring", "replicated",
         "sharded, ring, every segment split")


def batch_lengths(long: int) -> list[int]:
    from megatron_chunkflow.core.profiles import sample_lengths

    short = sample_lengths("A", 16, 0, scale=0.25)
    return [long] + [n + n % 2 for n in short]  # whole pieces for the 2 x CP split after padding


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
    job = init_distributed(parallel, 3)  # one set of groups: the four models live side by side
    for name, (cp_kv, cp_attention, placement) in zip(NAMES, SYSTEMS):
        torch.manual_seed(3)
        config = ChunkFlowConfig(chunk_size, 1, cp_kv=cp_kv, cp_attention=cp_attention,
                                 cp_placement=placement)
        s = TrainSettings(shape=shape, model_name=model, system="chunkflow", parallel=parallel,
                          chunkflow=config,
                          train_iters=steps + 1, global_batch_size=len(lengths),
                          seq_length=max(lengths),
                          optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-5, lr_warmup_iters=0),
                          dtype="float32", seed=3)
        tr = build_training(s, job)
        runs.append((name, config, s, tr, StatePeaks(tr.chunkflow_model.store), []))
    for it in range(steps + 1):  # the systems take turns, step by step: the same load for each
        for name, config, s, tr, peak, rows in runs:
            store = tr.chunkflow_model.store
            before = (store.cp_traffic.gathered, store.cp_traffic.reduce_scattered)
            peak.reset()
            start = time.perf_counter()
            outcome = training_step(s, tr, sequences, it, observers=[peak])
            seconds = time.perf_counter() - start
            if it:
                rows.append((seconds, store.cp_traffic.gathered - before[0],
                             store.cp_traffic.reduce_scattered - before[1], peak.device,
                             outcome.num_chunks))
    out = []
    for name, config, s, tr, peak, rows in runs:
        out.append({"system": name, "cp_kv": config.cp_kv, "cp_attention": config.cp_attention,
                    "cp_placement": config.cp_placement,
                    "step_s": statistics.median(r[0] for r in rows),
                    "steps_s": [r[0] for r in rows], "gathered_bytes": rows[-1][1],
                    "reduce_scattered_bytes": rows[-1][2], "state_peak_bytes": rows[-1][3],
                    "chunks": rows[-1][4]})
    shutdown()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    parser.add_argument("--long", type=int, default=8192,
                        help="tokens of the long sequence (default 8192)")
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
    print("| CP attention | step (s) | K/V received (MiB / rank) | dK/dV received (MiB / rank) "
          "| state peak (MiB / rank) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['system']} | {r['step_s']:.3f} | {r['gathered_bytes'] / mib:.1f} | "
              f"{r['reduce_scattered_bytes'] / mib:.1f} | {r['state_peak_bytes'] / mib:.1f} |")
    gather = results[0]
    for r in results[1:]:
        moved = [x["gathered_bytes"] + x["reduce_scattered_bytes"] for x in (r, gather)]
        state = (f"{r['state_peak_bytes'] / gather['state_peak_bytes']:.2f}x"
                 if gather["state_peak_bytes"] else "none (no dependent chunk)")
        print(f"{r['system']} / sharded, gather first: step {r['step_s'] / gather['step_s']:.2f}x,"
              f" traffic {moved[0] / moved[1]:.2f}x, state {state}")
    ring, split = results[1], results[3]
    moved = [x["gathered_bytes"] + x["reduce_scattered_bytes"] for x in (ring, split)]
    print(f"hybrid placement: {ring['system']} / {split['system']}: step "
          f"{ring['step_s'] / split['step_s']:.2f}x, traffic {moved[0] / moved[1]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "load_average": [load, after], "lengths": lengths},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
