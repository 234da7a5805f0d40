"""ChunkFlow behind Megatron's forward_backward signature, so it can stand in for
`get_forward_backward_func()` (the Megatron-LM plugin does exactly that).

    losses = forward_backward_chunkflow(forward_step_func=..., data_iterator=..., model=...,
                                        num_microbatches=..., seq_length=..., micro_batch_size=...)

Each call pulls one `runtime.inputs.ChunkedStep` (runtime/execute.py: plan_step) from
`data_iterator` and runs it with execute_step. Megatron's sizing arguments (num_microbatches,
seq_length, micro_batch_size, decoder_seq_length) are accepted and ignored: the step carries its
chunks and their shapes.
"""

from __future__ import annotations

from megatron_chunkflow.runtime.execute import execute_step
from megatron_chunkflow.runtime.inputs import ChunkedStep


def forward_backward_chunkflow(*, forward_step_func, data_iterator, model, num_microbatches=None,
                               seq_length=None, micro_batch_size=None, decoder_seq_length=None,
                               forward_only: bool = False, collect_non_loss_data: bool = False,
                               first_val_step=None, adjust_tensor_shapes_fn=None,
                               p2p_communicator=None, pg_collection=None,
                               force_all_reduce: bool = False):
    """Run the next step of `data_iterator`; returns the last stage's loss reports."""
    if isinstance(model, list) and len(model) == 1:
        model = model[0]  # a list of model chunks with virtual stages, as Megatron passes it
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("adjust_tensor_shapes_fn is not supported with ChunkFlow")
    step = next(data_iterator)
    if not isinstance(step, ChunkedStep):
        raise TypeError(f"ChunkFlow's data iterator must yield ChunkedStep, got {type(step)}")
    return execute_step(step, model, forward_step_func, forward_only=forward_only,
                        collect_non_loss_data=collect_non_loss_data,
                        pg_collection=pg_collection, p2p_communicator=p2p_communicator,
                        force_all_reduce=force_all_reduce)
