"""Replay a plan with per-op costs: step time, busy/idle time per stage, bubble ratio, memory.

Each stage runs its ops in plan order. F on stage s > 0 starts after F of the same chunk ended on
stage s - 1 (plus `comm`); B on stage s < p - 1 starts after B of the same chunk ended on s + 1.
R is stage-local. With virtual stages the same holds per virtual stage (model chunk x p + rank),
each rank running its model chunks' ops one at a time; `costs` and `held_bytes` take the virtual
stage, and the per-stage results (busy, peak held model-chunk activations, bytes) are per rank. Sends are asynchronous, so a plan replays iff it cannot deadlock on hardware that
posts sends without waiting for the receiver.

Bubble ratio = idle / (p * step_time), where a stage is idle whenever it is not running an op
between time 0 and the end of the step. For m equal micro-batches under 1F1B this is exactly
(p - 1) / (m + p - 1).

Memory, per stage: the activations its chunks hold (`held_bytes`: from a chunk's F, or its R, to
its B) and, with `op_bytes`, what else each op does: state it allocates as it starts and releases
when it ends, and working memory while it runs. The peak is taken while each op runs (held before
it, its own chunk's activations for an F or R, the state, its working memory), with what it was
made of (`peak_parts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.types import Op, PipelinePlan


@dataclass(frozen=True)
class TimedOp:
    op: Op
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    step_time: float
    busy: tuple[float, ...]  # per stage
    timeline: tuple[tuple[TimedOp, ...], ...]  # per stage, in plan order
    peak_held: tuple[int, ...]  # per stage: most chunks holding activations at once
    peak_bytes: tuple[float, ...]  # per stage, when `held_bytes` is given (else zeros)
    num_recompute: int  # R ops on the first stage = chunks re-forwarded
    # per stage at its peak: (held activations, state, the running op's working memory), and
    # the op then running
    peak_parts: tuple[tuple[float, float, float], ...] = ()
    peak_ops: tuple[Op | None, ...] = ()

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.step_time - b for b in self.busy)

    @property
    def bubble_ratio(self) -> float:
        total = self.step_time * len(self.busy)
        return sum(self.idle) / total if total > 0 else 0.0


class PlanDeadlock(RuntimeError):
    """The plan cannot run: every stage waits on an op that never comes."""


def simulate(plan: PipelinePlan, costs: OpCosts | Callable[[str, int, int], float],
             comm: float | None = None,
             held_bytes: Callable[[int, int], float] | None = None,
             op_bytes: Callable[[Op, int], tuple[float, float, float]] | None = None
             ) -> SimResult:
    """Replay `plan`. `held_bytes(chunk, virtual stage)` gives the activation bytes a chunk
    holds there; `op_bytes(op, virtual stage)`: (state allocated as the op starts, state
    released as it ends, working memory while it runs)."""
    p, n = plan.num_stages, plan.num_virtual_stages
    if comm is None:
        comm = getattr(costs, "comm", 0.0)
    f_end: list[dict[int, float]] = [{} for _ in range(n)]  # per virtual stage
    b_end: list[dict[int, float]] = [{} for _ in range(n)]
    ptr, free = [0] * p, [0.0] * p
    timeline: list[list[TimedOp]] = [[] for _ in range(p)]
    busy = [0.0] * p
    held, peak_held = [0] * p, [0] * p
    cur_bytes, peak_bytes = [0.0] * p, [0.0] * p
    state, parts, peak_ops = [0.0] * p, [(0.0, 0.0, 0.0)] * p, [None] * p
    recomputed = [set(op.chunk for op in ops if op.kind == "R") for ops in plan.stages]
    remaining = sum(len(ops) for ops in plan.stages)
    while remaining:
        progress = False
        for s in range(p):
            ops = plan.stages[s]
            while ptr[s] < len(ops):
                op = ops[ptr[s]]
                k = plan.virtual_stage(s, op)
                ready = free[s]
                if op.kind == "F" and k > 0:
                    if op.chunk not in f_end[k - 1]:
                        break
                    ready = max(ready, f_end[k - 1][op.chunk] + comm)
                elif op.kind == "B" and k < n - 1:
                    if op.chunk not in b_end[k + 1]:
                        break
                    ready = max(ready, b_end[k + 1][op.chunk] + comm)
                end = ready + costs(op.kind, op.chunk, k)
                timeline[s].append(TimedOp(op, ready, end))
                busy[s] += end - ready
                free[s] = end
                ptr[s] += 1
                remaining -= 1
                progress = True
                holds = op.kind == "R" or (op.kind == "F" and op.chunk not in recomputed[s])
                delta = (held_bytes(op.chunk, k) if held_bytes else 0.0)
                if op.kind == "F":
                    f_end[k][op.chunk] = end
                elif op.kind == "B":
                    b_end[k][op.chunk] = end
                start, end, running = op_bytes(op, k) if op_bytes else (0.0, 0.0, 0.0)
                state[s] += start
                during = (cur_bytes[s] + (delta if holds else 0.0), state[s], running)
                if sum(during) > peak_bytes[s]:
                    peak_bytes[s], parts[s], peak_ops[s] = sum(during), during, op
                state[s] += end
                if holds:
                    held[s] += 1
                    cur_bytes[s] += delta
                    peak_held[s] = max(peak_held[s], held[s])
                elif op.kind == "B":
                    held[s] -= 1
                    cur_bytes[s] -= delta
        if not progress:
            stuck = {s: plan.stages[s][ptr[s]] for s in range(p) if ptr[s] < len(plan.stages[s])}
            raise PlanDeadlock(f"plan deadlocks; next op per stage: {stuck}")
    step_time = max(free) if p else 0.0
    return SimResult(
        step_time=step_time,
        busy=tuple(busy),
        timeline=tuple(tuple(t) for t in timeline),
        peak_held=tuple(peak_held),
        peak_bytes=tuple(peak_bytes),
        num_recompute=len(recomputed[0]) if p else 0,
        peak_parts=tuple(parts),
        peak_ops=tuple(peak_ops),
    )
