"""The training loop behind `chunkflow train`: ChunkFlow, or a stock-Megatron baseline.

    history = train(settings, job, dataset, on_step=print)   # job: mcore/dist.py init_distributed

Per step, every rank takes the same global batch of `global_batch_size` sequences (a seeded
shuffle of the dataset, epoch after epoch, data/sampler.py) and takes one step through
mcore/step.py (training_step: ChunkFlow's plan and schedule, or Megatron's own, then Megatron's
optimizer). The loop itself only loads a checkpoint, runs steps, reports each step's metrics and
saves (training/checkpoint.py: Checkpointer).
"""

from __future__ import annotations

import dataclasses
import math
import time

from megatron_chunkflow.core.costs import sequence_model_flops
from megatron_chunkflow.data.sampler import BatchSampler
from megatron_chunkflow.data.store import batch_lengths, global_batch
from megatron_chunkflow.mcore.settings import TrainSettings
from megatron_chunkflow.mcore.step import (
    Training,
    build_training,
    peak_memory_bytes,
    training_step,
)
from megatron_chunkflow.runtime.loss import global_loss
from megatron_chunkflow.training.checkpoint import Checkpointer


class Diverged(RuntimeError):
    """A step's loss or gradient norm was not finite: training stopped before saving it."""


def train(s: TrainSettings, job, dataset, on_step=None) -> list[dict]:
    """Run the loop on `job` (mcore/job.py); returns one metrics dict per step. A step
    whose loss or gradient norm is not finite (every rank sees the same reduced values) raises
    Diverged before that step is saved: the last checkpoint on disk is the last good one."""
    tr = build_training(s, job)
    checkpointer = Checkpointer(s.checkpoint, tr.model, tr.optimizer, tr.scheduler,
                                dataclasses.asdict(s))
    start, consumed = checkpointer.load()
    sampler = BatchSampler(len(dataset), s.global_batch_size, s.seed)
    if s.memory_check and s.device == "cuda" and start < s.train_iters:
        from megatron_chunkflow.memtrace.guard import check_memory

        check_memory(s, batch_lengths(global_batch(dataset, sampler.batch_at(consumed))))
    history = []
    stop = s.train_iters if not s.exit_interval else min(s.train_iters, start + s.exit_interval)
    if not s.uses_chunkflow and s.parallel.vpp > 1:
        check_stock_interleaving(s, dataset, sampler, start, stop, consumed, job.ranks.dp)
    for it in range(start, stop):
        sequences = global_batch(dataset, sampler.batch_at(consumed))
        metrics = train_step(s, tr, sequences, it)
        consumed += s.global_batch_size
        history.append(metrics)
        if on_step is not None:
            on_step(metrics)
        _check_finite(s, metrics, checkpointer)
        checkpointer.save(it + 1, consumed, last_step=it + 1 == stop)
    if s.checkpoint.save_hf:
        _export_hf(s, tr.model)
    return history


def check_stock_interleaving(s: TrainSettings, dataset, sampler, start: int, stop: int,
                             consumed: int, dp: int) -> None:
    """Stock Megatron with virtual stages: every step's micro-batch count on `dp` DP ranks
    checked against Megatron's interleaved schedule before the first (a step it refuses would
    otherwise end the run mid-training), from the lengths alone."""
    from megatron_chunkflow.core.step import baseline_microbatches
    from megatron_chunkflow.mcore.step import stock_interleaving_problem

    for it in range(start, stop):
        lengths = batch_lengths(global_batch(dataset, sampler.batch_at(consumed)))
        consumed += s.global_batch_size
        mbs = baseline_microbatches(lengths, s.seq_length, dp, s.system)
        problem = stock_interleaving_problem(s, mbs, dp, it)
        if problem:
            raise ValueError(f"{problem} (checked before step {start}: the run would stop "
                             "there)")


def train_step(s: TrainSettings, tr: Training, sequences, it: int) -> dict:
    """One optimizer step on the global batch `sequences`; its metrics."""
    traffic = tr.chunkflow_model.store.cp_traffic if s.parallel.cp > 1 else None
    before = (traffic.gathered, traffic.reduce_scattered) if traffic else None
    t0 = time.perf_counter()
    out = training_step(s, tr, sequences, it)
    loss_sum, count = global_loss(out.reports, tr.job.ranks.tp)
    elapsed = time.perf_counter() - t0
    lengths = batch_lengths(sequences)
    metrics = {
        "step": it + 1, "loss": loss_sum / max(count, 1), "tokens": sum(lengths),
        "loss_tokens": int(count), "tokens_per_s": sum(lengths) / elapsed,
        "model_tflops": sequence_model_flops(lengths, s.shape) / elapsed / 1e12,
        "peak_mem_bytes": peak_memory_bytes(), "num_chunks": out.num_chunks,
        "lr": out.lr, "grad_norm": out.grad_norm, "step_s": elapsed,
    }
    if s.shape.is_moe:  # the balancing loss and each expert's share of the tokens
        from megatron_chunkflow.runtime.moe import step_metrics

        metrics.update(step_metrics(tr.chunkflow_model.store, tr.chunkflow_model.config,
                                    len(lengths), s.parallel.tp * s.parallel.cp))
    if traffic:  # what this rank received in ChunkFlow's CP attention (runtime/cp.py Traffic)
        metrics.update(cp_kv_received_bytes=traffic.gathered - before[0],
                       cp_grad_received_bytes=traffic.reduce_scattered - before[1])
    if s.sparse.enabled:  # approximate: say so in every record
        metrics.update(_sparse_metrics(s, out.backward, tr.job.groups.dp))
    return metrics


def _check_finite(s: TrainSettings, metrics: dict, checkpointer: Checkpointer) -> None:
    """Megatron-LM's check_for_nan_in_loss_and_grad, for this loop: stop at the first step whose
    loss or gradient norm is inf or nan, naming the step and the flags most likely at fault."""
    loss, norm = metrics["loss"], metrics["grad_norm"]
    if math.isfinite(loss) and (norm is None or math.isfinite(norm)):
        return
    o = s.optimizer
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    value = loss if what == "loss" else norm
    suspects = f"--lr {o.lr:g} (this step applied {metrics['lr']:g})"
    if s.lora is not None:
        suspects += f", --lora-alpha {s.lora.alpha:g}"
    if o.clip_grad == 0:
        suspects += ", --clip-grad 0 (clipping off)"
    kept = (f"the last checkpoint in {s.checkpoint.save} is the last good step"
            if s.checkpoint.save else "nothing was saved (no --save)")
    raise Diverged(f"step {metrics['step']}: the {what} is {value}; training stopped, this step "
                   f"not saved ({kept}). Likely cause: {suspects}")


def _export_hf(s: TrainSettings, model) -> None:
    """--save-hf: the trained model as a Hugging Face checkpoint (LoRA adapters merged)."""
    from pathlib import Path

    from megatron_chunkflow.mcore.hf import save_hf_checkpoint

    load_hf = s.checkpoint.load_hf
    source = Path(load_hf) / "config.json" if load_hf else None
    if s.lora is not None:
        from megatron_chunkflow.mcore.lora import merge_lora

        merge_lora(model)  # the exported weights are W + (alpha / r) B A
    config = (model[0] if isinstance(model, list) else model).config
    save_hf_checkpoint(model, config, s.hf_shape or s.shape, s.checkpoint.save_hf, source)


def _sparse_metrics(s: TrainSettings, backward: tuple[int, int], dp_group) -> dict:
    """SpaCO's per-step record: labelled approximate, with the chunks that ran backward (all DP
    ranks: `dp_group`)."""
    import torch
    import torch.distributed as dist

    from megatron_chunkflow.runtime.p2p import comm_device

    counts = torch.tensor(backward, dtype=torch.int64, device=comm_device())
    dist.all_reduce(counts, group=dp_group)
    return {"approximate": True, "sparse_backward": s.sparse.sparse_backward,
            "backward_chunks": int(counts[0]), "dependent_chunks": int(counts[1])}
