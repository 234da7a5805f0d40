"""One pipeline stage executing its list of plan ops with Megatron's forward_step and backward_step.

Each op of core/schedule.py's plan for this stage, in order (Megatron letters: activations
[t, b=1, h], t split over TP under sequence parallelism):
- F: receive the chunk's input from the previous stage (stages after the first), forward, send the
  output to the next stage. A chunk re-forwarded later runs F under torch.no_grad: only its K/V
  state is kept (runtime/state.py) and, on stages after the first, its received input, from which
  R re-runs the stage's layers without communicating.
- R: the re-forward with grad, right before the chunk's B. With --chunkflow-reforward-attention
  keep / offload, F keeps each layer's attention output and R skips the attention
  (runtime/reforward.py); the store drops what is left after the chunk's B on the stage.
- B: receive the output gradient from the next stage (stages before the last), Megatron's
  backward_step inside DDP's no_sync for all but the stage's last backward, send the input
  gradient to the previous stage.
A chunk's loss is multiplied by its SpaCO `grad_weight`; SpaCO's forward-only chunks
(`step.forward_only`) have an F without graph and no R or B, and still count their loss and tokens.
With virtual stages (plan.num_model_chunks V > 1) each op names its model chunk: the rank runs it
on that chunk's module, and the op's virtual stage (model chunk x PP + rank) decides whether it
receives or sends (the first virtual stage reads data, the last computes the loss). Receives are
matched to each neighbour's send order by `Inbox`. Point-to-point goes through runtime/p2p.py;
measurement through observers (runtime/observe.py).
"""

from __future__ import annotations

import contextlib

import torch

from megatron_chunkflow import compat
from megatron_chunkflow.runtime.observe import observing


class StageRun:
    """The state of one stage between its ops: activations awaiting B, inputs kept for R. With
    virtual stages the rank runs ops on several model chunks (`models[op.model_chunk]`)."""

    def __init__(self, *, step, ops, models, config, link, store, forward_step_func, observers,
                 forward_only: bool, collect_non_loss_data: bool, stage: int):
        self.step, self.ops, self.models, self.config = step, ops, models, config
        self.link, self.store, self.forward_step_func = link, store, forward_step_func
        self.observers = observers
        self.forward_only, self.collect_non_loss_data = forward_only, collect_non_loss_data
        self.stage, self.plan = stage, step.plan
        self.num_virtual = step.plan.num_virtual_stages
        sp = config.tensor_model_parallel_size if config.sequence_parallel else 1
        self.shapes = {c: (m.local_tokens // sp, 1, config.hidden_size)
                       for c, m in step.metas.items()}
        self.recomputed = step.plan.recomputed
        self.last_backward = max((i for i, op in enumerate(ops) if op.kind == "B"), default=-1)
        self.first_forward = {}  # model chunk -> index of its first forward (is_first_microbatch)
        for i, op in enumerate(ops):
            self.first_forward.setdefault(op.model_chunk, i)
        self.inbox = Inbox(step.plan, stage, link, self.shapes, forward_only) \
            if link is not None else None
        self.forward_data_store: list = []
        # on the model's device: finalize_model_grads reduces it (NCCL needs a GPU tensor)
        self.total_num_tokens = torch.zeros([], dtype=torch.int,
                                            device=next(models[0].parameters()).device)
        self.held: dict[tuple, tuple] = {}  # (chunk, model chunk) -> (input, output) awaiting B
        self.saved_inputs: dict[tuple, torch.Tensor] = {}  # inputs of forwards without graph

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

    def _virtual(self, op) -> int:
        return self.plan.virtual_stage(self.stage, op)

    # ---- ops ------------------------------------------------------------------------------------
    def _forward(self, i: int, op) -> None:
        chunk, k = op.chunk, self._virtual(op)
        is_last = k == self.num_virtual - 1
        dropped = chunk in self.step.forward_only
        keep = not self.forward_only and not (
            op.kind == "F" and (chunk in self.recomputed or dropped))
        input_tensor = self._forward_input(op, k)
        # the first forward of a chunk re-forwarded later keeps its attention for the re-forward
        # under --chunkflow-reforward-attention keep / offload (runtime/reforward.py)
        keeps_attention = op.kind == "F" and not keep and not dropped and not self.forward_only
        output, num_tokens = self._run_forward(i, op, input_tensor, keep, is_last, record=(
            keep or self.forward_only or dropped), keeps_attention=keeps_attention)
        if op.kind == "F" and not is_last:
            with observing(self.observers, "communicate", "send_forward", op):
                self.link.send_forward(output)
        if keep:
            self.total_num_tokens += num_tokens
            if not is_last:
                from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

                deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
            self.held[chunk, op.model_chunk] = (input_tensor, output)
        elif dropped and not self.forward_only:
            self.total_num_tokens += num_tokens

    def _forward_input(self, op, k: int):
        """The stage input of F (received) or R (kept at F); None on the first stage."""
        if k == 0:
            return None
        key = (op.chunk, op.model_chunk)
        if op.kind == "R":
            for observer in self.observers:
                observer.input_released(key)
            return self.saved_inputs.pop(key).requires_grad_()
        with observing(self.observers, "communicate", "recv_forward", op):
            tensor = self.inbox.take("F", op.chunk, k - 1)
        if op.chunk in self.recomputed and not self.forward_only:
            self.saved_inputs[key] = tensor.detach()
            for observer in self.observers:
                observer.input_kept(key, tensor)
        return tensor

    def _run_forward(self, i: int, op, input_tensor, keep: bool, is_last: bool, record: bool,
                     keeps_attention: bool = False):
        from megatron.core.pipeline_parallel.schedules import forward_step

        meta = self.step.metas[op.chunk]
        step_func = self.forward_step_func if meta.grad_weight == 1 else \
            _weighted_loss(self.forward_step_func, meta.grad_weight)
        vp_stage = op.model_chunk if len(self.models) > 1 else None
        self.store.begin(meta, reforward=op.kind == "R", keep_attention=keeps_attention)
        try:
            with observing(self.observers, "forward", op, keep), \
                    (contextlib.nullcontext() if keep else torch.no_grad()):
                return forward_step(
                    step_func, iter([self.step.inputs[op.chunk]]), self.models[op.model_chunk],
                    len(self.step.metas), input_tensor,
                    self.forward_data_store if record else [], self.config, 1,
                    self.collect_non_loss_data,
                    is_first_microbatch=(i == self.first_forward[op.model_chunk]),
                    current_microbatch=i, vp_stage=vp_stage, is_last_stage=is_last)
        finally:
            self.store.end()

    def _backward(self, i: int, op) -> None:
        k = self._virtual(op)
        grad = None
        if k < self.num_virtual - 1:
            with observing(self.observers, "communicate", "recv_backward", op):
                grad = self.inbox.take("B", op.chunk, k + 1)
        input_tensor, output = self.held.pop((op.chunk, op.model_chunk))
        # Megatron's activation recompute (full or selective) re-runs attention inside the
        # backward: it needs the chunk's context too (reading the state, storing nothing).
        self.store.begin(self.step.metas[op.chunk], reforward=True)
        try:
            with observing(self.observers, "backward", op), \
                    (contextlib.nullcontext() if i == self.last_backward else _no_sync(self.config)):
                input_grad = compat.backward_step(input_tensor, output, grad, self.config)
        finally:
            self.store.end()
        if op.model_chunk == 0:  # the chunk's last backward on this rank (its V model chunks)
            self.store.release_attention(self.step.metas[op.chunk])
        if k > 0:
            with observing(self.observers, "communicate", "send_backward", op):
                self.link.send_backward(input_grad)


class Inbox:
    """This rank's receives, matched to the sends in the order each neighbour makes them.

    Every rank knows every rank's plan, so it knows the sequence of messages each neighbour sends
    it: an F's output to the rank of the next virtual stage, a B's input gradient to the rank of
    the previous one. Point-to-point messages between two ranks are matched in the order they are
    posted (NCCL and gloo), so `take` receives, in that order, every message of the sender up to
    the one wanted, keeping the others until their op asks for them. Without virtual stages the
    plan's shared forward and backward orders make that the wanted one every time; with them (and
    with PP = 2, where both neighbours are one rank) messages may arrive ahead of their op."""

    def __init__(self, plan, stage: int, link, shapes: dict, forward_only: bool):
        self.link, self.shapes, self.stage = link, shapes, stage
        p, n = plan.num_stages, plan.num_virtual_stages
        self.expected: dict[int, list] = {}  # sender rank -> [(kind, chunk, sender's stage)]
        for sender, ops in enumerate(plan.stages):
            for op in ops:
                k = plan.virtual_stage(sender, op)
                if op.kind == "F" and k + 1 < n and (k + 1) % p == stage:
                    self.expected.setdefault(sender, []).append(("F", op.chunk, k))
                elif op.kind == "B" and k > 0 and (k - 1) % p == stage and not forward_only:
                    self.expected.setdefault(sender, []).append(("B", op.chunk, k))
        self.position = dict.fromkeys(self.expected, 0)
        self.arrived: dict[tuple, torch.Tensor] = {}
        self.p = p

    def take(self, kind: str, chunk: int, sender_stage: int) -> torch.Tensor:
        """The activation (kind F) or gradient (kind B) that virtual stage `sender_stage` sends
        for `chunk`."""
        want = (kind, chunk, sender_stage)
        sender = sender_stage % self.p
        queue = self.expected[sender]
        while want not in self.arrived:
            message = queue[self.position[sender]]
            self.position[sender] += 1
            shape = self.shapes[message[1]]
            # the communicator's "previous" rank sends forwards, its "next" rank gradients (one
            # rank when PP = 2: then the two calls receive from the same queue)
            self.arrived[message] = (self.link.recv_forward(shape) if message[0] == "F"
                                     else self.link.recv_backward(shape))
        return self.arrived.pop(want)


def _no_sync(config):
    """DDP's no_sync for every model chunk of this rank (Megatron's config.no_sync_func, a list
    with virtual stages)."""
    funcs = config.no_sync_func
    if funcs is None:
        return contextlib.nullcontext()
    if not isinstance(funcs, list):
        return funcs()
    stack = contextlib.ExitStack()
    for func in funcs:
        stack.enter_context(func())
    return stack


def _weighted_loss(forward_step_func, weight: float):
    """The same forward step with its loss (not the reported value) multiplied by `weight`."""

    def step_func(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)

        def weighted(*args, **kwargs):
            loss, *rest = loss_func(*args, **kwargs)
            return (loss * weight, *rest)

        return output, weighted

    return step_func
