"""ChunkFlow's forward_backward function: executes a core/schedule.py plan on megatron-core.

    from megatron_chunkflow.integration.schedules import forward_backward_chunkflow
    losses = forward_backward_chunkflow(forward_step_func=..., data_iterator=..., model=...,
                                        num_microbatches=..., seq_length=..., micro_batch_size=...)

Same keyword signature as Megatron's forward_backward_* functions, so it can stand in for
`get_forward_backward_func()`. Each call pulls one `integration.data.ChunkedStep` (the plan and the
chunks' inputs for this DP rank) from `data_iterator` and runs its ops:
- F without a graph (torch.no_grad) for chunks re-forwarded later: only their K/V state is kept;
- F with a graph for kept chunks, R (re-forward with grad) right before a re-forwarded chunk's B;
- B through Megatron's backward_step, inside DDP's no_sync for all but the last one.
Forwards go through Megatron's forward_step with config.calculate_per_token_loss, so every chunk's
loss_func returns (sum, count, report); finalize_model_grads divides the gradients once by the
DP-wide token count. Only the graph-enabled forward of each chunk contributes to the reported loss.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_chunkflow.integration.data import ChunkedStep
from megatron_chunkflow.integration.model import get_state_store


def _pp_size(pg_collection) -> int:
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        return pg_collection.pp.size()
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


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
):
    """Run one step's plan; returns the loss reports of the last stage (one per chunk)."""
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
    from megatron.core.utils import get_model_config, get_model_type

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
    if _pp_size(pg_collection) > 1:
        raise NotImplementedError("ChunkFlow's pipeline schedule (PP >= 2) is not built yet; "
                                  "use --pipeline-model-parallel-size 1")
    step = next(data_iterator)
    if not isinstance(step, ChunkedStep):
        raise TypeError(f"ChunkFlow's data iterator must yield ChunkedStep, got {type(step)}")

    store = get_state_store(model)
    model_type = get_model_type(model)
    ops = step.plan.stages[0]
    recomputed = step.plan.recomputed
    if forward_only:  # evaluation: every chunk once, in forward order, no graph kept
        ops = [op for op in ops if op.kind == "F"]
    last_backward = max((i for i, op in enumerate(ops) if op.kind == "B"), default=-1)
    no_sync = config.no_sync_func or contextlib.nullcontext
    forward_data_store: list = []
    outputs: dict[int, torch.Tensor] = {}
    total_num_tokens = torch.zeros([], dtype=torch.int)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    try:
        for i, op in enumerate(ops):
            if op.kind == "B":
                sync = contextlib.nullcontext() if i == last_backward else no_sync()
                with sync:
                    backward_step(None, outputs.pop(op.chunk), None, model_type, config)
                if meter is not None:
                    meter.release(op.chunk)
                continue
            keep = not forward_only and not (op.kind == "F" and op.chunk in recomputed)
            track = meter.track(op.chunk) if (meter is not None and keep) else contextlib.nullcontext()
            store.begin(step.metas[op.chunk], reforward=op.kind == "R")
            try:
                with (contextlib.nullcontext() if keep else torch.no_grad()), track:
                    output, num_tokens = forward_step(
                        forward_step_func, iter([step.inputs[op.chunk]]), model, num_microbatches,
                        None, forward_data_store if keep or forward_only else [], config, 1,
                        collect_non_loss_data, is_first_microbatch=(i == 0), current_microbatch=i,
                        is_last_stage=True,
                    )
            finally:
                store.end()
            if keep:
                outputs[op.chunk] = output
                total_num_tokens += num_tokens
    except BaseException:
        store.clear()
        raise
    if forward_only:
        store.clear()
    assert not outputs and store.is_empty(), f"plan left state behind: {list(store._kv)[:5]} {list(store._grad)[:5]}"

    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func([model], total_num_tokens, pg_collection=pg_collection,
                                         force_all_reduce=force_all_reduce)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return forward_data_store
