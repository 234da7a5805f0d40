"""SpaCO against the exact gradient: the mean of many sparse gradients, and its expected error.

    chunkflow verify --chunkflow-sparse-backward 2 --draws 64       # CLI (cli/verify.py)

The exact gradient g is stock Megatron's (checks/verify.py's reference, PP = 1); then one
ChunkFlow model with the same weights runs the same batch `draws` times, each time with a fresh
SpaCO draw (sparse.sparsify with step_index = the draw), and keeps the running mean and, per
coordinate, the sum of squared deviations (Welford). Reported, over every trainable parameter
(each TP shard and pipeline stage counted once):
- rel_err_of_mean = ||mean - g|| / ||g||;
- expected_rel_err = sqrt(trace(Var) / N) / ||g||, trace(Var) estimated from the draws (sample
  variance about their own mean, so a bias would show as rel_err_of_mean >> expected_rel_err);
- the same error after the first 1, 4, 16, ... draws (it should fall like 1 / sqrt(draws));
- with `blocks` (tests): for each block size b, the squared relative error of the mean of every
  disjoint block of b consecutive draws (E = sigma^2 / b for unbiased i.i.d. draws).
`exhaustive=True` replaces the random draws by every selection with its probability: the mean is
then E[sparse gradient] itself (exact up to rounding) and `rel_std` is sqrt(E||g_hat - g||^2)/||g||.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_chunkflow.checks.verify import _run_reference, build_chunked_model
from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.data.synthetic import make_sequences
from megatron_chunkflow.mcore.names import full_model_name
from megatron_chunkflow.mcore.step import forward_backward
from megatron_chunkflow.runtime.execute import plan_step
from megatron_chunkflow.runtime.loss import global_loss, make_forward_step
from megatron_chunkflow.runtime.sparse import inclusion_probability, sparsify


@dataclass
class SparseVerifyResult:
    t: int
    draws: int  # random draws, or the number of selections when exhaustive
    loss_ref: float
    loss_sparse: float  # every chunk runs forward, so the loss value is the exact one
    rel_err_of_mean: float
    expected_rel_err: float  # random draws: sqrt(trace Var / N) / ||g||; exhaustive: 0
    rel_std: float  # one draw's RMS relative error: sqrt(E||g_hat - g||^2) / ||g||
    curve: list[tuple[int, float]] = field(default_factory=list)  # (n, rel err of first n)
    block_sq_errors: dict[int, list[float]] = field(default_factory=dict)  # b -> per block
    backward_fraction: float = 0.0  # mean share of dependent chunks back-propagated
    num_dependent: int = 0


def run_sparse_verify(shape, lengths: Sequence[int], chunkflow: ChunkFlowConfig, t: int,
                      draws: int = 16, dtype=torch.float64, seed: int = 0, draw_seed: int = 0,
                      parallel: ParallelConfig = ParallelConfig(), lora=None,
                      exhaustive: bool = False, blocks: Sequence[int] = (),
                      model_class: str = "gpt") -> SparseVerifyResult:
    """One batch: the exact gradient, then `draws` SpaCO gradients (or all selections)."""
    from megatron_chunkflow.mcore.dist import init_distributed

    sequences = make_sequences(lengths, shape.vocab_size, seed)
    reference_job = init_distributed(ParallelConfig(tp=parallel.tp), seed)
    ref_state, [(ref_loss, ref_count, ref_grads, _)] = _run_reference(
        reference_job, shape, [sequences], dtype, lora, seed, model_class)
    job = init_distributed(parallel, seed)
    cm = build_chunked_model(job, shape, ref_state, dtype, chunkflow, lora, model_class)
    base = plan_step(sequences, chunkflow, job.parallel, shape, job.ranks)
    batch = base.batch
    step_fn = make_forward_step(job.groups.tp, exact_loss=True)
    # (this stage's name, the PP = 1 model's name, parameter) over every model chunk
    params = [(n, full_model_name(n, model), p)
              for model in cm.models for n, p in model.named_parameters() if p.requires_grad]
    counted = _counted(params)
    g = torch.cat([ref_grads[full].double().flatten() for _, full, _ in params])
    group = job.groups.mp

    def norm2(x: torch.Tensor) -> float:
        total = torch.tensor([float((x[counted] ** 2).sum())], dtype=torch.float64)
        dist.all_reduce(total, group=group)
        return float(total)

    g_norm = math.sqrt(norm2(g))
    samples = _selections(batch, t) if exhaustive else \
        ((dict(seed=draw_seed, step_index=d), 1.0 / draws) for d in range(draws))
    mean, m2 = torch.zeros_like(g), torch.zeros_like(g)
    weight_sum, sq_err, n, kept, dep = 0.0, 0.0, 0, 0, 0
    curve, loss = [], 0.0
    block_sums = {b: torch.zeros_like(g) for b in blocks}
    block_errors: dict[int, list[float]] = {b: [] for b in blocks}
    for how, prob in samples:
        step = sparsify(base, t, **how)
        kept += sum(1 for c, m in step.metas.items() if m.dependent and c not in step.forward_only)
        dep += sum(1 for m in step.metas.values() if m.dependent)
        reports = forward_backward(job, cm, step, step_fn)
        loss_sum, count = global_loss(reports, job.ranks.tp)
        assert count == ref_count, f"token counts differ: {count} vs {ref_count}"
        loss = loss_sum / max(count, 1)
        x = torch.cat([p.main_grad.double().flatten() for *_, p in params])
        n += 1
        sq_err += prob * norm2(x - g)
        if exhaustive:
            mean += prob * x
            continue
        weight_sum += 1.0  # Welford: running mean and sum of squared deviations
        delta = x - mean
        mean += delta / weight_sum
        m2 += delta * (x - mean)
        if n & (n - 1) == 0 and (n.bit_length() - 1) % 2 == 0 or n == draws:  # 1, 4, 16, ...
            curve.append((n, math.sqrt(norm2(mean - g)) / g_norm))
        for b, acc in block_sums.items():
            acc += x
            if n % b == 0:
                block_errors[b].append(norm2(acc / b - g) / g_norm ** 2)
                acc.zero_()
    counts = torch.tensor([kept, dep], dtype=torch.float64)
    dist.all_reduce(counts, group=job.groups.dp)
    rel_err = math.sqrt(norm2(mean - g)) / g_norm
    trace_var = _masked_sum(m2, counted, group) / (n - 1) if n > 1 else 0.0
    expected = 0.0 if exhaustive else math.sqrt(trace_var / n) / g_norm
    return SparseVerifyResult(
        t=t, draws=n, loss_ref=ref_loss / max(ref_count, 1), loss_sparse=loss,
        rel_err_of_mean=rel_err, expected_rel_err=expected, rel_std=math.sqrt(sq_err) / g_norm,
        curve=curve if not exhaustive else [(n, rel_err)], block_sq_errors=block_errors,
        backward_fraction=float(counts[0] / counts[1]) if counts[1] else 1.0,
        num_dependent=int(counts[1]) // max(n, 1))


def _masked_sum(x: torch.Tensor, counted: torch.Tensor, group) -> float:
    total = torch.tensor([float(x[counted].sum())], dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return float(total)


def _counted(params) -> torch.Tensor:
    """Per coordinate: whether it counts in a norm over the model-parallel group (TP-replicated
    parameters on TP rank 0 only; a tied embedding's copy on the last stage not at all)."""
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    flags = []
    for n, full, p in params:
        tied_copy = full != n and full == "embedding.word_embeddings.weight"
        flags.append(torch.full((p.numel(),), param_is_not_tensor_parallel_duplicate(p)
                                and not tied_copy, dtype=torch.bool))
    return torch.cat(flags) if flags else torch.zeros(0, dtype=torch.bool)


def _selections(batch, t: int, limit: int = 1 << 12):
    """Every selection of the batch's long sequences with its probability (exhaustive mode)."""
    seqs = {}
    for c in batch.chunks:
        if c.is_dependent:
            seqs[c.parent] = c.num_siblings
    seqs = {s: k for s, k in seqs.items() if inclusion_probability(k, t) < 1}
    total = 2 ** sum(seqs.values())
    if total > limit:
        raise ValueError(f"exhaustive SpaCO check: {total} selections (more than {limit})")
    masks = [list(itertools.product([False, True], repeat=k)) for k in seqs.values()]
    for combo in itertools.product(*masks):
        prob = 1.0
        for (s, k), mask in zip(seqs.items(), combo):
            p = inclusion_probability(k, t)
            prob *= math.prod(p if m else 1 - p for m in mask)
        yield dict(selected=dict(zip(seqs, combo)), step_index=0), prob
