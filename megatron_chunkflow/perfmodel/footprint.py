"""Device memory per GPU: weights, gradients and optimizer states, activations, K/V state.

Static (Megatron's distributed optimizer, Megatron-LM README "Distributed Optimizer"): bf16
params and fp32 gradients take 6 + 12/d bytes per parameter (fp32 master, Adam m and v sharded
over the d = DP x CP ranks that hold the same weights); fp32 params (CPU runs) 8 + 8/d.
Parameters are split over TP and PP.

Activations saved for backward per token per layer, after Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models"), whose GPT count is 34 bytes * h plus
5 * a * s bytes of attention scores. Adapted to Qwen2.5 (GQA with K/V width kv, SwiGLU with
width f, RMSNorm, no dropout) and a fused flash-style kernel that never stores the scores:
two norm inputs (2h), QKV input (h), Q (h), K and V (2 kv), attention output = projection
input (h), fc1 input (h), fc1 output (2f), SwiGLU output (f): 6h + 2kv + 3f elements, plus
the kernel's fp32 log-sum-exp (4 bytes per head). Check: with kv = h, a 4h GeLU MLP and the
two 1-byte dropout masks this gives Korthikanti's 34h bytes. Sequence parallelism divides all
of it by TP (Korthikanti section 4.2.2).
- selective recompute (Megatron's core_attn module): Q, K, V stay as checkpoint inputs and the
  output is the projection's input, so only the log-sum-exp is saved (the s^2 term it was
  designed for is already gone with a fused kernel).
- full recompute: the layer input only, 2 * h / TP bytes (Korthikanti's 2sbh per layer).
The output layer keeps its input and the final norm's (2h / TP) and the fp32 softmax of the
vocabulary-parallel cross entropy (4 V / TP bytes per token) on the last stage.

Transient: while a layer runs backward (or is recomputed) its activations and their gradients
live at once; we add one layer's full activations of the largest micro-batch, or the bf16
logits on the last stage if larger.

ChunkFlow adds, per stage, the state of the one long sequence in flight (sequence_state_bytes:
its K/V, their fp32 gradient accumulators, the prefix copies its held chunks' attention saves)
and, after the first stage, the stage inputs saved for its re-forwards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_chunkflow.core.costs import kv_state_bytes_per_token, layers_per_stage
from megatron_chunkflow.perfmodel.hardware import Hardware
from megatron_chunkflow.perfmodel.layout import Layout
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.types import DataChunk


def layer_params(shape: ModelShape) -> int:
    h, kv, f = shape.hidden_size, shape.kv_dim, shape.ffn_hidden_size
    attn = shape.num_attention_heads * shape.head_dim
    qkv = h * (attn + 2 * kv) + ((attn + 2 * kv) if shape.qkv_bias else 0)
    return qkv + attn * h + 3 * h * f + 2 * h


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
    return sum(stage_params(shape, 1))


def static_bytes(params: float, layout: Layout, hw: Hardware) -> float:
    """Weights, fp32 gradient buffer and optimizer states of `params` (before TP), the states
    sharded over DP x CP (CP ranks hold the same weights; Megatron reduces and shards over both)."""
    local = params / layout.tp
    states = 12 if hw.dtype_bytes == 2 else 8  # (fp32 master +) Adam m and v
    return local * (hw.dtype_bytes + 4 + states / (layout.dp * layout.cp))


def layer_activation_bytes(shape: ModelShape, layout: Layout, hw: Hardware,
                           recompute: str | None = None) -> float:
    """Bytes saved for backward per token (on this GPU, after CP) per transformer layer."""
    recompute = recompute or layout.recompute
    t, h = layout.tp, shape.hidden_size
    if recompute == "full":
        return hw.dtype_bytes * h / t
    elems = 6 * h + 2 * shape.kv_dim + 3 * shape.ffn_hidden_size
    lse = 4 * shape.num_attention_heads if recompute == "none" else 0
    return (elems * hw.dtype_bytes + lse) / t


def head_activation_bytes(shape: ModelShape, layout: Layout, hw: Hardware) -> float:
    return (2 * shape.hidden_size * hw.dtype_bytes / layout.tp
            + 4 * math.ceil(shape.vocab_size / layout.tp))


def per_token_bytes(shape: ModelShape, layout: Layout, hw: Hardware,
                    num_stages: int) -> list[float]:
    """Activation bytes a micro-batch holds per token (after CP) on each stage."""
    layer = layer_activation_bytes(shape, layout, hw)
    out = [n * layer for n in layers_per_stage(shape.num_layers, num_stages)]
    out[-1] += head_activation_bytes(shape, layout, hw)
    return out


def held_bytes_fn(chunks: Sequence[DataChunk], shape: ModelShape, layout: Layout, hw: Hardware,
                  num_stages: int):
    """held_bytes(chunk id, stage) for core.simulate.simulate."""
    per_token = per_token_bytes(shape, layout, hw, num_stages)
    tokens = {c.id: math.ceil(c.num_tokens / layout.cp) for c in chunks}
    return lambda chunk, stage: per_token[stage] * tokens[chunk]


def transient_bytes(max_tokens: int, shape: ModelShape, layout: Layout, hw: Hardware,
                    last_stage: bool) -> float:
    """Working memory of the backward of one layer (or the logits) for the largest micro-batch
    on this GPU (`max_tokens` after CP)."""
    layer = layer_activation_bytes(shape, layout, hw, recompute="none")
    logits = 2 * math.ceil(shape.vocab_size / layout.tp) if last_stage else 0.0
    return max_tokens * max(layer, logits)


def sequence_state_bytes(longest: int, chunk_size: int, k: int, shape: ModelShape,
                         layout: Layout, hw: Hardware, num_stages: int) -> list[float]:
    """Per stage, an upper bound of the state of a long sequence of `longest` tokens, as the
    plugin keeps it (docs/exactness.md, "Memory"): its stored K/V (u bytes per token) and fp32
    gradient accumulators (a), the cat(prefix, own) K/V copy the attention of each of the K
    chunks holding activations saves ((j+1) C tokens for chunk j), and after the first stage the
    inputs kept for the re-forwarded chunks (h per token):

        L (u + a)  +  u * sum over the last K chunks of min((j+1) C, L)  +  (L - kept) h

    For K = 1 this is 2 L u + L a, above the exact peak docs/exactness.md derives."""
    if longest <= chunk_size:
        return [0.0] * num_stages
    n = math.ceil(longest / chunk_size)
    first_kept = max(0, n - k)
    copies = sum(min((j + 1) * chunk_size, longest) for j in range(first_kept, n))
    reforwarded = first_kept * chunk_size
    out = []
    for s, layers in enumerate(layers_per_stage(shape.num_layers, num_stages)):
        u = kv_state_bytes_per_token(shape, layers, hw.dtype_bytes, layout.tp, with_grad=False)
        a = kv_state_bytes_per_token(shape, layers, hw.dtype_bytes, layout.tp) - u
        inputs = reforwarded * hw.dtype_bytes * shape.hidden_size / layout.tp if s > 0 else 0.0
        out.append(longest * (u + a) + copies * u + inputs)
    return out


def chunkflow_state_bytes(chunks: Sequence[DataChunk], shape: ModelShape, layout: Layout,
                          hw: Hardware, num_stages: int, chunk_size: int,
                          k: int) -> list[float]:
    """sequence_state_bytes of the longest long sequence on this DP rank (one sequence's state
    lives at a time)."""
    longest = max((c.segments[0].end for c in chunks if c.is_dependent), default=0)
    return sequence_state_bytes(longest, chunk_size, k, shape, layout, hw, num_stages)


def chunkflow_memory_floor(lengths: Sequence[int], shape: ModelShape, layout: Layout,
                           hw: Hardware, chunk_size: int, k: int) -> float:
    """A lower bound of ChunkFlow's peak memory per GPU, without planning (to skip hopeless
    (chunk size, K) candidates): on every stage the last K chunks of the longest sequence hold
    activations at once (all are forwarded before the first of them runs backward), beside its
    state, the static memory and the transient of one chunk."""
    longest = max(lengths)
    if longest > chunk_size:
        n = math.ceil(longest / chunk_size)
        held = longest - (n - min(k, n)) * chunk_size
    else:
        held = longest
    per_token = per_token_bytes(shape, layout, hw, layout.pp)
    params = stage_params(shape, layout.pp)
    state = sequence_state_bytes(longest, chunk_size, k, shape, layout, hw, layout.pp)
    return max(static_bytes(params[s], layout, hw) + held * per_token[s] + state[s]
               + transient_bytes(min(chunk_size, longest), shape, layout, hw, s == layout.pp - 1)
               for s in range(layout.pp))


def megatron_memory_floor(lengths: Sequence[int], shape: ModelShape, layout: Layout,
                          hw: Hardware) -> float:
    """A lower bound of stock Megatron's peak memory per GPU, without planning: on every stage
    the micro-batch with the longest sequence holds activations at some point."""
    tokens = math.ceil(max(lengths) / layout.cp)
    per_token = per_token_bytes(shape, layout, hw, layout.pp)
    params = stage_params(shape, layout.pp)
    return max(static_bytes(params[s], layout, hw) + tokens * per_token[s]
               + transient_bytes(tokens, shape, layout, hw, s == layout.pp - 1)
               for s in range(layout.pp))
