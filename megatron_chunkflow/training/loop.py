"""The training loop behind `chunkflow train`: ChunkFlow, or the stock-Megatron baseline.

    model, ... = build_training(settings); train(settings, dataset, on_step=print)

Per step, every rank takes the same global batch of `global_batch_size` sequences (a seeded shuffle
of the dataset, epoch after epoch, data/sampler.py) and then:
- ChunkFlow: runtime/execute.py's plan_step (cut, pack, distribute over DP, plan for PP) and
  execute_step;
- a stock baseline (--no-chunkflow; core/step.py: megatron-sft, megatron-packed or
  megatron-unpacked): whole sequences in micro-batches of at most --seq-length, dealt round-robin
  over DP, Megatron's own get_forward_backward_func() (1F1B for PP >= 2: fixed --seq-length
  shapes for megatron-sft, else its variable_seq_lengths shape exchange), Megatron's recompute as
  configured.
Both then run Megatron's optimizer (get_megatron_optimizer: Adam, weight decay, gradient clipping) and
OptimizerParamScheduler (linear warmup, cosine decay), per-token loss throughout. The loop itself
only loads a checkpoint, runs steps and saves (training/checkpoint.py: Checkpointer).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from megatron_chunkflow.core.costs import sequence_model_flops
from megatron_chunkflow.core.step import baseline_microbatches
from megatron_chunkflow.data.sampler import BatchSampler
from megatron_chunkflow.data.store import batch_lengths, global_batch
from megatron_chunkflow.runtime.execute import execute_step, plan_step
from megatron_chunkflow.runtime.inputs import chunk_input, chunk_meta
from megatron_chunkflow.runtime.loss import global_loss, make_forward_step
from megatron_chunkflow.runtime.ranks import Ranks
from megatron_chunkflow.runtime.sparse import num_backward_chunks
from megatron_chunkflow.training.checkpoint import Checkpointer
from megatron_chunkflow.training.settings import TrainSettings

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class Training:
    """What build_training makes: this rank's model stage, its K/V store, Megatron's DDP wrapper,
    optimizer and LR scheduler."""

    model: object
    store: object
    ddp: object
    optimizer: object
    scheduler: object


def build_training(s: TrainSettings) -> Training:
    """Model (patched for THD chunk attention), DDP, optimizer and LR scheduler."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_chunkflow.mcore.build import build_gpt_model, transformer_config, wrap_ddp
    from megatron_chunkflow.runtime.model import apply_chunkflow

    dtype = DTYPES[s.dtype]
    config = transformer_config(s.shape, dtype, sequence_parallel=s.parallel.sequence_parallel,
                                **s.recompute.megatron_kwargs())
    model = build_gpt_model(s.shape, config)
    if s.checkpoint.load_hf:
        from megatron_chunkflow.mcore.hf import import_hf_weights

        import_hf_weights(model, s.checkpoint.load_hf, config, s.hf_shape)
    if s.lora is not None:
        from megatron_chunkflow.mcore.lora import apply_lora

        apply_lora(model, s.lora, s.seed)  # freezes the rest: DDP and Adam see adapters only
    # the baseline uses the same attention, as plain THD attention within packed sequences
    store = apply_chunkflow(model, backend=s.chunkflow.attention_backend)
    ddp = wrap_ddp(model, config)
    o = s.optimizer
    opt_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        clip_grad=o.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's train() wires it
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters, lr_decay_steps=s.train_iters,
        lr_decay_style="cosine", start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=s.train_iters, wd_incr_style="constant",
        override_opt_param_scheduler=s.checkpoint.override_lr_schedule,
        use_checkpoint_opt_param_scheduler=not s.checkpoint.override_lr_schedule)
    return Training(model, store, ddp, optimizer, scheduler)


def run_step(s: TrainSettings, sequences, ddp, config, step_index: int = 0, observers=()):
    """Forward and backward of one global batch; returns (loss reports, chunks or micro-batches,
    (dependent chunks back-propagated, dependent chunks) on this rank). `observers`
    (runtime/observe.py) measure ChunkFlow's schedule; Megatron's own schedule does not call them
    (bench/instrument.py wraps it)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ranks = Ranks.current()
    step_fn = make_forward_step(exact_loss=s.dtype == "float64", vocab_size=s.real_vocab_size)
    if s.uses_chunkflow:
        step = plan_step(sequences, s.chunkflow, s.parallel, s.shape, ranks, sparse=s.sparse,
                         seed=s.seed, step_index=step_index)
        reports = execute_step(step, ddp, step_fn, observers=observers)
        return reports, len(step.batch.chunks), num_backward_chunks(step)
    mbs = baseline_microbatches(batch_lengths(sequences), s.seq_length, ranks.dp, s.system)
    mine = [c for c in mbs if c.dp_rank == ranks.dp_rank]
    if not mine:  # fewer micro-batches than DP ranks: idle, as ChunkFlow's idle ranks are
        _idle_step(ddp, config)
        return [], len(mbs), (0, 0)
    pad = s.parallel.pad_multiple
    inputs = [chunk_input(c, sequences, chunk_meta(c, s.seq_length, pad)) for c in mine]
    # Megatron-LM's SFT path sends fixed --seq-length shapes (every line is padded to it); the
    # others exchange each micro-batch's shape first (variable_seq_lengths)
    fixed = s.system == "megatron-sft"
    config.variable_seq_lengths = s.parallel.pp > 1 and not fixed
    reports = get_forward_backward_func()(
        forward_step_func=step_fn, data_iterator=iter(inputs), model=ddp,
        num_microbatches=len(inputs),
        seq_length=s.seq_length if fixed else max(x.tokens.size(1) for x in inputs),
        micro_batch_size=1)
    return reports, len(mbs), (0, 0)


def _idle_step(ddp, config) -> None:
    """A DP rank without a micro-batch this step: no forward or backward, but the same gradient
    reduction as the others (Megatron's finalize_model_grads, 0 tokens), so it contributes zero
    gradients and no token to the per-token mean and every collective still matches."""
    if config.finalize_model_grads_func is None:
        return
    device = next(ddp.parameters()).device
    config.finalize_model_grads_func([ddp], torch.zeros((), dtype=torch.int, device=device))


def peak_memory_bytes() -> int:
    """GPU: torch.cuda.max_memory_allocated; CPU: the process's peak resident set size."""
    from megatron_chunkflow.mcore.cpu import has_real_cuda

    if has_real_cuda():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def train(s: TrainSettings, dataset, on_step=None) -> list[dict]:
    """Run the loop on an initialised process group; returns one metrics dict per step."""
    tr = build_training(s)
    checkpointer = Checkpointer(s.checkpoint, tr.model, tr.optimizer, tr.scheduler,
                                dataclasses.asdict(s))
    start, consumed = checkpointer.load()
    sampler = BatchSampler(len(dataset), s.global_batch_size, s.seed)
    history = []
    stop = s.train_iters if not s.exit_interval else min(s.train_iters, start + s.exit_interval)
    for it in range(start, stop):
        sequences = global_batch(dataset, sampler.batch_at(consumed))
        metrics = train_step(s, tr, sequences, it)
        consumed += s.global_batch_size
        history.append(metrics)
        if on_step is not None:
            on_step(metrics)
        checkpointer.save(it + 1, consumed, last_step=it + 1 == stop)
    if s.checkpoint.save_hf:
        _export_hf(s, tr.model)
    return history


def train_step(s: TrainSettings, tr: Training, sequences, it: int) -> dict:
    """One optimizer step on the global batch `sequences`; its metrics."""
    t0 = time.perf_counter()
    tr.ddp.zero_grad_buffer()
    tr.optimizer.zero_grad()
    reports, num_chunks, backward = run_step(s, sequences, tr.ddp, tr.model.config, it)
    lr = tr.optimizer.param_groups[0]["lr"]  # the rate this step applies (the scheduler's last)
    _, grad_norm, _ = tr.optimizer.step()
    tr.scheduler.step(increment=1)
    loss_sum, count = global_loss(reports)
    elapsed = time.perf_counter() - t0
    lengths = batch_lengths(sequences)
    metrics = {
        "step": it + 1, "loss": loss_sum / max(count, 1), "tokens": sum(lengths),
        "loss_tokens": int(count), "tokens_per_s": sum(lengths) / elapsed,
        "model_tflops": sequence_model_flops(lengths, s.shape) / elapsed / 1e12,
        "peak_mem_bytes": peak_memory_bytes(), "num_chunks": num_chunks,
        "lr": lr, "grad_norm": grad_norm, "step_s": elapsed,
    }
    if s.sparse.enabled:  # approximate: say so in every record
        metrics.update(_sparse_metrics(s, backward))
    return metrics


def _export_hf(s: TrainSettings, model) -> None:
    """--save-hf: the trained model as a Hugging Face checkpoint (LoRA adapters merged)."""
    from pathlib import Path

    from megatron_chunkflow.mcore.hf import save_hf_checkpoint

    load_hf = s.checkpoint.load_hf
    source = Path(load_hf) / "config.json" if load_hf else None
    if s.lora is not None:
        from megatron_chunkflow.mcore.lora import merge_lora

        merge_lora(model)  # the exported weights are W + (alpha / r) B A
    save_hf_checkpoint(model, model.config, s.hf_shape or s.shape, s.checkpoint.save_hf, source)


def _sparse_metrics(s: TrainSettings, backward: tuple[int, int]) -> dict:
    """SpaCO's per-step record: labelled approximate, with the chunks that ran backward (all DP
    ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_chunkflow.runtime.p2p import comm_device

    counts = torch.tensor(backward, dtype=torch.int64, device=comm_device())
    dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    return {"approximate": True, "sparse_backward": s.sparse.sparse_backward,
            "backward_chunks": int(counts[0]), "dependent_chunks": int(counts[1])}
