"""One training step of a system, ChunkFlow or a stock baseline, on megatron-core: the one glue
between a global batch and Megatron's optimizer. `chunkflow train`'s loop, bench's measured
systems and the device check all step through here.

    tr = build_training(settings, job)  # build_chunkflow_model, Megatron's Adam and LR schedule
    out = training_step(settings, tr, sequences, step_index, observers=[timeline, meter])
    reports = forward_backward(job, cm, step, forward_step)  # one planned ChunkFlow step

Per step, every rank takes the same global batch `sequences` and then:
- ChunkFlow: runtime/execute.py's plan_step (cut, pack, distribute over DP, plan for PP) and
  execute_step;
- a stock baseline (core/step.py: megatron-sft, megatron-packed or megatron-unpacked): whole
  sequences in micro-batches of at most --seq-length, dealt round-robin over DP, Megatron's own
  get_forward_backward_func() (1F1B for PP >= 2: fixed --seq-length shapes for megatron-sft, else
  its variable_seq_lengths shape exchange), Megatron's recompute as configured.
Both then run Megatron's optimizer (get_megatron_optimizer: Adam, weight decay, gradient
clipping) and OptimizerParamScheduler (linear warmup, cosine decay), per-token loss throughout.
`observers` (runtime/observe.py) measure either schedule the same way. forward_backward is the
one planned ChunkFlow step without training settings that training, bench and the checks share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_chunkflow.core.schedule import interleaving_problem
from megatron_chunkflow.core.step import baseline_microbatches
from megatron_chunkflow.data.store import batch_lengths
from megatron_chunkflow.mcore.build import ChunkFlowModel, build_chunkflow_model
from megatron_chunkflow.mcore.job import Job
from megatron_chunkflow.mcore.settings import TrainSettings
from megatron_chunkflow.runtime.execute import execute_step, plan_step
from megatron_chunkflow.runtime.inputs import ChunkedStep, chunk_input, chunk_meta
from megatron_chunkflow.runtime.loss import make_forward_step
from megatron_chunkflow.runtime.observe import observing_megatron
from megatron_chunkflow.runtime.sparse import num_backward_chunks

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class Training:
    """What build_training makes: the job it runs on, this rank's model stage (patched for chunk
    attention, in DDP), Megatron's optimizer and LR scheduler."""

    job: Job
    chunkflow_model: ChunkFlowModel
    optimizer: object
    scheduler: object

    @property
    def model(self):
        """The model stage; with virtual stages the list of this rank's model chunks."""
        models = self.chunkflow_model.models
        return models[0] if len(models) == 1 else models

    @property
    def ddp(self):
        return self.chunkflow_model.ddp

    @property
    def store(self):
        return self.chunkflow_model.store


@dataclass
class StepOutcome:
    """What one step did on this rank."""

    reports: list  # the last stage's loss reports (runtime/loss.py global_loss sums them)
    num_chunks: int  # ChunkFlow's chunks, or the baseline's micro-batches, of the global batch
    backward: tuple[int, int]  # SpaCO: (dependent chunks back-propagated, dependent chunks)
    lr: float = 0.0  # the learning rate this step applied
    grad_norm: float | None = None


def build_training(s: TrainSettings, job: Job) -> Training:
    """Model on `job`'s process groups running s.parallel (mcore/job.py Job.for_layout; mcore/
    build.py: build_chunkflow_model; the baselines use the same attention, as plain THD attention
    within packed sequences), Megatron's optimizer and LR scheduler."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    dtype = DTYPES[s.dtype]
    job = job.for_layout(s.parallel)  # its recompute and sequence parallelism
    cm = build_chunkflow_model(
        s.shape, dtype, job, attention_backend=s.chunkflow.attention_backend,
        load_hf=s.checkpoint.load_hf, hf_shape=s.hf_shape, lora=s.lora, lora_seed=s.seed,
        device=s.device, fusions=s.fusions, loss_piece=s.chunkflow.loss_piece,
        vocab_size=s.real_vocab_size, distributed_optimizer=s.distributed_optimizer,
        model_class=s.model_class)
    o = s.optimizer
    opt_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        clip_grad=o.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=s.distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_config, cm.ddps)
    cm.config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's train() wires it
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters, lr_decay_steps=s.train_iters,
        lr_decay_style="cosine", start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=s.train_iters, wd_incr_style="constant",
        override_opt_param_scheduler=s.checkpoint.override_lr_schedule,
        use_checkpoint_opt_param_scheduler=not s.checkpoint.override_lr_schedule)
    return Training(job, cm, optimizer, scheduler)


def stock_interleaving_problem(s: TrainSettings, microbatches, dp: int,
                               step_index: int) -> str | None:
    """Why Megatron's interleaved schedule would refuse a stock step of `microbatches` (every DP
    rank's, each rank running its own count), or None (train checks every step before the first:
    training/loop.py)."""
    if s.parallel.vpp == 1 or not microbatches:
        return None
    counts = {sum(c.dp_rank == r for c in microbatches) for r in range(dp)} - {0}
    for m in sorted(counts):  # a rank with none steps idle
        problem = interleaving_problem(m, s.parallel.pp, s.parallel.vpp)
        if problem:
            return (f"step {step_index}: {problem} ({len(microbatches)} micro-batches over {dp} "
                    "DP ranks); give a --global-batch-size that makes more")
    return None


def training_step(s: TrainSettings, tr: Training, sequences, step_index: int = 0,
                  observers=()) -> StepOutcome:
    """One optimizer step on the global batch `sequences`: gradients zeroed, forward and
    backward, Adam, the LR schedule advanced."""
    tr.optimizer.zero_grad()
    out = batch_forward_backward(s, tr, sequences, step_index, observers)
    out.lr = tr.optimizer.param_groups[0]["lr"]  # the rate this step applies (the scheduler's)
    _, out.grad_norm, _ = tr.optimizer.step()
    tr.scheduler.step(increment=1)
    return out


def forward_backward(job: Job, cm: ChunkFlowModel, step: ChunkedStep, forward_step,
                     observers=()) -> list:
    """One planned ChunkFlow step (runtime/execute.py plan_step) through `cm` on `job`: DDP's
    gradient buffers zeroed, this stage's forward and backward (execute_step, `observers`
    called from ChunkFlow's schedule), the gradients left in the buffers (reduced over DP and
    divided by the step's tokens); the last stage's loss reports (runtime/loss.py global_loss)."""
    cm.zero_grad_buffers()
    return execute_step(step, cm.ddp, forward_step, observers=observers,
                        pg_collection=job.groups)


def batch_forward_backward(s: TrainSettings, tr: Training, sequences, step_index: int = 0,
                           observers=()) -> StepOutcome:
    """Forward and backward of one global batch from zeroed gradients, left in DDP's buffers
    (`observers` called from ChunkFlow's schedule, or from Megatron's own)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ranks = tr.job.ranks
    config = tr.chunkflow_model.config
    step_fn = make_forward_step(tr.job.groups.tp, exact_loss=s.dtype == "float64",
                                vocab_size=s.real_vocab_size)
    if s.uses_chunkflow:
        step = plan_step(sequences, s.chunkflow, s.parallel, s.shape, ranks, sparse=s.sparse,
                         seed=s.seed, step_index=step_index)
        reports = forward_backward(tr.job, tr.chunkflow_model, step, step_fn, observers)
        return StepOutcome(reports, len(step.batch.chunks), num_backward_chunks(step))
    tr.chunkflow_model.zero_grad_buffers()
    mbs = baseline_microbatches(batch_lengths(sequences), s.seq_length, ranks.dp, s.system)
    mine = [c for c in mbs if c.dp_rank == ranks.dp_rank]
    if not mine:  # fewer micro-batches than DP ranks: idle, as ChunkFlow's idle ranks are
        with observing_megatron(observers):
            _idle_step(tr.ddp, config, tr.job.groups)
        return StepOutcome([], len(mbs), (0, 0))
    problem = stock_interleaving_problem(s, mbs, ranks.dp, step_index)
    if problem:  # Megatron would raise its RuntimeError mid-step
        raise ValueError(problem)
    pad = s.parallel.pad_multiple
    inputs = [chunk_input(c, sequences, chunk_meta(c, s.seq_length, pad)) for c in mine]
    # Megatron-LM's SFT path sends fixed --seq-length shapes (every line is padded to it); the
    # others exchange each micro-batch's shape first (variable_seq_lengths)
    fixed = s.system == "megatron-sft"
    config.variable_seq_lengths = s.parallel.pp > 1 and not fixed
    # with virtual stages Megatron's interleaved schedule reads each model chunk's iterator
    data = iter(inputs) if s.parallel.vpp == 1 else [iter(inputs) for _ in range(s.parallel.vpp)]
    with observing_megatron(observers):
        reports = get_forward_backward_func()(
            forward_step_func=step_fn, data_iterator=data, model=tr.ddp,
            num_microbatches=len(inputs),
            seq_length=s.seq_length if fixed else max(x.tokens.size(1) for x in inputs),
            micro_batch_size=1)
    return StepOutcome(reports, len(mbs), (0, 0))


def _idle_step(ddp, config, groups) -> None:
    """A DP rank without a micro-batch this step: no forward or backward, but the same gradient
    reduction as the others (Megatron's finalize_model_grads, 0 tokens), so it contributes zero
    gradients and no token to the per-token mean and every collective still matches."""
    if config.finalize_model_grads_func is None:
        return
    chunks = ddp if isinstance(ddp, list) else [ddp]
    device = next(chunks[0].parameters()).device
    config.finalize_model_grads_func(chunks, torch.zeros((), dtype=torch.int, device=device),
                                     pg_collection=groups)


def peak_memory_bytes() -> int:
    """GPU: torch.cuda.max_memory_allocated; CPU: the process's peak resident set size."""
    from megatron_chunkflow.mcore.cpu import has_real_cuda

    if has_real_cuda():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
