"""Chunked against unchunked training on real megatron-core: loss and every parameter gradient.

The reference is stock Megatron: each sequence whole as one micro-batch, the model's own local
DotProductAttention (causal), Megatron's forward_backward_no_pipelining, DDP and finalize_model_grads.
The chunked run is a second GPTModel with the same weights, patched by apply_chunkflow, executing the
core planner's plan through forward_backward_chunkflow. Both use per-token loss, so both gradients are
(sum of masked token-loss gradients) / (global token count).

Run in every process of a job (one process, or torchrun with world = TP x DP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.schedule import state_aware_plan
from megatron_chunkflow.integration.data import ChunkInput, TokenSequence, build_step
from megatron_chunkflow.integration.loss import token_loss_sum

BOUNDS = {torch.float64: 1e-10, torch.float32: 1e-4}


@dataclass
class VerifyResult:
    loss_ref: float
    loss_chunked: float
    max_rel_grad_err: float
    worst_param: str
    param_errors: list[tuple[str, float]] = field(default_factory=list)
    activation_bytes: dict[str, int] = field(default_factory=dict)
    state_bytes: int = 0


def make_sequences(lengths: Sequence[int], vocab_size: int, seed: int,
                   prompt_fraction: float = 0.3,
                   fully_masked: Sequence[int] = ()) -> list[TokenSequence]:
    """Random tokens; an SFT-like loss mask: the first `prompt_fraction` of targets masked, and
    every target of the sequences in `fully_masked` (prompt-only samples)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        tokens = torch.randint(0, vocab_size, (n,), generator=g)
        mask = torch.ones(n)
        mask[: int(n * prompt_fraction)] = 0
        mask[-1] = 0  # the last token has no target
        if i in fully_masked:
            mask.zero_()
        out.append(TokenSequence(tokens, mask))
    return out


def forward_step(data_iterator, model, tp_group=None):
    """A Megatron forward_step_func: THD for chunks, SBHD [s, b=1] for whole sequences."""
    inp = next(data_iterator)
    output = model(inp.tokens, inp.position_ids, None, packed_seq_params=inp.packed_seq_params)
    return output, partial(token_loss_sum, inp.labels, inp.loss_mask, tp_group=tp_group)


def whole_sequence_input(seq: TokenSequence) -> ChunkInput:
    n = len(seq)
    labels = torch.cat([seq.tokens[1:], seq.tokens.new_zeros(1)])
    return ChunkInput(seq.tokens.view(1, -1), labels.view(1, -1), seq.loss_mask.view(1, -1),
                      torch.arange(n).view(1, -1), None)


def _global_loss(reports) -> tuple[torch.Tensor, torch.Tensor]:
    from megatron.core import parallel_state

    total = sum((r["lm loss"] for r in reports), torch.zeros(2, dtype=torch.float64))
    total = total.to(torch.float64)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return total[0], total[1]


def run_verify(shape: ModelShape, lengths: Sequence[int], chunk_size: int, k: int,
               dtype: torch.dtype = torch.float64, seed: int = 0, backend: str = "torch",
               meter_cls=None, fully_masked: Sequence[int] = (),
               sequence_parallel: bool = False) -> VerifyResult:
    """One training step both ways in this process group; returns the comparison.

    With `sequence_parallel` the chunked model runs with sequence parallelism (chunks padded to a
    multiple of TP) and the reference without: the mathematics is the same.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_chunkflow.integration.build import build_gpt_model, transformer_config, wrap_ddp
    from megatron_chunkflow.integration.model import apply_chunkflow
    from megatron_chunkflow.integration.schedules import forward_backward_chunkflow

    from megatron_chunkflow.config import ChunkFlowConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    cf_config = ChunkFlowConfig(chunk_size=chunk_size, k=k)
    cf_config.check_layout(tp, sequence_parallel)
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if len(lengths) < dp:
        raise ValueError(f"{len(lengths)} sequences for {dp} data-parallel ranks: need at least "
                         "one per rank")
    sequences = make_sequences(lengths, shape.vocab_size, seed, fully_masked=fully_masked)
    step_fn = partial(forward_step, tp_group=tp_group)

    cfg_ref = transformer_config(shape, dtype)
    cfg_cf = transformer_config(shape, dtype, sequence_parallel=sequence_parallel)
    ref = build_gpt_model(shape, cfg_ref)
    chunked = build_gpt_model(shape, cfg_cf)
    chunked.load_state_dict(ref.state_dict())
    store = apply_chunkflow(chunked, backend=backend)
    ref, chunked = wrap_ddp(ref, cfg_ref), wrap_ddp(chunked, cfg_cf)

    mine = [whole_sequence_input(s) for i, s in enumerate(sequences) if i % dp == dp_rank]
    reports_ref = forward_backward_no_pipelining(
        forward_step_func=step_fn, data_iterator=iter(mine), model=ref,
        num_microbatches=len(mine), seq_length=max(lengths), micro_batch_size=1)

    batch = build_chunks(lengths, chunk_size, dp, k, shape)
    chunks = batch.chunks_for_rank(dp_rank)
    plan = state_aware_plan(chunks, 1, k, OpCosts.from_model(chunks, shape, 1))
    step = build_step(plan, sequences, chunk_size,
                      pad_multiple=cf_config.pad_multiple(tp, sequence_parallel))
    meter = meter_cls(chunked, store) if meter_cls is not None else None
    reports_cf = forward_backward_chunkflow(
        forward_step_func=step_fn, data_iterator=iter([step]), model=chunked,
        num_microbatches=len(chunks), seq_length=chunk_size, micro_batch_size=1, meter=meter)

    loss_ref, n_ref = _global_loss(reports_ref)
    loss_cf, n_cf = _global_loss(reports_cf)
    assert n_ref == n_cf, f"token counts differ: {n_ref} vs {n_cf}"
    errors = _grad_errors(ref.module, chunked.module)
    worst = max(errors, key=lambda e: e[1])
    result = VerifyResult(
        loss_ref=float(loss_ref / n_ref.clamp(min=1)),
        loss_chunked=float(loss_cf / n_cf.clamp(min=1)),
        max_rel_grad_err=worst[1], worst_param=worst[0], param_errors=errors)
    if meter is not None:
        result.activation_bytes = {"chunked": meter.peak_activation + meter.peak_state}
        result.state_bytes = meter.peak_state
    return result


def _grad_errors(ref, chunked) -> list[tuple[str, float]]:
    """Per parameter: max |g_chunked - g_ref| / max |g_ref|, maxima taken over all ranks."""
    names, stats = [], []
    for (name, p_ref), (_, p_cf) in zip(ref.named_parameters(), chunked.named_parameters()):
        g_ref, g_cf = p_ref.main_grad.double(), p_cf.main_grad.double()
        names.append(name)
        stats.append(torch.stack([(g_cf - g_ref).abs().max(), g_ref.abs().max()]))
    stats = torch.stack(stats)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return [(n, float(d / s) if s > 0 else float(d)) for n, (d, s) in zip(names, stats.tolist())]
