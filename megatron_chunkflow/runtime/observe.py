"""Observers: measurement attached to a step from outside its op loop.

    timeline = StageTimeline()
    execute_step(step, model, forward_step, pg_collection=job.groups, observers=[timeline, meter])
    timeline.busy, timeline.step_time

runtime/execute.py calls every observer, in list order, at these points of one pipeline stage's
step (point-to-point waits are outside every context, so they count as idle time):
- `step_began()` before the first op, `step_ended()` after the last send has completed;
- `forward(op, keeps_graph)`: a context around one F or R (Megatron's forward_step, loss
  included); `keeps_graph` says whether autograd keeps its graph for a later B;
- `backward(op)`: a context around one B (Megatron's backward_step);
- `input_kept(chunk, tensor)` / `input_released(chunk)`: a stage input kept after a forward
  without graph (stages after the first) until the chunk's re-forward takes it;
- `communicate(what, op)`: a context around one point-to-point exchange with a neighbouring
  stage (recv_forward, send_forward, recv_backward, send_backward) for op's chunk.
`observing_megatron` drives the same hooks from Megatron's own schedule (the stock baselines), so
both systems are measured by the same observers.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from megatron_chunkflow.core.types import Op


class StepObserver:
    """Base class: every hook does nothing, so an observer overrides only what it measures."""

    def step_began(self) -> None:
        """Before the stage's first op."""

    @contextlib.contextmanager
    def forward(self, op: Op, keeps_graph: bool):
        """Around one forward (F or R) of chunk `op.chunk`."""
        yield

    @contextlib.contextmanager
    def backward(self, op: Op):
        """Around one backward (B) of chunk `op.chunk`."""
        yield

    def input_kept(self, key: tuple[int, int], tensor: torch.Tensor) -> None:
        """A stage input kept for a later re-forward; key (chunk, model chunk)."""

    def input_released(self, key: tuple[int, int]) -> None:
        """The kept stage input of `key` (chunk, model chunk), taken by its re-forward."""

    @contextlib.contextmanager
    def communicate(self, what: str, op: Op):
        """Around one send or receive of op's chunk with a neighbouring stage."""
        yield

    def step_ended(self) -> None:
        """After the stage's last op and the completion of its sends."""


@dataclass
class StageTimeline(StepObserver):
    """Per-op compute intervals (kind, chunk, start, end), seconds since the step began."""

    ops: list[tuple[str, int, float, float]] = field(default_factory=list)
    step_time: float = 0.0
    _t0: float = 0.0

    @property
    def busy(self) -> float:
        return sum(end - start for _, _, start, end in self.ops)

    def step_began(self) -> None:
        self._t0 = _now()

    @contextlib.contextmanager
    def forward(self, op: Op, keeps_graph: bool):
        with self._interval(op):
            yield

    @contextlib.contextmanager
    def backward(self, op: Op):
        with self._interval(op):
            yield

    def step_ended(self) -> None:
        self.step_time = _now() - self._t0

    @contextlib.contextmanager
    def _interval(self, op: Op):
        start = _now()
        yield
        self.ops.append((op.kind, op.chunk, start - self._t0, _now() - self._t0))


class StatePeaks(StepObserver):
    """The K/V store's largest bytes, read after every forward and backward: `device`
    (store.nbytes(): K/V buffers, accumulators, attention kept on the GPU) and `host` (attention
    offloaded to host memory); `reset()` between steps. A coarser, cheaper reading than
    runtime/meter.py's, for benchmarks comparing state across configurations."""

    def __init__(self, store):
        self.store = store
        self.device = self.host = 0

    def reset(self) -> None:
        self.device = self.host = 0

    def _read(self) -> None:
        self.device = max(self.device, self.store.nbytes())
        self.host = max(self.host, self.store.kept_host_bytes())

    @contextlib.contextmanager
    def forward(self, op: Op, keeps_graph: bool):
        yield
        self._read()

    @contextlib.contextmanager
    def backward(self, op: Op):
        yield
        self._read()


def _now() -> float:
    """Wall time after the GPU's queued work (kernels run asynchronously to the host)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def observing(observers, hook: str, *args) -> contextlib.ExitStack:
    """One context entering `hook(*args)` of every observer, in order."""
    stack = contextlib.ExitStack()
    for observer in observers:
        stack.enter_context(getattr(observer, hook)(*args))
    return stack


@contextlib.contextmanager
def observing_megatron(observers):
    """Call `observers` from Megatron's own schedule for the duration of the context: its
    module-level forward_step (micro-batch i's forward, loss included) and backward_step (1F1B
    runs backwards in forward order) are wrapped, as execute_step calls them for ChunkFlow. No
    observers: nothing is wrapped."""
    if not observers:
        yield
        return
    from megatron.core.pipeline_parallel import schedules

    original_fwd, original_bwd = schedules.forward_step, schedules.backward_step
    count = {"F": 0, "B": 0}

    def forward_step(*args, **kwargs):
        i, count["F"] = count["F"], count["F"] + 1
        with observing(observers, "forward", Op("F", i), True):
            return original_fwd(*args, **kwargs)

    def backward_step(*args, **kwargs):
        i, count["B"] = count["B"], count["B"] + 1
        with observing(observers, "backward", Op("B", i)):
            return original_bwd(*args, **kwargs)

    for observer in observers:
        observer.step_began()
    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    try:
        yield
    finally:
        schedules.forward_step, schedules.backward_step = original_fwd, original_bwd
        for observer in observers:
            observer.step_ended()
