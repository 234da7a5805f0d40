"""ChunkFlow's CP attention on this CPU, CP 2: a long sequence's K/V state sharded (every chunk
all-gathers [prefix ++ chunk] K/V in every layer, again in the backward) against replicated (every
CP rank keeps the whole prefix; a chunk gathers only its own K/V, once, and reduce-scatters only
its gradient), in one job (~2 minutes on 2 cores).

    python scripts/benchmarks/bench_cp_kv.py                  # table on stdout
    python scripts/benchmarks/bench_cp_kv.py --json out.json --steps 5

One job of 2 processes (CP 2, DP 1), one global batch: one long sequence of --long tokens cut
into chunks of --chunk-size, K = 1, and 16 short ones drawn from profile A at 1/4 scale (seed 0), in
float32 on the `tiny-bench` model, stepped as `chunkflow train` steps them (mcore/step.py, Megatron's
Adam). Per system and step: the step's wall time, the bytes this rank received in K/V all-gathers
and dK/dV reduce-scatters (runtime/cp.py Traffic, the count NCCL's ring would move), and the bytes
of the long sequence's K/V state at its largest (runtime/state.py, stored K/V and accumulators).
Medians over --steps steps after one warm-up step, with the load average the run saw. The
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

SYSTEMS = ("sharded", "replicated")


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

    torch.set_num_threads(threads)
    shape = get_model_shape(model)
    sequences = make_sequences(lengths, shape.vocab_size, seed=7)
    out = []
    for cp_kv in SYSTEMS:
        parallel = ParallelConfig(cp=2)
        s = TrainSettings(shape=shape, model_name=model, system="chunkflow", parallel=parallel,
                          chunkflow=ChunkFlowConfig(chunk_size, 1, cp_kv=cp_kv),
                          train_iters=steps + 1, global_batch_size=len(lengths),
                          seq_length=max(lengths),
                          optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-5, lr_warmup_iters=0),
                          dtype="float32", seed=3)
        init_distributed(parallel, s.seed)
        tr = build_training(s)
        store = tr.chunkflow_model.store
        peak = state_peak(store)
        rows = []
        for it in range(steps + 1):
            before = (store.cp_traffic.gathered, store.cp_traffic.reduce_scattered)
            peak.bytes = 0
            start = time.perf_counter()
            outcome = training_step(s, tr, sequences, it, observers=[peak])
            seconds = time.perf_counter() - start
            if it:
                rows.append((seconds, store.cp_traffic.gathered - before[0],
                             store.cp_traffic.reduce_scattered - before[1], peak.bytes,
                             outcome.num_chunks))
        out.append({"cp_kv": cp_kv, "step_s": statistics.median(r[0] for r in rows),
                    "steps_s": [r[0] for r in rows], "gathered_bytes": rows[-1][1],
                    "reduce_scattered_bytes": rows[-1][2], "state_peak_bytes": rows[-1][3],
                    "chunks": rows[-1][4]})
    shutdown()
    return out


def state_peak(store):
    """A step observer (runtime/observe.py) keeping the long sequence's K/V state at its largest,
    read after every forward and backward: `.bytes`."""
    import contextlib

    from megatron_chunkflow.runtime.observe import StepObserver

    class StatePeak(StepObserver):
        bytes = 0

        def _read(self):
            self.bytes = max(self.bytes, store.nbytes())

        @contextlib.contextmanager
        def forward(self, op, keeps_graph):
            yield
            self._read()

        @contextlib.contextmanager
        def backward(self, op):
            yield
            self._read()

    return StatePeak()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    parser.add_argument("--long", type=int, default=8192,
                        help="tokens of the long sequence (default 8192)")
    parser.add_argument("--chunk-size", type=int, default=512, help="C (default 512)")
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
    print("| K/V state | step (s) | K/V all-gathered (MiB / rank) | dK/dV reduce-scattered "
          "(MiB / rank) | state peak (MiB / rank) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['cp_kv']} | {r['step_s']:.3f} | {r['gathered_bytes'] / mib:.1f} | "
              f"{r['reduce_scattered_bytes'] / mib:.1f} | {r['state_peak_bytes'] / mib:.1f} |")
    shard, rep = results
    moved = {r["cp_kv"]: r["gathered_bytes"] + r["reduce_scattered_bytes"] for r in results}
    print(f"replicated / sharded: step {rep['step_s'] / shard['step_s']:.2f}x, traffic "
          f"{moved['replicated'] / moved['sharded']:.2f}x, state "
          f"{rep['state_peak_bytes'] / shard['state_peak_bytes']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "load_average": [load, after], "lengths": lengths},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
