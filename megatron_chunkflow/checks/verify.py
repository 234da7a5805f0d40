"""Chunked against unchunked training on real megatron-core: loss and every parameter gradient.

The reference is stock Megatron at PP = 1: each sequence whole as one micro-batch, the model's own
local DotProductAttention (causal), Megatron's forward_backward_no_pipelining, DDP and
finalize_model_grads, with DP = world / TP. Then the process groups are rebuilt for the layout under
test (TP x CP x PP x DP, sequence parallelism and recompute as it says), each pipeline stage's model
is built by mcore/build.py's build_chunkflow_model with its slice of the reference weights and runs
the step through runtime/execute.py's plan_step and mcore/step.py's forward_backward.
Both use per-token loss, so both gradients are (sum of masked token-loss gradients) / (global token
count). Several steps (batches of different sizes, so different chunk counts) run in one go.

Run in every process of a job (one process, or torchrun with world = TP x PP x DP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.simulate import simulate
from megatron_chunkflow.data.synthetic import make_sequences
from megatron_chunkflow.mcore.step import forward_backward
from megatron_chunkflow.runtime.execute import plan_step
from megatron_chunkflow.runtime.inputs import whole_sequence_input
from megatron_chunkflow.runtime.loss import global_loss, make_forward_step
from megatron_chunkflow.runtime.observe import StageTimeline
from megatron_chunkflow.runtime.p2p import comm_device

BOUNDS = {torch.float64: 1e-10, torch.float32: 1e-4}


@dataclass
class VerifyResult:
    loss_ref: float
    loss_chunked: float
    max_rel_grad_err: float
    worst_param: str
    param_errors: list[tuple[str, float]] = field(default_factory=list)
    activation_bytes_per_stage: list[int] = field(default_factory=list)  # peak, incl. K/V state
    state_bytes_per_stage: list[int] = field(default_factory=list)
    held_bytes_per_stage: list[int] = field(default_factory=list)  # peak, K/V state excluded
    chunk_bytes_per_stage: list[int] = field(default_factory=list)  # largest single chunk
    bubble_measured: float = 0.0
    bubble_predicted: float = 0.0
    num_chunks: int = 0
    # MoE: the step's per-sequence balancing loss (over layers, / its coefficient), as Megatron's
    # tracker holds it (float32 there); None for a dense model
    balance_ref: float | None = None
    balance_chunked: float | None = None


def run_verify(shape: ModelShape, steps: Sequence[Sequence[int]],
               chunkflow: ChunkFlowConfig | Sequence[ChunkFlowConfig],
               parallel: ParallelConfig = ParallelConfig(), dtype: torch.dtype = torch.float64,
               seed: int = 0, fully_masked: Sequence[int] = (), meter_cls=None,
               lora=None, model_class: str = "gpt") -> list:
    """One training step per entry of `steps` (sequence lengths), both ways; one result each
    (for a list of configs, a list of results per config, all run on one set of process groups
    against one reference).

    `parallel`: the chunked model's TP, CP, PP, EP, sequence parallelism and recompute (the
    reference runs at the same TP and expert TP, CP = PP = 1, EP 1 unless expert TP is below
    TP, no recompute; DP is what the world leaves). `lora`
    (mcore/lora.py LoRAConfig): both models get the same adapters, B initialised at random
    (LORA_B_STD) so that A's gradient is not zero, and only the adapters are compared. The
    reference of one (model, steps, seed, dtype, TP, world) is computed once per process
    (REFERENCES): a long-lived job checking many layouts runs it once. `model_class`: "gpt"
    (GPTModel) or "hybrid" (HybridModel, mcore/hybrid.py), both models of it."""
    from megatron_chunkflow.mcore.dist import init_distributed

    configs = [chunkflow] if isinstance(chunkflow, ChunkFlowConfig) else list(chunkflow)
    for config in configs:
        parallel.check_chunk_size(config.chunk_size)
    batches = [make_sequences(lengths, shape.vocab_size, seed + i, fully_masked=fully_masked)
               for i, lengths in enumerate(steps)]
    # with expert TP below TP, the reference needs expert parallelism to reduce the experts'
    # gradients (ParallelConfig's check): the same EP, whose groups then lie in TP groups
    reference_ep = parallel.ep if parallel.expert_tp != parallel.tp else 1
    if parallel.tp % (parallel.expert_tp * reference_ep):
        raise ValueError(f"verify: EP {parallel.ep} x expert TP {parallel.expert_tp} must divide "
                         f"TP {parallel.tp} when expert TP is below TP (the unchunked reference "
                         "runs expert parallelism inside each TP group)")
    key = (shape, tuple(map(tuple, steps)), dtype, seed, tuple(fully_masked), lora, parallel.tp,
           parallel.etp, reference_ep, dist.get_world_size() if dist.is_initialized() else 1,
           model_class)
    if key not in REFERENCES:
        # megatron-core refuses MoE under TP without sequence parallelism: the reference of an
        # MoE model under TP has it (every sequence's length then a multiple of TP)
        # (and the chunked model's expert TP: the same expert weights)
        reference_job = init_distributed(ParallelConfig(
            tp=parallel.tp, sequence_parallel=shape.is_moe and parallel.tp > 1,
            etp=parallel.etp, ep=reference_ep), seed)
        REFERENCES[key] = _run_reference(reference_job, shape, batches, dtype, lora, seed,
                                         model_class)
    job = init_distributed(parallel, seed)
    out = [_run_chunked(job, shape, batches, REFERENCES[key], config, dtype, meter_cls, lora,
                        model_class) for config in configs]
    return out[0] if isinstance(chunkflow, ChunkFlowConfig) else out


REFERENCES: dict[tuple, tuple] = {}  # run_verify's unchunked runs, by what they depend on


LORA_B_STD = 0.05


def _run_reference(job, shape, batches, dtype, lora=None, seed: int = 0,
                   model_class: str = "gpt"):
    """Stock Megatron on `job` (PP = 1): per step, (loss sum, count, {param name: gradient}),
    parameters named as the PP = 1 GPTModel names them (mcore/names.py)."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_chunkflow.mcore.build import build_model, transformer_config, wrap_ddp
    from megatron_chunkflow.mcore.names import full_model_name

    ranks = job.ranks
    step_fn = make_forward_step(job.groups.tp, exact_loss=True)
    config = transformer_config(shape, job, dtype,
                                sequence_parallel=job.parallel.sequence_parallel)
    model = build_model(shape, config, job, model_class)
    config = model.config  # a HybridModel's: twice the layers
    if lora is not None:
        from megatron_chunkflow.mcore.lora import apply_lora

        apply_lora(model, lora, seed, b_init_std=LORA_B_STD)
    state = {full_model_name(k, model): (v.clone() if v is not None else None)
             for k, v in model.state_dict().items()}
    ddp = wrap_ddp(model, config)
    out = []
    for sequences in batches:
        mine = [whole_sequence_input(s) for i, s in enumerate(sequences)
                if i % ranks.dp == ranks.dp_rank]
        ddp.zero_grad_buffer()
        if mine:
            reports = forward_backward_no_pipelining(
                forward_step_func=step_fn, data_iterator=iter(mine), model=ddp,
                num_microbatches=len(mine), seq_length=max(len(s) for s in sequences),
                micro_batch_size=1)
        else:  # more reference ranks than sequences: this one only joins the gradient reduction
            reports = []
            config.finalize_model_grads_func([ddp], torch.zeros([], dtype=torch.int,
                                                                device=comm_device()))
        grads = {full_model_name(name, model): p.main_grad.detach().clone()
                 for name, p in model.named_parameters() if p.requires_grad}
        out.append((*global_loss(reports, ranks.tp), grads, _balancing_loss(shape)))
    return state, out


def _balancing_loss(shape: ModelShape) -> float | None:
    """The step's seq_load_balancing_loss from Megatron's MoE tracker, summed over layers and
    ranks (each rank holds its share), the tracker then cleared; None for a dense model."""
    if not shape.is_moe:
        return None
    from megatron_chunkflow.runtime.moe import take_tracked_loss

    total = torch.tensor([take_tracked_loss()], dtype=torch.float64, device=comm_device())
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total)


def build_chunked_model(job, shape, ref_state, dtype, chunkflow: ChunkFlowConfig, lora=None,
                        model_class: str = "gpt"):
    """This stage of `job`'s ChunkFlow model (mcore/build.py; every model chunk with virtual
    stages) with the reference weights (and adapters)."""
    from megatron_chunkflow.mcore.build import build_chunkflow_model

    return build_chunkflow_model(shape, dtype, job, lora=lora, weights=ref_state,
                                 attention_backend=chunkflow.attention_backend,
                                 loss_piece=chunkflow.loss_piece, model_class=model_class)


def _run_chunked(job, shape, batches, reference, chunkflow: ChunkFlowConfig, dtype, meter_cls,
                 lora=None, model_class: str = "gpt") -> list[VerifyResult]:
    ref_state, ref_steps = reference
    cm = build_chunked_model(job, shape, ref_state, dtype, chunkflow, lora, model_class)
    step_fn = make_forward_step(job.groups.tp, exact_loss=True)
    results = []
    for sequences, (ref_loss, ref_count, ref_grads, ref_balance) in zip(batches, ref_steps):
        step = plan_step(sequences, chunkflow, job.parallel, shape, job.ranks)
        meter = meter_cls(cm.models, cm.store) if meter_cls is not None else None
        timeline = StageTimeline()
        reports = forward_backward(job, cm, step, step_fn,
                                   [timeline] + ([meter] if meter is not None else []))
        loss, count = global_loss(reports, job.ranks.tp)
        assert count == ref_count, f"token counts differ: {count} vs {ref_count}"
        errors = _grad_errors(cm.named_parameters(), ref_grads)
        worst = max(errors, key=lambda e: e[1])
        result = VerifyResult(
            loss_ref=ref_loss / max(ref_count, 1), loss_chunked=loss / max(count, 1),
            max_rel_grad_err=worst[1], worst_param=worst[0], param_errors=errors,
            bubble_predicted=(simulate(step.plan, step.costs).bubble_ratio
                              if step.plan.chunks else 0.0),
            num_chunks=len(step.batch.chunks), balance_ref=ref_balance,
            balance_chunked=_balancing_loss(shape))
        _pipeline_stats(result, timeline, meter, job.groups.pp)
        results.append(result)
    return results


def _grad_errors(named_parameters, ref_grads) -> list[tuple[str, float]]:
    """Per parameter: max |g_chunked - g_ref| / max |g_ref|, maxima taken over all ranks.

    `named_parameters`: (PP = 1 name, parameter) of this rank's stage (every model chunk). Rows
    are the reference model's parameters; a stage reports the ones it holds."""
    mine = {n: p.main_grad.double() for n, p in named_parameters if p.requires_grad}
    full = sorted(ref_grads)
    stats = torch.zeros(len(full), 2, dtype=torch.float64, device=comm_device())
    for i, name in enumerate(full):
        if name in mine:
            g_ref = ref_grads[name].double()
            stats[i, 0] = (mine[name] - g_ref).abs().max()
            stats[i, 1] = g_ref.abs().max()
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return [(n, float(d / s) if s > 0 else float(d)) for n, (d, s) in zip(full, stats.tolist())]


def _pipeline_stats(result: VerifyResult, timeline, meter, group) -> None:
    """Measured bubble of this DP replica's pipeline (its pipeline `group`), and peak bytes per
    stage."""
    p = dist.get_world_size(group)
    peaks = ((meter.peak_total, meter.peak_state, meter.peak_activation,
              meter.max_chunk_activation) if meter else (0, 0, 0, 0))
    mine = torch.tensor([timeline.busy, timeline.step_time, *peaks], dtype=torch.float64,
                        device=comm_device())
    rows = [torch.zeros_like(mine) for _ in range(p)]
    dist.all_gather(rows, mine, group=group)
    busy = sum(float(r[0]) for r in rows)
    span = max(float(r[1]) for r in rows)
    result.bubble_measured = 1.0 - busy / (p * span) if span > 0 else 0.0
    result.activation_bytes_per_stage = [int(r[2]) for r in rows]
    result.state_bytes_per_stage = [int(r[3]) for r in rows]
    result.held_bytes_per_stage = [int(r[4]) for r in rows]
    result.chunk_bytes_per_stage = [int(r[5]) for r in rows]
