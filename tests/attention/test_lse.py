"""attention/lse.py: the forward returning (out, lse) and the backward from (dout, q, k, v, out, lse)
equal chunk_attention and autograd through it, for the backends that have the pair on CPU.

Run: python -m pytest tests/attention/test_lse.py -q
"""

import pytest
import torch

from megatron_chunkflow.attention import (
    attention_backward,
    attention_with_lse,
    chunk_attention,
    cpu_flash,
    lse_by_token,
    lse_pair,
    merge_lse,
    torch_attention,
)
from tests.attention.test_chunk_attention import CASES, cumsum, make_inputs, run_with_grads

PAIRED = ["cpu_flash", "torch"]  # the CPU backends with the pair
# random multi-segment chunks: (lq, lk) per segment, with prefixes (lk > lq), an empty segment and
# single queries, under GQA 6:2, MQA 5:1 and MHA
RANDOM = {"gqa": (6, 2, 16), "mqa": (5, 1, 8), "mha": (3, 3, 12)}


def random_segments(seed: int):
    g = torch.Generator().manual_seed(seed)
    lq = [int(x) for x in torch.randint(0, 40, (5,), generator=g)] + [1, 0]
    lq[0] = max(lq[0], 1)
    lk = [q + int(p) for q, p in zip(lq, torch.randint(0, 90, (len(lq),), generator=g))]
    return lq, lk


def rel_err(x, ref):
    return ((x - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("backend", PAIRED)
@pytest.mark.parametrize("heads", RANDOM)
@pytest.mark.parametrize("seed", [0, 1])
def test_pair_equals_chunk_attention_and_autograd_float64(backend, heads, seed):
    nh, ng, hd = RANDOM[heads]
    lq, lk = random_segments(seed)
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q, k, v, dout = make_inputs(lq, lk, nh, ng, hd, torch.float64, seed=seed)
    ref = run_with_grads(lambda *a: chunk_attention(*a, cu_q, cu_kv, backend=backend), q, k, v,
                         dout)
    scale = 0.3
    ref_scaled = run_with_grads(
        lambda *a: chunk_attention(*a, cu_q, cu_kv, softmax_scale=scale, backend=backend),
        q, k, v, dout)
    sdpa = run_with_grads(lambda *a: chunk_attention(*a, cu_q, cu_kv, backend="sdpa"), q, k, v,
                          dout)  # an independent computation: the shared code is not its own check
    for softmax_scale, expected in ((None, ref), (scale, ref_scaled), (None, sdpa)):
        out, lse = attention_with_lse(q, k, v, cu_q, cu_kv, softmax_scale=softmax_scale,
                                      backend=backend)
        assert not out.requires_grad and lse.numel() == nh * sum(lq)
        grads = attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, cu_q,
                                   cu_kv, softmax_scale=softmax_scale, backend=backend)
        for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), expected, strict=True):
            assert x.dtype == torch.float64 and x.shape == r.shape
            assert rel_err(x, r) <= 1e-12, (name, rel_err(x, r))


@pytest.mark.parametrize("backend", PAIRED)
@pytest.mark.parametrize("case", CASES)
def test_pair_on_the_awkward_cases(backend, case):
    lq, lk, nh, ng, hd = CASES[case]
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q, k, v, dout = make_inputs(lq, lk, nh, ng, hd, torch.float64)
    ref = run_with_grads(lambda *a: chunk_attention(*a, cu_q, cu_kv, backend=backend), q, k, v,
                         dout)
    out, lse = attention_with_lse(q, k, v, cu_q, cu_kv, backend=backend)
    got = (out, *attention_backward(dout, q, k, v, out, lse, cu_q, cu_kv, backend=backend))
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert rel_err(x, r) <= 1e-12, (name, rel_err(x, r))


def test_the_backward_runs_no_forward(monkeypatch):
    """The autograd Functions and the pair share one forward: counted, the backward calls it
    never (and the counter sees the forwards, so it can fail)."""
    calls = []
    for module, name in ((cpu_flash, "cpu_flash_forward"), (torch_attention, "torch_forward")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name: (calls.append(_n),
                                                                             _f(*a))[1])
    lq, lk, nh, ng, hd = CASES["mixed_gqa"]
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q, k, v, dout = make_inputs(lq, lk, nh, ng, hd, torch.float64)
    for backend in PAIRED:
        calls.clear()
        out, lse = attention_with_lse(q, k, v, cu_q, cu_kv, backend=backend)
        assert len(calls) == 1
        attention_backward(dout, q, k, v, out, lse, cu_q, cu_kv, backend=backend)
        assert len(calls) == 1
        chunk_attention(q, k, v, cu_q, cu_kv, backend=backend).backward(dout)
        assert len(calls) == 2


def test_which_backends_have_the_pair():
    assert lse_pair("cpu_flash") is not None and lse_pair("torch") is not None
    for backend in ("sdpa", "flex", "te"):
        assert lse_pair(backend) is None
    q, k, v, _ = make_inputs([3], [5], 2, 2, 8, torch.float64)
    with pytest.raises(ValueError, match="backend 'sdpa' has no forward/backward pair"):
        attention_with_lse(q, k, v, [0, 3], [0, 5], backend="sdpa")
    out, lse = attention_with_lse(q, k, v, [0, 3], [0, 5], backend="auto")  # cpu_flash on CPU
    with pytest.raises(ValueError, match="must have q's shape"):
        attention_backward(out[:2], q, k, v, out, lse, [0, 3], [0, 5], backend="auto")
    with pytest.raises(ValueError, match="lk >= lq"):
        attention_with_lse(q, k[:2], v[:2], [0, 3], [0, 2], backend="torch")


def test_no_queries():
    q, k, v, dout = make_inputs([0], [4], 2, 1, 8, torch.float64)
    out, lse = attention_with_lse(q, k, v, [0, 0], [0, 4], backend="torch")
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, [0, 0], [0, 4], backend="torch")
    assert out.shape == q.shape and not dk.any() and dv.shape == v.shape


def full_attention(q, k, v, cu_q, cu_kv):
    """Every query sees all of its segment's keys: a plain softmax per segment (autograd)."""
    outs = []
    rep = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)
        ks, vs = (x[cu_kv[i]:cu_kv[i + 1]].repeat_interleave(rep, 1).transpose(0, 1)
                  for x in (k, v))
        p = torch.softmax(qs @ ks.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        outs.append((p @ vs).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", PAIRED)
@pytest.mark.parametrize("heads", RANDOM)
def test_non_causal_pair_float64(backend, heads):
    """causal=False: each query sees all of its segment's keys, fewer keys than queries too."""
    nh, ng, hd = RANDOM[heads]
    lq, lk = [7, 30, 1, 0, 12], [20, 4, 9, 3, 12]
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q, k, v, dout = make_inputs(lq, lk, nh, ng, hd, torch.float64, seed=3)
    ref = run_with_grads(lambda *a: full_attention(*a, cu_q, cu_kv), q, k, v, dout)
    out, lse = attention_with_lse(q, k, v, cu_q, cu_kv, backend=backend, causal=False)
    got = (out, *attention_backward(dout, q, k, v, out, lse, cu_q, cu_kv, backend=backend,
                                    causal=False))
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert rel_err(x, r) <= 1e-12, (name, rel_err(x, r))
    with pytest.raises(ValueError, match="segment 1 has lq=30 queries and no keys"):
        attention_with_lse(q, k, v, cu_q, [0, 20, 20, 29, 32, 48], backend=backend, causal=False)


@pytest.mark.parametrize("backend", PAIRED)
def test_merged_parts_equal_the_whole(backend):
    """A segment's keys cut in two, the ones before its queries (non-causal) and the rest
    (causal): merge_lse of the parts is the whole attention, and each part's backward from the
    merged output and log-sum-exp adds up to the whole backward (as the ring CP attention
    uses them), in some rows only (`rows`: the queries the second part has)."""
    nh, ng, hd = RANDOM["gqa"]
    lq, lk = [10, 6], [25, 6]  # segment 0 has 15 prefix keys, segment 1 none
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q, k, v, dout = make_inputs(lq, lk, nh, ng, hd, torch.float64, seed=5)
    ref = run_with_grads(lambda *a: chunk_attention(*a, cu_q, cu_kv, backend="sdpa"), q, k, v,
                         dout)
    # part A: segment 0's last 5 prefix keys and its own, segment 1 whole; part B: segment 0's
    # first 10 prefix keys, for segment 0's queries (rows 0..9) only
    idx_a = torch.cat([torch.arange(10, 25), torch.arange(25, 31)])
    idx_b = torch.arange(0, 10)
    ka, va, kb, vb = k[idx_a], v[idx_a], k[idx_b], v[idx_b]
    out, lse = attention_with_lse(q, ka, va, cu_q, [0, 15, 21], backend=backend)
    rows = torch.arange(10)
    out_b, lse_b = attention_with_lse(q[rows], kb, vb, [0, 10], [0, 10], backend=backend,
                                      causal=False)
    merge_lse(out, lse, rows, out_b, lse_b)
    assert rel_err(out, ref[0]) <= 1e-12
    dq, dka, dva = attention_backward(dout, q, ka, va, out, lse, cu_q, [0, 15, 21],
                                      backend=backend)
    lse_rows = lse_by_token(lse, out)[rows].t().reshape(lse_b.shape)
    dqb, dkb, dvb = attention_backward(dout[rows], q[rows], kb, vb, out[rows], lse_rows,
                                       [0, 10], [0, 10], backend=backend, causal=False)
    dq = dq.index_add(0, rows, dqb)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk[idx_a], dv[idx_a] = dka, dva
    dk[idx_b], dv[idx_b] = dkb, dvb
    for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[1:], strict=True):
        assert rel_err(x, r) <= 1e-12, (name, rel_err(x, r))


def test_lse_by_token_names_a_foreign_layout():
    out = torch.zeros(4, 2, 8)
    assert lse_by_token(torch.arange(8.0).view(2, 4), out)[1].tolist() == [1.0, 5.0]
    with pytest.raises(ValueError, match="layout differs"):
        lse_by_token(torch.zeros(1, 2, 6), out)


def test_merge_over_every_row_equals_the_indexed_merge():
    """merge_lse with rows None (every token) is the indexed merge over all the rows."""
    lq, lk = [6, 5], [9, 5]
    q, k, v, _ = make_inputs(lq, lk, 4, 2, 8, torch.float64, seed=7)
    halves = [(k[i::2], v[i::2]) for i in (0, 1)]  # two key sets of every segment's keys
    results = []
    for rows in (None, torch.arange(sum(lq))):
        out, lse = attention_with_lse(q, *halves[0], cumsum(lq), [0, 5, 7], backend="torch",
                                      causal=False)
        out_b, lse_b = attention_with_lse(q, *halves[1], cumsum(lq), [0, 4, 7], backend="torch",
                                          causal=False)
        merge_lse(out, lse, rows, out_b, lse_b)
        results.append((out, lse))
    for every, indexed in zip(*results, strict=True):  # the same arithmetic, other memory order
        torch.testing.assert_close(every, indexed, rtol=1e-14, atol=1e-14)


class CpuFlashOps:
    """aten::_flash_attention_forward / _backward's contract on CPU (varlen tokens-first layout,
    int32 cu_seqlens tensors, GQA native, bottom-right causal, lse [N, Tq], a head dim that is a
    multiple of 8, dropout off), computed by the torch backend: what the varlen pair hands the
    CUDA kernels, checked where CPU can run it."""

    def __init__(self):
        self.calls = []

    def _check(self, q, cu_q, cu_k, max_q, max_k, dropout_p):
        assert q.shape[-1] % 8 == 0, "the kernel takes head dims that are multiples of 8"
        assert cu_q.dtype == cu_k.dtype == torch.int32 and dropout_p == 0.0
        lq, lk = cu_q.diff().tolist(), cu_k.diff().tolist()
        assert (max_q, max_k) == (max(lq), max(lk))
        return cu_q.tolist(), cu_k.tolist()

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, *, scale):
        cq, ck = self._check(q, cu_q, cu_k, max_q, max_k, dropout_p)
        self.calls.append("forward")
        out, lse = torch_attention.torch_forward(q, k, v, cq, ck, scale, is_causal)
        return out, lse.reshape(q.shape[1], q.shape[0]), torch.zeros(2), torch.empty(0), None

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                 rng_state, unused, *, scale):
        cq, ck = self._check(q, cu_q, cu_k, max_q, max_k, dropout_p)
        self.calls.append("backward")
        g = k.shape[1]
        return torch_attention.torch_backward(dout, q, k, v, out, lse.reshape(g, -1, q.shape[0]),
                                              cq, ck, scale, is_causal)


@pytest.mark.parametrize("heads", RANDOM)  # head dims 16, 8 and 12 (padded to 16)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_pair_around_the_flash_ops_float64(heads, causal):
    """The varlen pair's code around torch's flash ops (padding the head dim, cu_seqlens, the lse
    layout, no K/V repeat under GQA), float64 on CPU through a stand-in with the ops' contract:
    equal to chunk_attention (causal) or a plain softmax (not) and autograd, to 1e-12."""
    from megatron_chunkflow.attention import lse as lse_module

    nh, ng, hd = RANDOM[heads]
    lq, lk = random_segments(3)
    if not causal:
        lk = [max(n, 1) for n in lk]
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q, k, v, dout = make_inputs(lq, lk, nh, ng, hd, torch.float64, seed=3)
    attend = (lambda *a: chunk_attention(*a, cu_q, cu_kv, backend="sdpa")) if causal else \
        (lambda *a: full_attention(*a, cu_q, cu_kv))
    ref = run_with_grads(attend, q, k, v, dout)
    ops, scale = CpuFlashOps(), hd ** -0.5
    out, lse = lse_module.flash_ops_forward(ops, q, k, v, cu_q, cu_kv, scale, causal)
    assert lse.shape == (nh, sum(lq)) and out.shape == q.shape
    grads = lse_module.flash_ops_backward(ops, dout, q, k, v, out, lse, cu_q, cu_kv, scale,
                                          causal)
    assert ops.calls == ["forward", "backward"]  # the backward ran no forward
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), ref, strict=True):
        assert x.shape == r.shape and rel_err(x, r) <= 1e-12, (name, rel_err(x, r))
    # the lse the merge and CP's backward read: heads-major, tokens last
    assert torch.equal(lse_by_token(lse, out), lse.t())


def test_varlen_pair_needs_no_varlen_lse_api():
    """torch 2.11's varlen_attn returns no lse: the pair comes from the flash ops every CUDA
    build registers, so it is there whatever varlen_attn's signature (and refuses CPU tensors)."""
    assert lse_pair("varlen") is not None
    q, k, v, _ = make_inputs([3], [5], 2, 1, 8, torch.float64)
    with pytest.raises(ValueError, match="backend 'varlen' needs CUDA fp16/bf16 tensors"):
        attention_with_lse(q, k, v, [0, 3], [0, 5], backend="varlen")


def test_the_ring_fallback_is_said_where_it_happens():
    """CP with a backend that has no log-sum-exp pair runs the gather path (train and the
    Megatron-LM launcher print this line); the ring's backends, CP 1, gather or replicated
    state: nothing to say."""
    from megatron_chunkflow.attention.lse import ring_fallback
    from megatron_chunkflow.config import ChunkFlowConfig

    cfg = ChunkFlowConfig(64, 1)
    assert "attention backend sdpa has no log-sum-exp pair" in ring_fallback(cfg, 2, "sdpa")
    assert ring_fallback(cfg, 2, "torch") is None and ring_fallback(cfg, 1, "sdpa") is None
    assert ring_fallback(ChunkFlowConfig(64, 1, cp_kv="replicated"), 2, "sdpa") is None
    assert ring_fallback(ChunkFlowConfig(64, 1, cp_attention="gather"), 2, "sdpa") is None
