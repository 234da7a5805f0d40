"""State-aware 1F1B on megatron-core: one pipeline stage executing its list of plan ops.

Every stage runs its ops from core/schedule.py in order, with Megatron's forward_step and
backward_step and its P2PCommunicator:
- F on stage s > 0 receives the chunk's activations from s - 1; F on s < p - 1 sends its output to
  s + 1. A forward without graph (the chunk is re-forwarded later) keeps its received input: R re-runs
  the stage's layers from it, so re-forwards never communicate.
- B on s < p - 1 receives the output gradient from s + 1; B on s > 0 sends the input gradient to s - 1.
- Shapes: every rank knows every chunk's length from the plan, so receivers allocate the exact
  shape. Nothing is padded to the chunk size and no shape handshake is needed
  (config.variable_seq_lengths stays off).
- Sends are posted asynchronously (isend through P2PCommunicator._communicate with wait_on_reqs=False,
  which needs config.batch_p2p_comm=False) and waited at the end of the step; receives block. The plan
  is a valid schedule with asynchronous sends (core/simulate.py replays it), and every stage forwards
  in one order and backwards in another shared order, so each receive is matched by a send that is
  posted: no deadlock. An output is sent from a copy, so deallocate_output_tensor can free the output
  at once without racing the send.
- SpaCO (runtime/sparse.py): chunks in `step.forward_only` have an F without graph and no R or
  B; their loss and tokens still count. A chunk's loss is multiplied by its `grad_weight`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch


@dataclass
class StageTimeline:
    """Per-op compute intervals (seconds since the step began) on this rank; waits excluded."""

    ops: list[tuple[str, int, float, float]] = field(default_factory=list)
    step_time: float = 0.0

    @property
    def busy(self) -> float:
        return sum(end - start for _, _, start, end in self.ops)


def _shape(meta, config, sequence_parallel_size: int) -> tuple[int, int, int]:
    return (meta.num_tokens // sequence_parallel_size, 1, config.hidden_size)


def run_stage(*, ops, step, model, config, p2p, store, forward_step_func, num_microbatches: int,
              forward_only: bool, collect_non_loss_data: bool, is_first: bool, is_last: bool,
              meter=None, timeline: StageTimeline | None = None):
    """Execute this stage's ops; returns (forward_data_store, total_num_tokens)."""
    from megatron.core.pipeline_parallel.schedules import (
        backward_step,
        deallocate_output_tensor,
        forward_step,
    )
    from megatron.core.utils import get_model_type

    model_type = get_model_type(model)
    sp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    recomputed = step.plan.recomputed
    sparse_dropped = step.forward_only
    last_backward = max((i for i, op in enumerate(ops) if op.kind == "B"), default=-1)
    no_sync = config.no_sync_func or contextlib.nullcontext
    forward_data_store: list = []
    total_num_tokens = torch.zeros([], dtype=torch.int)
    held: dict[int, tuple] = {}  # chunk -> (input tensor, output tensor) awaiting B
    saved_inputs: dict[int, torch.Tensor] = {}  # stage inputs of forwards without graph
    pending_sends: list = []
    t0 = time.perf_counter()

    def send(tensor, forward: bool) -> None:
        buf = tensor.detach().clone()
        _, _, reqs = p2p._communicate(
            tensor_send_next=buf if forward else None, tensor_send_prev=None if forward else buf,
            recv_prev=False, recv_next=False, tensor_shape=None, wait_on_reqs=False)
        pending_sends.append((buf, reqs))

    def record(op, start) -> None:
        if timeline is not None:
            timeline.ops.append((op.kind, op.chunk, start - t0, time.perf_counter() - t0))

    for i, op in enumerate(ops):
        meta = step.metas[op.chunk]
        if op.kind == "B":
            grad = None if is_last else p2p.recv_backward(_shape(meta, config, sp), False)
            start = time.perf_counter()
            input_tensor, output = held.pop(op.chunk)
            # Megatron's activation recompute (full or selective) re-runs attention inside the
            # backward: it needs the chunk's context too (reading the state, storing nothing).
            store.begin(meta, reforward=True)
            try:
                with (contextlib.nullcontext() if i == last_backward else no_sync()):
                    input_grad = backward_step(input_tensor, output, grad, model_type, config)
            finally:
                store.end()
            if meter is not None:
                meter.release(op.chunk)
            record(op, start)
            if not is_first:
                send(input_grad, forward=False)
            continue

        dropped = op.chunk in sparse_dropped
        keep = not forward_only and not (op.kind == "F" and (op.chunk in recomputed or dropped))
        if op.kind == "R":
            input_tensor = None if is_first else saved_inputs.pop(op.chunk).requires_grad_()
            if meter is not None and not is_first:
                meter.release_extra(op.chunk)
        else:
            input_tensor = None if is_first else p2p.recv_forward(_shape(meta, config, sp), False)
        start = time.perf_counter()
        if op.kind == "F" and op.chunk in recomputed and not is_first and not forward_only:
            saved_inputs[op.chunk] = input_tensor.detach()
            if meter is not None:
                meter.hold_extra(op.chunk, input_tensor)
        track = meter.track(op.chunk) if (meter is not None and keep) else contextlib.nullcontext()
        step_func = forward_step_func if meta.grad_weight == 1 else \
            _weighted_loss(forward_step_func, meta.grad_weight)
        store.begin(meta, reforward=op.kind == "R")
        try:
            with (contextlib.nullcontext() if keep else torch.no_grad()), track:
                output, num_tokens = forward_step(
                    step_func, iter([step.inputs[op.chunk]]), model, num_microbatches, input_tensor,
                    forward_data_store if (keep or forward_only or dropped) else [], config, 1,
                    collect_non_loss_data, is_first_microbatch=(i == 0), current_microbatch=i,
                    is_last_stage=is_last)
        finally:
            store.end()
        record(op, start)
        if op.kind == "F" and not is_last:
            send(output, forward=True)
        if keep:
            total_num_tokens += num_tokens
            if not is_last:
                deallocate_output_tensor(output, config.deallocate_pipeline_outputs)
            held[op.chunk] = (input_tensor, output)
        elif dropped and not forward_only:
            total_num_tokens += num_tokens

    for _, reqs in pending_sends:
        for req in (reqs.values() if isinstance(reqs, dict) else reqs or []):
            req.wait()
    assert not held and not saved_inputs, "plan left activations behind on this stage"
    if timeline is not None:
        timeline.step_time = time.perf_counter() - t0
    return forward_data_store, total_num_tokens


def _weighted_loss(forward_step_func, weight: float):
    """The same forward step with its loss (not the reported value) multiplied by `weight`."""

    def step_func(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)

        def weighted(*args, **kwargs):
            loss, *rest = loss_func(*args, **kwargs)
            return (loss * weight, *rest)

        return output, weighted

    return step_func
