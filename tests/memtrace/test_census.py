"""The kernels a traced step launches (memtrace/census.py) against what the time model charges for
megatron-core's local spec (perfmodel/kernels.py): bytes per token and kernels per layer, the
loss's bytes per logit, the gradient accumulation and the optimizer's bytes per parameter."""

import dataclasses

import pytest

from megatron_chunkflow import compat
from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
from megatron_chunkflow.memtrace.trace import trace_memory
from megatron_chunkflow.perfmodel.footprint import layer_params, total_params
from megatron_chunkflow.perfmodel.kernels import (
    GRAD_ACCUM_BYTES,
    LOSS_BYTES,
    OPTIMIZER_BYTES,
    GRAD_SCALE_BYTES,
    ZERO_GRAD_BYTES,
    local_layer,
)

T = 512  # tokens of the smaller trace; the larger has 2 T


def _census(shape, tokens, fused, stack):
    s = TrainSettings(shape=shape, model_name="x", dtype="bfloat16", seq_length=tokens,
                      global_batch_size=1, train_iters=3,
                      chunkflow=ChunkFlowConfig(tokens, 1, "varlen"),
                      optimizer=OptimizerConfig(lr_warmup_iters=0), parallel=ParallelConfig(),
                      device="cuda", fusions=fused)
    return trace_memory(s, [tokens], stack=stack, census=True).census


# Qwen2.5 (Q/K/V bias) on torch 2.11 (K/V repeated) unfused: the H200 profile's build; Qwen3 (Q/K
# norms) on torch 2.13 (grouped-query varlen) fused
@pytest.mark.parametrize("model,fused,stack", [("qwen2.5-1.5b", False, "torch-2.11"),
                                               ("qwen3-0.6b", True, "torch-2.13")])
def test_the_local_layer_moves_and_launches_what_the_model_charges(model, fused, stack):
    full = get_model_shape(model)
    traced = {(n, t): _census(dataclasses.replace(full, num_layers=n), t, fused, stack)
              for n in (2, 3) for t in (T, 2 * T)}
    expected = local_layer(full, 1, False, fused, stack == "torch-2.11")

    def layer(phase, t):  # one layer's bytes: 3 layers less 2
        return (traced[3, t].phases[phase].memory_bytes
                - traced[2, t].phases[phase].memory_bytes)

    for phase, per_token, kernels in (("forward", expected.fwd_bytes, expected.fwd_kernels),
                                      ("backward", expected.bwd_bytes, expected.bwd_kernels)):
        assert (layer(phase, 2 * T) - layer(phase, T)) / T == pytest.approx(per_token, rel=0.01)
        assert (traced[3, T].phases[phase].kernels
                - traced[2, T].phases[phase].kernels) == kernels
    two, small = traced[2, 2 * T], traced[2, T]
    shape = dataclasses.replace(full, num_layers=2)
    params = total_params(shape)
    # the loss per logit; backward: autograd's pass through the cross entropy ("loss") and the
    # output layer's gradient of the logits cast back ("backward")
    loss = (two.phases["loss"].memory_bytes - small.phases["loss"].memory_bytes) / T
    assert loss / shape.vocab_size == pytest.approx(LOSS_BYTES[0] + LOSS_BYTES[1], rel=0.02)
    # per step: Adam (foreach) and the zeroed gradient buffer, per parameter
    assert two.phases["optimizer"].memory_bytes / params == pytest.approx(OPTIMIZER_BYTES,
                                                                          rel=0.02)
    # per step, outside the layers: the gradient buffer zeroed, then divided by the token count
    # (finalize_model_grads). megatron-core 0.16.1 scales only `if num_tokens > 0`, which a traced
    # step reads as 0 (device scalars read zeros); 0.17 and later scale unconditionally.
    def fixed(op):
        return (2 * small.phases["forward"].bytes_by_op[op]
                - two.phases["forward"].bytes_by_op[op]) / params

    assert fixed("zero_") == pytest.approx(ZERO_GRAD_BYTES, rel=0.1)
    scaled = compat.installed() >= (0, 17, 0)
    assert fixed("mul_") == pytest.approx(GRAD_SCALE_BYTES if scaled else 0, abs=0.4)
    others = (2 * small.phases["forward"].memory_bytes - two.phases["forward"].memory_bytes) \
        / params - fixed("zero_") - fixed("mul_")
    assert abs(others) < 0.4
    # per micro-batch: each layer's weight gradients added into their fp32 main_grad
    per_layer = [2 * traced[n, T].phases["backward"].memory_bytes
                 - traced[n, 2 * T].phases["backward"].memory_bytes for n in (2, 3)]
    assert (per_layer[1] - per_layer[0]) / layer_params(full) == pytest.approx(
        GRAD_ACCUM_BYTES, rel=0.01)
