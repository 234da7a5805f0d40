"""The check before step 1 (memtrace/guard.py): the trace in a child process, and the refusal
that names a plan that fits. check_memory itself needs CUDA (tests/gpu); everything it decides
with is here.

    python -m pytest tests/memtrace/test_guard.py -q
"""

import dataclasses

import pytest

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
from megatron_chunkflow.memtrace.guard import refusal, traced_need
from megatron_chunkflow.memtrace.trace import trace_memory

pytestmark = pytest.mark.slow
GiB = 2**30
LENGTHS = [14000, 3000, 2500, 900, 700, 400, 300, 120]


def _settings(**chunkflow):
    shape = dataclasses.replace(get_model_shape("qwen2.5-1.5b"), num_layers=4)
    return TrainSettings(shape=shape, model_name="qwen2.5-1.5b", dtype="bfloat16",
                         seq_length=16384, global_batch_size=len(LENGTHS), train_iters=2,
                         chunkflow=ChunkFlowConfig(**{"chunk_size": 16384, **chunkflow}),
                         optimizer=OptimizerConfig(lr_warmup_iters=0),
                         parallel=ParallelConfig(), device="cuda")


def test_the_child_traces_what_the_process_would():
    s = _settings(chunk_size=4096)
    needed = traced_need(s, LENGTHS, 1)
    assert list(needed) == [0]
    assert needed[0] == trace_memory(s, LENGTHS, world=1).needed


def test_a_first_step_that_does_not_fit_is_refused_with_a_plan_that_does():
    s = _settings()  # one 14K chunk: the whole loss of 14,000 tokens on a 152K vocabulary
    needed = trace_memory(s, LENGTHS, world=1, warm_optimizer=True).needed
    assert refusal(s, LENGTHS, 1, needed, 0, needed + GiB) is None
    message = refusal(s, LENGTHS, 1, needed, 0, needed - 3 * GiB, "NVIDIA H100 80GB HBM3")
    assert f"needs {needed / GiB:.1f} GiB of GPU memory on rank 0" in message
    assert f"has {(needed - 3 * GiB) / GiB:.1f} GiB" in message
    assert "the model finds that --chunk-size" in message and "--chunkflow-skip-memory-check" \
        in message
    hopeless = refusal(s, LENGTHS, 1, needed, 0, 4 * GiB)  # less than the weights and Adam
    assert "finds no plan on this layout that fits" in hopeless
