"""A ChunkFlow training step on megatron-core: plan it, then execute it. Every caller (`chunkflow
train`, the Megatron-LM plugin, verify, bench) goes through these two functions.

    step = plan_step(sequences, chunkflow, parallel, shape, job.ranks)   # job: mcore/job.py
    reports = execute_step(step, ddp_model, make_forward_step(job.groups.tp),
                           pg_collection=job.groups, observers=[timeline])

plan_step: the core planner cuts, packs and distributes the global batch over DP (every rank builds
the same chunks from the same lengths), plans this DP rank's chunks for the pipeline (state-aware
1F1B), builds their THD inputs (padded to a multiple of TP under sequence parallelism) and, with
SpaCO, draws which dependent chunks run backward.

execute_step: checks that every rank of the model replica (TP x CP x PP) holds the same plan, runs this
pipeline stage's ops (runtime/pipeline.py) and then Megatron's finalize_model_grads, which divides
the gradients once by the step's token count over all DP ranks (config.calculate_per_token_loss):
chunked training then has the gradients of ordinary training. Returns the last stage's loss
reports (one per chunk whose forward counts).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import torch

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.ep_align import aligned_plan
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.schedule import state_aware_plan
from megatron_chunkflow.data.sequence import TokenSequence
from megatron_chunkflow.data.store import batch_lengths
from megatron_chunkflow.runtime.inputs import ChunkedStep, build_step
from megatron_chunkflow.runtime.model import get_state_store
from megatron_chunkflow.runtime.observe import StepObserver
from megatron_chunkflow.runtime.pipeline import StageRun
from megatron_chunkflow.runtime.ranks import Ranks
from megatron_chunkflow.runtime.sparse import SparseConfig, sparsify
from megatron_chunkflow.runtime.trace import debug_observers


def plan_step(sequences: Sequence[TokenSequence], chunkflow: ChunkFlowConfig,
              parallel: ParallelConfig, shape: ModelShape, ranks: Ranks = Ranks(), *,
              sparse: SparseConfig | None = None, seed: int = 0, step_index: int = 0,
              device=None) -> ChunkedStep:
    """This DP rank's step of the global batch `sequences` (the same on every rank) for the
    layout `parallel`; under context parallelism (parallel.cp > 1) this CP rank's share of it."""
    batch = build_chunks(batch_lengths(sequences), chunkflow.chunk_size, ranks.dp,
                         chunkflow.num_kept, shape, segment_multiple=parallel.segment_multiple,
                         chunk_multiple=parallel.chunk_padding)
    if len(ranks.expert_dp_ranks) > 1:  # an expert group over DP ranks: one plan shape
        if sparse is not None and sparse.enabled:
            raise ValueError("--chunkflow-sparse-backward cannot run with expert parallelism "
                             "across data-parallel ranks: the chunks it drops from backward "
                             "would leave the expert group's all-to-alls out of step")
        plan, costs = aligned_plan(batch, ranks.expert_dp_ranks, ranks.dp_rank, parallel.pp,
                                   chunkflow.num_kept, shape, parallel.vpp,
                                   filler_tokens=2 * parallel.cp * parallel.pad_multiple)
    else:
        chunks = batch.chunks_for_rank(ranks.dp_rank)
        costs = OpCosts.from_model(chunks, shape, parallel.num_virtual_stages)
        plan = state_aware_plan(chunks, parallel.pp, chunkflow.num_kept, costs, parallel.vpp)
    step = build_step(plan, sequences, chunkflow.chunk_size, device=device,
                      pad_multiple=parallel.pad_multiple, batch=batch, costs=costs,
                      cp_size=parallel.cp, cp_rank=ranks.cp_rank,
                      cp_placement=chunkflow.cp_placement)
    if parallel.cp > 1:
        step.metas = {i: dataclasses.replace(m, cp_kv=chunkflow.cp_kv,
                                             cp_attention=chunkflow.cp_attention)
                      for i, m in step.metas.items()}
    if sparse is not None and sparse.enabled:
        step = sparsify(step, sparse.sparse_backward, seed, step_index)
    if chunkflow.reforward_attention != "recompute":  # runtime/reforward.py
        step.metas = {i: dataclasses.replace(m, reforward_attention=chunkflow.reforward_attention)
                      if i in step.plan.recomputed and i not in step.forward_only
                      and m.dependent else m
                      for i, m in step.metas.items()}
    return step


def execute_step(step: ChunkedStep, model, forward_step_func, *,
                 observers: Sequence[StepObserver] = (), forward_only: bool = False,
                 collect_non_loss_data: bool = False, pg_collection,
                 p2p_communicator=None, force_all_reduce: bool = False) -> list:
    """Run this stage's share of `step` on `model` (a GPTModel stage patched by apply_chunkflow,
    usually wrapped in Megatron's DDP; with virtual stages the list of this rank's model chunks,
    as Megatron's schedules take them) over the job's process groups `pg_collection` (a
    megatron-core ProcessGroupCollection: mcore/job.py Job.groups); `forward_step_func` is a
    Megatron forward_step_func (runtime/loss.py: make_forward_step). With `forward_only`
    (evaluation) every chunk runs once, in forward order, without graph."""
    from megatron.core.utils import get_model_config

    models = model if isinstance(model, list) else [model]
    config = get_model_config(models[0])
    if not config.calculate_per_token_loss:
        raise ValueError("ChunkFlow needs per-token loss (--calculate-per-token-loss / "
                         "calculate_per_token_loss=True): a chunk's loss is a sum over its tokens")
    pp_group = _group(pg_collection, "pp")
    num_stages, stage = pp_group.size(), pp_group.rank()
    if step.plan.num_stages != num_stages:
        raise ValueError(f"the step was planned for {step.plan.num_stages} pipeline stages, but "
                         f"the pipeline has {num_stages}")
    if step.plan.num_model_chunks != len(models):
        raise ValueError(f"the step was planned for {step.plan.num_model_chunks} virtual stages "
                         f"per pipeline rank, but this rank has {len(models)} model chunk(s)")
    check_same_plan(step, _group(pg_collection, "mp"))
    check_same_plan(step, _group(pg_collection, "cp"))
    link = None
    if num_stages > 1:
        from megatron_chunkflow.runtime.p2p import StageLink

        link = StageLink(pp_group, config, p2p_communicator)
    store = get_state_store(models[0])
    ops = step.plan.stages[stage]
    observers = [*observers, *debug_observers(stage)]  # CHUNKFLOW_TRACE, CHUNKFLOW_NVTX
    if forward_only:
        ops = tuple(op for op in ops if op.kind == "F")
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    for observer in observers:
        observer.step_began()
    try:
        forward_data_store, total_num_tokens = StageRun(
            step=step, ops=ops, models=models, config=config, link=link, store=store,
            forward_step_func=forward_step_func, observers=observers, forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data, stage=stage).run()
    except BaseException:
        store.clear()
        if store.balance is not None:
            store.balance.clear()
        raise
    if store.balance is not None:  # MoE: the step's balancing loss (runtime/moe.py)
        store.balance.finish_step()
    for observer in observers:
        observer.step_ended()
    if forward_only:
        store.clear()
    assert store.is_empty(), "the plan left K/V state behind"
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(models, total_num_tokens, pg_collection=pg_collection,
                                         force_all_reduce=force_all_reduce)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return forward_data_store


def check_same_plan(step: ChunkedStep, group) -> None:
    """Every rank of a model replica (TP x CP x PP) must run the same plan: compare a digest (CP
    ranks compare their shared chunks, not their shards)."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return
    text = repr([[(op.kind, op.chunk, op.model_chunk) for op in ops]
                 for ops in step.plan.stages]) + repr(
        sorted((c, m.cu_seqlens, m.cp_owners, m.seq_id, m.index, m.grad_weight,
                m.reforward_attention)
               for c, m in step.metas.items()))
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    from megatron_chunkflow.runtime.p2p import comm_device

    mine = torch.tensor([digest], dtype=torch.int64, device=comm_device())
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if any(int(t) != digest for t in everyone):
        raise RuntimeError("ranks of one model replica built different ChunkFlow plans for this "
                           "step (digests " + ", ".join(f"{int(t):x}" for t in everyone) + "); "
                           "chunk construction must see the same sequence lengths everywhere")


def _group(pg_collection, name: str):
    """The pipeline ("pp"), context-parallel ("cp") or model-parallel ("mp") group of the job's
    `pg_collection`."""
    group = getattr(pg_collection, name, None)
    if group is None:
        raise ValueError(f"the process groups given to execute_step have no {name!r} group "
                         "(pass the job's: mcore/job.py Job.groups)")
    return group
