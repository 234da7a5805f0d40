"""The analytic memory model (perfmodel/: footprint, kvstate, moments, predict) against the tracer
(memtrace/): the peak per GPU within 5% over a grid of families, chunk sizes, K, the recompute
menu, TP with and without sequence parallelism, PP, virtual stages, CP, the re-forward's
attention, the pieced loss, fused and unfused SwiGLU, kernels with and without grouped-query
attention, and the stock baselines.

    python -m pytest tests/memtrace/test_footprint.py -q

Real widths and vocabularies (Qwen2.5-1.5B, Qwen3-1.7B, Llama 3.2-1B) at reduced depth, bf16 as on
a GPU, torch's varlen kernel (2.11's repeats K/V per head, 2.13's has grouped-query attention and
the log-sum-exp the re-forward's keep and offload need); the model is asked for the same job
(DP 1), the tracer runs every pipeline stage (and every CP rank) and the highest peak is compared
with the model's, which is the highest too. The model assumes a fused attention kernel: the
plain-torch backend (fp32 GPU runs, CPU) keeps score tiles in its backward that it does not count.
"""

import dataclasses

import pytest

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
from megatron_chunkflow.memtrace.trace import trace_memory
from megatron_chunkflow.perfmodel.hardware import get_gpu
from megatron_chunkflow.perfmodel.predict import predict_chunkflow, predict_megatron

pytestmark = pytest.mark.slow
LENGTHS = [14000, 3000, 2500, 900, 700, 400, 300, 120]  # one sequence cut, the rest packed

# name -> settings: model, layers, system, C, K, recompute, TP, PP, V, CP, SP, stack, extra
GRID = {
    "qwen25_k1": dict(),
    "qwen25_k2_core_attn": dict(K=2, recompute="selective"),
    "qwen25_full_pieced": dict(recompute="full", loss_piece=1024),
    "qwen25_block_unfused": dict(layers=6, recompute="block:2", fusions=False),
    "qwen25_mlp_layernorm": dict(recompute="selective:mlp+layernorm", stack="torch-2.13"),
    "qwen3_qk_norm": dict(model="qwen3-1.7b", C=2048, K=2, stack="torch-2.13"),
    "llama32_keep": dict(model="llama3.2-1b", K=2, reforward="keep", stack="torch-2.13"),
    "tp2_sequence_parallel": dict(tp=2, sp=True, recompute="selective:mlp"),
    "tp2": dict(tp=2, K=2),
    "pp2": dict(layers=8, pp=2, K=2),
    "pp2_vpp2": dict(layers=8, pp=2, vpp=2, loss_piece=2048),
    "cp2": dict(cp=2),
    "cp2_offload": dict(cp=2, reforward="offload", C=2048, stack="torch-2.13"),
    "stock_packed": dict(system="megatron-packed"),
    "stock_packed_full_pieced": dict(system="megatron-packed", recompute="full", loss_piece=2048),
    "stock_sft_pp2": dict(system="megatron-sft", layers=8, pp=2, recompute="selective:mlp"),
}
BOUND = 0.05


def _case(model="qwen2.5-1.5b", layers=4, system="chunkflow", C=4096, K=1, recompute="none",
          tp=1, pp=1, vpp=1, cp=1, sp=False, stack="torch-2.11", backend="varlen",
          reforward="recompute", loss_piece=0, fusions=True):
    shape = dataclasses.replace(get_model_shape(model), num_layers=layers)
    parallel = ParallelConfig(tp=tp, pp=pp, vpp=vpp, cp=cp, sequence_parallel=sp,
                              recompute=recompute)
    seq = 16384 if system == "chunkflow" else max(LENGTHS) + 16
    settings = TrainSettings(
        shape=shape, model_name=model, system=system, dtype="bfloat16", seq_length=seq,
        global_batch_size=len(LENGTHS), train_iters=3, device="cuda", fusions=fusions,
        chunkflow=ChunkFlowConfig(C, K, backend, reforward_attention=reforward,
                                  loss_piece=loss_piece),
        optimizer=OptimizerConfig(lr_warmup_iters=0), parallel=parallel)
    # the build the model is told about: Megatron's fusions, a kernel that repeats K/V per head
    # (torch 2.11's varlen_attn has no grouped-query attention)
    hw = dataclasses.replace(get_gpu("h200"), fused_swiglu=fusions,
                             kv_repeat=stack == "torch-2.11" and backend == "varlen")
    layout = dataclasses.replace(parallel, dp=1)
    if system == "chunkflow":
        predicted = predict_chunkflow(LENGTHS, shape, hw, layout, C, K, reforward=reforward,
                                      loss_piece=loss_piece)
    else:
        predicted = predict_megatron(LENGTHS, shape, hw, layout, seq, system, loss_piece)
    world = tp * pp * cp
    ranks = sorted({pp_rank * tp * cp + cp_rank * tp for pp_rank in range(pp)
                    for cp_rank in range(cp)})  # Megatron's order: TP fastest, then CP
    traced = max(trace_memory(settings, LENGTHS, world=world, rank=r, stack=stack,
                              warm_optimizer=True).peak_allocated for r in ranks)
    return predicted.peak_mem_bytes, traced


@pytest.mark.parametrize("name", GRID)
def test_model_agrees_with_the_trace(name):
    predicted, traced = _case(**GRID[name])
    assert predicted == pytest.approx(traced, rel=BOUND), \
        f"{name}: model {predicted / 2**30:.2f} GiB, trace {traced / 2**30:.2f} GiB"
