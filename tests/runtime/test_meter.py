"""The exact activation meter (runtime/meter.py ActivationMeter, which verify and bench both use): a
saved tensor counts from its save until autograd frees it, at storage level.

    python -m pytest tests/runtime/test_meter.py -q

The first tests drive the meter with toy autograd graphs in this process. The rest run real
megatron-core on CPU in a world of one (the tests' gloo job, tests/workers.py): tiny
GPT models, micro-batches through Megatron's forward_backward_no_pipelining inside
runtime/observe.observing_megatron, and one ChunkFlow step; they check the meter's peaks against
layer arithmetic taken from an independent count (module by module, and one layer run alone).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_chunkflow.runtime.meter import ActivationMeter
from megatron_chunkflow.core.types import Op
from megatron_chunkflow.runtime.observe import StepObserver

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
        self.prefix_copies, self.bytes = set(), 0

    def nbytes(self):
        return self.bytes


def test_state_store_prefix_copies_and_kept_inputs():
    store = FakeStore()
    meter = ActivationMeter(torch.nn.Module(), store)
    x = torch.randn(4, requires_grad=True)
    prefix, own = torch.randn(128, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    meter.input_kept(3, torch.zeros(16, dtype=torch.float64))
    with meter.forward(F, True):
        store.bytes = 10_000  # the store grows inside the forward (no save follows)
        store.prefix_copies.add(prefix.untyped_storage().data_ptr())
        y = Save.apply(x, prefix, own)
    live = meter.live
    assert (live.activation, live.prefix_copies, live.kv_store, live.kept_inputs) == \
        (512, 1024, 10_000, 128)
    assert meter.peak_state == live.state == 11_152 and meter.peak_total == 11_664
    assert meter.max_chunk_activation == 512  # prefix copies are state, not the chunk's
    meter.input_released(3)
    with meter.backward(B):
        y.sum().backward()
    store.bytes = 0
    assert meter.live.total == 0 and meter.at_peak.total == meter.peak_total == 11_664


# ---- megatron-core, one spawned process ---------------------------------------------------------
class SavedByModule(StepObserver):
    """An independent count for the layer arithmetic (not the meter): every distinct storage
    saved in the forwards (weights left out, each kept alive so no address is reused), by the
    module that saved it first: `embedding`, `layer<i>` (decoder.layers[i], its input included:
    its first norm saves it) or `output` (everything else: final norm, output layer, loss)."""

    def __init__(self, gpt):
        self.weights = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
        self.bytes: dict[str, int] = {}
        self.kept: dict[int, torch.Tensor] = {}
        self.where = ["output"]
        named = [("embedding", gpt.embedding)] + [(f"layer{i}", layer) for i, layer in
                                                   enumerate(gpt.decoder.layers)]
        self.handles = []
        for name, module in named:
            self.handles += [
                module.register_forward_pre_hook(lambda m, a, name=name: self.enter(name)),
                module.register_forward_hook(lambda m, a, o: self.leave())]

    def enter(self, name):
        self.where.append(name)

    def leave(self):
        self.where.pop()

    def step_ended(self):
        for handle in self.handles:
            handle.remove()

    @contextlib.contextmanager
    def forward(self, op, keeps_graph):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.weights and ptr not in self.kept:
            self.kept[ptr] = t
            self.bytes[self.where[-1]] = self.bytes.get(self.where[-1], 0) + nbytes(t)
        return t


class OldMeter(StepObserver):
    """The meter before issue 14, for the over-count it made: the distinct storages a forward saved
    count until its backward_step returns, and what the backward saves counts on top."""

    def __init__(self, gpt):
        self.weights = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
        self.held, self.extra, self.peak = 0, 0, 0

    def _bytes_of(self, t):
        s = t.untyped_storage()
        return 0 if s.data_ptr() in self.weights else s.nbytes()

    @contextlib.contextmanager
    def forward(self, op, keeps_graph):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = self._bytes_of(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.held = sum(seen.values())
        self.peak = max(self.peak, self.held)

    @contextlib.contextmanager
    def backward(self, op):
        refs, meter = {}, self

        class Held:
            def __init__(self, t):
                self.t, self.ptr = t, t.untyped_storage().data_ptr()

            def __del__(self):
                refs[self.ptr][0] -= 1
                if not refs[self.ptr][0]:
                    meter.extra -= refs.pop(self.ptr)[1]

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in refs:
                refs[ptr] = [0, self._bytes_of(t)]
                self.extra += refs[ptr][1]
                self.peak = max(self.peak, self.held + self.extra)
            refs[ptr][0] += 1
            return Held(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
            yield
        self.held = 0


def _micro_batch(t: int, vocab: int, seed: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_chunkflow.runtime.inputs import ChunkInput

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, t), generator=g)
    cu = torch.tensor([0, t], dtype=torch.int32)
    return ChunkInput(tokens, torch.roll(tokens, -1, 1), torch.ones(1, t),
                      torch.arange(t).view(1, -1),
                      PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                      max_seqlen_q=t, max_seqlen_kv=t))


def _gpt(shape_name: str, recompute: str, dtype):
    from megatron_chunkflow.config import Recompute
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.runtime.model import apply_chunkflow
    from megatron_chunkflow.mcore.build import build_gpt_model, transformer_config, wrap_ddp

    shape = get_model_shape(shape_name)
    config = transformer_config(shape, dtype, **Recompute.parse(recompute).megatron_kwargs())
    torch.manual_seed(0)
    gpt = build_gpt_model(shape, config)
    store = apply_chunkflow(gpt, backend="cpu_flash")  # flash-style: no score-sized tensor
    return shape, gpt, store, wrap_ddp(gpt, config)


def _megatron_step(ddp, shape, tokens: int, observers, forward_only=False):
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_chunkflow.runtime.observe import observing_megatron
    from megatron_chunkflow.runtime.loss import make_forward_step

    with observing_megatron(observers), \
            torch.no_grad() if forward_only else contextlib.nullcontext():
        forward_backward_no_pipelining(
            forward_step_func=make_forward_step(exact_loss=True), model=ddp,
            data_iterator=iter([_micro_batch(tokens, shape.vocab_size, tokens)]),
            num_microbatches=1, seq_length=tokens, micro_batch_size=1, forward_only=forward_only)
    ddp.zero_grad_buffer()


def _saved_bytes(gpt, run) -> int:
    """Bytes of the distinct non-weight storages that `run()` saves for backward."""
    weights = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = nbytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _isolated_layer(gpt, tokens: int, dtype) -> int:
    """What one transformer layer saves, run alone on a [t, 1, h] input (counted: its first norm
    saves it), with the model's rotary embedding and one packed sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    x = torch.randn(tokens, 1, gpt.config.hidden_size, dtype=dtype, requires_grad=True)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=tokens, max_seqlen_kv=tokens)
    rope = gpt.rotary_pos_emb(tokens, packed_seq=True)
    saved = _saved_bytes(gpt, lambda: gpt.decoder.layers[0](
        x, attention_mask=None, rotary_pos_emb=rope, packed_seq_params=packed))
    return saved, nbytes(rope)


def _isolated_norm(gpt, tokens: int) -> int:
    """What a layer's first norm saves, run alone on a [t, 1, h] input (its input included)."""
    x = torch.randn(tokens, 1, gpt.config.hidden_size, requires_grad=True)
    return _saved_bytes(gpt, lambda: gpt.decoder.layers[0].input_layernorm(x))


def _meter_run(ddp, gpt, store, shape, tokens, recompute):
    meter = ActivationMeter(ddp, store)
    _megatron_step(ddp, shape, tokens, [meter])
    old = OldMeter(gpt)
    _megatron_step(ddp, shape, tokens, [old])
    return {"peak": meter.peak_total, "activation": meter.peak_activation,
            "state": meter.peak_state, "recompute": meter.peak_recompute,
            "chunk": meter.max_chunk_activation, "at_peak_recompute": meter.at_peak.recompute,
            "old": old.peak, "live_after": meter.live.total}


def _chunkflow_state(c: int, n: int) -> dict:
    """One sequence of n chunks of c tokens, K = 1, float64, through ChunkFlow's schedule: at the
    end of every op, the meter's live split and the store's own bytes."""
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.perfmodel.footprint import kv_state_bytes_per_token
    from megatron_chunkflow.runtime.execute import execute_step, plan_step
    from megatron_chunkflow.runtime.loss import make_forward_step
    from megatron_chunkflow.runtime.model import apply_chunkflow
    from megatron_chunkflow.mcore.build import build_gpt_model, transformer_config, wrap_ddp

    from megatron_chunkflow.checks.memory import kv_state_formula

    shape = get_model_shape("tiny")
    config = transformer_config(shape, torch.float64)
    model = build_gpt_model(shape, config)
    store = apply_chunkflow(model, backend="cpu_flash")
    model = wrap_ddp(model, config)
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

    execute_step(step, model, make_forward_step(exact_loss=True), observers=[meter, AtOpEnds()])
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


def _chunkflow_with_megatron_recompute() -> list[tuple]:
    """Sequences of up to 11 chunks (C = 64, K = 2), bfloat16, with Megatron's full recompute on
    top of ChunkFlow (prefix copies made and freed in each recompute's first, no_grad pass):
    every peak, for the meter and for ReadsStoreAlways, twice each."""
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.runtime.execute import execute_step, plan_step
    from megatron_chunkflow.runtime.loss import make_forward_step

    shape, gpt, store, ddp = _gpt("tiny", "full", torch.bfloat16)
    step = plan_step(make_sequences([700, 60, 130, 300], shape.vocab_size, 0),
                     ChunkFlowConfig(64, 2, "torch"), ParallelConfig(), shape)
    out = []
    for cls in (CountsStaleStoreReads, ReadsStoreAlways) * 2:
        meter = cls(ddp, store)
        execute_step(step, ddp, make_forward_step(), observers=[meter])
        ddp.zero_grad_buffer()
        out.append((meter.peak_total, meter.peak_activation, meter.peak_state,
                    meter.peak_recompute, meter.max_chunk_activation, meter.at_peak,
                    meter.live.total, getattr(meter, "stale", 0)))
    return out


def _child():
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown

    init_distributed()
    out = {"layers": {}, "recompute": {}}
    try:
        # no recompute, tiny, float64, three lengths: the independent count and the meter
        shape, gpt, store, ddp = _gpt("tiny", "none", torch.float64)
        for t in (64, 128, 256):
            counted = SavedByModule(gpt)
            _megatron_step(ddp, shape, t, [counted])
            layer, _ = _isolated_layer(gpt, t, torch.float64)
            out["layers"][t] = {"by_module": counted.bytes, "isolated_layer": layer,
                                **_meter_run(ddp, gpt, store, shape, t, "none")}
        meter = ActivationMeter(ddp, store)
        _megatron_step(ddp, shape, 64, [meter], forward_only=True)
        out["no_grad_peak"] = meter.peak_total
        # recompute menu on tiny-bench (float32: a layer outweighs the output layer's saves)
        t = 64
        for recompute in ("none", "block:1", "block:3", "full", "selective:layernorm"):
            shape, gpt, store, ddp = _gpt("tiny-bench", recompute, torch.float32)
            row = _meter_run(ddp, gpt, store, shape, t, recompute)
            if recompute == "none":
                counted = SavedByModule(gpt)
                _megatron_step(ddp, shape, t, [counted])
                row["by_module"] = counted.bytes
                row["isolated_layer"], row["rope"] = _isolated_layer(gpt, t, torch.float32)
                row["isolated_norm"] = _isolated_norm(gpt, t)
            out["recompute"][recompute] = row
        out["hidden"], out["layers_n"] = shape.hidden_size, shape.num_layers
        out["chunkflow"] = _chunkflow_state(64, 4)
        out["chunkflow_recompute"] = _chunkflow_with_megatron_recompute()
    finally:
        shutdown()
    return out


@pytest.fixture(scope="module")
def megatron(gloo):
    return gloo.run(_child, 1, timeout=600)[0]


@pytest.mark.slow
def test_no_recompute_peak_is_the_layer_sum_and_linear_in_tokens(megatron):
    """No recompute: the peak is everything one forward saved (nothing is freed before the
    backward, which saves nothing), i.e. the embedding's + L x one layer's (run alone) + the
    output part's (final norm, output layer, loss), and with a flash-style kernel it is linear in
    the micro-batch's tokens T."""
    rows = megatron["layers"]
    for t, r in rows.items():
        by = r["by_module"]
        layers = [by[f"layer{i}"] for i in range(4)]
        assert layers == [r["isolated_layer"]] * 4, (t, layers, r["isolated_layer"])
        assert by["embedding"] == 8 * t  # the token ids
        assert r["peak"] == by["embedding"] + 4 * r["isolated_layer"] + by["output"], (t, r)
        assert r["peak"] == r["activation"] == r["chunk"] == r["old"]
        assert r["state"] == r["recompute"] == r["live_after"] == 0
    assert rows[128]["peak"] == 2 * rows[64]["peak"] and rows[256]["peak"] == 4 * rows[64]["peak"]
    assert rows[256]["isolated_layer"] == 4 * rows[64]["isolated_layer"]


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["block:1", "block:3", "full"])
def test_block_and_full_recompute_peak_is_exact(megatron, recompute):
    """Megatron's block recompute of N layers (full: N = L, one checkpoint per layer) keeps
    N layer inputs X (plus the rotary embedding R, one storage for all checkpoints) and L - N whole
    layers A. Layer N-1 is recomputed inside the backward after the output part and layers
    N..L-1 have been freed, so its working set (A - X more: its input is already counted) sits on
    the embedding's E, R and the N inputs. The exact peak is the larger of the two moments:
        end of forward:            E + R + N X + (L - N) A + O
        recompute of layer N - 1:  E + R + N X + (A - X)
    The old meter held every forward save until backward_step returned and added the recompute's
    working set on top (with the already-held input counted again): more."""
    none, r = megatron["recompute"]["none"], megatron["recompute"][recompute]
    t, n_layers = 64, megatron["layers_n"]
    n = n_layers if recompute == "full" else int(recompute.split(":")[1])
    a, x, rope = none["isolated_layer"], t * megatron["hidden"] * 4, none["rope"]
    e, o = none["by_module"]["embedding"], none["by_module"]["output"]
    forward_end = e + rope + n * x + (n_layers - n) * a + o
    recompute_moment = e + rope + n * x + (a - x)
    assert r["recompute"] == a - x
    assert r["chunk"] == forward_end  # one micro-batch: everything its forward saved
    assert r["peak"] == max(forward_end, recompute_moment), (r, forward_end, recompute_moment)
    assert r["old"] > r["peak"], f"old meter {r['old']:,} vs exact {r['peak']:,}"
    assert r["old"] == forward_end + a, \
        f"old meter {r['old']:,} = forward {forward_end:,} + whole layer {a:,}"
    assert r["live_after"] == 0
    if recompute == "full":  # here the recompute is the peak: the meter's split says so
        assert r["peak"] == recompute_moment > forward_end and r["at_peak_recompute"] == a - x


@pytest.mark.slow
def test_selective_layernorm_recompute_follows_the_discarded_outputs(megatron):
    """Selective layernorm recompute (CheckpointWithoutOutput): each of a layer's two norms keeps
    only its input, which the layer saved anyway, and its output storage, saved by the next
    linear, is resized to 0 after the forward. Saved per norm: exactly what the norm saves when
    run alone (its input, the normalised input and the reciprocal RMS). The old meter kept counting
    the discarded outputs."""
    none, r = megatron["recompute"]["none"], megatron["recompute"]["selective:layernorm"]
    per_norm, n_layers = none["isolated_norm"], megatron["layers_n"]
    assert r["peak"] == none["peak"] - 2 * n_layers * per_norm, (r, none["peak"], per_norm)
    assert r["old"] > r["peak"] and r["recompute"] > 0 and r["live_after"] == 0


@pytest.mark.slow
def test_no_grad_megatron_forward_counts_nothing(megatron):
    assert megatron["no_grad_peak"] == 0


@pytest.mark.slow
def test_chunkflow_kv_state_is_the_store_plus_prefix_copies(megatron):
    """One sequence of 4 chunks (C = 64, K = 1, float64) through ChunkFlow's schedule: at every op's
    end the meter's K/V-store part is the store's own bytes; after a graph-keeping forward of chunk
    j the prefix copies saved are cat(prefix, own) of (j + 1) C tokens (none for chunk 0); the
    state's peak is the documented formula's."""
    cf = megatron["chunkflow"]
    u, c = cf["u"], cf["c"]
    assert [(kind, j) for kind, j, *_ in cf["ends"]] == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 3), ("R", 2), ("B", 2), ("R", 1), ("B", 1),
        ("R", 0), ("B", 0)]
    for kind, j, keeps_graph, live, store_bytes in cf["ends"]:
        assert live.kv_store == store_bytes
        if keeps_graph:
            assert live.prefix_copies == (0 if j == 0 else (j + 1) * c * u), (kind, j, live)
        else:
            assert live.prefix_copies == live.activation == 0, (kind, j, live)
    assert cf["peak_state"] == cf["formula"]
    assert cf["live_after"] == 0


@pytest.mark.slow
def test_store_read_after_changes_only_and_prefix_copies_by_identity(megatron):
    """The meter reads store.nbytes() only after the store may have changed (kv_with_state, the
    relay's backward): at every one of its samples its store bytes are store.nbytes(), and its
    peaks are those of reading at every sample. Under Megatron's recompute each recompute first
    makes prefix copies under no_grad and frees them; an activation saved later at the same
    address is not taken for one: the figures are the same run after run."""
    runs = megatron["chunkflow_recompute"]
    assert all(run == runs[0] for run in runs), runs  # the stale count included: 0
    peak, _, state, recompute, *_, live_after, stale = runs[0]
    assert peak > state > 0 and recompute > 0 and live_after == 0 and stale == 0
