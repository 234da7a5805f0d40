"""ChunkFlow's forward_backward function: executes a core/schedule.py plan on megatron-core.

    from megatron_chunkflow.runtime.schedules import forward_backward_chunkflow
    losses = forward_backward_chunkflow(forward_step_func=..., data_iterator=..., model=...,
                                        num_microbatches=..., seq_length=..., micro_batch_size=...)

Same keyword signature as Megatron's forward_backward_* functions, so it can stand in for
`get_forward_backward_func()`. Each call pulls one `runtime.inputs.ChunkedStep` (the plan and the
chunks' inputs for this DP rank) from `data_iterator`, checks that every rank of the model replica
(TP x PP) holds the same plan, and runs this pipeline stage's ops (runtime/pipeline.py):
- F without a graph (torch.no_grad) for chunks re-forwarded later: only their K/V state is kept;
- F with a graph for kept chunks, R (re-forward with grad) right before a re-forwarded chunk's B;
- B through Megatron's backward_step, inside DDP's no_sync for all but the last one.
Forwards go through Megatron's forward_step with config.calculate_per_token_loss, so every chunk's
loss_func returns (sum, count, report); finalize_model_grads divides the gradients once by the
DP-wide token count. Only the graph-enabled forward of each chunk contributes to the reported loss.
With SpaCO (runtime/sparse.py: sparsify) some chunks are forward-only: their forward reports
the loss and tokens, and they have no R or B (approximate; docs/sparse.md).
"""

from __future__ import annotations

import torch

from megatron_chunkflow.runtime.inputs import ChunkedStep
from megatron_chunkflow.runtime.model import get_state_store
from megatron_chunkflow.runtime.pipeline import run_stage


def forward_backward_chunkflow(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: bool = False,
    meter=None,
    timeline=None,
):
    """Run one step's plan; returns the loss reports of the last stage (one per chunk)."""
    from megatron.core.utils import get_model_config

    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("ChunkFlow does not support virtual pipeline stages (model chunks)")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("adjust_tensor_shapes_fn is not supported with ChunkFlow")
    config = get_model_config(model)
    if not config.calculate_per_token_loss:
        raise ValueError("ChunkFlow needs per-token loss (--calculate-per-token-loss / "
                         "calculate_per_token_loss=True): a chunk's loss is a sum over its tokens")
    step = next(data_iterator)
    if not isinstance(step, ChunkedStep):
        raise TypeError(f"ChunkFlow's data iterator must yield ChunkedStep, got {type(step)}")
    pp_group = _pp_group(pg_collection)
    num_stages, stage = pp_group.size(), pp_group.rank()
    if step.plan.num_stages != num_stages:
        raise ValueError(f"the step was planned for {step.plan.num_stages} pipeline stages, but "
                         f"the pipeline has {num_stages}")
    check_same_plan(step, _model_parallel_group(pg_collection))
    p2p = None
    if num_stages > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        config.batch_p2p_comm = False  # sends are posted asynchronously (runtime/pipeline.py)
        config.variable_seq_lengths = False  # every rank knows every chunk's shape from the plan
        p2p = p2p_communicator or P2PCommunicator(pp_group, config)

    store = get_state_store(model)
    ops = step.plan.stages[stage]
    if forward_only:  # evaluation: every chunk once, in forward order, no graph kept
        ops = tuple(op for op in ops if op.kind == "F")
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    try:
        forward_data_store, total_num_tokens = run_stage(
            ops=ops, step=step, model=model, config=config, p2p=p2p, store=store,
            forward_step_func=forward_step_func, num_microbatches=num_microbatches,
            forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
            is_first=stage == 0, is_last=stage == num_stages - 1, meter=meter, timeline=timeline)
    except BaseException:
        store.clear()
        raise
    if forward_only:
        store.clear()
    assert store.is_empty(), "the plan left K/V state behind"

    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func([model], total_num_tokens, pg_collection=pg_collection,
                                         force_all_reduce=force_all_reduce)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return forward_data_store


def check_same_plan(step: ChunkedStep, group) -> None:
    """Every rank of a model replica (TP x PP) must run the same plan: compare a digest."""
    import hashlib

    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return
    text = repr([[(op.kind, op.chunk) for op in ops] for ops in step.plan.stages]) + repr(
        sorted((c, m.cu_seqlens, m.seq_id, m.index, m.grad_weight) for c, m in step.metas.items()))
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    mine = torch.tensor([digest], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if any(int(t) != digest for t in everyone):
        raise RuntimeError("ranks of one model replica built different ChunkFlow plans for this "
                           "step (digests " + ", ".join(f"{int(t):x}" for t in everyone) + "); "
                           "chunk construction must see the same sequence lengths everywhere")


def _pp_group(pg_collection):
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        return pg_collection.pp
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def _model_parallel_group(pg_collection):
    from megatron.core import parallel_state

    if pg_collection is not None and getattr(pg_collection, "mp", None) is not None:
        return pg_collection.mp
    return parallel_state.get_model_parallel_group()
