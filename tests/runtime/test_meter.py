"""The exact activation meter (runtime/meter.py ActivationMeter, which verify and bench both use): a
saved tensor counts from its save until autograd frees it, at storage level.

    python -m pytest tests/runtime/test_meter.py -q

The first tests drive the meter with toy autograd graphs in this process. The last run ChunkFlow's
schedule on real megatron-core in a world of one (the tests' gloo job, tests/workers.py) and check
the meter's K/V state against the store's own bytes and the documented formula. Megatron's own
schedule and recompute menu are tests/runtime/test_meter_megatron.py's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_chunkflow.core.types import Op
from megatron_chunkflow.runtime.meter import ActivationMeter
from megatron_chunkflow.runtime.observe import StatePeaks, StepObserver

F, B = Op("F", 0), Op("B", 0)


class Save(torch.autograd.Function):
    """Identity on x that saves `tensors` for its backward (and reads them there)."""

    @staticmethod
    def forward(ctx, x, *tensors):
        ctx.save_for_backward(*tensors)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        return (grad, *[None] * len(saved))


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


# ---- toy graphs, in this process ---------------------------------------------------------------
def test_views_count_once_weights_and_empty_storages_never():
    model = torch.nn.Linear(16, 16, dtype=torch.float64)
    meter = ActivationMeter(model)
    base = torch.randn(256, dtype=torch.float64)  # 2,048 bytes
    x = torch.randn(4, requires_grad=True, dtype=torch.float64)
    with meter.forward(F, True):
        y = Save.apply(x, base[:10], base[100:], base.view(16, 16), base.view(16, 16).t(),
                       model.weight, model.weight.t(), model.bias, torch.empty(0))
    assert meter.live.activation == meter.peak_total == nbytes(base) == 2048
    assert meter.max_chunk_activation == 2048
    with meter.backward(B):
        y.sum().backward()
    assert meter.live.total == 0 and meter.peak_total == 2048


def test_counts_from_save_until_autograd_frees_it():
    """Two nodes saving 1 KiB and 4 KiB: both count after the forward; the later one's bytes are
    gone by the time the earlier one's backward starts; nothing counts afterwards."""
    meter = ActivationMeter(torch.nn.Module())
    a, b = torch.randn(128, dtype=torch.float64), torch.randn(512, dtype=torch.float64)
    x = torch.randn(4, requires_grad=True)
    with meter.forward(F, True):
        y1 = Save.apply(x, a)
        y2 = Save.apply(y1, b)
    seen = []
    y1.register_hook(lambda g: seen.append(meter.live.activation))  # between the two backwards
    assert meter.live.activation == 1024 + 4096
    with meter.backward(B):
        y2.sum().backward()
    assert seen == [1024]
    assert meter.live.total == 0 and meter.peak_total == meter.peak_activation == 5120
    assert meter.peak_recompute == 0


def test_a_graph_dropped_without_backward_is_uncounted():
    meter = ActivationMeter(torch.nn.Module())
    x = torch.randn(64, requires_grad=True, dtype=torch.float64)
    with meter.forward(F, True):
        y = (x.exp() * x).sum()  # saves x and exp(x)
    assert meter.live.activation == 2 * 512
    del y
    assert meter.live.total == 0


def test_no_grad_forward_counts_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    meter = ActivationMeter(model)
    with meter.forward(F, False), torch.no_grad():
        model(torch.randn(16, 32))
    with meter.forward(Op("F", 1), True), torch.no_grad():  # a graph was wanted, none was kept
        model(torch.randn(16, 32))
    assert meter.peak_total == meter.max_chunk_activation == 0


def test_gradients_are_unchanged():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.SiLU(), torch.nn.Linear(32, 1))
    x = torch.randn(5, 8)

    def grads(meter):
        model.zero_grad()
        with meter.forward(F, True) if meter else contextlib.nullcontext():
            loss = model(x).square().sum()
        with meter.backward(B) if meter else contextlib.nullcontext():
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    meter = ActivationMeter(model)
    for plain, metered in zip(grads(None), grads(meter)):
        assert torch.equal(plain, metered)
    assert meter.peak_total > 0 and meter.live.total == 0


def test_recompute_in_backward_is_the_working_set():
    """Reentrant checkpoint (Megatron's CheckpointFunction does the same): the forward saves the
    input only; the backward re-runs the function, whose saves count until the inner backward
    frees them; the input (already counted) is not counted twice."""
    from torch.utils.checkpoint import checkpoint

    meter = ActivationMeter(torch.nn.Module())
    x = torch.randn(1024, dtype=torch.float64, requires_grad=True)  # 8 KiB

    def f(t):
        return (t.exp() * 3).sin()  # saves exp(t) (mul by a constant saves nothing), exp*3

    with meter.forward(F, True):
        y = checkpoint(f, x, use_reentrant=True).sum()
    assert meter.live.activation == 8192
    with meter.backward(B):
        y.backward()
    assert meter.peak_recompute == 2 * 8192  # exp(t) and exp(t)*3: the input was counted already
    assert meter.peak_total == 8192 + 2 * 8192
    assert meter.at_peak.recompute == 2 * 8192 and meter.live.total == 0


def test_resized_storages_count_their_size():
    """A saved storage resized to 0 (CheckpointWithoutOutput's discard) stops counting; regrown
    inside a backward (its recompute) it counts again, as recompute."""
    meter = ActivationMeter(torch.nn.Module())
    x = torch.randn(4, requires_grad=True)
    out = torch.randn(256, dtype=torch.float64)
    with meter.forward(F, True):
        y = Save.apply(x, out)
        out.untyped_storage().resize_(0)
    assert meter.live.activation == 0 and meter.peak_total == 2048

    def regrow(grad):
        out.untyped_storage().resize_(2048)
        return grad

    y.register_hook(regrow)
    with meter.backward(B):
        y.sum().backward()
    assert meter.peak_recompute == 2048 and meter.live.total == 0
    assert "resize_" not in torch.UntypedStorage.__dict__  # the patch is undone


class FakeStore:
    def __init__(self):
        self.storages, self.bytes = set(), 0

    def nbytes(self):
        return self.bytes


def test_state_peaks_read_after_every_forward_and_backward():
    """StatePeaks (the benchmarks' coarse reading): the largest device and host bytes of the
    store seen at the end of a forward or backward; reset() starts over."""

    class Store:
        device, host = 0, 0

        def nbytes(self):
            return self.device

        def kept_host_bytes(self):
            return self.host

    store = Store()
    peaks = StatePeaks(store)
    for device, host, hook in ((100, 0, "F"), (300, 50, "F"), (200, 80, "B"), (0, 0, "B")):
        context = peaks.forward(F, True) if hook == "F" else peaks.backward(B)
        with context:
            store.device, store.host = device, host
    assert (peaks.device, peaks.host) == (300, 80)
    peaks.reset()
    assert (peaks.device, peaks.host) == (0, 0)


def test_saved_views_of_the_store_buffer_and_kept_inputs_are_state():
    """A saved view of the store's K/V buffer (a storage in store.storages) is counted once, in
    the store's bytes, not again as an activation."""
    store = FakeStore()
    meter = ActivationMeter(torch.nn.Module(), store)
    x = torch.randn(4, requires_grad=True)
    buffer, own = torch.randn(2, 128, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    meter.input_kept(3, torch.zeros(16, dtype=torch.float64))
    with meter.forward(F, True):
        store.bytes = 10_000  # the store grows inside the forward (no save follows)
        store.storages.add(buffer.untyped_storage().data_ptr())
        y = Save.apply(x, buffer[0, :64], buffer[1, :64], own)
    live = meter.live
    assert (live.activation, live.kv_store, live.kept_inputs) == (512, 10_000, 128)
    assert meter.peak_state == live.state == 10_128 and meter.peak_total == 10_640
    assert meter.max_chunk_activation == 512  # the buffer is state, not the chunk's
    meter.input_released(3)
    with meter.backward(B):
        y.sum().backward()
    store.bytes = 0
    assert meter.live.total == 0 and meter.at_peak.total == meter.peak_total == 10_640


# ---- ChunkFlow's schedule on megatron-core, in the world-of-one job ------------------------------
def _chunkflow_state(job, c: int, n: int) -> dict:
    """One sequence of n chunks of c tokens, K = 1, float64, through ChunkFlow's schedule: at the
    end of every op, the meter's live split and the store's own bytes."""
    from megatron_chunkflow.checks.memory import kv_state_formula
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.build import build_chunkflow_model
    from megatron_chunkflow.perfmodel.kvstate import kv_state_bytes_per_token
    from megatron_chunkflow.runtime.execute import execute_step, plan_step
    from megatron_chunkflow.runtime.loss import make_forward_step

    shape = get_model_shape("tiny")
    cm = build_chunkflow_model(shape, torch.float64, job, attention_backend="cpu_flash")
    model, store = cm.ddp, cm.store
    cfg = ChunkFlowConfig(c, 1, "cpu_flash")
    step = plan_step(make_sequences([n * c], shape.vocab_size, 0), cfg, ParallelConfig(), shape)
    meter = ActivationMeter(model, store)
    ends = []

    class AtOpEnds(StepObserver):
        @contextlib.contextmanager
        def forward(self, op, keeps_graph):
            yield
            ends.append((op.kind, step.metas[op.chunk].index, keeps_graph, meter.live,
                         store.nbytes()))

        @contextlib.contextmanager
        def backward(self, op):
            yield
            ends.append(("B", step.metas[op.chunk].index, False, meter.live, store.nbytes()))

    execute_step(step, model, make_forward_step(job.groups.tp, exact_loss=True),
                 pg_collection=job.groups, observers=[meter, AtOpEnds()])
    u = kv_state_bytes_per_token(shape, shape.num_layers, 8, 1, with_grad=False)
    return {"ends": ends, "peak_state": meter.peak_state, "u": u, "c": c,
            "formula": kv_state_formula(n * c, c, u, u), "live_after": meter.live.total}


class ReadsStoreAlways(ActivationMeter):
    """The meter reading store.nbytes() at every sample instead of only after the store changed."""

    def _sample(self, fresh=False):
        self._store_dirty = True
        super()._sample(fresh)


class CountsStaleStoreReads(ActivationMeter):
    """The meter, counting the samples at which its store bytes differ from store.nbytes()."""

    stale = 0

    def _sample(self, fresh=False):
        super()._sample(fresh)
        self.stale += self._store_bytes != self.store.nbytes()


def _chunkflow_with_megatron_recompute(job) -> list[tuple]:
    """Sequences of up to 11 chunks (C = 64, K = 2), bfloat16, with Megatron's full recompute on
    top of ChunkFlow (views of the K/V buffer saved again by each recompute):
    every peak, for the meter and for ReadsStoreAlways, twice each."""
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.build import build_chunkflow_model
    from megatron_chunkflow.runtime.execute import execute_step, plan_step
    from megatron_chunkflow.runtime.loss import make_forward_step

    shape = get_model_shape("tiny")
    cm = build_chunkflow_model(shape, torch.bfloat16,
                               job.for_layout(ParallelConfig(recompute="full")),
                               attention_backend="cpu_flash")
    store, ddp = cm.store, cm.ddp
    step = plan_step(make_sequences([700, 60, 130, 300], shape.vocab_size, 0),
                     ChunkFlowConfig(64, 2, "torch"), ParallelConfig(), shape)
    out = []
    for cls in (CountsStaleStoreReads, ReadsStoreAlways) * 2:
        meter = cls(ddp, store)
        execute_step(step, ddp, make_forward_step(job.groups.tp), pg_collection=job.groups,
                     observers=[meter])
        ddp.zero_grad_buffer()
        out.append((meter.peak_total, meter.peak_activation, meter.peak_state,
                    meter.peak_recompute, meter.max_chunk_activation, meter.at_peak,
                    meter.live.total, getattr(meter, "stale", 0)))
    return out


def _chunkflow_child():
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown

    job = init_distributed()
    try:
        return {"state": _chunkflow_state(job, 64, 4),
                "recompute": _chunkflow_with_megatron_recompute(job)}
    finally:
        shutdown()


@pytest.fixture(scope="module")
def chunkflow(gloo):
    return gloo.run(_chunkflow_child, 1, timeout=600)[0]


@pytest.mark.slow
def test_chunkflow_kv_state_is_the_store(chunkflow):
    """One sequence of 4 chunks (C = 64, K = 1, float64) through ChunkFlow's schedule: at every op's
    end the meter's state is the store's own bytes, the K/V buffer of all N C tokens from chunk 0's
    forward on, plus the accumulator of (N - 1) C tokens from the first backward until chunk 0's
    drops both; the state's peak is the documented formula's."""
    cf = chunkflow["state"]
    u, c = cf["u"], cf["c"]
    assert [(kind, j) for kind, j, *_ in cf["ends"]] == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 3), ("R", 2), ("B", 2), ("R", 1), ("B", 1),
        ("R", 0), ("B", 0)]
    n = 4
    for kind, j, keeps_graph, live, store_bytes in cf["ends"]:
        assert live.kv_store == store_bytes and live.state == store_bytes, (kind, j, live)
        expected = 0 if (kind, j) == ("B", 0) else \
            n * c * u + (0 if kind == "F" else (n - 1) * c * u)  # fp64: accumulators as K/V
        assert store_bytes == expected, (kind, j, store_bytes, expected)
        if not keeps_graph and kind != "B":
            assert live.activation == 0, (kind, j, live)
    assert cf["peak_state"] == cf["formula"]
    assert cf["live_after"] == 0


@pytest.mark.slow
def test_store_read_after_changes_only(chunkflow):
    """The meter reads store.nbytes() only after the store may have changed (kv_with_state, the
    relay's backward): at every one of its samples its store bytes are store.nbytes(), and its
    peaks are those of reading at every sample, the same run after run (Megatron's recompute
    saving views of the K/V buffer again in every backward)."""
    runs = chunkflow["recompute"]
    assert all(run == runs[0] for run in runs), runs  # the stale count included: 0
    peak, _, state, recompute, *_, live_after, stale = runs[0]
    assert peak > state > 0 and recompute > 0 and live_after == 0 and stale == 0
