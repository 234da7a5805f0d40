"""Backends of chunk_attention: one function per library, all with the same contract.

Every backend is called as fn(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale) with inputs already
validated by chunk_attention (cu_q / cu_kv: host lists of ints, Tq > 0, lk >= lq per segment) and
returns out_TNH. Each computes bottom-right causal attention within segments; autograd comes from
the library (torch autograd for sdpa and flex, flash-attn's and TE's own autograd Functions).
cpu_flash, torch, flash and varlen also run as a forward returning (out, lse) and a backward from
it (attention/lse.py), for context parallelism's backward.

- torch: exact and memory-efficient in plain torch (torch_attention.py): saves only q, k, v, out and
  the log-sum-exp, like flash-attention, and computes in tiles, so a chunk over a long prefix
  never holds its [queries x keys] scores; any device and dtype. auto's choice for fp32/fp64 on
  a GPU.
- cpu_flash: ATen's fused CPU flash kernel (cpu_flash.py), prefix and own keys merged by
  log-sum-exp; CPU only, saves q, k, v, out and the log-sum-exp; 20-40x faster than torch.
- sdpa: the reference. A loop over segments of F.scaled_dot_product_attention; any device, any
  floating dtype (float64 included), GQA through enable_gqa (torch >= 2.5) or repeat_interleave.
- flex: torch.nn.attention.flex_attention with a block mask from per-token segment ids. On CUDA it
  runs compiled (torch.compile), on inputs the compiled kernel takes for every preset's shape
  (flex_compilable_inputs: K/V repeated to every query head, the head dim zero-padded to a power
  of two >= 16; exact, at N / G times the K/V memory under GQA; UNTESTED until a GPU run). On
  CPU, as of torch 2.13, FlexAttention is forward-only: eager runs in float32 and float64
  (unfused, materializing the scores) and compiled runs float32 only, but there is no CPU
  backward in either mode. This backend therefore runs eager on CPU and raises
  a ValueError when a gradient would be needed there; on CUDA it refuses float64.
- varlen: torch.nn.attention.varlen.varlen_attn, PyTorch's own flash kernel (no extra package;
  torch >= 2.10), causal (bottom-right aligned, as flash-attn's); CUDA, fp16/bf16. UNTESTED
  until a GPU run (tests/gpu/test_attention_backends.py).
- flash: flash_attn.flash_attn_varlen_func(causal=True); CUDA, fp16/bf16, flash-attn >= 2.1
  (older versions align the causal mask to the top-left corner).
- te: transformer_engine.pytorch.DotProductAttention with qkv_format="thd" and
  attn_mask_type="padding_causal_bottom_right"; CUDA. Written from TE's documented API and UNTESTED
  until a GPU run (tests/gpu/test_attention_backends.py).
"""

# Shape suffixes: T packed tokens (Tq on the query side, Tk on the key/value side),
# N query heads (nh), G key/value heads (ng), H head dim (hd), Q / K one segment's queries / keys,
# B batch (always 1 here); e.g. q_TNH, k_TGH, q_BNQH.

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_chunkflow.attention.flex import flex_attention_backend, segment_lengths

# sdpa gained enable_gqa in torch 2.5; setup.py allows torch >= 2.4.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def sdpa_attention(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale):
    """Reference backend: F.scaled_dot_product_attention on each segment in turn."""
    nh, ng = q_TNH.shape[1], k_TGH.shape[1]
    gqa = nh != ng
    if gqa and not _SDPA_HAS_GQA:
        k_TGH = k_TGH.repeat_interleave(nh // ng, dim=1)
        v_TGH = v_TGH.repeat_interleave(nh // ng, dim=1)
        gqa = False
    outs = []
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_kv[i + 1] - cu_kv[i]
        if lq == 0:
            continue
        q_BNQH = q_TNH[cu_q[i] : cu_q[i + 1]].transpose(0, 1).unsqueeze(0)
        k_BGKH = k_TGH[cu_kv[i] : cu_kv[i + 1]].transpose(0, 1).unsqueeze(0)
        v_BGKH = v_TGH[cu_kv[i] : cu_kv[i + 1]].transpose(0, 1).unsqueeze(0)
        mask_QK, is_causal = None, False
        if lq == lk:
            is_causal = True  # top-left and bottom-right alignment coincide
        elif lq > 1:  # a single query sees every key: no mask at all
            ones_QK = torch.ones(lq, lk, dtype=torch.bool, device=q_TNH.device)
            mask_QK = ones_QK.tril(diagonal=lk - lq)
        kwargs = {"enable_gqa": True} if gqa else {}
        out_BNQH = F.scaled_dot_product_attention(
            q_BNQH,
            k_BGKH,
            v_BGKH,
            attn_mask=mask_QK,
            is_causal=is_causal,
            scale=softmax_scale,
            **kwargs,
        )
        outs.append(out_BNQH.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


def flash_attention_backend(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale):
    """flash_attn_varlen_func with causal=True (bottom-right aligned since flash-attn 2.1)."""
    flash_attn = _import_or_explain("flash_attn", "flash", "pip install flash-attn")
    if _major_minor(flash_attn.__version__) < (2, 1):
        raise ImportError(
            f"backend 'flash' needs flash-attn >= 2.1 (bottom-right causal mask); found "
            f"{flash_attn.__version__}: pip install -U flash-attn"
        )
    _require_cuda_half("flash", q_TNH)
    cu_q_t, cu_kv_t, max_q, max_kv = _cu_on_device(cu_q, cu_kv, q_TNH.device)
    return flash_attn.flash_attn_varlen_func(
        q_TNH,
        k_TGH,
        v_TGH,
        cu_q_t,
        cu_kv_t,
        max_q,
        max_kv,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        causal=True,
    )


def varlen_attention_backend(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale):
    """torch.nn.attention.varlen.varlen_attn, causal; its keyword for the causal mask and for
    grouped K/V heads differs across torch versions, so both are read off its signature."""
    varlen = _import_or_explain("torch.nn.attention.varlen", "varlen",
                                "upgrade PyTorch to 2.10 or newer")
    _require_cuda_half("varlen", q_TNH)
    if _varlen_uses_cudnn(varlen):
        raise ValueError(f"backend 'varlen': torch {torch.__version__} runs varlen_attn through "
                         "cuDNN on this GPU, whose causal mask and GQA support differ from the "
                         "flash kernel's bottom-right mask that chunks over a prefix need; use "
                         "backend 'flash' or 'torch'")
    params = inspect.signature(varlen.varlen_attn).parameters
    kwargs = {"scale": softmax_scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal, no sliding window
    else:
        kwargs["is_causal"] = True
    nh, ng = q_TNH.shape[1], k_TGH.shape[1]
    if nh != ng:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k_TGH = k_TGH.repeat_interleave(nh // ng, dim=1)
            v_TGH = v_TGH.repeat_interleave(nh // ng, dim=1)
    cu_q_t, cu_kv_t, max_q, max_kv = _cu_on_device(cu_q, cu_kv, q_TNH.device)
    return varlen.varlen_attn(q_TNH, k_TGH, v_TGH, cu_q_t, cu_kv_t, max_q, max_kv, **kwargs)


def _varlen_uses_cudnn(varlen=None) -> bool:
    """Whether PyTorch's varlen_attn would take its cuDNN path on the current CUDA device (some
    torch versions choose it by device capability) instead of the flash kernel."""
    if varlen is None:
        try:
            varlen = importlib.import_module("torch.nn.attention.varlen")
        except ImportError:
            return False
    choose = getattr(varlen, "_should_use_cudnn", None)
    return bool(choose and torch.cuda.is_available() and choose(torch.cuda.current_device()))


def _flash_attn_aligns_bottom_right() -> bool:
    """Whether the installed flash-attn (>= 2.1) aligns its causal mask to the bottom-right corner,
    read from the package metadata without importing its CUDA extension."""
    from importlib import metadata

    try:
        version = metadata.version("flash-attn")
    except metadata.PackageNotFoundError:
        return _installed("flash_attn")  # installed without metadata: the backend checks it
    return _major_minor(version) >= (2, 1)


def _major_minor(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "2.7.4.post1"."""
    return tuple(int(x) for x in version.split(".")[:2] if x.isdigit())


_TE_MODULES: dict[tuple[int, int, int, float], torch.nn.Module] = {}


def te_attention_backend(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale):
    """TE DotProductAttention, THD layout, padding_causal_bottom_right mask (untested on GPU)."""
    install = "pip install transformer-engine[pytorch]"
    te = _import_or_explain("transformer_engine.pytorch", "te", install)
    if q_TNH.device.type != "cuda":
        raise ValueError(f"backend 'te' needs CUDA tensors; got device {q_TNH.device}")
    tq, nh, hd = q_TNH.shape
    ng = k_TGH.shape[1]
    key = (nh, hd, ng, float(softmax_scale))
    if key not in _TE_MODULES:
        _TE_MODULES[key] = te.DotProductAttention(
            nh,
            hd,
            num_gqa_groups=ng,
            attention_dropout=0.0,
            qkv_format="thd",
            attn_mask_type="padding_causal_bottom_right",
            softmax_scale=softmax_scale,
        )
    cu_q_t, cu_kv_t, max_q, max_kv = _cu_on_device(cu_q, cu_kv, q_TNH.device)
    out = _TE_MODULES[key](
        q_TNH,
        k_TGH,
        v_TGH,
        cu_seqlens_q=cu_q_t,
        cu_seqlens_kv=cu_kv_t,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
    )
    return out.reshape(tq, nh, hd)  # TE returns THD output flattened to (Tq, nh * hd)


def torch_attention_backend(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale):
    """Plain-torch attention that saves no [lq, lk] tensor for backward (torch_attention.py)."""
    from megatron_chunkflow.attention.torch_attention import TorchChunkAttention

    return TorchChunkAttention.apply(q_TNH, k_TGH, v_TGH, list(cu_q), list(cu_kv), softmax_scale)


def cpu_flash_backend(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale):
    """ATen's CPU flash-attention kernel per segment, prefix merged by log-sum-exp (cpu_flash.py)."""
    from megatron_chunkflow.attention.cpu_flash import cpu_flash_attention

    return cpu_flash_attention(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale)


BACKENDS: dict[str, Callable[..., torch.Tensor]] = {
    "torch": torch_attention_backend,
    "cpu_flash": cpu_flash_backend,
    "sdpa": sdpa_attention,
    "flex": flex_attention_backend,  # attention/flex.py
    "varlen": varlen_attention_backend,
    "flash": flash_attention_backend,
    "te": te_attention_backend,
}

# The module each backend needs; find_spec checks it is installed without importing it.
_REQUIRES = {
    "torch": "torch",
    "cpu_flash": "torch",
    "sdpa": "torch",
    "flex": "torch.nn.attention.flex_attention",
    "varlen": "torch.nn.attention.varlen",
    "flash": "flash_attn",
    "te": "transformer_engine",
}


def available_backends() -> list[str]:
    """Names of the backends whose library is installed here (device and dtype not considered)."""
    return [name for name, module in _REQUIRES.items() if _installed(module)]


# `auto` on each device type, fastest first: the first installed backend that takes the dtype.
# On CUDA the fused varlen kernels (flash-attn's, else PyTorch's own, which needs no extra
# package) for fp16/bf16, and the tiled plain-torch backend for fp32/fp64: never a kernel whose
# memory grows with chunk x prefix (sdpa, and flex on CPU, materialise the scores).
AUTO: dict[str, tuple[str, ...]] = {
    "cpu": ("cpu_flash", "torch"),
    "cuda": ("flash", "varlen", "torch"),
}
HALF_ONLY = ("flash", "varlen")  # fp16/bf16 kernels
HALF_DTYPES = (torch.float16, torch.bfloat16)
CUDA_ONLY = ("flash", "varlen", "te")
# Backends that hold a chunk's whole [queries x keys] score block (and sdpa its mask) at once.
MATERIALISING = {"cpu": ("sdpa", "flex"), "cuda": ("sdpa",)}


def resolve_backend(name: str, device_type: str, dtype: torch.dtype | None = None) -> str:
    """The backend `name` stands for on a device of `device_type` ("cuda" or "cpu") for inputs of
    `dtype` (None: any): "auto" is the first installed backend of AUTO[device_type] that takes
    the dtype, "torch" when none does. Any other name is itself."""
    if name != "auto":
        return name
    for backend in AUTO.get(device_type, ()):
        if backend in HALF_ONLY and dtype is not None and dtype not in HALF_DTYPES:
            continue
        if backend == "varlen" and device_type == "cuda" and _varlen_uses_cudnn():
            continue
        if backend == "flash" and not _flash_attn_aligns_bottom_right():
            continue
        if _installed(_REQUIRES[backend]):
            return backend
    return "torch"


# Context parallelism (runtime/cp.py) runs a backend on gathered K/V with lk >= lq segments; its
# backward runs from the saved log-sum-exp where the backend has the pair (attention/lse.py), and
# otherwise recomputes the forward under autograd: every backend with a backward on that device can.
NO_BACKWARD = {"cpu": ("flex",)}  # torch's FlexAttention has no CPU backward


def check_context_parallel(name: str, device_type: str, flag: str = "--attention-backend") -> None:
    """ValueError naming `flag` if backend `name` cannot train under context parallelism on a
    device of `device_type`."""
    backend = resolve_backend(name, device_type)
    if backend in NO_BACKWARD.get(device_type, ()):
        raise ValueError(f"{flag} {name}: context parallelism recomputes attention in the "
                         f"backward, and {backend} has no backward on {device_type} (torch "
                         f"{torch.__version__}); choose one of "
                         f"{', '.join(AUTO.get(device_type, ()))} or auto")


def get_backend(name: str) -> Callable[..., torch.Tensor]:
    """The backend function called `name`; ValueError naming the known ones if there is none."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known backends: "
                         f"{sorted(BACKENDS)} and auto")
    return BACKENDS[name]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package of a dotted name
        return False


def _import_or_explain(module: str, backend: str, install: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"backend {backend!r} needs {module}, which failed to import ({e}): {install}"
        ) from e


def _require_cuda_half(backend: str, q_TNH: torch.Tensor) -> None:
    if q_TNH.device.type != "cuda" or q_TNH.dtype not in HALF_DTYPES:
        raise ValueError(
            f"backend {backend!r} needs CUDA fp16/bf16 tensors; got {q_TNH.dtype} on "
            f"{q_TNH.device} (use backend='sdpa' for other devices and dtypes)"
        )


def _cu_on_device(cu_q, cu_kv, device):
    """cu_seqlens as int32 tensors on `device`, plus the longest query and key segment."""
    cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=device)
    cu_kv_t = torch.tensor(cu_kv, dtype=torch.int32, device=device)
    return cu_q_t, cu_kv_t, max(segment_lengths(cu_q)), max(segment_lengths(cu_kv))
