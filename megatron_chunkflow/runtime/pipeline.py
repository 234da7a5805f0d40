"""One pipeline stage executing its list of plan ops with Megatron's forward_step and backward_step.

Each op of core/schedule.py's plan for this stage, in order (Megatron letters: activations
[t, b=1, h], t split over TP under sequence parallelism):
- F: receive the chunk's input from the previous stage (stages after the first), forward, send the
  output to the next stage. A chunk re-forwarded later runs F under torch.no_grad: only its K/V
  state is kept (runtime/state.py) and, on stages after the first, its received input, from which
  R re-runs the stage's layers without communicating.
- R: the re-forward with grad, right before the chunk's B.
- B: receive the output gradient from the next stage (stages before the last), Megatron's
  backward_step inside DDP's no_sync for all but the stage's last backward, send the input
  gradient to the previous stage.
A chunk's loss is multiplied by its SpaCO `grad_weight`; SpaCO's forward-only chunks
(`step.forward_only`) have an F without graph and no R or B, and still count their loss and tokens.
Point-to-point goes through runtime/p2p.py; measurement through observers (runtime/observe.py).
"""

from __future__ import annotations

import contextlib

import torch

from megatron_chunkflow.runtime.observe import observing


class StageRun:
    """The state of one stage between its ops: activations awaiting B, inputs kept for R."""

    def __init__(self, *, step, ops, model, config, link, store, forward_step_func, observers,
                 forward_only: bool, collect_non_loss_data: bool, is_first: bool, is_last: bool):
        from megatron.core.utils import get_model_type

        self.step, self.ops, self.model, self.config = step, ops, model, config
        self.link, self.store, self.forward_step_func = link, store, forward_step_func
        self.observers = observers
        self.forward_only, self.collect_non_loss_data = forward_only, collect_non_loss_data
        self.is_first, self.is_last = is_first, is_last
        self.model_type = get_model_type(model)
        sp = config.tensor_model_parallel_size if config.sequence_parallel else 1
        self.shapes = {c: (m.local_tokens // sp, 1, config.hidden_size)
                       for c, m in step.metas.items()}
        self.recomputed = step.plan.recomputed
        self.last_backward = max((i for i, op in enumerate(ops) if op.kind == "B"), default=-1)
        self.forward_data_store: list = []
        # on the model's device: finalize_model_grads reduces it (NCCL needs a GPU tensor)
        self.total_num_tokens = torch.zeros([], dtype=torch.int,
                                            device=next(model.parameters()).device)
        self.held: dict[int, tuple] = {}  # chunk -> (input tensor, output tensor) awaiting B
        self.saved_inputs: dict[int, torch.Tensor] = {}  # inputs of forwards without graph

    def run(self) -> tuple[list, torch.Tensor]:
        """Execute every op; returns (forward_data_store, total_num_tokens)."""
        for i, op in enumerate(self.ops):
            if op.kind == "B":
                self._backward(i, op)
            else:
                self._forward(i, op)
        if self.link is not None:
            self.link.wait()
        assert not self.held and not self.saved_inputs, "plan left activations behind"
        return self.forward_data_store, self.total_num_tokens

    # ---- ops ------------------------------------------------------------------------------------
    def _forward(self, i: int, op) -> None:
        chunk = op.chunk
        dropped = chunk in self.step.forward_only
        keep = not self.forward_only and not (
            op.kind == "F" and (chunk in self.recomputed or dropped))
        input_tensor = self._forward_input(op)
        output, num_tokens = self._run_forward(i, op, input_tensor, keep, record=(
            keep or self.forward_only or dropped))
        if op.kind == "F" and not self.is_last:
            with observing(self.observers, "communicate", "send_forward", op):
                self.link.send_forward(output)
        if keep:
            self.total_num_tokens += num_tokens
            if not self.is_last:
                from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

                deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
            self.held[chunk] = (input_tensor, output)
        elif dropped and not self.forward_only:
            self.total_num_tokens += num_tokens

    def _forward_input(self, op):
        """The stage input of F (received) or R (kept at F); None on the first stage."""
        if self.is_first:
            return None
        if op.kind == "R":
            for observer in self.observers:
                observer.input_released(op.chunk)
            return self.saved_inputs.pop(op.chunk).requires_grad_()
        with observing(self.observers, "communicate", "recv_forward", op):
            tensor = self.link.recv_forward(self.shapes[op.chunk])
        if op.chunk in self.recomputed and not self.forward_only:
            self.saved_inputs[op.chunk] = tensor.detach()
            for observer in self.observers:
                observer.input_kept(op.chunk, tensor)
        return tensor

    def _run_forward(self, i: int, op, input_tensor, keep: bool, record: bool):
        from megatron.core.pipeline_parallel.schedules import forward_step

        meta = self.step.metas[op.chunk]
        step_func = self.forward_step_func if meta.grad_weight == 1 else \
            _weighted_loss(self.forward_step_func, meta.grad_weight)
        self.store.begin(meta, reforward=op.kind == "R")
        try:
            with observing(self.observers, "forward", op, keep), \
                    (contextlib.nullcontext() if keep else torch.no_grad()):
                return forward_step(
                    step_func, iter([self.step.inputs[op.chunk]]), self.model,
                    len(self.step.metas), input_tensor,
                    self.forward_data_store if record else [], self.config, 1,
                    self.collect_non_loss_data, is_first_microbatch=(i == 0),
                    current_microbatch=i, is_last_stage=self.is_last)
        finally:
            self.store.end()

    def _backward(self, i: int, op) -> None:
        from megatron.core.pipeline_parallel.schedules import backward_step

        grad = None
        if not self.is_last:
            with observing(self.observers, "communicate", "recv_backward", op):
                grad = self.link.recv_backward(self.shapes[op.chunk])
        input_tensor, output = self.held.pop(op.chunk)
        no_sync = self.config.no_sync_func or contextlib.nullcontext
        # Megatron's activation recompute (full or selective) re-runs attention inside the
        # backward: it needs the chunk's context too (reading the state, storing nothing).
        self.store.begin(self.step.metas[op.chunk], reforward=True)
        try:
            with observing(self.observers, "backward", op), \
                    (contextlib.nullcontext() if i == self.last_backward else no_sync()):
                input_grad = backward_step(input_tensor, output, grad, self.model_type,
                                           self.config)
        finally:
            self.store.end()
        if not self.is_first:
            with observing(self.observers, "communicate", "send_backward", op):
                self.link.send_backward(input_grad)


def _weighted_loss(forward_step_func, weight: float):
    """The same forward step with its loss (not the reported value) multiplied by `weight`."""

    def step_func(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)

        def weighted(*args, **kwargs):
            loss, *rest = loss_func(*args, **kwargs)
            return (loss * weight, *rest)

        return output, weighted

    return step_func
