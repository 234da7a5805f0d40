"""chunk_attention: causal attention over packed (THD) segments whose queries follow a K/V prefix.

ChunkFlow cuts a long sequence into data chunks; chunk c's queries attend to the K/V of chunks
0..c-1 (the prefix) followed by its own, so each segment has lk >= lq keys and the causal diagonal
sits at the bottom-right corner of its [lq, lk] score block. Several segments (sequences packed
into one chunk) go into one call through cu_seqlens, as in flash_attn_varlen_func.

Run its tests: python -m pytest tests/attention/test_chunk_attention.py -q
"""

# Shape suffixes (as in backends.py): T packed tokens (Tq on the query side, Tk on the key/value
# side), N query heads (nh), G key/value heads or groups (ng), H head dim (hd); e.g. q_TNH, k_TGH.
# The public arguments keep flash-attn's plain names q, k, v; their shapes are in the docstring.

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_chunkflow.attention.backends import get_backend, resolve_backend

CuSeqlens = torch.Tensor | Sequence[int]


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: CuSeqlens,
    cu_seqlens_kv: CuSeqlens,
    *,
    softmax_scale: float | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Bottom-right causal attention over packed segments, differentiable w.r.t. q, k and v.

    Arguments:
        q: (Tq, nh, hd), the queries of all segments, concatenated.
        k: (Tk, ng, hd), the keys of all segments, concatenated; nh must be a multiple of ng
            (GQA: query head h uses key/value head h // (nh // ng)).
        v: (Tk, ng, hd), the values, laid out as k.
        cu_seqlens_q: (S + 1,) ints, 0 = cu_seqlens_q[0] <= ... <= cu_seqlens_q[S] = Tq. Segment
            i's queries are q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]] (lq_i of them).
        cu_seqlens_kv: (S + 1,) ints, likewise for k and v (lk_i keys), with lk_i >= lq_i for
            every segment. Lists or CPU tensors avoid a device sync; CUDA tensors are read back
            to the host for validation.
        softmax_scale: float, the scaling of QK^T before the softmax; default 1 / sqrt(hd).
        backend: one of BACKENDS: "sdpa" (reference, any device and dtype), "torch" and
            "cpu_flash" (memory-efficient; cpu_flash: CPU only, fast), "flex", "flash",
            "te"; or "auto", resolved by q's device and dtype (resolve_backend). See backends.py
            for what each needs.

    The causal mask is aligned to the bottom-right corner of each segment's [lq, lk] block, as in
    flash_attn_varlen_func(causal=True): query j (0-based) attends to keys 0 .. lk - lq + j. The
    first lk - lq keys are the prefix (earlier chunks' K/V); the last lq are the chunk's own.
    For example, with lq = 3 and lk = 5 the mask (1 = attend, 0 = masked out) is:
        1 1 1 0 0
        1 1 1 1 0
        1 1 1 1 1
    With lk == lq this is the usual causal mask. Keys of other segments are never attended.

    Return:
        out: (Tq, nh, hd), same dtype and device as q.
    """
    attend = get_backend(resolve_backend(backend, q.device.type, q.dtype))
    cu_q, cu_kv = _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_kv)
    if q.shape[0] == 0:
        return q.clone()  # no queries: an empty output that still carries autograd
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    return attend(q, k, v, cu_q, cu_kv, softmax_scale)


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_kv,
                  causal: bool = True) -> tuple[list[int], list[int]]:
    """Validate shapes, dtypes and cu_seqlens; return both cu_seqlens as host lists of ints.
    Non-`causal` segments (attention/lse.py) need a key for each query's softmax, not lk >= lq."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 3-D tensor (tokens, heads, head_dim); got {got}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    (_, nh, hd), (_, ng, hd_k) = q.shape, k.shape
    if hd != hd_k:
        raise ValueError(f"q head dim {hd} != k/v head dim {hd_k}")
    if ng == 0 or nh % ng != 0:
        raise ValueError(f"q has nh={nh} heads, which is not a multiple of k/v's ng={ng} groups")
    dtypes = (q.dtype, k.dtype, v.dtype)
    if len(set(dtypes)) != 1 or not q.dtype.is_floating_point:
        got = ", ".join(map(str, dtypes))
        raise ValueError(f"q, k, v must share one floating dtype; got {got}")
    devices = (q.device, k.device, v.device)
    if len(set(devices)) != 1:
        raise ValueError(f"q, k, v must be on one device; got {', '.join(map(str, devices))}")

    cu_q = _cu_list("cu_seqlens_q", cu_seqlens_q, total=q.shape[0], total_name="q.shape[0]")
    cu_kv = _cu_list("cu_seqlens_kv", cu_seqlens_kv, total=k.shape[0], total_name="k.shape[0]")
    if len(cu_q) != len(cu_kv):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_kv must both have S + 1 entries; "
            f"got {len(cu_q)} and {len(cu_kv)}"
        )
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_kv[i + 1] - cu_kv[i]
        if not causal:
            if lq and not lk:
                raise ValueError(f"segment {i} has lq={lq} queries and no keys")
            continue
        if lk < lq:
            raise ValueError(
                f"segment {i} has lq={lq} queries but lk={lk} keys "
                f"(cu_seqlens_q[{i}:{i + 2}]={cu_q[i : i + 2]}, "
                f"cu_seqlens_kv[{i}:{i + 2}]={cu_kv[i : i + 2]}); bottom-right causal attention "
                f"needs lk >= lq"
            )
    return cu_q, cu_kv


def _cu_list(name: str, cu: CuSeqlens, *, total: int, total_name: str) -> list[int]:
    """One cu_seqlens argument as a list of ints, checked: 1-D, >= 2 entries, 0, sorted, total."""
    cu_t = cu if isinstance(cu, torch.Tensor) else torch.as_tensor(cu)
    if cu_t.dim() != 1 or cu_t.numel() < 2:
        shape = tuple(cu_t.shape)
        raise ValueError(f"{name} must be 1-D with S + 1 >= 2 entries; got shape {shape}")
    if cu_t.dtype.is_floating_point or cu_t.dtype.is_complex or cu_t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers; got dtype {cu_t.dtype}")
    values = cu_t.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0]={values[0]}")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(
                f"{name} must be non-decreasing; got {name}[{i}]={values[i]} > "
                f"{name}[{i + 1}]={values[i + 1]}"
            )
    if values[-1] != total:
        raise ValueError(f"{name}[-1]={values[-1]} must equal {total_name}={total} (total tokens)")
    return values
