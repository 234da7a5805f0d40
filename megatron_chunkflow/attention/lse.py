"""chunk_attention as two functions: a forward that returns (out, lse) and a backward from (dout,
q, k, v, out, lse) that returns (dq, dk, dv) and runs no attention forward.

    out, lse = attention_with_lse(q, k, v, cu_q, cu_kv, backend="cpu_flash")
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cu_q, cu_kv, backend="cpu_flash")

Context parallelism (runtime/cp.py) saves out and lse after its forward and calls the backward on
K/V it gathers again, instead of recomputing the forward under autograd. Inputs, masks and GQA are
chunk_attention's (validated the same way: bottom-right causal segments, lk >= lq), or with
causal=False segments every query of which sees all of its keys (the part of a query's keys that
all precede it). The lse is heads-major with the tokens last ([N, T], or [G, N / G, T]), in float32
for half precision inputs; `lse_by_token` views it [T, N], and `merge_lse` combines two partial
results (attention over keys A and over keys B) into the attention over both. The backends that
have the pair (`lse_pair`):

- cpu_flash: cpu_flash.py's cpu_flash_forward / cpu_flash_backward, the code its autograd
  Function runs; lse [N, Tq] in the kernel's dtype. CPU, float32 / float64 / bfloat16.
- torch: torch_attention.py's torch_forward / torch_backward, likewise; lse [G, N / G, Tq] in the
  compute dtype. Any device and dtype.
- flash: flash_attn_varlen_func(return_attn_probs=True) for (out, lse [N, Tq] float32), and
  flash-attn's internal _flash_attn_varlen_backward, whose keywords after `causal` (window_size
  or window_size_left / _right, softcap, alibi_slopes, deterministic, rng_state) are read off its
  signature. CUDA, fp16/bf16, flash-attn >= 2.1. UNTESTED until a GPU run
  (tests/gpu/test_attention_backends.py).
- varlen: the flash kernel varlen_attn runs, called as the aten ops its own autograd calls
  (aten::_flash_attention_forward for (out, lse [N, Tq] float32) and _flash_attention_backward),
  so torch 2.11, whose varlen_attn returns no lse, has the pair with no extra package; GQA
  without repeating K/V; no pair where varlen_attn would take its cuDNN path. CUDA, fp16/bf16.
  The code around the two kernels is tested on CPU against a stand-in with their contract; the
  kernels UNTESTED until a GPU run (tests/gpu/test_attention_backends.py).

sdpa, flex and te have no pair (their libraries run the backward only inside their own autograd,
from what they saved): context parallelism recomputes their forward in the backward.
"""

# Shape suffixes as in backends.py: T tokens, N query heads, G key/value heads, H head dim.

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megatron_chunkflow.attention import backends
from megatron_chunkflow.attention.chunk_attention import CuSeqlens, _check_inputs


class LsePair(NamedTuple):
    """A backend's two halves, on inputs chunk_attention validated (host cu_seqlens lists)."""

    forward: Callable  # (q, k, v, cu_q, cu_kv, scale, causal) -> (out, lse)
    backward: Callable  # (dout, q, k, v, out, lse, cu_q, cu_kv, scale, causal) -> (dq, dk, dv)


def lse_pair(backend: str) -> LsePair | None:
    """The pair of the (resolved) backend `backend`, None if it has none here."""
    if backend == "cpu_flash":
        from megatron_chunkflow.attention import cpu_flash

        return LsePair(cpu_flash.cpu_flash_attention_lse, cpu_flash.cpu_flash_backward)
    if backend == "torch":
        from megatron_chunkflow.attention import torch_attention

        return LsePair(torch_attention.torch_forward, torch_attention.torch_backward)
    if backend == "flash" and backends._installed("flash_attn"):
        return LsePair(_flash_forward, _flash_backward)
    if backend == "varlen" and _varlen_has_pair():
        return LsePair(_varlen_forward, _varlen_backward)
    return None


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cu_seqlens_q: CuSeqlens, cu_seqlens_kv: CuSeqlens, *,
                       softmax_scale: float | None = None, backend: str = "torch",
                       causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_attention's output (no autograd graph) and the backend's log-sum-exp. `causal`
    False: every query sees all of its segment's keys (any lk >= 1), the part of a query's keys
    that all precede it (runtime/cp.py's ring attention)."""
    pair, cu_q, cu_kv, scale = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_kv, softmax_scale,
                                        backend, causal)
    if q.shape[0] == 0:
        return torch.empty_like(q), q.new_empty(0)
    with torch.no_grad():
        return pair.forward(q, k, v, cu_q, cu_kv, scale, causal)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: CuSeqlens,
                       cu_seqlens_kv: CuSeqlens, *, softmax_scale: float | None = None,
                       backend: str = "torch", causal: bool = True) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of chunk_attention at (q, k, v) for output gradient `dout`, from the `out` and
    `lse` attention_with_lse returned for them (same backend and arguments); no forward.

    `out` and `lse` may be those of a larger key set that holds these keys (a merge of partial
    results, merge_lse): the probabilities rebuilt, exp(s - lse), are then the full softmax's and
    rowsum(dout * out) the full row's, so dq is this part's share and dk, dv are exact."""
    pair, cu_q, cu_kv, scale = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_kv, softmax_scale,
                                        backend, causal)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have q's "
                         f"shape {tuple(q.shape)}")
    if q.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    with torch.no_grad():
        return pair.backward(dout, q, k, v, out, lse, cu_q, cu_kv, scale, causal)


def lse_by_token(lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A view [T, N] of a backend's log-sum-exp for the output `out` [T, N, H]: every pair's
    layout is heads-major with the tokens last ([N, T]; torch's [G, N / G, T], head g * N / G + r,
    as GQA numbers them)."""
    t, n = out.shape[0], out.shape[1]
    if lse.numel() != t * n or lse.shape[-1] != t:
        raise ValueError(f"a log-sum-exp of shape {tuple(lse.shape)} is not one per head and "
                         f"token of an output {tuple(out.shape)} (heads-major, tokens last); "
                         "this backend's layout differs from attention/lse.py's")
    return lse.reshape(n, t).t()


def merge_lse(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor | None,
              out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place: `out` [T, N, H] and `lse` (a pair's layout), attention over keys A, become
    attention over keys A and B in the token `rows` (None: every token), given out_b
    [len(rows), N, H] and lse_b, attention of those queries over keys B (log-sum-exp weights,
    computed in float32 at least)."""
    if rows is not None and rows.numel() == 0:
        return
    lse_tn, lse_b_tn = lse_by_token(lse, out), lse_by_token(lse_b, out_b)
    wide = torch.promote_types(lse_tn.dtype, torch.float32)
    a = out if rows is None else out.index_select(0, rows)
    la = (lse_tn if rows is None else lse_tn.index_select(0, rows)).to(wide)
    lb = lse_b_tn.to(wide)
    merged_lse = torch.logaddexp(la, lb)
    merged = (a.to(wide) * torch.exp(la - merged_lse).unsqueeze(-1)
              + out_b.to(wide) * torch.exp(lb - merged_lse).unsqueeze(-1))
    if rows is None:
        out.copy_(merged)
        lse_tn.copy_(merged_lse)
    else:
        out.index_copy_(0, rows, merged.to(out.dtype))
        lse.view(-1, out.shape[0]).index_copy_(1, rows, merged_lse.t().to(lse.dtype))


def _prepare(q, k, v, cu_seqlens_q, cu_seqlens_kv, softmax_scale, backend, causal=True):
    name = backends.resolve_backend(backend, q.device.type, q.dtype)
    backends.get_backend(name)  # unknown names: the usual error
    pair = lse_pair(name)
    if pair is None:
        raise ValueError(f"backend {name!r} has no forward/backward pair from the log-sum-exp "
                         "here (attention/lse.py): use chunk_attention and autograd")
    cu_q, cu_kv = _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_kv, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    return pair, cu_q, cu_kv, scale


# ---- flash-attn (UNTESTED until a GPU run) -------------------------------------------------------
def _flash_forward(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, scale, causal):
    flash_attn = backends._import_or_explain("flash_attn", "flash", "pip install flash-attn")
    if backends._major_minor(flash_attn.__version__) < (2, 1):
        raise ImportError(f"backend 'flash' needs flash-attn >= 2.1 (bottom-right causal mask); "
                          f"found {flash_attn.__version__}: pip install -U flash-attn")
    backends._require_cuda_half("flash", q_TNH)
    cu_q_t, cu_kv_t, max_q, max_kv = backends._cu_on_device(cu_q, cu_kv, q_TNH.device)
    out, lse, _ = flash_attn.flash_attn_varlen_func(
        q_TNH, k_TGH, v_TGH, cu_q_t, cu_kv_t, max_q, max_kv, dropout_p=0.0,
        softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out, lse


def _flash_backward(dout_TNH, q_TNH, k_TGH, v_TGH, out_TNH, lse, cu_q, cu_kv, scale, causal):
    interface = backends._import_or_explain("flash_attn.flash_attn_interface", "flash",
                                            "pip install flash-attn")
    bwd = interface._flash_attn_varlen_backward
    hd = q_TNH.shape[-1]
    pad = -hd % 8  # flash_attn_varlen_func pads the head dim to a multiple of 8 itself

    def padded(x):
        return (F.pad(x, (0, pad)) if pad else x).contiguous()

    dout, q, k, v, out = (padded(x) for x in (dout_TNH, q_TNH, k_TGH, v_TGH, out_TNH))
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    params = inspect.signature(bwd).parameters
    optional = {"window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1,
                "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "rng_state": None}
    kwargs = {name: value for name, value in optional.items() if name in params}
    cu_q_t, cu_kv_t, max_q, max_kv = backends._cu_on_device(cu_q, cu_kv, q.device)
    bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q_t, cu_kv_t, max_q, max_kv, 0.0, scale, causal,
        **kwargs)
    return tuple(x[..., :hd] for x in (dq, dk, dv))


# ---- PyTorch's own flash kernel, the one varlen_attn runs ---------------------------------------
# aten::_flash_attention_forward / _flash_attention_backward: what varlen_attn calls off its cuDNN
# path, in every CUDA build of torch (2.11 included, whose varlen_attn returns no lse and takes no
# enable_gqa). Grouped-query attention native, the causal mask bottom-right aligned (flash-attn
# 2.x), lse [N, Tq] float32, the head dim a multiple of 8 (padded here, as flash-attn pads).
# Everything but the two kernels runs on CPU in tests/attention/test_lse.py, against a CPU
# stand-in that keeps the ops' contract; the kernels themselves UNTESTED until a GPU run.
class FlashOps(NamedTuple):
    forward: Callable  # aten::_flash_attention_forward's signature
    backward: Callable  # aten::_flash_attention_backward's


def _aten_flash_ops() -> FlashOps:
    return FlashOps(torch.ops.aten._flash_attention_forward,
                    torch.ops.aten._flash_attention_backward)


FLASH_HEAD_DIM_MULTIPLE = 8


def _varlen_has_pair() -> bool:
    """torch's flash ops are registered and varlen_attn would not run through cuDNN on the
    current device (its mask and GQA differ there; the varlen backend refuses it too)."""
    return (hasattr(torch.ops.aten, "_flash_attention_backward")
            and not backends._varlen_uses_cudnn(_varlen_module()))


def _varlen_module():
    try:
        return importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        return None


def _pad_head_dim(*xs):
    pad = -xs[0].shape[-1] % FLASH_HEAD_DIM_MULTIPLE
    return tuple((F.pad(x, (0, pad)) if pad else x).contiguous() for x in xs)


def flash_ops_forward(ops: FlashOps, q_TNH, k_TGH, v_TGH, cu_q, cu_kv, scale, causal):
    """(out, lse [N, Tq] float32) from torch's flash forward op `ops.forward`, dropout off."""
    hd = q_TNH.shape[-1]
    q, k, v = _pad_head_dim(q_TNH, k_TGH, v_TGH)
    cu_q_t, cu_kv_t, max_q, max_kv = backends._cu_on_device(cu_q, cu_kv, q.device)
    out, lse, *_ = ops.forward(q, k, v, cu_q_t, cu_kv_t, max_q, max_kv, 0.0, causal, False,
                               scale=scale)
    return out[..., :hd], lse


def flash_ops_backward(ops: FlashOps, dout_TNH, q_TNH, k_TGH, v_TGH, out_TNH, lse, cu_q, cu_kv,
                       scale, causal):
    """(dq, dk, dv) from torch's flash backward op `ops.backward`: no forward, dropout off (its
    random state is then never read)."""
    hd = q_TNH.shape[-1]
    dout, q, k, v, out = _pad_head_dim(dout_TNH, q_TNH, k_TGH, v_TGH, out_TNH)
    cu_q_t, cu_kv_t, max_q, max_kv = backends._cu_on_device(cu_q, cu_kv, q.device)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    grads = ops.backward(dout, q, k, v, out, lse, cu_q_t, cu_kv_t, max_q, max_kv, 0.0, causal,
                         rng_state, unused, scale=scale)
    return tuple(g[..., :hd] for g in grads)


def _varlen_forward(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, scale, causal):
    backends._require_cuda_half("varlen", q_TNH)
    return flash_ops_forward(_aten_flash_ops(), q_TNH, k_TGH, v_TGH, cu_q, cu_kv, scale, causal)


def _varlen_backward(dout_TNH, q_TNH, k_TGH, v_TGH, out_TNH, lse, cu_q, cu_kv, scale, causal):
    backends._require_cuda_half("varlen", q_TNH)
    return flash_ops_backward(_aten_flash_ops(), dout_TNH, q_TNH, k_TGH, v_TGH, out_TNH, lse,
                              cu_q, cu_kv, scale, causal)


def ring_fallback(cfg, cp: int, backend: str) -> str | None:
    """What a CP run of ChunkFlowConfig `cfg` on `backend` (resolved) runs instead of the sharded
    state's ring, in one line (train and the Megatron-LM launcher print it), or None."""
    if cp == 1 or cfg.cp_attention != "ring" or cfg.cp_kv != "sharded":
        return None
    if lse_pair(backend) is not None:
        return None
    return (f"CP attention: gathered first, not the ring, its backward recomputing the "
            f"attention: attention backend {backend} has no log-sum-exp pair for the ring "
            "(torch, cpu_flash, varlen and flash have)")
