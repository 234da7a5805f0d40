"""Device memory per GPU: weights, gradients and optimizer states, activations, the loss,
the working memory of the backward; ChunkFlow's K/V state is perfmodel/kvstate.py's.

Every term below was read off what the real step allocates (memtrace/: the build and step that
`chunkflow train` and the Megatron-LM launcher run, traced on meta tensors; the tracer reproduces
torch.cuda.max_memory_allocated of the H200 runs within 0.3%), for the build as it is on a GPU:
megatron-core 0.16.1's local spec with Megatron-LM's defaults that need neither Transformer
Engine nor Apex (bias-SwiGLU and bias-dropout-add fused; `Build` says what else the build and its
software stack decide). tests/memtrace/test_footprint.py holds the model to the tracer within 5%
over families, C, K, the recompute menu, TP/SP, PP, VPP, CP and the re-forward's attention.

Static (Megatron's distributed optimizer, Megatron-LM README "Distributed Optimizer"): bf16
params and fp32 gradients take 6 + 12/d bytes per parameter (fp32 master, Adam m and v sharded
over the d = DP x CP ranks that hold the same weights); fp32 params (CPU runs) 8 + 8/d.
Parameters are split over TP and PP.

Activations saved for backward per token per layer (ACTIVATION_TERMS; elements unless said; h
hidden, a = heads x head dim, kv = K/V groups x head dim, f the FFN width), what megatron-core
0.16.1's layer keeps without recompute:
  norm_inputs  2h   both RMSNorms' inputs (the residual stream)
  norm_rstd    8 bytes: the two norms' fp32 1/rms per token (torch's fused RMSNorm on CUDA)
  qkv_input    h    the input norm's output, saved by the QKV linear
  q, kv        a, 2kv  post-RoPE Q, and K and V, saved by the attention kernel
  lse          4 bytes per head: the kernel's fp32 log-sum-exp
  proj_input   a    the attention output, saved by the projection
  fc1_input    h    the pre-MLP norm's output, saved by fc1
  fc1_output   2f   saved by SwiGLU
  glu_parts    2f   unfused SwiGLU only (Build.fused_swiglu False, CPU builds): SiLU's output and
                    the linear half plus Megatron's glu_linear_offset, saved by their product
  act_output   f    SwiGLU's output, saved by fc2
and, per key token a chunk's attention reads (its prefix's and its own, kv_repeat_bytes), K and V
repeated to every query head (2a) where the kernel has no grouped-query attention
(Build.kv_repeat: torch 2.10-2.12's varlen_attn) and keeps the copies. Under TP the head
dimensions are split; the h terms are split only under sequence parallelism (without it every TP
rank holds the whole sequence's hidden states).
What each recompute option drops (RECOMPUTE_DROPS), from megatron-core's code:
- core_attn (attention.py _checkpointed_attention_forward: tensor_parallel.checkpoint of the core
  attention on Q, K, V): Q, K, V stay as the checkpoint's inputs and the output is the
  projection's input anyway, so the log-sum-exp and any repeated K/V go;
- mlp (transformer_layer.py _forward_mlp: tensor_parallel.checkpoint of the whole MLP on the
  pre-MLP norm's output): everything inside the MLP goes, fc1's input stays as the checkpoint's;
- layernorm (CheckpointWithoutOutput on both norms, discard_output_and_register_recompute): the
  norms' outputs and their rstd go (qkv_input and fc1_input), their inputs stay as the checkpoint's;
- full (transformer_block.py _checkpointed_forward, CheckpointFunction per layer): the layer
  input only, h elements (Korthikanti's 2sbh per layer), recomputed whole in the backward;
  block:N does that for the first N layers of each stage and keeps everything in the others.

The loss (the last stage). Stock Megatron's output layer and vocab-parallel cross entropy keep
the final norm's input and the output layer's (2h) and the fp32 softmax (4 V / TP bytes per
token) for backward, and make the logits in the compute dtype beside their fp32 copy first (the
transient: 2 V / TP bytes per token of the micro-batch). With the loss in token pieces
(Build.loss_piece p, runtime/pieced_loss.py) the head keeps the output layer's input, whole under
sequence parallelism, an fp32 log-sum-exp and the int64 label per token, and the transient is one
piece's logits and their fp32 copy (6 p V / TP bytes), the output weight's gradient (2 V h / TP)
and the fp32 gradient of the hidden states.

Working memory while an op runs (the loss's, a layer's backward) and when the K/V state is
allocated are perfmodel/moments.py's; what a chunk holds (per token, per key token its kernel
read, per own token of a standalone chunk) is perfmodel/held.py's.

Every function takes the bytes per element of weights and activations (`dtype_bytes`: 2 for
bf16, 4 for fp32; a device's Hardware.dtype_bytes) and, where it matters, the `Build`. Token
counts are computed tokens (a baseline's padding included, core/types.py). The planner
(core/step.py) models time only; memory_hooks hands it this model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_chunkflow.config import NO_RECOMPUTE, ParallelConfig, Recompute
from megatron_chunkflow.core.costs import layers_per_stage, linear_weights_per_layer
from megatron_chunkflow.core.cp_place import place_segments
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.types import DataChunk


def layer_params(shape: ModelShape) -> int:
    """Parameters of one transformer layer: matmul weights, QKV bias, two RMSNorm weights (and
    Qwen3's two QK norms of one head dim each)."""
    h, kv = shape.hidden_size, shape.kv_dim
    attn = shape.num_attention_heads * shape.head_dim
    bias = (attn + 2 * kv) if shape.qkv_bias else 0
    qk_norm = 2 * shape.head_dim if shape.qk_norm else 0
    return linear_weights_per_layer(shape) + bias + 2 * h + qk_norm


def stage_params(shape: ModelShape, pp: int) -> list[int]:
    """Parameters per pipeline stage: its layers, the embedding on the first stage, the final
    norm and output layer on the last (tied embeddings keep a copy there when PP > 1)."""
    emb = shape.vocab_size * shape.hidden_size
    out = []
    for s, n in enumerate(layers_per_stage(shape.num_layers, pp)):
        p = n * layer_params(shape)
        if s == 0:
            p += emb
        if s == pp - 1:
            p += shape.hidden_size
            if not shape.tie_embeddings or pp > 1:
                p += emb
        out.append(p)
    return out


def total_params(shape: ModelShape) -> int:
    """Parameters of the whole model (tied embeddings counted once)."""
    return sum(stage_params(shape, 1))


def static_bytes(params: float, layout: ParallelConfig, dtype_bytes: int) -> float:
    """Weights, fp32 gradient buffer and optimizer states of `params` (before TP), the states
    sharded over DP x CP (CP ranks hold the same weights; Megatron reduces and shards over both)."""
    local = params / layout.tp
    states = 12 if dtype_bytes == 2 else 8  # (fp32 master +) Adam m and v
    return local * (dtype_bytes + 4 + states / (layout.dp * layout.cp))


def recompute_of(layout: ParallelConfig, recompute: Recompute | str | None) -> Recompute:
    """`recompute` (or its text form), else the layout's."""
    if recompute is None:
        return layout.recompute
    return Recompute.parse(recompute) if isinstance(recompute, str) else recompute


@dataclass(frozen=True)
class Build:
    """What the training build and its software stack keep that the model's shape does not say
    (module docstring); the GPU build by default."""

    fused_swiglu: bool = True
    """Megatron's bias-SwiGLU fusion (Megatron-LM's default, and `chunkflow train`'s on a GPU);
    without it SwiGLU keeps 2 f more per token and layer (glu_parts)."""
    kv_repeat: bool = False
    """The attention kernel takes K and V repeated to every query head and keeps the copies
    (torch 2.10-2.12's varlen_attn, which has no enable_gqa): 2 a per key token and layer."""
    loss_piece: int = 0
    """--chunkflow-loss-piece: tokens per piece of the output layer and cross entropy (0: the
    micro-batch's logits whole, as stock Megatron makes them)."""


CPU_BUILD = Build(fused_swiglu=False)  # megatron-core's fusions are compiled for CUDA
ACTIVATION_TERMS = ("norm_inputs", "norm_rstd", "qkv_input", "qkv_output", "q", "kv", "lse",
                    "proj_input", "fc1_input", "fc1_output", "glu_parts", "act_output")
RECOMPUTE_DROPS = {"core_attn": ("lse",), "mlp": ("fc1_output", "glu_parts", "act_output"),
                   "layernorm": ("qkv_input", "fc1_input", "norm_rstd")}


def _split(layout: ParallelConfig) -> int:
    """What the hidden-size terms are divided by on one TP rank: TP under sequence parallelism."""
    return layout.tp if layout.sequence_parallel else 1


def activation_terms(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                     build: Build = Build()) -> dict[str, float]:
    """Bytes per token (on this GPU, after CP) of each tensor one layer saves for backward
    without recompute (the module docstring's table), the head dimensions split over TP and the
    hidden ones too under sequence parallelism."""
    h, kv, f, t, sp = (shape.hidden_size, shape.kv_dim, shape.ffn_hidden_size, layout.tp,
                       _split(layout))
    a = shape.num_attention_heads * shape.head_dim
    out = {"norm_inputs": 2 * h / sp, "qkv_input": h / sp,
           "qkv_output": (a + 2 * kv) / t if shape.qk_norm else 0, "q": a / t, "kv": 2 * kv / t,
           "proj_input": a / t, "fc1_input": h / sp, "fc1_output": 2 * f / t,
           "glu_parts": 0 if build.fused_swiglu else 2 * f / t, "act_output": f / t}
    out = {k: v * dtype_bytes for k, v in out.items()}
    out["lse"] = 4.0 * shape.num_attention_heads / t
    out["norm_rstd"] = 8.0 / sp
    return {k: out[k] for k in ACTIVATION_TERMS}


def kv_repeat_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                    build: Build = Build(), recompute: Recompute | str | None = None) -> float:
    """Bytes per key token per layer of K and V repeated to every query head, where the kernel
    keeps such copies (Build.kv_repeat, grouped-query attention) and the layer keeps its
    attention's saved tensors under `recompute` (default: the layout's; core_attn, full and a
    block's recomputed layers do not)."""
    rc = recompute_of(layout, recompute)
    if (not build.kv_repeat or shape.num_query_groups == shape.num_attention_heads
            or rc.kind in ("full", "block") or "core_attn" in rc.modules):
        return 0.0
    return 2 * shape.num_attention_heads * shape.head_dim / layout.tp * dtype_bytes


def dropped_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                  recompute: Recompute | str | None = None, build: Build = Build()) -> float:
    """Bytes per token per layer a selective option does not keep (0 for the others)."""
    rc = recompute_of(layout, recompute)
    if rc.kind != "selective":
        return 0.0
    terms = activation_terms(shape, layout, dtype_bytes, build)
    return sum(terms[n] for n in {t for m in rc.modules for t in RECOMPUTE_DROPS[m]})


def view_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int) -> float:
    """Bytes per token per layer of the attention's inputs as the layer makes them: post-RoPE K
    and V, a view of the QKV output that keeps all of it (a + 2 kv) alive (with Qwen3's QK norms
    it is kept anyway: qkv_output). Kept by the core_attn checkpoint, and by a kernel with
    grouped-query attention that saves K and V themselves (a standalone chunk's, or a stock
    micro-batch's: a dependent chunk's attention reads the state's buffer)."""
    a, kv = shape.num_attention_heads * shape.head_dim, shape.kv_dim
    return dtype_bytes * (kv + (0 if shape.qk_norm else a + 2 * kv)) / layout.tp


def checkpoint_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                     recompute: Recompute | str | None = None) -> float:
    """Bytes per token per layer a selective option keeps that the layer without it does not:
    the core_attn checkpoint's inputs (view_bytes) for every chunk."""
    rc = recompute_of(layout, recompute)
    if rc.kind != "selective" or "core_attn" not in rc.modules:
        return 0.0
    return view_bytes(shape, layout, dtype_bytes)


def layer_input_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int) -> float:
    """What a fully recomputed layer keeps per token: its input (split over TP under sequence
    parallelism)."""
    return dtype_bytes * shape.hidden_size / _split(layout)


def layer_activation_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                           recompute: Recompute | str | None = None,
                           build: Build = Build()) -> float:
    """Bytes saved for backward per token (on this GPU, after CP) by one layer under `recompute`
    (default: the layout's): everything less the selective modules' drops, or for a fully
    recomputed layer (full; block's first N layers) its input. For block, the bytes of one of
    its recomputed layers (stage_activation_bytes has the stage's mix). K/V repeated per query
    head are per key token: kv_repeat_bytes."""
    rc = recompute_of(layout, recompute)
    if rc.kind in ("full", "block"):
        return layer_input_bytes(shape, layout, dtype_bytes)
    return (sum(activation_terms(shape, layout, dtype_bytes, build).values())
            - dropped_bytes(shape, layout, dtype_bytes, rc, build)
            + checkpoint_bytes(shape, layout, dtype_bytes, rc))


def stage_activation_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                           layers: int, build: Build = Build()) -> float:
    """Bytes per token a micro-batch keeps on a stage of `layers` layers under the layout's
    recompute: its recomputed layers keep their input, the others their (selective) bytes."""
    r = layout.recompute.layers_recomputed(layers)
    kept = layer_activation_bytes(shape, layout, dtype_bytes,
                                  NO_RECOMPUTE if r else layout.recompute, build)
    return r * layer_input_bytes(shape, layout, dtype_bytes) + (layers - r) * kept


def head_activation_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                          build: Build = Build()) -> float:
    """Bytes per token the last stage keeps for the loss's backward (module docstring): the final
    norm's input and rstd, the output layer's input, and the fp32 softmax of the vocabulary-
    parallel cross entropy, or with the loss in pieces an fp32 log-sum-exp and the label."""
    h, sp = shape.hidden_size, _split(layout)
    norm = (h * dtype_bytes + 4) / sp
    if build.loss_piece:  # the pieced loss keeps the output layer's input as it takes it: whole
        return norm + h * dtype_bytes + 4 + 8
    return norm + h * dtype_bytes / sp + 4 * math.ceil(shape.vocab_size / layout.tp)


def per_token_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                    num_stages: int, build: Build = Build()) -> list[float]:
    """Activation bytes a micro-batch holds per token (after CP) on each stage, without the K/V
    repeated per query head (per key token: key_token_bytes)."""
    out = [stage_activation_bytes(shape, layout, dtype_bytes, n, build)
           for n in layers_per_stage(shape.num_layers, num_stages)]
    out[-1] += head_activation_bytes(shape, layout, dtype_bytes, build)
    return out
