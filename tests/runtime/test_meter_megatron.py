"""The exact activation meter (runtime/meter.py) on Megatron's own schedule and recompute menu,
checked against layer arithmetic taken from an independent count (module by module, and one layer
run alone); the meter's mechanics on toy graphs and ChunkFlow's K/V state are
tests/runtime/test_meter.py's.

    python -m pytest tests/runtime/test_meter_megatron.py -q

Real megatron-core on CPU in a world of one (the tests' gloo job, tests/workers.py): tiny GPT
models, micro-batches through Megatron's forward_backward_no_pipelining inside
runtime/observe.observing_megatron, under no recompute, block:N, full and selective:layernorm.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_chunkflow.runtime.meter import ActivationMeter
from megatron_chunkflow.runtime.observe import StepObserver


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


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


def _gpt(job, shape_name: str, recompute: str, dtype):
    from megatron_chunkflow.config import ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.mcore.build import build_chunkflow_model

    shape = get_model_shape(shape_name)
    torch.manual_seed(0)
    cm = build_chunkflow_model(shape, dtype, job.for_layout(ParallelConfig(recompute=recompute)),
                               attention_backend="cpu_flash")  # flash-style: no score-sized tensor
    return shape, cm.model, cm.store, cm.ddp


def _megatron_step(ddp, shape, tokens: int, observers, forward_only=False):
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_chunkflow.mcore.job import tensor_parallel_of
    from megatron_chunkflow.runtime.loss import make_forward_step
    from megatron_chunkflow.runtime.observe import observing_megatron

    *_, tp_group = tensor_parallel_of(ddp.module)

    with observing_megatron(observers), \
            torch.no_grad() if forward_only else contextlib.nullcontext():
        forward_backward_no_pipelining(
            forward_step_func=make_forward_step(tp_group, exact_loss=True), model=ddp,
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


def _child():
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown

    job = init_distributed()
    out = {"layers": {}, "recompute": {}}
    try:
        # no recompute, tiny, float64, three lengths: the independent count and the meter
        shape, gpt, store, ddp = _gpt(job, "tiny", "none", torch.float64)
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
            shape, gpt, store, ddp = _gpt(job, "tiny-bench", recompute, torch.float32)
            row = _meter_run(ddp, gpt, store, shape, t, recompute)
            if recompute == "none":
                counted = SavedByModule(gpt)
                _megatron_step(ddp, shape, t, [counted])
                row["by_module"] = counted.bytes
                row["isolated_layer"], row["rope"] = _isolated_layer(gpt, t, torch.float32)
                row["isolated_norm"] = _isolated_norm(gpt, t)
            out["recompute"][recompute] = row
        out["hidden"], out["layers_n"] = shape.hidden_size, shape.num_layers
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
