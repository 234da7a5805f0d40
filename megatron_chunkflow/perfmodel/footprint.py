"""Device memory per GPU: weights, gradients and optimizer states, activations, K/V state.

Static (Megatron's distributed optimizer, Megatron-LM README "Distributed Optimizer"): bf16
params and fp32 gradients take 6 + 12/d bytes per parameter (fp32 master, Adam m and v sharded
over the d = DP x CP ranks that hold the same weights); fp32 params (CPU runs) 8 + 8/d.
Parameters are split over TP and PP.

Activations saved for backward per token per layer, after Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models"), adapted to Qwen2.5 (GQA with K/V width
kv, SwiGLU with width f, RMSNorm, no dropout) and a fused flash-style kernel that never stores
the scores. Term by term (ACTIVATION_TERMS, elements per token unless said), what megatron-core
0.16.1's layer (transformer_layer.py, attention.py, mlp.py) keeps without recompute:
  norm_inputs  2h   both RMSNorms' inputs (the residual stream)
  qkv_input    h    the input norm's output, saved by the QKV linear
  q, kv        a, 2kv  post-RoPE Q, K, V saved by the attention kernel (a = heads x head dim)
  lse          4 bytes per head: the kernel's fp32 log-sum-exp
  proj_input   a    the attention output, saved by the projection
  fc1_input    h    the pre-MLP norm's output, saved by fc1
  fc1_output   2f   saved by SwiGLU
  act_output   f    SwiGLU's output, saved by fc2
6h + 2kv + 3f elements (a = h in Qwen2.5) plus the log-sum-exp; with kv = h, a 4h GeLU MLP and
the two 1-byte dropout masks this is Korthikanti's 34h bytes. Sequence parallelism divides all of
it by TP (the linears save their SP-split input and all-gather it again in the backward).
What each recompute option drops (RECOMPUTE_DROPS), from megatron-core's code:
- core_attn (attention.py _checkpointed_attention_forward: tensor_parallel.checkpoint of the core
  attention on Q, K, V): Q, K, V stay as the checkpoint's inputs and the output is the
  projection's input anyway, so only the log-sum-exp goes;
- mlp (transformer_layer.py _forward_mlp: tensor_parallel.checkpoint of the whole MLP on the
  pre-MLP norm's output): fc1's output and SwiGLU's output go, fc1's input stays as the
  checkpoint's input;
- layernorm (CheckpointWithoutOutput on both norms, discard_output_and_register_recompute): the
  norms' outputs go (qkv_input and fc1_input), their inputs stay as the checkpoint's inputs;
- full (transformer_block.py _checkpointed_forward, CheckpointFunction per layer): the layer
  input only, h elements (Korthikanti's 2sbh per layer), recomputed whole in the backward;
  block:N does that for the first N layers of each stage and keeps everything in the others.
The output layer keeps its input and the final norm's (2h / TP) and the fp32 softmax of the
vocabulary-parallel cross entropy (4 V / TP bytes per token) on the last stage.

Transient (transient_bytes): while a layer runs backward its activation gradients are live
beside the saved activations; we count one layer's full activations of the largest micro-batch
for them (the gradient working set), and, on top, what recompute brings back at that moment:
selective modules re-create the dropped tensors of the layer being back-propagated (the first
layer to run backward, while every other layer still holds its own); a fully recomputed layer
re-creates all but its input, but only when every layer of the stage is recomputed (full, or
block with N = the stage's layers): with block N < layers the first recomputed layer runs when
the stage's kept layers have already freed more than it re-creates. On the last stage the bf16
logits count instead if larger.

ChunkFlow adds, per stage, the state of the one long sequence in flight (long_sequence_state_bytes,
the one formula for it, on per-token bytes: modelled here from shape, layout and dtype, measured
by `chunkflow bench` in perfmodel/budget.py) and, after the first stage, the stage inputs saved
for its re-forwards. A chunk's attention reads its prefix and its own K/V as one view of the
sequence's K/V buffer (runtime/state.py), written in place: the relay copies nothing K/V-sized
per chunk, with or without recompute (under CP the attention's own transient copies are below).

ChunkFlow under CP (runtime/cp.py) keeps all of that as 1/CP shards on each rank: activations of
T/CP tokens (the chunks come padded, predict.cp_padded_lengths), the K/V buffer, fp32 accumulators
and the re-forward inputs, so the per-token bytes of the state are divided by CP. What is whole on
every rank is its attention's transient, one layer at a time (gather_transient_bytes): the gathered
K/V of [prefix ++ chunk] (G tokens) and the selection its pieces read (S >= G tokens) in the
forward; in the backward the selection made again and its gradient (2 S), then the gradient
scattered back into the gathered shape with its fp32 copy for the reduce-scatter (G x (1 + 4 /
dtype_bytes) under half precision); the larger counts. Its attention also saves the kernel's output
(the projection's input: counted once, as proj_input) and log-sum-exp (the lse term), for a backward
that runs from them (runtime/cp.py), as without CP: the activation terms are unchanged.

Every function takes the bytes per element of weights and activations (`dtype_bytes`: 2 for
bf16, 4 for fp32; a device's Hardware.dtype_bytes); nothing else about the device matters here.
Token counts are computed tokens (a baseline's padding included, core/types.py). The planner
(core/step.py) models time only; memory_hooks hands it this model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from megatron_chunkflow.config import NO_RECOMPUTE, ParallelConfig, Recompute
from megatron_chunkflow.core.costs import layers_per_stage, linear_weights_per_layer
from megatron_chunkflow.core.cp_place import place_segments
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.types import DataChunk
from megatron_chunkflow.perfmodel.layer import gather_extent


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


ACTIVATION_TERMS = ("norm_inputs", "qkv_input", "q", "kv", "lse", "proj_input", "fc1_input",
                    "fc1_output", "act_output")
RECOMPUTE_DROPS = {"core_attn": ("lse",), "mlp": ("fc1_output", "act_output"),
                   "layernorm": ("qkv_input", "fc1_input")}


def activation_terms(shape: ModelShape, layout: ParallelConfig,
                     dtype_bytes: int) -> dict[str, float]:
    """Bytes per token (on this GPU, after CP) of each tensor one layer saves for backward
    without recompute (the module docstring's table), split over TP by sequence parallelism."""
    h, kv, f, t = shape.hidden_size, shape.kv_dim, shape.ffn_hidden_size, layout.tp
    a = shape.num_attention_heads * shape.head_dim
    elems = {"norm_inputs": 2 * h, "qkv_input": h, "q": a, "kv": 2 * kv, "proj_input": a,
             "fc1_input": h, "fc1_output": 2 * f, "act_output": f}
    out = {k: v * dtype_bytes / t for k, v in elems.items()}
    out["lse"] = 4.0 * shape.num_attention_heads / t
    return {k: out[k] for k in ACTIVATION_TERMS}


def dropped_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                  recompute: Recompute | str | None = None) -> float:
    """Bytes per token per layer a selective option does not keep (0 for the others)."""
    rc = recompute_of(layout, recompute)
    if rc.kind != "selective":
        return 0.0
    terms = activation_terms(shape, layout, dtype_bytes)
    return sum(terms[n] for n in {t for m in rc.modules for t in RECOMPUTE_DROPS[m]})


def layer_input_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int) -> float:
    """What a fully recomputed layer keeps per token: its SP-split input."""
    return dtype_bytes * shape.hidden_size / layout.tp


def layer_activation_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                           recompute: Recompute | str | None = None) -> float:
    """Bytes saved for backward per token (on this GPU, after CP) by one layer under `recompute`
    (default: the layout's): everything less the selective modules' drops, or for a fully
    recomputed layer (full; block's first N layers) its input. For block, the bytes of one of
    its recomputed layers (stage_activation_bytes has the stage's mix)."""
    rc = recompute_of(layout, recompute)
    if rc.kind in ("full", "block"):
        return layer_input_bytes(shape, layout, dtype_bytes)
    return (sum(activation_terms(shape, layout, dtype_bytes).values())
            - dropped_bytes(shape, layout, dtype_bytes, rc))


def stage_activation_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                           layers: int) -> float:
    """Bytes per token a micro-batch keeps on a stage of `layers` layers under the layout's
    recompute: its recomputed layers keep their input, the others their (selective) bytes."""
    r = layout.recompute.layers_recomputed(layers)
    kept = layer_activation_bytes(shape, layout, dtype_bytes,
                                  NO_RECOMPUTE if r else layout.recompute)
    return r * layer_input_bytes(shape, layout, dtype_bytes) + (layers - r) * kept


def head_activation_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int) -> float:
    """Bytes per token the output layer saves on the last stage: its input and the final norm's,
    and the fp32 softmax of the vocabulary-parallel cross entropy."""
    return (2 * shape.hidden_size * dtype_bytes / layout.tp
            + 4 * math.ceil(shape.vocab_size / layout.tp))


def per_token_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                    num_stages: int) -> list[float]:
    """Activation bytes a micro-batch holds per token (after CP) on each stage."""
    out = [stage_activation_bytes(shape, layout, dtype_bytes, n)
           for n in layers_per_stage(shape.num_layers, num_stages)]
    out[-1] += head_activation_bytes(shape, layout, dtype_bytes)
    return out


def chunk_tokens(chunk: DataChunk, cp: int = 1, hybrid_multiple: int = 0) -> int:
    """Tokens a micro-batch computes on one of its CP ranks (padding included); with
    `hybrid_multiple` (ChunkFlow's hybrid CP: TP under sequence parallelism, else 1) a standalone
    chunk's tokens as core/cp_place.py places its segments (each rank padded to the busiest)."""
    if hybrid_multiple and cp > 1 and not chunk.is_dependent:
        placed = place_segments([s.computed_tokens for s in chunk.segments], cp, hybrid_multiple)
        if placed is not None:
            return placed.local_tokens
    return math.ceil(chunk.computed_tokens / cp)


def chunk_bytes_fn(chunks: Sequence[DataChunk], per_token: Sequence[float], cp: int = 1,
                   hybrid_multiple: int = 0) -> Callable[[int, int], float]:
    """held_bytes(chunk id, stage) for core.simulate.simulate: `per_token[stage]` bytes (modelled
    or measured) for each of the chunk's computed tokens on this GPU (after CP, chunk_tokens)."""
    tokens = {c.id: chunk_tokens(c, cp, hybrid_multiple) for c in chunks}
    return lambda chunk, stage: per_token[stage] * tokens[chunk]


def held_bytes_fn(chunks: Sequence[DataChunk], shape: ModelShape, layout: ParallelConfig,
                  dtype_bytes: int, num_stages: int,
                  hybrid: bool = False) -> Callable[[int, int], float]:
    """chunk_bytes_fn on this model's per_token_bytes; `hybrid`: ChunkFlow's hybrid CP."""
    return chunk_bytes_fn(chunks, per_token_bytes(shape, layout, dtype_bytes, num_stages),
                          layout.cp, layout.pad_multiple if hybrid else 0)


def transient_bytes(max_tokens: int, shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                    last_stage: bool, layers: int | None = None) -> float:
    """Working memory of the backward of one layer (or the logits) for the largest micro-batch
    on this GPU (`max_tokens` after CP), on a stage of `layers` layers (default: an even split;
    with virtual stages a model chunk's, which is what recompute applies to): the gradient
    working set plus what recompute re-creates then (module docstring)."""
    layers = shape.num_layers // layout.num_virtual_stages if layers is None else layers
    full = layer_activation_bytes(shape, layout, dtype_bytes, NO_RECOMPUTE)
    r = layout.recompute.layers_recomputed(layers)
    if r and r == layers:
        extra = full - layer_input_bytes(shape, layout, dtype_bytes)
    else:
        extra = 0.0 if r else dropped_bytes(shape, layout, dtype_bytes)
    logits = 2 * math.ceil(shape.vocab_size / layout.tp) if last_stage else 0.0
    return max_tokens * max(full + extra, logits)


def kv_state_bytes_per_token(shape: ModelShape, num_layers: int, dtype_bytes: int = 2,
                             tp: int = 1, with_grad: bool = True) -> float:
    """Bytes per token of a long sequence's K/V state over `num_layers` layers on one TP rank:
    the stored K and V, plus (with_grad) their gradient accumulators in fp32."""
    kv_heads_per_rank = max(1, shape.num_query_groups // tp)
    kv = kv_heads_per_rank * shape.head_dim
    per_layer = 2 * kv * dtype_bytes + (2 * kv * 4 if with_grad else 0)
    return num_layers * per_layer


def long_sequence_state_bytes(longest: int, chunk_size: int, num_kept: int, kv: float, acc: float,
                              hidden: float, attention: float = 0.0) -> float:
    """The state one stage keeps for a long sequence of `longest` tokens cut into C = `chunk_size`
    token chunks, K = `num_kept` of them holding activations, at its peak, as the plugin keeps it
    (runtime/state.py; docs/exactness.md, "Memory"). Per-token bytes of the stage: `kv` (u) its
    K/V, `acc` (a) their gradient accumulators, `hidden` (h) the stage input kept for each
    re-forwarded chunk (0 on the first stage, which re-reads its input), `attention` (o) each
    re-forwarded chunk's attention output and log-sum-exp kept for its re-forward
    (--chunkflow-reforward-attention keep; 0 otherwise). With n = ceil(L / C):

        L u  +  (n - 1) C a  +  (n - K) C (h + o)

    the sequence's K/V buffer (allocated by chunk 0's forward), the accumulator over
    the last chunk's prefix (allocated by the first backward; both held until chunk 0's backward),
    the inputs of the n - K re-forwarded (full) chunks; K does not change the K/V terms (a held
    chunk's attention saves a view of the buffer, not a copy). Zero for a sequence not cut."""
    if longest <= chunk_size:
        return 0.0
    n = math.ceil(longest / chunk_size)
    first_kept = max(0, n - num_kept)
    return (longest * kv + (n - 1) * chunk_size * acc
            + first_kept * chunk_size * (hidden + attention))


def sequence_state_bytes(longest: int, chunk_size: int, num_kept: int, shape: ModelShape,
                         layout: ParallelConfig, dtype_bytes: int, num_stages: int,
                         cp_kv: str = "sharded", reforward: str = "recompute") -> list[float]:
    """long_sequence_state_bytes per stage (pipeline rank), on per-token bytes modelled from the
    shape: K/V in `dtype_bytes`, fp32 accumulators, stage inputs of hidden_size / TP elements, each
    1/CP on a rank under CP (but K/V and accumulators whole on every rank with `cp_kv`
    "replicated"). With V virtual stages per rank (layout.vpp) a rank keeps the K/V of all its
    layers and a stage input per model chunk (but virtual stage 0's). Recompute changes none of it.
    `reforward` keep: each re-forwarded chunk's attention output (heads x head dim / TP in the
    compute dtype) and log-sum-exp (fp32 under half precision) per layer and local token."""
    out = []
    tp, cp, v = layout.tp, layout.cp, layout.vpp
    for s, layers in enumerate(layers_per_stage(shape.num_layers, num_stages)):
        whole = 1 if cp_kv == "replicated" else cp
        u = kv_state_bytes_per_token(shape, layers, dtype_bytes, tp, with_grad=False) / whole
        a = kv_state_bytes_per_token(shape, layers, dtype_bytes, tp) / whole - u
        h = dtype_bytes * shape.hidden_size / tp / cp * (v if s > 0 else v - 1)
        heads = shape.num_attention_heads // tp
        o = (layers * heads * (shape.head_dim * dtype_bytes + (4 if dtype_bytes < 4 else
                                                               dtype_bytes)) / cp
             if reforward == "keep" else 0.0)
        out.append(long_sequence_state_bytes(longest, chunk_size, num_kept, u, a, h, o))
    return out


def gather_transient_bytes(chunks: Sequence[DataChunk], shape: ModelShape, layout: ParallelConfig,
                           dtype_bytes: int) -> float:
    """ChunkFlow under CP: the largest transient of one layer's attention among `chunks` on one
    GPU (module docstring): max(2 S x dtype, G x (dtype + 4 under half precision)) bytes per
    K/V element; 0 without CP. Every segment counted as split: under the hybrid placement a
    standalone chunk gathers less (a bound; a long sequence's chunks, split, set the peak)."""
    if layout.cp == 1 or not chunks:
        return 0.0
    kv = kv_state_bytes_per_token(shape, 1, dtype_bytes, layout.tp, with_grad=False)
    wide = 4 if dtype_bytes < 4 else 0  # the reduce-scatter's fp32 copy
    return max(max(2 * selected, gathered * (dtype_bytes + wide) / dtype_bytes) * kv
               for gathered, selected in (gather_extent(c.prefix_len, c.computed_tokens, layout.cp)
                                          for c in chunks))


def longest_cut_sequence(chunks: Sequence[DataChunk]) -> int:
    """Tokens of the longest sequence cut into dependent chunks among `chunks` (0 if none)."""
    return max((c.segments[0].end for c in chunks if c.is_dependent), default=0)


def chunkflow_state_bytes(chunks: Sequence[DataChunk], shape: ModelShape, layout: ParallelConfig,
                          dtype_bytes: int, num_stages: int, chunk_size: int,
                          num_kept: int, cp_kv: str = "sharded",
                          reforward: str = "recompute") -> list[float]:
    """sequence_state_bytes of the longest long sequence on this DP rank (one sequence's state
    lives at a time)."""
    return sequence_state_bytes(longest_cut_sequence(chunks), chunk_size, num_kept, shape, layout,
                                dtype_bytes, num_stages, cp_kv, reforward)


def memory_hooks(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int, chunk_size: int = 0,
                 num_kept: int = 1, cp_kv: str = "sharded",
                 cp_placement: str = "split",
                 reforward: str = "recompute") -> tuple[Callable, Callable]:
    """(held_bytes_for, state_bytes_for): this memory model as core/step.py's hooks, for a plan
    of `chunk_size`-token chunks with K = `num_kept` (the state hook is for plan_chunkflow only),
    ChunkFlow's standalone chunks placed `cp_placement` under CP, re-forwarded chunks'
    attention kept by `reforward` (--chunkflow-reforward-attention)."""
    hybrid = cp_placement == "hybrid"
    return (lambda chunks, p: held_bytes_fn(chunks, shape, layout, dtype_bytes, p, hybrid),
            lambda chunks, p: chunkflow_state_bytes(chunks, shape, layout, dtype_bytes, p,
                                                    chunk_size, num_kept, cp_kv, reforward))
