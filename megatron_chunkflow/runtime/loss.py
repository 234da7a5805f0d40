"""Per-token loss for data chunks: (sum of masked token losses, token count).

The gradient is divided once, by the global (DP-wide) token count, in Megatron's
finalize_model_grads (config.calculate_per_token_loss=True), so chunked and unchunked training give
the same loss and the same gradients.

`forward_step` (a Megatron forward_step_func; `make_forward_step` binds it) runs the model on one
chunk and returns `token_loss_sum` as its loss function. `vocab_parallel_token_losses` is the cross
entropy over TP-sharded logits in the logits' own dtype. megatron-core's
vocab_parallel_cross_entropy casts logits to fp32 inside its autograd Function, which is right for
bf16 training and makes float64 exactness checks impossible; this one is used when `exact_loss` is
set (float64 training, the checks) and matches it in fp32.

Megatron pads the vocabulary (embedding and output rows) to a multiple of 128 x TP; Megatron-LM
leaves the padded rows inside the softmax, so its loss depends on TP and differs from the Hugging
Face model's. Given the real `vocab_size`, both cross entropies here set those logits to -inf
(`mask_padded_vocab_`): the loss is the Hugging Face one at every TP, and the padded rows get no
gradient.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist


def _tp(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def padded_columns(v_local: int, vocab_size: int | None, tp_rank: int) -> int:
    """The first local column of this TP rank's logits shard that is a padded vocabulary row
    (v_local when none is)."""
    if vocab_size is None:
        return v_local
    return min(max(vocab_size - tp_rank * v_local, 0), v_local)


def mask_padded_vocab_(logits: torch.Tensor, vocab_size: int | None, tp_group=None):
    """Set the logits of Megatron's padded vocabulary rows (ids >= vocab_size) to -inf, in place
    and recorded by autograd (their gradient is zero); no copy of the logits is made."""
    first = padded_columns(logits.size(-1), vocab_size, _tp(tp_group)[1])
    if first < logits.size(-1):
        logits[..., first:] = float("-inf")
    return logits


def vocab_parallel_token_losses(logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                                vocab_size: int | None = None):
    """logits [..., V/tp] (this rank's vocab shard), labels [...] -> per-token losses [...].

    `vocab_size`: the real vocabulary; logits of Megatron's padding rows beyond it are left out
    of the softmax (as a Hugging Face model, which has no padding rows, computes it).
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_size, tp_rank = _tp(tp_group)
    v_local = logits.size(-1)
    start = tp_rank * v_local
    if padded_columns(v_local, vocab_size, tp_rank) < v_local:
        logits = mask_padded_vocab_(logits.clone(), vocab_size, tp_group)
    with torch.no_grad():
        shift = logits.max(dim=-1).values
        if tp_size > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp_group)
    z = logits - shift.unsqueeze(-1)
    sum_exp = z.exp().sum(dim=-1)
    in_range = (labels >= start) & (labels < start + v_local)
    local = (labels - start).clamp(0, v_local - 1)
    # where, not a product: a label outside this shard may index a padded (-inf) column
    picked = torch.where(in_range, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0)
    if tp_size > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, tp_group)
        picked = reduce_from_tensor_model_parallel_region(picked, tp_group)
    return sum_exp.log() - picked


def token_loss_sum(labels: torch.Tensor, loss_mask: torch.Tensor, output: torch.Tensor,
                   tp_group=None, exact: bool = True, vocab_size: int | None = None):
    """Megatron loss_func contract (3-tuple): (loss sum, token count, {'lm loss': [sum, count]}).

    `output` is the model's output on the last stage: logits [b, s, V/tp], or the per-token losses
    [b, s] that GPTModel computes itself when given labels (`forward_step` does that when it is
    not `exact` and no padded row needs masking). Logits not `exact`: Megatron's vocab-parallel
    cross entropy (fp32) after masking the padded rows.
    """
    if output.dim() == labels.dim():  # the model's own per-token losses (pieced or Megatron's)
        losses = output
    elif exact:
        losses = vocab_parallel_token_losses(output, labels, tp_group, vocab_size)
    else:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        losses = vocab_parallel_cross_entropy(mask_padded_vocab_(output, vocab_size, tp_group),
                                              labels)
    # half precision sums in float32; the report is float64, so token counts stay exact
    acc = torch.float32 if losses.dtype in (torch.float16, torch.bfloat16) else losses.dtype
    loss = (losses.to(acc) * loss_mask.to(acc)).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    report = torch.stack([loss.detach().double(), num_tokens.double()])
    return loss, num_tokens, {"lm loss": report}


def global_loss(reports, tp: int) -> tuple[float, float]:
    """(loss sum, token count) over the whole job from the last stages' loss reports (every one of
    the job's `tp` tensor-parallel ranks reports the same).

    A collective over all ranks: every rank must call it, those without reports add nothing.
    """
    from megatron_chunkflow.runtime.p2p import comm_device

    device = comm_device()
    total = sum((r["lm loss"].double().to(device) for r in reports),
                torch.zeros(2, dtype=torch.float64, device=device))
    dist.all_reduce(total)
    return float(total[0]) / tp, float(total[1]) / tp  # every TP rank reports the same


def forward_step(data_iterator, model, tp_group=None, exact_loss: bool = True,
                 vocab_size: int | None = None):
    """A Megatron forward_step_func over runtime.inputs.ChunkInput batches: THD for chunks, SBHD
    [s, b=1] for whole sequences (packed_seq_params None).

    exact_loss: cross entropy in the logits' dtype (vocab_parallel_token_losses); otherwise
    GPTModel computes the per-token loss itself from labels (Megatron's fp32 vocab-parallel cross
    entropy). vocab_size: the real vocabulary; Megatron's padded rows beyond it are left out of
    the softmax (the model then returns logits and the loss function masks them)."""
    inp = next(data_iterator)
    device = next(model.parameters()).device
    if inp.tokens.device != device:  # plans are built on the host; the model may be on a GPU
        inp = inp.to(device)
    rows, pieced = _model_vocab(model)
    padded = vocab_size is not None and (rows is None or vocab_size < rows)
    # a pieced loss (runtime/pieced_loss.py) takes labels: exact in the model's dtype, padded
    # vocabulary rows masked
    labels = inp.labels if pieced or not (exact_loss or padded) else None
    output = model(inp.tokens, inp.position_ids, None, labels=labels,
                   packed_seq_params=inp.packed_seq_params)
    return output, partial(token_loss_sum, inp.labels, inp.loss_mask, tp_group=tp_group,
                           exact=exact_loss, vocab_size=vocab_size)


def _model_vocab(model) -> tuple[int | None, bool]:
    """The model's vocabulary rows (padded; None when the wrapped model does not say), and
    whether it computes its loss in pieces."""
    while hasattr(model, "module"):  # DDP, Float16Module
        model = model.module
    return getattr(model, "vocab_size", None), bool(getattr(model, "chunkflow_loss_piece", 0))


def make_forward_step(tp_group, exact_loss: bool = False, vocab_size: int | None = None):
    """forward_step bound to this rank's tensor-parallel group (the job's: mcore/job.py
    Job.groups.tp)."""
    return partial(forward_step, tp_group=tp_group, exact_loss=exact_loss, vocab_size=vocab_size)
