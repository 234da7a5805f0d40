"""State-aware 1F1B on megatron-core: memory per stage, failures end the job, plan agreement."""

import os

import pytest

from megatron_chunkflow.config import ParallelConfig

pytestmark = pytest.mark.slow

C = 16
LENGTHS = [70, 5, 33, 100, 12, 64, 1, 16, 48, 9, 130]


def _memory(pp, k):
    from megatron_chunkflow.checks.verify import run_verify
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.mcore.dist import shutdown
    from megatron_chunkflow.runtime.meter import ActivationMeter

    (r,) = run_verify(get_model_shape("tiny"), [LENGTHS], ChunkFlowConfig(C, k, "torch"),
                      ParallelConfig(pp=pp), meter_cls=ActivationMeter)
    shutdown()
    return r.held_bytes_per_stage, r.chunk_bytes_per_stage, r.bubble_measured, r.bubble_predicted


@pytest.mark.parametrize("pp,k", [pytest.param(2, 1, marks=pytest.mark.medium), (4, 2)])
def test_stage_activations_bounded_by_window(gloo, pp, k):
    """Measured: stage s never holds more than max(p - s, K) chunks' activations at once
    (1F1B's in-flight count for standalone chunks, the K window for a long sequence)."""
    held, largest, measured, predicted = gloo.run(_memory, pp, pp, k, timeout=600)[0]
    for s in range(pp):
        assert 0 < held[s] <= max(pp - s, k) * largest[s], (s, held[s], largest[s])
    assert 0 <= measured < 1 and 0 <= predicted < 1


def _failing_step():
    """PP=2: rank 1's third forward raises; rank 0 is then blocked in a receive."""
    import itertools
    from functools import partial

    from megatron_chunkflow.core.costs import OpCosts
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.core.packer import build_chunks
    from megatron_chunkflow.core.schedule import state_aware_plan
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.build import build_gpt_model, transformer_config, wrap_ddp
    from megatron_chunkflow.mcore.dist import init_distributed
    from megatron_chunkflow.runtime.inputs import build_step
    from megatron_chunkflow.runtime.loss import forward_step
    from megatron_chunkflow.runtime.model import apply_chunkflow
    from megatron_chunkflow.runtime.schedules import forward_backward_chunkflow

    job = init_distributed(ParallelConfig(pp=2))
    shape = get_model_shape("tiny")
    config = transformer_config(shape, job)
    model = build_gpt_model(shape, config, job)
    apply_chunkflow(model)
    model = wrap_ddp(model, config)
    chunks = build_chunks(LENGTHS, C, 1, 1, shape).chunks
    plan = state_aware_plan(chunks, 2, 1, OpCosts.from_model(chunks, shape, 2))
    step = build_step(plan, make_sequences(LENGTHS, shape.vocab_size, 0), C)
    calls = itertools.count()

    def failing_forward_step(data_iterator, model):
        if job.ranks.pp_rank == 1 and next(calls) == 2:
            raise RuntimeError("injected failure on stage 1")
        return forward_step(data_iterator, model)

    forward_backward_chunkflow(forward_step_func=partial(failing_forward_step), model=model,
                               data_iterator=iter([step]), num_microbatches=len(chunks),
                               pg_collection=job.groups)


def test_exception_on_one_rank_ends_all_ranks(gloo):
    with pytest.raises(RuntimeError, match="rank 1 failed(.|\n)*injected failure on stage 1"):
        gloo.run(_failing_step, 2, timeout=120)


def _diverging_plans():
    """Two ranks of one pipeline build plans from different lengths: refused, not a hang."""
    from megatron_chunkflow.core.costs import OpCosts
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.core.packer import build_chunks
    from megatron_chunkflow.core.schedule import state_aware_plan
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.build import build_gpt_model, transformer_config
    from megatron_chunkflow.mcore.dist import init_distributed
    from megatron_chunkflow.runtime.inputs import build_step
    from megatron_chunkflow.runtime.loss import forward_step
    from megatron_chunkflow.runtime.model import apply_chunkflow
    from megatron_chunkflow.runtime.schedules import forward_backward_chunkflow

    job = init_distributed(ParallelConfig(pp=2))
    shape = get_model_shape("tiny")
    model = build_gpt_model(shape, transformer_config(shape, job), job)
    apply_chunkflow(model)
    lengths = LENGTHS if int(os.environ["RANK"]) == 0 else LENGTHS[:-1]
    chunks = build_chunks(lengths, C, 1, 1, shape).chunks
    plan = state_aware_plan(chunks, 2, 1, OpCosts.from_model(chunks, shape, 2))
    step = build_step(plan, make_sequences(lengths, shape.vocab_size, 0), C)
    forward_backward_chunkflow(forward_step_func=forward_step, model=model,
                               data_iterator=iter([step]), num_microbatches=len(chunks),
                               pg_collection=job.groups)


def test_ranks_with_different_plans_are_refused(gloo):
    with pytest.raises(RuntimeError, match="different ChunkFlow plans"):
        gloo.run(_diverging_plans, 2, timeout=120)


def _traced_step():
    """PP=2, CHUNKFLOW_TRACE=1: one ChunkFlow step."""
    import os

    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.build import build_chunkflow_model
    from megatron_chunkflow.mcore.dist import init_distributed
    from megatron_chunkflow.runtime.execute import execute_step, plan_step
    from megatron_chunkflow.runtime.loss import forward_step

    import torch

    os.environ["CHUNKFLOW_TRACE"] = "1"
    parallel = ParallelConfig(pp=2)
    job = init_distributed(parallel)
    shape = get_model_shape("tiny")
    cm = build_chunkflow_model(shape, torch.float32, job, attention_backend="torch")
    step = plan_step(make_sequences(LENGTHS, shape.vocab_size, 0), ChunkFlowConfig(C, 1),
                     parallel, shape, job.ranks)
    execute_step(step, cm.ddp, forward_step, pg_collection=job.groups)
    return [(op.kind, op.chunk) for op in step.plan.stages[job.ranks.pp_rank]]


def test_trace_names_every_op_and_exchange_in_order(gloo, capfd):
    """CHUNKFLOW_TRACE=1: each rank prints every op of its plan and every send and receive, in
    the order it runs them, so a hang's last unmatched begin says where a rank waits."""
    import re

    plans = gloo.run(_traced_step, 2)
    err = capfd.readouterr().err
    for rank, plan in enumerate(plans):
        begun = re.findall(rf"\[chunkflow trace\] rank {rank} stage {rank} \+\S+ begin (\w+) "
                           r"chunk (\d+)", err)
        ops = [(kind, int(chunk)) for kind, chunk in begun if kind in ("F", "R", "B")]
        assert ops == plan
        exchanges = {kind for kind, _ in begun} - {"F", "R", "B"}
        assert exchanges == ({"send_forward", "recv_backward"} if rank == 0
                             else {"recv_forward", "send_backward"})
