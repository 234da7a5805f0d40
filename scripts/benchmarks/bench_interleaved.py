"""Virtual pipeline stages on this CPU: the pipeline bubble measured against predicted, PP 2 x V 2
against PP 2, for ChunkFlow and for stock Megatron (~3 minutes on 2 cores).

    python scripts/benchmarks/bench_interleaved.py                 # table on stdout
    python scripts/benchmarks/bench_interleaved.py --json out.json --steps 5

One job of 2 processes (PP 2, DP 1), one long-tailed global batch, four runs built and stepped
as `chunkflow train` steps them (mcore/step.py, Megatron's Adam): ChunkFlow's plan (1F1B, then
the interleaved plan) and stock megatron-sft on Megatron's own schedule (1F1B, then
forward_backward_pipelining_with_interleaving). megatron-sft is the stock baseline here because
core_v0.16.1's interleaved schedule cannot run variable shapes at PP 2 (its shape exchange
crosses when both neighbours are one rank); its lines are padded to --seq-length, so its step
does more work than ChunkFlow's and the two step times are not the comparison: the bubble is.

Per run and step, every rank's stage timeline (runtime/observe.py: each forward and backward's
compute interval) gives the measured bubble, 1 - busy / (PP x span). Two predictions of it:
- model: the plan replayed with the planner's cost model (FLOPs per op, core/simulate.py);
- replayed: the same plan replayed with each op's measured duration, so that only the schedule's
  dependencies are modelled (the gap to the measurement is what the replay leaves out: sends,
  receives and host time between ops).
The medians over --steps measured steps (after one warm-up step) are printed with the load
average the run saw.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def batch_lengths() -> list[int]:
    """One long sequence (2048 tokens: 4 chunks of 512) and 39 drawn from profile A at 1/4 scale
    (seed 0); stock megatron-sft packs them into 6 lines of 2048 tokens, a count Megatron's
    interleaved schedule takes at PP 2."""
    from megatron_chunkflow.core.profiles import sample_lengths

    return [2048] + sample_lengths("A", 39, 0, scale=0.25)

RUNS = [("chunkflow", 1), ("chunkflow", 2), ("megatron-sft", 1), ("megatron-sft", 2)]


def _job(lengths, chunk_size: int, steps: int, model: str, threads: int,
         runs=tuple(RUNS)) -> list[dict]:
    import torch

    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.costs import OpCosts
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.core.schedule import megatron_interleaved_plan
    from megatron_chunkflow.core.simulate import simulate
    from megatron_chunkflow.core.step import baseline_microbatches
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
    from megatron_chunkflow.mcore.step import build_training, training_step
    from megatron_chunkflow.runtime.execute import plan_step
    from megatron_chunkflow.runtime.observe import StageTimeline

    torch.set_num_threads(threads)
    shape = get_model_shape(model)
    seq_length = max(lengths)
    sequences = make_sequences(lengths, shape.vocab_size, seed=7)
    out = []
    for system, vpp in runs:
        parallel = ParallelConfig(pp=2, vpp=vpp)
        s = TrainSettings(shape=shape, model_name=model, system=system, parallel=parallel,
                          chunkflow=ChunkFlowConfig(chunk_size, 1), train_iters=steps + 1,
                          global_batch_size=len(lengths), seq_length=seq_length,
                          optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-5, lr_warmup_iters=0),
                          dtype="float32", seed=3)
        job = init_distributed(parallel, s.seed)
        ranks = job.ranks
        tr = build_training(s, job)
        if system == "chunkflow":
            step = plan_step(sequences, s.chunkflow, parallel, shape, ranks)
            plan, costs = step.plan, step.costs
        else:
            mbs = baseline_microbatches(lengths, seq_length, 1, system)
            plan = megatron_interleaved_plan(mbs, 2, vpp)
            costs = OpCosts.from_model(mbs, shape, parallel.num_virtual_stages)
        rows = []
        for it in range(steps + 1):
            timeline = StageTimeline()
            training_step(s, tr, sequences, it, observers=[timeline])
            if it:
                rows.append(_gather(timeline, plan, ranks.pp_rank))
        if ranks.pp_rank == 0:
            out.append({"system": system, "vpp": vpp, "chunks": len(plan.chunks),
                        "model_bubble": simulate(plan, costs).bubble_ratio,
                        **_medians(rows, plan)})
    shutdown()  # once: it ends the job's default group too
    return out


def _gather(timeline, plan, stage: int) -> list:
    """Every stage's (busy, span, op durations in plan order). Megatron's own schedule runs the
    ops of megatron_interleaved_plan in that order (its observer numbers them by call)."""
    import torch.distributed as dist

    kinds = [kind for kind, *_ in timeline.ops]
    assert kinds == [op.kind for op in plan.stages[stage]], "ops ran out of the plan's order"
    mine = [timeline.busy, timeline.step_time, [end - start for *_, start, end in timeline.ops]]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _medians(rows: list, plan) -> dict:
    from megatron_chunkflow.core.simulate import simulate

    measured, replayed = [], []
    for ranks in rows:
        p = len(ranks)
        span = max(r[1] for r in ranks)
        measured.append(1.0 - sum(r[0] for r in ranks) / (p * span))
        durations = {}
        for stage, (_, _, times) in enumerate(ranks):
            for op, t in zip(plan.stages[stage], times):
                durations[op.kind, op.chunk, plan.virtual_stage(stage, op)] = t
        replayed.append(simulate(plan, lambda kind, chunk, k: durations[kind, chunk, k],
                                 comm=0.0).bubble_ratio)
    return {"bubble": statistics.median(measured), "bubble_steps": measured,
            "replayed_bubble": statistics.median(replayed),
            "step_s": statistics.median(max(r[1] for r in ranks) for ranks in rows)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run (default 3)")
    parser.add_argument("--chunk-size", type=int, default=512, help="ChunkFlow's C (default 512)")
    parser.add_argument("--model", default="tiny-bench",
                        help="a model preset with 4 layers or a multiple (default tiny-bench)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    from megatron_chunkflow.mcore.dist import run_processes

    lengths = batch_lengths()
    load = os.getloadavg()
    results = run_processes(_job, 2, lengths, args.chunk_size, args.steps, args.model, 1,
                            timeout=3600)[0]
    after = os.getloadavg()
    print(f"# {len(lengths)} sequences, {sum(lengths)} tokens (longest {max(lengths)}), model "
          f"{args.model}, PP 2, C {args.chunk_size}, K 1; median of {args.steps} steps; load "
          f"average {load[0]:.2f} before, {after[0]:.2f} after")
    print("| system | layout | micro-batches / chunks | step (s) | bubble measured | "
          "replayed (measured op times) | cost model |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        layout = "PP 2" if r["vpp"] == 1 else f"PP 2 x V {r['vpp']}"
        print(f"| {r['system']} | {layout} | {r['chunks']} | {r['step_s']:.3f} | "
              f"{r['bubble']:.1%} | {r['replayed_bubble']:.1%} | {r['model_bubble']:.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "load_average": [load, after],
                       "lengths": lengths}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
