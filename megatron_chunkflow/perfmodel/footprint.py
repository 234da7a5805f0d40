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

ChunkFlow adds, per stage, the state of the one long sequence in flight (long_sequence_state_bytes,
the one formula for it, on per-token bytes: modelled here from shape, layout and dtype, measured
by `chunkflow bench` in perfmodel/budget.py) and, after the first stage, the stage inputs saved
for its re-forwards.

Every function takes the bytes per element of weights and activations (`dtype_bytes`: 2 for
bf16, 4 for fp32; a device's Hardware.dtype_bytes); nothing else about the device matters here.
The planner (core/step.py) models time only; memory_hooks hands it this model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from megatron_chunkflow.core.costs import layers_per_stage, linear_weights_per_layer
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.types import DataChunk
from megatron_chunkflow.perfmodel.layout import Layout


def layer_params(shape: ModelShape) -> int:
    """Parameters of one transformer layer: matmul weights, QKV bias, two RMSNorm weights."""
    h, kv = shape.hidden_size, shape.kv_dim
    attn = shape.num_attention_heads * shape.head_dim
    bias = (attn + 2 * kv) if shape.qkv_bias else 0
    return linear_weights_per_layer(shape) + bias + 2 * h


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


def static_bytes(params: float, layout: Layout, dtype_bytes: int) -> float:
    """Weights, fp32 gradient buffer and optimizer states of `params` (before TP), the states
    sharded over DP x CP (CP ranks hold the same weights; Megatron reduces and shards over both)."""
    local = params / layout.tp
    states = 12 if dtype_bytes == 2 else 8  # (fp32 master +) Adam m and v
    return local * (dtype_bytes + 4 + states / (layout.dp * layout.cp))


def layer_activation_bytes(shape: ModelShape, layout: Layout, dtype_bytes: int,
                           recompute: str | None = None) -> float:
    """Bytes saved for backward per token (on this GPU, after CP) per transformer layer."""
    recompute = recompute or layout.recompute
    t, h = layout.tp, shape.hidden_size
    if recompute == "full":
        return dtype_bytes * h / t
    elems = 6 * h + 2 * shape.kv_dim + 3 * shape.ffn_hidden_size
    lse = 4 * shape.num_attention_heads if recompute == "none" else 0
    return (elems * dtype_bytes + lse) / t


def head_activation_bytes(shape: ModelShape, layout: Layout, dtype_bytes: int) -> float:
    """Bytes per token the output layer saves on the last stage: its input and the final norm's,
    and the fp32 softmax of the vocabulary-parallel cross entropy."""
    return (2 * shape.hidden_size * dtype_bytes / layout.tp
            + 4 * math.ceil(shape.vocab_size / layout.tp))


def per_token_bytes(shape: ModelShape, layout: Layout, dtype_bytes: int,
                    num_stages: int) -> list[float]:
    """Activation bytes a micro-batch holds per token (after CP) on each stage."""
    layer = layer_activation_bytes(shape, layout, dtype_bytes)
    out = [n * layer for n in layers_per_stage(shape.num_layers, num_stages)]
    out[-1] += head_activation_bytes(shape, layout, dtype_bytes)
    return out


def chunk_bytes_fn(chunks: Sequence[DataChunk], per_token: Sequence[float],
                   cp: int = 1) -> Callable[[int, int], float]:
    """held_bytes(chunk id, stage) for core.simulate.simulate: `per_token[stage]` bytes (modelled
    or measured) for each of the chunk's tokens on this GPU (after CP)."""
    tokens = {c.id: math.ceil(c.num_tokens / cp) for c in chunks}
    return lambda chunk, stage: per_token[stage] * tokens[chunk]


def held_bytes_fn(chunks: Sequence[DataChunk], shape: ModelShape, layout: Layout,
                  dtype_bytes: int, num_stages: int) -> Callable[[int, int], float]:
    """chunk_bytes_fn on this model's per_token_bytes."""
    return chunk_bytes_fn(chunks, per_token_bytes(shape, layout, dtype_bytes, num_stages),
                          layout.cp)


def transient_bytes(max_tokens: int, shape: ModelShape, layout: Layout, dtype_bytes: int,
                    last_stage: bool) -> float:
    """Working memory of the backward of one layer (or the logits) for the largest micro-batch
    on this GPU (`max_tokens` after CP)."""
    layer = layer_activation_bytes(shape, layout, dtype_bytes, recompute="none")
    logits = 2 * math.ceil(shape.vocab_size / layout.tp) if last_stage else 0.0
    return max_tokens * max(layer, logits)


def kv_state_bytes_per_token(shape: ModelShape, num_layers: int, dtype_bytes: int = 2,
                             tp: int = 1, with_grad: bool = True) -> float:
    """Bytes per token of a long sequence's K/V state over `num_layers` layers on one TP rank:
    the stored K and V, plus (with_grad) their gradient accumulators in fp32."""
    kv_heads_per_rank = max(1, shape.num_query_groups // tp)
    kv = kv_heads_per_rank * shape.head_dim
    per_layer = 2 * kv * dtype_bytes + (2 * kv * 4 if with_grad else 0)
    return num_layers * per_layer


def long_sequence_state_bytes(longest: int, chunk_size: int, k: int, kv: float, acc: float,
                              hidden: float) -> float:
    """An upper bound of the state one stage keeps for a long sequence of `longest` tokens cut
    into C = `chunk_size` token chunks, K = `k` of them holding activations, as the plugin keeps
    it (docs/exactness.md, "Memory"). Per-token bytes of the stage: `kv` (u) its stored K/V,
    `acc` (a) their gradient accumulators, `hidden` (h) the stage input kept for each
    re-forwarded chunk (0 on the first stage, which re-reads its input). With n = ceil(L / C):

        L (u + a)  +  u * sum over the last K chunks j of min((j+1) C, L)  +  (n - K) C h

    the stored K/V and accumulators, the cat(prefix, own) K/V copy the attention of each chunk
    holding activations saves, the inputs of the n - K re-forwarded (full) chunks. For K = 1 the
    K/V part is 2 L u + L a, above the exact peak docs/exactness.md derives,
    max(((n-1) C + L) u, ((n-2) C + (n-1) C) u + (n-1) C a) (its second prefix-copy term is 0
    when n = 2). Zero for a sequence that is not cut."""
    if longest <= chunk_size:
        return 0.0
    n = math.ceil(longest / chunk_size)
    first_kept = max(0, n - k)
    copies = sum(min((j + 1) * chunk_size, longest) for j in range(first_kept, n))
    return longest * (kv + acc) + copies * kv + first_kept * chunk_size * hidden


def sequence_state_bytes(longest: int, chunk_size: int, k: int, shape: ModelShape,
                         layout: Layout, dtype_bytes: int, num_stages: int) -> list[float]:
    """long_sequence_state_bytes per stage, on per-token bytes modelled from the shape: K/V in
    `dtype_bytes`, fp32 accumulators, stage inputs of hidden_size / TP elements."""
    out = []
    for s, layers in enumerate(layers_per_stage(shape.num_layers, num_stages)):
        u = kv_state_bytes_per_token(shape, layers, dtype_bytes, layout.tp, with_grad=False)
        a = kv_state_bytes_per_token(shape, layers, dtype_bytes, layout.tp) - u
        h = dtype_bytes * shape.hidden_size / layout.tp if s > 0 else 0.0
        out.append(long_sequence_state_bytes(longest, chunk_size, k, u, a, h))
    return out


def longest_cut_sequence(chunks: Sequence[DataChunk]) -> int:
    """Tokens of the longest sequence cut into dependent chunks among `chunks` (0 if none)."""
    return max((c.segments[0].end for c in chunks if c.is_dependent), default=0)


def chunkflow_state_bytes(chunks: Sequence[DataChunk], shape: ModelShape, layout: Layout,
                          dtype_bytes: int, num_stages: int, chunk_size: int,
                          k: int) -> list[float]:
    """sequence_state_bytes of the longest long sequence on this DP rank (one sequence's state
    lives at a time)."""
    return sequence_state_bytes(longest_cut_sequence(chunks), chunk_size, k, shape, layout,
                                dtype_bytes, num_stages)


def memory_hooks(shape: ModelShape, layout: Layout, dtype_bytes: int, chunk_size: int = 0,
                 k: int = 1) -> tuple[Callable, Callable]:
    """(held_bytes_for, state_bytes_for): this memory model as core/step.py's hooks, for a plan
    of `chunk_size`-token chunks with K = `k` (the state hook is for plan_chunkflow only)."""
    return (lambda chunks, p: held_bytes_fn(chunks, shape, layout, dtype_bytes, p),
            lambda chunks, p: chunkflow_state_bytes(chunks, shape, layout, dtype_bytes, p,
                                                    chunk_size, k))


def chunkflow_memory_floor(lengths: Sequence[int], shape: ModelShape, layout: Layout,
                           dtype_bytes: int, chunk_size: int, k: int) -> float:
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
    per_token = per_token_bytes(shape, layout, dtype_bytes, layout.pp)
    params = stage_params(shape, layout.pp)
    state = sequence_state_bytes(longest, chunk_size, k, shape, layout, dtype_bytes, layout.pp)
    return max(static_bytes(params[s], layout, dtype_bytes) + held * per_token[s] + state[s]
               + transient_bytes(min(chunk_size, longest), shape, layout, dtype_bytes,
                                 s == layout.pp - 1)
               for s in range(layout.pp))


def megatron_memory_floor(lengths: Sequence[int], shape: ModelShape, layout: Layout,
                          dtype_bytes: int) -> float:
    """A lower bound of stock Megatron's peak memory per GPU, without planning: on every stage
    the micro-batch with the longest sequence holds activations at some point."""
    tokens = math.ceil(max(lengths) / layout.cp)
    per_token = per_token_bytes(shape, layout, dtype_bytes, layout.pp)
    params = stage_params(shape, layout.pp)
    return max(static_bytes(params[s], layout, dtype_bytes) + tokens * per_token[s]
               + transient_bytes(tokens, shape, layout, dtype_bytes, s == layout.pp - 1)
               for s in range(layout.pp))
