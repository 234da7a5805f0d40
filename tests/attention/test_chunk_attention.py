"""chunk_attention on CPU against a naive dense oracle: outputs and gradients, masks, validation.

Run: python -m pytest tests/attention/test_chunk_attention.py -q
"""

# Shape suffixes: T packed tokens, N query heads, G key/value heads, H head dim.

import itertools
import re
import subprocess
import sys

import pytest
import torch

from megatron_chunkflow.attention import BACKENDS, available_backends, chunk_attention
from megatron_chunkflow.attention import backends as backends_module

# name: (lq per segment, lk per segment, nh, ng, hd). Awkward on purpose: length-1 segments, 97,
# long prefixes (lk >> lq), an empty segment, head dims 8 and 24, GQA 4:2 and 7:1, MHA.
CASES = {
    "one_segment_97": ([97], [97], 4, 2, 8),
    "length_one": ([1, 1, 1], [1, 6, 1], 2, 2, 8),
    "long_prefix_mqa": ([7], [130], 7, 1, 24),
    "mixed_mha": ([5, 97, 1, 13, 0], [5, 200, 1, 40, 3], 4, 4, 24),
    "mixed_gqa": ([13, 31], [13, 80], 4, 2, 8),
    "docstring_3_5": ([3], [5], 4, 2, 8),
}


def cumsum(lengths):
    """cu_seqlens (as a list) for segment lengths."""
    return [0, *itertools.accumulate(lengths)]


def make_inputs(lq, lk, nh, ng, hd, dtype, seed=0, device="cpu"):
    """q, k, v, dout drawn in float64 on CPU and cast, so every dtype and device sees one draw."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lq), sum(lk)
    shapes = [(tq, nh, hd), (tk, ng, hd), (tk, ng, hd), (tq, nh, hd)]
    draws = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    q, k, v, dout = (x.to(device=device, dtype=dtype) for x in draws)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def dense_reference(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale=None):
    """Naive attention: the full [Tq, Tk] score matrix, a mask built row by row, softmax."""
    tq, nh, hd = q_TNH.shape
    tk, ng, _ = k_TGH.shape
    scale = hd**-0.5 if softmax_scale is None else softmax_scale
    allowed = torch.zeros(tq, tk, dtype=torch.bool)
    for s in range(len(cu_q) - 1):
        lq, lk = cu_q[s + 1] - cu_q[s], cu_kv[s + 1] - cu_kv[s]
        for j in range(lq):  # query j of segment s sees its keys 0 .. lk - lq + j
            allowed[cu_q[s] + j, cu_kv[s] : cu_kv[s] + lk - lq + j + 1] = True
    allowed = allowed.to(q_TNH.device)
    group = torch.arange(nh, device=q_TNH.device) // (nh // ng)  # head h reads kv head h // rep
    k_TNH, v_TNH = k_TGH[:, group], v_TGH[:, group]
    scores = torch.einsum("qnh,knh->nqk", q_TNH, k_TNH) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("nqk,knh->qnh", probs, v_TNH)


def run_with_grads(fn, q, k, v, dout):
    """(out, dq, dk, dv) of fn(q, k, v) for the upstream gradient dout."""
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def max_err(xs, refs):
    """Max absolute error of each tensor in xs against its float64 reference."""
    return [(x.double() - r).abs().max().item() for x, r in zip(xs, refs, strict=True)]


TRAINABLE = ["sdpa", "torch", "cpu_flash"]  # the backends with a CPU backward


@pytest.mark.parametrize("backend", TRAINABLE)
@pytest.mark.parametrize("case", CASES)
def test_matches_oracle_float64(case, backend):
    """float64: outputs and all three gradients agree with the oracle to ~1e-12."""
    lq, lk, nh, ng, hd = CASES[case]
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q, k, v, dout = make_inputs(lq, lk, nh, ng, hd, torch.float64)
    got = run_with_grads(lambda *a: chunk_attention(*a, cu_q, cu_kv, backend=backend), q, k, v,
                         dout)
    ref = run_with_grads(lambda *a: dense_reference(*a, cu_q, cu_kv), q, k, v, dout)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", TRAINABLE)
@pytest.mark.parametrize("case", CASES)
def test_float32_error_budget(case, backend):
    """fp32 kernel error vs the fp64 oracle is at most 2x the naive fp32 error (+ 1e-6 floor)."""
    lq, lk, nh, ng, hd = CASES[case]
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q64, k64, v64, dout64 = make_inputs(lq, lk, nh, ng, hd, torch.float64)
    q32, k32, v32, dout32 = make_inputs(lq, lk, nh, ng, hd, torch.float32)
    ref = run_with_grads(lambda *a: dense_reference(*a, cu_q, cu_kv), q64, k64, v64, dout64)
    naive = run_with_grads(lambda *a: dense_reference(*a, cu_q, cu_kv), q32, k32, v32, dout32)
    got = run_with_grads(lambda *a: chunk_attention(*a, cu_q, cu_kv, backend=backend), q32, k32,
                         v32, dout32)
    assert got[0].dtype == torch.float32
    for name, e_got, e_naive in zip(
        ("out", "dq", "dk", "dv"), max_err(got, ref), max_err(naive, ref), strict=True
    ):
        assert e_got <= 2 * e_naive + 1e-6, (name, e_got, e_naive)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["mixed_mha", "long_prefix_mqa", "mixed_gqa"])
def test_flex_forward_on_cpu(case, dtype):
    """flex runs eagerly on CPU, forward only (torch 2.13 has no CPU FlexAttention backward)."""
    lq, lk, nh, ng, hd = CASES[case]
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q64, k64, v64, _ = make_inputs(lq, lk, nh, ng, hd, torch.float64)
    q, k, v, _ = make_inputs(lq, lk, nh, ng, hd, dtype)
    with torch.no_grad():
        ref = dense_reference(q64, k64, v64, cu_q, cu_kv)
        got = chunk_attention(q, k, v, cu_q, cu_kv, backend="flex")
        naive = dense_reference(q, k, v, cu_q, cu_kv)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float64:
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    else:
        (e_got,), (e_naive,) = max_err([got], [ref]), max_err([naive], [ref])
        assert e_got <= 2 * e_naive + 1e-6, (e_got, e_naive)


def _preset_attention_shapes():
    from megatron_chunkflow.core.models import MODEL_SHAPES

    return sorted({(m.num_attention_heads, m.num_query_groups, m.head_dim)
                   for m in MODEL_SHAPES.values()})


@pytest.mark.parametrize("heads,groups,head_dim", _preset_attention_shapes())
def test_flex_compilable_inputs_keep_the_attention(heads, groups, head_dim):
    """What flex runs on CUDA for every preset's (heads, K/V groups, head dim): K/V repeated to
    every head and the head dim padded to a power of two >= 16 give the same attention (flex's
    own forward on CPU, float64, against sdpa on the untouched inputs, to 1e-12)."""
    from megatron_chunkflow.attention.flex import flex_compilable_inputs

    lq, lk = [5, 1, 7], [9, 1, 7]
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q, k, v, _ = make_inputs(lq, lk, heads, groups, head_dim, torch.float64)
    q2, k2, v2 = flex_compilable_inputs(q, k, v)
    assert k2.shape[1] == heads and q2.shape[-1] >= 16
    assert q2.shape[-1] & (q2.shape[-1] - 1) == 0  # a power of two
    with torch.no_grad():
        ref = chunk_attention(q, k, v, cu_q, cu_kv, backend="sdpa")
        got = chunk_attention(q2, k2, v2, cu_q, cu_kv, softmax_scale=head_dim ** -0.5,
                              backend="flex")[..., :head_dim]
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_flex_refuses_backward_on_cpu():
    """A clear ValueError, not torch's NotImplementedError deep in flex_attention."""
    q, k, v, _ = make_inputs([4], [6], 2, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="forward-only on CPU.*sdpa"):
        chunk_attention(q, k, v, [0, 4], [0, 6], backend="flex")


@pytest.mark.parametrize("backend", TRAINABLE)
def test_chunked_equals_whole_sequence(backend):
    """How ChunkFlow uses it: chunk c of each sequence attends to k[:end], v[:end] of its sequence.

    Two sequences (203 tokens in chunks of 70, 97 tokens in chunks of 40; neither divides) are
    processed chunk by chunk, chunk c of both packed into one call, and must match the whole
    sequences attended at once, outputs and gradients.
    """
    lengths, chunk_sizes, nh, ng, hd = [203, 97], [70, 40], 4, 2, 24
    q, k, v, dout = make_inputs(lengths, lengths, nh, ng, hd, torch.float64, seed=3)
    starts = cumsum(lengths)
    cu = starts
    whole = run_with_grads(lambda *a: chunk_attention(*a, cu, cu, backend=backend), q, k, v, dout)

    def chunked(q_TNH, k_TGH, v_TGH):
        out_parts = [[] for _ in lengths]
        num_chunks = max(-(-n // c) for n, c in zip(lengths, chunk_sizes, strict=True))
        for c in range(num_chunks):
            q_parts, kv_idx, lq, lk, owners = [], [], [], [], []
            for s, (n, size) in enumerate(zip(lengths, chunk_sizes, strict=True)):
                begin, end = c * size, min((c + 1) * size, n)
                if begin >= n:
                    continue
                q_parts.append(q_TNH[starts[s] + begin : starts[s] + end])
                kv_idx.append(torch.arange(starts[s], starts[s] + end))  # prefix + own chunk
                lq.append(end - begin)
                lk.append(end)
                owners.append(s)
            kv_idx = torch.cat(kv_idx)
            out = chunk_attention(
                torch.cat(q_parts), k_TGH[kv_idx], v_TGH[kv_idx], cumsum(lq), cumsum(lk),
                backend=backend,
            )
            for s, part in zip(owners, out.split(lq), strict=True):
                out_parts[s].append(part)
        return torch.cat([torch.cat(parts) for parts in out_parts])

    got = run_with_grads(chunked, q, k, v, dout)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, whole, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_mask_matches_docstring_picture():
    """The ASCII mask in chunk_attention's docstring is what the function computes."""
    rows = [
        [int(c) for c in line.split()]
        for line in chunk_attention.__doc__.splitlines()
        if re.fullmatch(r"\s*[01]( [01])+\s*", line)
    ]
    lq, lk = len(rows), len(rows[0])
    # Zero queries give uniform weights over the visible keys; v = identity reads them out.
    q = torch.zeros(lq, 1, lk, dtype=torch.float64)
    k = torch.randn(lk, 1, lk, dtype=torch.float64)
    v = torch.eye(lk, dtype=torch.float64).unsqueeze(1)
    out = chunk_attention(q, k, v, [0, lq], [0, lk])
    assert (out[:, 0] > 0).int().tolist() == rows


def test_gqa_fallback_without_enable_gqa(monkeypatch):
    """The repeat_interleave path kept for torch < 2.5 agrees with the oracle."""
    monkeypatch.setattr(backends_module, "_SDPA_HAS_GQA", False)
    lq, lk, nh, ng, hd = CASES["mixed_gqa"]
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q, k, v, dout = make_inputs(lq, lk, nh, ng, hd, torch.float64)
    got = run_with_grads(lambda *a: chunk_attention(*a, cu_q, cu_kv), q, k, v, dout)
    ref = run_with_grads(lambda *a: dense_reference(*a, cu_q, cu_kv), q, k, v, dout)
    for x, r in zip(got, ref, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12)


def test_tensor_cu_seqlens_and_custom_scale():
    """cu_seqlens may be int tensors of any integer dtype; softmax_scale is honoured."""
    lq, lk, nh, ng, hd = CASES["mixed_gqa"]
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q, k, v, _ = make_inputs(lq, lk, nh, ng, hd, torch.float64)
    got = chunk_attention(
        q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_kv), softmax_scale=0.3
    )
    torch.testing.assert_close(
        got, dense_reference(q, k, v, cu_q, cu_kv, 0.3), rtol=1e-12, atol=1e-12
    )


def test_no_queries_gives_empty_output():
    """Tq == 0 (only keys): an empty, differentiable output, no backend call."""
    q, k, v, _ = make_inputs([0], [3], 2, 2, 8, torch.float64)
    out = chunk_attention(q, k, v, [0, 0], [0, 3])
    assert out.shape == (0, 2, 8) and out.requires_grad


def _bad_inputs():
    """(label, kwargs overriding a valid call, regex the ValueError must match)."""
    q, k, v, _ = make_inputs([3, 4], [5, 4], 4, 2, 8, torch.float64)
    k3 = make_inputs([3, 4], [5, 4], 4, 3, 8, torch.float64)[1]
    return [
        (
            "q total",
            dict(cu_seqlens_q=[0, 3, 6]),
            r"cu_seqlens_q\[-1\]=6 must equal q.shape\[0\]=7",
        ),
        ("kv total", dict(cu_seqlens_kv=[0, 5, 10]), r"cu_seqlens_kv\[-1\]=10 .*k.shape\[0\]=9"),
        ("lk < lq", dict(cu_seqlens_kv=[0, 2, 9]), r"segment 0 has lq=3 queries but lk=2 keys"),
        ("decreasing", dict(cu_seqlens_q=[0, 5, 3, 7], cu_seqlens_kv=[0, 5, 5, 9]), r"\[1\]=5 >"),
        ("start", dict(cu_seqlens_q=[1, 3, 7]), r"cu_seqlens_q must start at 0"),
        ("lengths", dict(cu_seqlens_kv=[0, 9]), r"both have S \+ 1 entries; got 3 and 2"),
        ("float cu", dict(cu_seqlens_q=[0.0, 3.0, 7.0]), r"cu_seqlens_q must hold integers"),
        ("2-D cu", dict(cu_seqlens_q=[[0, 3, 7]]), r"cu_seqlens_q must be 1-D"),
        ("heads", dict(k=k3, v=k3), r"nh=4 heads, which is not a multiple of .* ng=3"),
        ("head dim", dict(k=k[..., :4], v=v[..., :4]), r"q head dim 8 != k/v head dim 4"),
        ("k vs v", dict(v=v[:, :1]), r"k and v must have the same shape"),
        (
            "dtype",
            dict(v=v.float()),
            r"one floating dtype; got torch.float64, torch.float64, torch",
        ),
        ("rank", dict(q=q[0]), r"q must be a 3-D tensor"),
        ("backend", dict(backend="nope"), r"unknown attention backend 'nope'.*'flash'.*'sdpa'"),
    ], dict(q=q, k=k, v=v, cu_seqlens_q=[0, 3, 7], cu_seqlens_kv=[0, 5, 9])


@pytest.mark.parametrize("label", [label for label, _, _ in _bad_inputs()[0]])
def test_validation_errors_name_the_argument(label):
    """Each bad input raises a ValueError naming the argument and the offending values."""
    bad, valid = _bad_inputs()
    override, pattern = next((kw, p) for lab, kw, p in bad if lab == label)
    with pytest.raises(ValueError, match=pattern):
        chunk_attention(**{**valid, **override})


def test_registry_and_availability():
    """Seven registered backends; torch, cpu_flash, sdpa and flex (pure torch) are always available
    here, varlen with torch >= 2.10 (CUDA-only kernels)."""
    assert set(BACKENDS) == {"torch", "cpu_flash", "sdpa", "flex", "varlen", "flash", "te"}
    available = available_backends()
    assert {"torch", "cpu_flash", "sdpa", "flex"} <= set(available) <= set(BACKENDS)


@pytest.mark.parametrize("backend", ["torch", "cpu_flash"])
def test_backend_saves_no_score_sized_tensor(backend):
    """torch and cpu_flash keep memory linear in the prefix: nothing [lq, lk]-sized is saved."""
    lq, lk, nh, ng, hd = [32], [512], 4, 2, 8
    q, k, v, _ = make_inputs(lq, lk, nh, ng, hd, torch.float64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunk_attention(q, k, v, cumsum(lq), cumsum(lk), backend=backend)
    biggest = max(t.numel() for t in saved)
    assert biggest == k.numel() and all(t.dim() != 2 or t.shape != (32, 512) for t in saved)


@pytest.mark.parametrize(
    "backend,module,hint",
    [
        ("flash", "flash_attn", "pip install flash-attn"),
        ("te", "transformer_engine", "pip install"),
    ],
)
def test_missing_library_says_what_to_install(backend, module, hint):
    """A missing flash-attn / TE is an ImportError with the pip command, never a fallback."""
    if backend in available_backends():
        pytest.skip(f"{module} is installed here, so its absence cannot be tested")
    q, k, v, _ = make_inputs([2], [2], 2, 2, 8, torch.float32)
    with pytest.raises(ImportError, match=re.escape(hint)):
        chunk_attention(q, k, v, [0, 2], [0, 2], backend=backend)


def test_import_pulls_in_no_gpu_or_megatron_library():
    """Importing the package loads neither megatron, flash_attn nor transformer_engine."""
    code = (
        "import sys, megatron_chunkflow.attention\n"
        "bad = [m for m in ('megatron', 'flash_attn', 'transformer_engine') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_varlen_refuses_cpu_tensors_naming_what_it_needs():
    """PyTorch's varlen flash kernel runs on CUDA in fp16/bf16 only: elsewhere a clear ValueError
    (not a kernel error), naming the backend to use instead."""
    from megatron_chunkflow.attention.backends import _installed

    if not _installed("torch.nn.attention.varlen"):
        pytest.skip("this torch has no torch.nn.attention.varlen")
    q, k, v, _ = make_inputs([5], [9], 4, 2, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="backend 'varlen' needs CUDA fp16/bf16 tensors"):
        chunk_attention(q, k, v, [0, 5], [0, 9], backend="varlen")


def test_auto_picks_a_fused_or_tiled_kernel(monkeypatch):
    """`auto` on a GPU: flash-attn's varlen kernel, else PyTorch's own, for half precision; the
    tiled torch backend for fp32/fp64; never a backend that materialises the scores."""
    from megatron_chunkflow.attention import backends

    monkeypatch.setattr(backends, "_installed", lambda module: True)
    assert backends.resolve_backend("auto", "cpu") == "cpu_flash"
    assert backends.resolve_backend("auto", "cuda", torch.bfloat16) == "flash"
    monkeypatch.setattr(backends, "_flash_attn_aligns_bottom_right", lambda: False)  # < 2.1
    assert backends.resolve_backend("auto", "cuda", torch.bfloat16) == "varlen"
    monkeypatch.setattr(backends, "_flash_attn_aligns_bottom_right", lambda: True)
    assert backends.resolve_backend("auto", "cuda", torch.float32) == "torch"
    assert backends.resolve_backend("auto", "cuda", torch.float64) == "torch"
    monkeypatch.setattr(backends, "_installed", lambda module: module != "flash_attn")
    assert backends.resolve_backend("auto", "cuda", torch.float16) == "varlen"
    # a torch whose varlen_attn takes cuDNN on this GPU (another causal mask): the tiled backend
    monkeypatch.setattr(backends, "_varlen_uses_cudnn", lambda varlen=None: True)
    assert backends.resolve_backend("auto", "cuda", torch.float16) == "torch"
    monkeypatch.undo()
    monkeypatch.setattr(backends, "_installed", lambda module: True)
    for device, dtype in itertools.product(("cpu", "cuda"), (torch.bfloat16, torch.float32)):
        assert backends.resolve_backend("auto", device, dtype) not in \
            backends.MATERIALISING[device]
    assert backends.resolve_backend("te", "cuda") == "te"  # named: the user's choice


@pytest.mark.parametrize(("name", "device", "dtype", "needle"), [
    ("flash", "cpu", torch.float32, "needs a CUDA GPU"),
    ("varlen", "cuda", torch.float32, "runs fp16/bf16 only"),
    ("flex", "cpu", torch.float32, "no CPU backward"),
    ("sdpa", "cuda", torch.bfloat16, "materialises each chunk's [queries x keys] scores: 7 heads "
                                     "x 16384 x 262144 keys = 116.0 GiB"),
    ("nope", "cpu", torch.float32, "unknown"),
    ("cpu_flash", "cuda", torch.bfloat16, "is ATen's CPU kernel"),
    ("flex", "cuda", torch.float64, "takes fp16, bf16 and fp32 on CUDA"),
])
def test_untrainable_backend_is_refused_naming_the_flag(monkeypatch, name, device, dtype, needle):
    from megatron_chunkflow.attention import backends, trainable

    monkeypatch.setattr(backends, "_installed", lambda module: True)
    with pytest.raises(ValueError, match=re.escape(f"--flag {name}")) as e:
        trainable.check_trainable(name, device, dtype, "--flag", heads=7, chunk=16384, keys=262144,
                                 memory_bytes=80 * 2**30)
    assert needle in str(e.value)
    assert trainable.check_trainable("auto", device, torch.bfloat16, "--flag", heads=7,
                                    chunk=16384, keys=262144, memory_bytes=80 * 2**30) in \
        ("cpu_flash", "flash")
