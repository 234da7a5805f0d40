"""ChunkFlow's K/V state per GPU: a long sequence's K/V buffer, the fp32 gradient accumulators,
the stage inputs kept for its re-forwards (and, under --chunkflow-reforward-attention keep, each
re-forwarded chunk's attention output), and the transient of ChunkFlow's CP attention.

The one formula of the state is long_sequence_state_bytes (docs/exactness.md, "Memory"), on
per-token bytes modelled from the shape here or measured by `chunkflow bench`
(perfmodel/budget.py). A chunk's attention reads its prefix and its own K/V as one view of the
sequence's K/V buffer (runtime/state.py), written in place: the relay copies nothing K/V-sized per
chunk, with or without recompute. Under CP (runtime/cp.py) the state is kept as 1/CP shards on each
rank (whole with --chunkflow-cp-kv replicated); what is whole on every rank is the attention's
transient, one layer at a time (gather_transient_bytes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.costs import layers_per_stage
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.types import DataChunk
from megatron_chunkflow.perfmodel.layer import gather_extent


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
                         cp_kv: str = "sharded", reforward: str = "recompute",
                         accumulators: bool = True) -> list[float]:
    """long_sequence_state_bytes per stage (pipeline rank), on per-token bytes modelled from the
    shape: K/V in `dtype_bytes`, fp32 accumulators, stage inputs of hidden_size / TP elements, each
    1/CP on a rank under CP (but K/V and accumulators whole on every rank with `cp_kv`
    "replicated"). With V virtual stages per rank (layout.vpp) a rank keeps the K/V of all its
    layers and a stage input per model chunk (but virtual stage 0's). Recompute changes none of it.
    `reforward` keep: each re-forwarded chunk's attention output (heads x head dim / TP in the
    compute dtype) and log-sum-exp (fp32 under half precision) per layer and local token.
    Without `accumulators`: the state before the sequence's first backward allocates them."""
    out = []
    tp, cp, v = layout.tp, layout.cp, layout.vpp
    for s, layers in enumerate(layers_per_stage(shape.num_layers, num_stages)):
        whole = 1 if cp_kv == "replicated" else cp
        u = kv_state_bytes_per_token(shape, layers, dtype_bytes, tp, with_grad=False) / whole
        a = (kv_state_bytes_per_token(shape, layers, dtype_bytes, tp) / whole - u
             if accumulators else 0.0)
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
