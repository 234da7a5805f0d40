"""The training loop behind `chunkflow train`: ChunkFlow, or the stock-Megatron baseline.

Per step, every rank takes the same global batch of `global_batch_size` sequences (a seeded shuffle
of the dataset, epoch after epoch) and then:
- ChunkFlow: core planner (cut, pack, distribute over DP, plan for PP) -> forward_backward_chunkflow;
- baseline (--no-chunkflow): whole sequences packed (THD) into micro-batches of --seq-length, dealt
  round-robin over DP, Megatron's own get_forward_backward_func() (1F1B for PP >= 2, with its
  variable_seq_lengths shape exchange), Megatron's recompute as configured.
Both then run Megatron's optimizer (get_megatron_optimizer: Adam, weight decay, gradient clipping) and
OptimizerParamScheduler (linear warmup, cosine decay), per-token loss throughout.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from megatron_chunkflow.core.costs import sequence_model_flops
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.step import baseline_microbatches
from megatron_chunkflow.runtime.inputs import chunk_input, chunk_meta, plan_step
from megatron_chunkflow.runtime.loss import global_loss
from megatron_chunkflow.checks.verify import forward_step


@dataclass
class TrainSettings:
    shape: ModelShape
    model_name: str
    train_iters: int = 50
    global_batch_size: int = 16
    seq_length: int = 32768
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 5
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 1234
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    chunkflow: bool = True
    chunk_size: int = 2048
    k: int = 1
    dtype: str = "float32"
    recompute_granularity: str | None = None
    backend: str = "torch"
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    exit_interval: int | None = None  # stop after this many steps of this run (Megatron-LM's flag)
    load_hf: str | None = None  # a Hugging Face Qwen2 checkpoint to start from
    save_hf: str | None = None  # write the trained model as a Hugging Face checkpoint here
    hf_shape: ModelShape | None = None  # the HF checkpoint's shape (unpadded vocabulary)
    lora: object | None = None  # training.lora.LoRAConfig: adapters only, base frozen
    sparse_backward: int | None = None  # SpaCO T (approximate; runtime/sparse.py)


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class BatchSampler:
    """Global batches of dataset indices: a fresh seeded permutation each epoch; the position is
    the number of sequences consumed, which is what a checkpoint stores."""

    def __init__(self, num_samples: int, batch_size: int, seed: int):
        self.n, self.batch, self.seed = num_samples, batch_size, seed
        self._epoch, self._order = -1, None

    def _permutation(self, epoch: int):
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._order

    def batch_at(self, consumed: int) -> list[int]:
        out = []
        for pos in range(consumed, consumed + self.batch):
            epoch, offset = divmod(pos, self.n)
            out.append(int(self._permutation(epoch)[offset]))
        return out


def build_training(s: TrainSettings):
    """Model (patched for THD chunk attention), DDP, optimizer and LR scheduler."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_chunkflow.training.build import (
        build_gpt_model,
        recompute_settings,
        transformer_config,
        wrap_ddp,
    )
    from megatron_chunkflow.runtime.model import apply_chunkflow

    dtype = DTYPES[s.dtype]
    config = transformer_config(s.shape, dtype, sequence_parallel=s.sequence_parallel,
                                **recompute_settings(s.recompute_granularity))
    model = build_gpt_model(s.shape, config)
    if s.load_hf:
        from megatron_chunkflow.training.hf import import_hf_weights

        import_hf_weights(model, s.load_hf, config, s.hf_shape)
    if s.lora is not None:
        from megatron_chunkflow.training.lora import apply_lora

        apply_lora(model, s.lora, s.seed)  # freezes the rest: DDP and Adam see adapters only
    store = apply_chunkflow(model, backend=s.backend)  # the baseline uses it as THD attention
    ddp = wrap_ddp(model, config)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=s.lr, min_lr=s.min_lr, weight_decay=s.weight_decay,
        clip_grad=s.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's train() wires it
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=s.lr, min_lr=s.min_lr,
        lr_warmup_steps=s.lr_warmup_iters, lr_decay_steps=s.train_iters, lr_decay_style="cosine",
        start_wd=s.weight_decay, end_wd=s.weight_decay, wd_incr_steps=s.train_iters,
        wd_incr_style="constant")
    return model, store, ddp, optimizer, scheduler


def run_step(s: TrainSettings, sequences, ddp, config, step_index: int = 0):
    """Forward and backward of one global batch; returns (loss reports, chunks or micro-batches,
    (dependent chunks back-propagated, dependent chunks) on this rank)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_chunkflow.runtime.schedules import forward_backward_chunkflow

    dp, dp_rank = (parallel_state.get_data_parallel_world_size(),
                   parallel_state.get_data_parallel_rank())
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pad = tp if s.sequence_parallel else 1
    step_fn = partial(forward_step, tp_group=parallel_state.get_tensor_model_parallel_group(),
                      exact_loss=s.dtype == "float64")
    lengths = [len(x) for x in sequences]
    if s.chunkflow:
        step, batch, _ = plan_step(sequences, s.chunk_size, s.k, s.pp, dp, dp_rank, s.shape, pad)
        from megatron_chunkflow.runtime.sparse import num_backward_chunks, sparsify

        if s.sparse_backward is not None:
            step = sparsify(step, s.sparse_backward, s.seed, step_index)
        reports = forward_backward_chunkflow(
            forward_step_func=step_fn, data_iterator=iter([step]), model=ddp,
            num_microbatches=len(step.metas), seq_length=s.chunk_size, micro_batch_size=1)
        return reports, len(batch.chunks), num_backward_chunks(step)
    mbs = baseline_microbatches(lengths, s.seq_length, dp)
    mine = [c for c in mbs if c.dp_rank == dp_rank]
    if not mine:
        raise ValueError(f"--global-batch-size {s.global_batch_size} packs into {len(mbs)} "
                         f"micro-batches of --seq-length {s.seq_length}, fewer than the {dp} "
                         "data-parallel ranks")
    inputs = [chunk_input(c, sequences, chunk_meta(c, s.seq_length, pad)) for c in mine]
    config.variable_seq_lengths = s.pp > 1  # Megatron's shape exchange for variable lengths
    reports = get_forward_backward_func()(
        forward_step_func=step_fn, data_iterator=iter(inputs), model=ddp,
        num_microbatches=len(inputs), seq_length=max(x.tokens.size(1) for x in inputs),
        micro_batch_size=1)
    return reports, len(mbs), (0, 0)


def peak_memory_bytes() -> int:
    """GPU: torch.cuda.max_memory_allocated; CPU: the process's peak resident set size."""
    from megatron_chunkflow.training.cpu import has_real_cuda

    if has_real_cuda():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def train(s: TrainSettings, dataset, on_step=None) -> list[dict]:
    """Run the loop on an initialised process group; returns one metrics dict per step."""
    from megatron_chunkflow.training.checkpoint import load_checkpoint, save_checkpoint

    model, _, ddp, optimizer, scheduler = build_training(s)
    config = model.config
    start, consumed = 0, 0
    if s.load:
        start, consumed, _ = load_checkpoint(s.load, model, optimizer, scheduler)
    sampler = BatchSampler(len(dataset), s.global_batch_size, s.seed)
    history = []
    stop = s.train_iters if not s.exit_interval else min(s.train_iters, start + s.exit_interval)
    for it in range(start, stop):
        sequences = [dataset[i] for i in sampler.batch_at(consumed)]
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports, num_chunks, backward = run_step(s, sequences, ddp, config, it)
        _, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        loss_sum, count = global_loss(reports)
        elapsed = time.perf_counter() - t0
        consumed += s.global_batch_size
        tokens = sum(len(x) for x in sequences)
        metrics = {
            "step": it + 1, "loss": loss_sum / max(count, 1), "tokens": tokens,
            "loss_tokens": int(count), "tokens_per_s": tokens / elapsed,
            "model_tflops": sequence_model_flops([len(x) for x in sequences], s.shape)
            / elapsed / 1e12,
            "peak_mem_bytes": peak_memory_bytes(), "num_chunks": num_chunks,
            "lr": optimizer.param_groups[0]["lr"], "grad_norm": grad_norm, "step_s": elapsed,
        }
        if s.sparse_backward is not None:  # approximate: say so in every record
            metrics.update(_sparse_metrics(s, backward))
        history.append(metrics)
        if on_step is not None:
            on_step(metrics)
        if s.save and s.save_interval and (it + 1) % s.save_interval == 0:
            save_checkpoint(s.save, it + 1, model, optimizer, scheduler, consumed,
                            dataclasses.asdict(s))
    if s.save and history and (not s.save_interval or stop % s.save_interval):
        save_checkpoint(s.save, stop, model, optimizer, scheduler, consumed,
                        dataclasses.asdict(s))
    if s.save_hf:
        from pathlib import Path

        from megatron_chunkflow.training.hf import save_hf_checkpoint

        source = Path(s.load_hf) / "config.json" if s.load_hf else None
        if s.lora is not None:
            from megatron_chunkflow.training.lora import merge_lora

            merge_lora(model)  # the exported weights are W + (alpha / r) B A
        save_hf_checkpoint(model, config, s.hf_shape or s.shape, s.save_hf, source)
    return history


def _sparse_metrics(s: TrainSettings, backward: tuple[int, int]) -> dict:
    """SpaCO's per-step record: labelled approximate, with the chunks that ran backward (all DP
    ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    counts = torch.tensor(backward, dtype=torch.int64)
    dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    return {"approximate": True, "sparse_backward": s.sparse_backward,
            "backward_chunks": int(counts[0]), "dependent_chunks": int(counts[1])}
