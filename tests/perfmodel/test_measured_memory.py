"""The analytic memory model against torch.cuda.max_memory_allocated measured on an H200: the
four runs of tests/memtrace/test_trace.py (Qwen2.5-1.5B, 32K, the same global batch of 128
profile-B sequences; torch 2.11, bf16, every fusion off, varlen: K/V repeated per head).

    python -m pytest tests/perfmodel/test_measured_memory.py -q
"""

import dataclasses

import pytest

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.perfmodel.hardware import get_gpu
from megatron_chunkflow.perfmodel.predict import predict_chunkflow, predict_megatron
from tests.memtrace.test_trace import H200_MEASURED_GIB, h200_batch

BUILD = dict(fused_swiglu=False, kv_repeat=True)  # the measured build and stack


@pytest.mark.parametrize("system, c, k, recompute, measured", H200_MEASURED_GIB)
def test_model_predicts_the_measured_peaks(system, c, k, recompute, measured):
    shape, hw = get_model_shape("qwen2.5-1.5b"), dataclasses.replace(get_gpu("h200"), **BUILD)
    layout = ParallelConfig(tp=1, pp=1, cp=1, dp=1, recompute=recompute)
    lengths = h200_batch()
    p = (predict_chunkflow(lengths, shape, hw, layout, c, k) if system == "chunkflow"
         else predict_megatron(lengths, shape, hw, layout, 32768, system))
    assert p.peak_mem_bytes / 2**30 == pytest.approx(measured, rel=0.05)
