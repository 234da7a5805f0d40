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
    lse_pair,
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
