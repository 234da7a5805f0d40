"""What megatron-core's local layer spec launches and moves beside its GEMMs and attention: the
memory-bound kernels of a layer, the loss, the gradient accumulation and the optimizer, counted
from the real step by memtrace/census.py (tests/memtrace/test_census.py keeps the two equal).

The local spec is what `chunkflow train` and the Megatron-LM launcher build where Transformer
Engine and Apex are absent (megatron-core 0.16.1, bf16): torch's RMSNorm (one fused kernel each
way on CUDA), Megatron's unfused rotary embedding (cos and sin of the fp32 frequencies made in
every layer, rotate-half by slices and a cat), the Q/K/V bias added after its GEMM, SwiGLU and
bias-dropout-add fused by torch.compile when fusions are on (--no-bias-swiglu-fusion,
--no-bias-dropout-fusion off) or as their pointwise ops, the residual adds, the casts around the
attention kernel; under torch 2.10-2.12's varlen attention (no grouped-query attention) K and V
repeated to every query head. Per token and layer, one TP rank, bytes read plus written:

  forward  = 20 h + (28 + 8 r + 4 b + 4.0625 n) q + (24 + 8 b + 4.0625 n) kv + (6 | 14) f + 112.125 d
  backward = 24 h + (32.0625 + 4 r + 2 b + 6.0625 n) q + (36 + 4 r + 4 b + 6.0625 n) kv + (10 | 26) f
             + 8.125 d

h: the hidden size (over TP under sequence parallelism), q: query width (heads x head dim), kv:
K width, f: FFN width (each over TP), d: the head dim (rotary frequencies, whole on every rank);
r: 1 with K/V repeated, b: 1 with a Q/K/V bias (Qwen2), n: 1 with Qwen3's Q/K norms; the f terms
fused | unfused. Kernels per layer: forward 39, backward 40, plus 2 / 2 with K/V repeated, 1 / 2
with a bias, 2 / 4 with Q/K norms; fused SwiGLU and bias-dropout-add save 2 forward and 3
backward. The coefficients come from traces of shapes varying each width alone (each a whole
number of bytes per element, the fractions fp32 statistics per head), and the test checks them on
real shapes (Qwen2.5-1.5B, Qwen3-0.6B) within 1%.

Outside the layers, per token: the output layer's cross entropy (Megatron's vocabulary-parallel
one, upcast to fp32) moves LOSS_BYTES per logit forward and backward; per micro-batch (chunk) the
backward adds each weight's gradient into its fp32 main_grad (GRAD_ACCUM_BYTES per parameter: no
gradient-accumulation fusion without Apex); per step the gradient buffer is zeroed and then
divided by the global token count (finalize_model_grads: 4 + 8 bytes per parameter,
GRAD_BUFFER_BYTES) and torch's AdamW (foreach, unfused) moves OPTIMIZER_BYTES per parameter of its shard
with 2 kernels per parameter tensor (the norm for clipping, the copy into the bf16 weight).
"""

from __future__ import annotations

from typing import NamedTuple

from megatron_chunkflow.core.models import ModelShape

LOSS_BYTES = (34, 14)  # per logit, forward and backward: fp32 upcast, max, exp, sum; grad, cast
LOSS_KERNELS = (35, 8)
GRAD_ACCUM_BYTES = 10  # per parameter and micro-batch: read the bf16 grad, read + write fp32
ZERO_GRAD_BYTES = 4  # per parameter and step: the fp32 gradient buffer zeroed
GRAD_SCALE_BYTES = 8  # per parameter and step: read + write it, times 1 / the global token count
GRAD_BUFFER_BYTES = ZERO_GRAD_BYTES + GRAD_SCALE_BYTES
OPTIMIZER_BYTES = 62  # per parameter of the shard: torch AdamW foreach, clip norm, bf16 copy
OPTIMIZER_KERNELS_PER_TENSOR = 2  # the clip norm and the copy into the compute-dtype weight
PARAM_TENSORS_PER_LAYER = 7  # QKV (weight), projection, fc1, fc2, two norms; + QKV bias


class LayerKernels(NamedTuple):
    """One layer's memory-bound work on one GPU: bytes per token and kernels, each way."""

    fwd_bytes: float
    bwd_bytes: float
    fwd_kernels: int
    bwd_kernels: int
    swiglu_bytes: float  # of fwd_bytes, SwiGLU's (what a recompute of the MLP runs again)


def local_layer(shape: ModelShape, tp: int, sequence_parallel: bool, fused: bool,
                kv_repeat: bool) -> LayerKernels:
    """The module docstring's counts for `shape` on one of `tp` ranks (bf16)."""
    h = shape.hidden_size / (tp if sequence_parallel else 1)
    q = shape.num_attention_heads * shape.head_dim / tp
    kv = shape.kv_dim / tp
    f = shape.ffn_hidden_size / tp
    r, b, n = int(kv_repeat), int(shape.qkv_bias), int(shape.qk_norm)
    d = shape.head_dim
    swiglu = (6 if fused else 14) * f
    fwd = (20 * h + (28 + 8 * r + 4 * b + 4.0625 * n) * q + (24 + 8 * b + 4.0625 * n) * kv
           + swiglu + 112.125 * d)
    bwd = (24 * h + (32.0625 + 4 * r + 2 * b + 6.0625 * n) * q
           + (36 + 4 * r + 4 * b + 6.0625 * n) * kv + (10 if fused else 26) * f + 8.125 * d)
    fk = 39 + 2 * r + b + 2 * n - 2 * fused
    bk = 40 + 2 * r + 2 * b + 4 * n - 3 * fused
    return LayerKernels(fwd, bwd, fk, bk, swiglu)


def param_tensors(shape: ModelShape, num_layers: int) -> int:
    """Parameter tensors of `num_layers` layers (the optimizer's per-tensor kernels)."""
    per = PARAM_TENSORS_PER_LAYER + (1 if shape.qkv_bias else 0) + (2 if shape.qk_norm else 0)
    return per * num_layers
