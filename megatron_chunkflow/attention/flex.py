"""The flex backend: torch.nn.attention.flex_attention with a block mask from per-token segment
ids (attention/backends.py says where it runs and how), and the inputs its compiled CUDA kernel
takes for every preset's attention shape.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F


def segment_lengths(cu: list[int]) -> list[int]:
    """Lengths of the segments a cu_seqlens list bounds."""
    return [b - a for a, b in zip(cu, cu[1:])]


def flex_attention_backend(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale):
    """FlexAttention with a block mask: same segment and kv_pos <= q_pos + (lk - lq)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    on_cpu = q_TNH.device.type == "cpu"
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q_TNH, k_TGH, v_TGH))
    if on_cpu and needs_grad:
        raise ValueError(
            f"backend 'flex' is forward-only on CPU (torch {torch.__version__} FlexAttention has "
            "no CPU backward); use backend='sdpa', or call it under torch.no_grad()"
        )
    if not on_cpu and q_TNH.dtype == torch.float64:
        raise ValueError("backend 'flex' on CUDA supports fp16, bf16 and fp32; use 'sdpa' for fp64")

    device = q_TNH.device
    lq_S = torch.tensor(segment_lengths(cu_q), device=device)
    lk_S = torch.tensor(segment_lengths(cu_kv), device=device)
    seg_ids = torch.arange(len(lq_S), device=device)
    q_seg_T = seg_ids.repeat_interleave(lq_S)
    kv_seg_T = seg_ids.repeat_interleave(lk_S)
    start_q = torch.tensor(cu_q[:-1], device=device)
    start_kv = torch.tensor(cu_kv[:-1], device=device)
    q_pos_T = torch.arange(len(q_seg_T), device=device) - start_q[q_seg_T]
    kv_pos_T = torch.arange(len(kv_seg_T), device=device) - start_kv[kv_seg_T]
    q_last_key_T = q_pos_T + (lk_S - lq_S)[q_seg_T]  # last key (in segment) query may see

    def mask_mod(b, h, q_idx, kv_idx):
        same_segment = q_seg_T[q_idx] == kv_seg_T[kv_idx]
        return same_segment & (kv_pos_T[kv_idx] <= q_last_key_T[q_idx])

    tq, tk = q_TNH.shape[0], k_TGH.shape[0]
    block_mask = create_block_mask(mask_mod, None, None, tq, tk, device=device)
    hd = q_TNH.shape[-1]
    scale = 1.0 / math.sqrt(hd) if softmax_scale is None else softmax_scale
    if not on_cpu:  # shapes inductor's flex kernel compiles (flex_compilable_inputs)
        q_TNH, k_TGH, v_TGH = flex_compilable_inputs(q_TNH, k_TGH, v_TGH)
    q_BNTH = q_TNH.transpose(0, 1).unsqueeze(0)
    k_BGTH = k_TGH.transpose(0, 1).unsqueeze(0)
    v_BGTH = v_TGH.transpose(0, 1).unsqueeze(0)
    kwargs = dict(block_mask=block_mask, scale=scale,
                  enable_gqa=k_TGH.shape[1] != q_TNH.shape[1])
    if on_cpu:
        # torch refuses CPU inputs with requires_grad even under no_grad; no gradient is needed here
        q_BNTH, k_BGTH, v_BGTH = q_BNTH.detach(), k_BGTH.detach(), v_BGTH.detach()
        with warnings.catch_warnings():  # eager on CPU is intended: see attention/backends.py
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out_BNTH = flex_attention(q_BNTH, k_BGTH, v_BGTH, **kwargs)
    else:
        out_BNTH = _compiled_flex()(q_BNTH, k_BGTH, v_BGTH, **kwargs)
    return out_BNTH.squeeze(0).transpose(0, 1)[..., :hd]


FLEX_MIN_HEAD_DIM = 16  # inductor: "NYI: embedding dimension must be at least 16"


def flex_compilable_inputs(q_TNH, k_TGH, v_TGH):
    """q, k, v in a form the compiled flex kernel takes on CUDA, with the same attention: K/V
    repeated to every query head (compiled GQA found no valid kernel choice at head dim 64 on an
    H200, torch 2.11; costs N / G times the K/V bytes flex saves for its backward) and the head
    dim zero-padded to a power of two >= 16 (scores q.k and the first H output columns
    unchanged; the caller keeps the softmax scale of the real head dim and drops the padding)."""
    nh, ng, hd = q_TNH.shape[1], k_TGH.shape[1], q_TNH.shape[-1]
    if ng != nh:
        k_TGH = k_TGH.repeat_interleave(nh // ng, dim=1)
        v_TGH = v_TGH.repeat_interleave(nh // ng, dim=1)
    pad = max(FLEX_MIN_HEAD_DIM, 1 << (hd - 1).bit_length()) - hd
    if pad:
        q_TNH, k_TGH, v_TGH = (F.pad(x, (0, pad)) for x in (q_TNH, k_TGH, v_TGH))
    return q_TNH, k_TGH, v_TGH


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)
