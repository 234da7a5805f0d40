"""The output layer and cross entropy in token pieces: a chunk's logits never exist whole.

    apply_pieced_loss(gpt, piece=4096, vocab_size=151_643)   # the last stage's GPTModel
    losses = gpt(tokens, positions, None, labels=labels, packed_seq_params=...)   # [b, s]

Stock Megatron makes a micro-batch's logits [s, V / TP] in the compute dtype, copies them to fp32
for its vocab-parallel cross entropy, keeps the fp32 softmax for backward and, in backward, makes
an fp32 gradient and its cast back: about 12 bytes per token and vocabulary row at once. At 16K
tokens and Qwen2.5's 151,936 ids that is 4.6 GiB of bf16 logits beside 9.3 GiB of fp32 softmax.
ChunkFlow's chunks are large by design, so this is the largest transient of its step.

PiecedCrossEntropy's forward computes, `piece` tokens at a time, the piece's logits (hidden @
W^T), their fp32 log-sum-exp and the label's logit (vocabulary-parallel under TP: a max, a sum
and the picked logit all-reduced over the TP group, as Megatron's cross entropy does), and keeps
only the hidden states, the weight, the labels and one fp32 log-sum-exp per token. Its backward
runs over blocks of the vocabulary instead, sized so a block's logits for every token are no
more than a piece's for every vocabulary row: it makes the block's logits again, softmax - onehot
(label) from the kept log-sum-exp scaled by each token's incoming gradient, writes that block's
rows of d W = g^T hidden whole (one GEMM, rounded once, as Megatron's own) and adds g W_block
into d hidden, accumulated in fp32. Nothing of the size of the logits or of an fp32 copy of the
weight is ever live; the price is one more logits GEMM per token. It is exact: the same sums,
regrouped (float64 checks in tests/checks/test_exact.py against the whole loss at TP 1, TP 2,
PP 2 and CP 2).

The hidden states enter as Megatron's ColumnParallelLinear takes them: under sequence
parallelism all-gathered over TP (reduce-scattered back in the backward), otherwise copied into
the TP region (the gradient all-reduced). Megatron's padded vocabulary rows (ids >= the real
`vocab_size`) are left out of the softmax, as runtime/loss.py does. Losses come out in fp32 for
half-precision models (Megatron's cross entropy's dtype) and in the model's dtype otherwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_chunkflow.runtime.loss import padded_columns


def _tp(group) -> tuple[int, int]:
    if group is None or dist.get_world_size(group) == 1:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _logits(hidden, weight, first_pad: int, acc):
    """The logits of `hidden` over `weight`'s rows in the accumulation dtype, the padded
    vocabulary rows (from column `first_pad` on) at -inf."""
    logits = (hidden @ weight.t()).to(acc)
    if first_pad < logits.size(-1):
        logits[:, max(first_pad, 0):] = float("-inf")
    return logits


class PiecedCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of hidden [t, h] through the output weight [V / TP, h] against
    labels [t] (global ids), `piece` tokens at a time (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, piece: int, tp_group, vocab_size):
        tp_size, tp_rank = _tp(tp_group)
        acc, t, v_local = _acc_dtype(hidden.dtype), hidden.size(0), weight.size(0)
        start, first_pad = tp_rank * v_local, padded_columns(v_local, vocab_size, tp_rank)
        losses = torch.empty(t, dtype=acc, device=hidden.device)
        lse = torch.empty(t, dtype=acc, device=hidden.device)
        for a in range(0, t, piece):
            b = min(t, a + piece)
            logits = _logits(hidden[a:b], weight, first_pad, acc)
            shift = logits.max(dim=-1).values
            if tp_size > 1:
                dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp_group)
            logits -= shift.unsqueeze(-1)
            local = labels[a:b] - start
            mine = (local >= 0) & (local < v_local)
            picked = logits.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
            picked = torch.where(mine, picked, 0)
            sum_exp = logits.exp_().sum(dim=-1)
            if tp_size > 1:
                dist.all_reduce(sum_exp, group=tp_group)
                dist.all_reduce(picked, group=tp_group)
            lse[a:b] = sum_exp.log() + shift
            losses[a:b] = lse[a:b] - (picked + shift)
            del logits
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.piece, ctx.start, ctx.first_pad = piece, start, first_pad
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, labels, lse = ctx.saved_tensors
        acc, t, v_local = lse.dtype, hidden.size(0), weight.size(0)
        block = max(1, ctx.piece * v_local // max(t, 1))  # vocabulary rows per block
        grad_hidden = (torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
                       if ctx.needs_input_grad[0] else None)
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        scale = grad_losses.to(acc).unsqueeze(-1)
        local = labels - ctx.start  # the label's column on this rank, where it is this rank's
        for a in range(0, v_local, block):
            b = min(v_local, a + block)
            g = _logits(hidden, weight[a:b], ctx.first_pad - a, acc)  # [t, b - a]
            g -= lse.unsqueeze(-1)
            g.exp_()  # softmax over the whole vocabulary (every TP rank's share), this block
            mine = ((local >= a) & (local < b)).to(acc).unsqueeze(-1)  # no host sync
            g.scatter_add_(-1, (local - a).clamp(0, b - a - 1).unsqueeze(-1), -mine)
            g *= scale
            g = g.to(hidden.dtype)
            if grad_weight is not None:
                grad_weight[a:b] = g.t() @ hidden
            if grad_hidden is not None:
                grad_hidden += g @ weight[a:b]
            del g
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None


class _Deferred:
    """The output layer's result before any logits exist: the hidden states as the layer's
    matmul takes them, and its weight. `transpose` (GPTModel's path without labels) makes the
    whole logits after all."""

    def __init__(self, hidden, weight, layer):
        self.hidden, self.weight, self.layer = hidden, weight, layer

    def transpose(self, *dims):
        logits = self.hidden @ self.weight.t()  # [s, b, V / TP]
        return logits.transpose(*dims)


def apply_pieced_loss(gpt, piece: int, vocab_size: int | None = None) -> None:
    """Make a last-stage GPTModel compute its loss (when given labels) `piece` tokens at a time;
    `vocab_size`: the real vocabulary (Megatron's padded rows left out of the softmax)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if piece < 1:
        raise ValueError(f"--chunkflow-loss-piece must be >= 1 to piece the loss, got {piece}")
    layer = gpt.output_layer
    group = layer.tp_group

    def output_layer(hidden, weight=None, runtime_gather_output=None):
        weight = layer.weight if weight is None else weight
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, True, group=group)
        elif _tp(group)[0] > 1:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=group)
        return _Deferred(hidden, weight, layer), None

    original_loss = gpt.compute_language_model_loss

    def compute_language_model_loss(labels, logits):
        if not isinstance(logits, _Deferred):
            return original_loss(labels, logits)
        s, b, h = logits.hidden.shape
        flat = labels.transpose(0, 1).reshape(-1)  # [b s] -> [s b] -> [s * b]
        losses = PiecedCrossEntropy.apply(logits.hidden.reshape(s * b, h), logits.weight, flat,
                                          piece, group, vocab_size)
        return losses.view(s, b).transpose(0, 1).contiguous()  # [b, s]

    layer.forward = output_layer
    gpt.compute_language_model_loss = compute_language_model_loss
    gpt.chunkflow_loss_piece = piece
