"""What a chunk (or a stock micro-batch) holds on a pipeline stage from its forward to its backward,
in bytes on one GPU: core/simulate.py's held_bytes hook, on perfmodel/footprint.py's terms.

Per token (footprint.per_token_bytes), plus per key token the attention's kernel read when it
keeps K and V repeated to every query head (key_token_bytes: its own tokens and a dependent
chunk's prefix), plus, for a standalone chunk (a stock micro-batch), per own token the
attention's inputs its kernel keeps as views of the QKV output (own_view_bytes; a dependent
chunk's attention reads the K/V state's buffer instead). The long sequence's state itself is
perfmodel/kvstate.py's, allocated and freed by the ops of perfmodel/moments.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from megatron_chunkflow.config import NO_RECOMPUTE, ParallelConfig
from megatron_chunkflow.core.costs import layers_per_stage
from megatron_chunkflow.core.cp_place import place_segments
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.types import DataChunk
from megatron_chunkflow.perfmodel.footprint import (
    Build,
    kv_repeat_bytes,
    per_token_bytes,
    view_bytes,
)
from megatron_chunkflow.perfmodel.kvstate import chunkflow_state_bytes


def key_token_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                    num_stages: int, build: Build = Build()) -> list[float]:
    """Bytes a held chunk keeps on each stage per key token its attention's kernel read: the
    K/V repeated per query head (kv_repeat_bytes) in every layer that keeps its attention's
    saved tensors (0 where the kernel has grouped-query attention)."""
    return [(n - layout.recompute.layers_recomputed(n))
            * kv_repeat_bytes(shape, layout, dtype_bytes, build,
                              NO_RECOMPUTE if layout.recompute.kind == "block" else None)
            for n in layers_per_stage(shape.num_layers, num_stages)]


def own_view_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                   num_stages: int, build: Build = Build()) -> list[float]:
    """Bytes a held standalone chunk (or stock micro-batch) keeps per token on each stage beyond
    per_token_bytes: its attention inputs as views (view_bytes) in every layer whose kernel saves
    K and V themselves, i.e. not repeated per head (kv_repeat_bytes) and not under core_attn's
    checkpoint (which per_token_bytes counts for every chunk)."""
    rc = layout.recompute
    repeated = build.kv_repeat and shape.num_query_groups != shape.num_attention_heads
    if repeated or (rc.kind == "selective" and "core_attn" in rc.modules):
        return [0.0] * num_stages
    v = view_bytes(shape, layout, dtype_bytes)
    return [(n - rc.layers_recomputed(n)) * v
            for n in layers_per_stage(shape.num_layers, num_stages)]


def key_tokens(chunk: DataChunk, cp: int, chunkflow: bool = True) -> int:
    """The key tokens whose K/V a chunk's kernel keeps repeated (key_token_bytes): its own and,
    for a dependent chunk, its prefix's. Under CP a dependent chunk's attention (and the stock
    baselines', Transformer Engine's) keeps none: runtime/cp.py recomputes or runs from the
    log-sum-exp; ChunkFlow's standalone chunks keep their own, the segments held whole on one
    rank attending there (counted for all its local tokens: a bound)."""
    if cp == 1:
        return chunk.prefix_len + chunk.computed_tokens
    return 0 if chunk.is_dependent or not chunkflow else math.ceil(chunk.computed_tokens / cp)


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
                   hybrid_multiple: int = 0, per_key_token: Sequence[float] | None = None,
                   chunkflow: bool = True, per_own_token: Sequence[float] | None = None
                   ) -> Callable[[int, int], float]:
    """held_bytes(chunk id, stage) for core.simulate.simulate: `per_token[stage]` bytes (modelled
    or measured) for each of the chunk's computed tokens on this GPU (after CP, chunk_tokens),
    `per_key_token[stage]` for each of its key_tokens and, for a standalone chunk,
    `per_own_token[stage]` for each of its tokens (`chunkflow`: ChunkFlow's chunks, not a stock
    baseline's micro-batches)."""
    tokens = {c.id: chunk_tokens(c, cp, hybrid_multiple) for c in chunks}
    keyed = per_key_token is not None and any(per_key_token)
    owned = per_own_token is not None and any(per_own_token)
    if not keyed and not owned:
        return lambda chunk, stage: per_token[stage] * tokens[chunk]
    keys = {c.id: key_tokens(c, cp, chunkflow) if keyed else 0 for c in chunks}
    own = {c.id: 0 if c.is_dependent or not owned else tokens[c.id] for c in chunks}
    per_key = per_key_token if keyed else [0.0] * len(per_token)
    per_own = per_own_token if owned else [0.0] * len(per_token)
    return lambda chunk, stage: (per_token[stage] * tokens[chunk] + per_key[stage] * keys[chunk]
                                 + per_own[stage] * own[chunk])


def held_bytes_fn(chunks: Sequence[DataChunk], shape: ModelShape, layout: ParallelConfig,
                  dtype_bytes: int, num_stages: int, hybrid: bool = False,
                  build: Build = Build(), chunkflow: bool = True) -> Callable[[int, int], float]:
    """chunk_bytes_fn on this model's per_token_bytes and key_token_bytes; `hybrid`: ChunkFlow's
    hybrid CP; `chunkflow`: ChunkFlow's chunks (not a stock baseline's micro-batches)."""
    return chunk_bytes_fn(chunks, per_token_bytes(shape, layout, dtype_bytes, num_stages, build),
                          layout.cp, layout.pad_multiple if hybrid else 0,
                          key_token_bytes(shape, layout, dtype_bytes, num_stages, build),
                          chunkflow, own_view_bytes(shape, layout, dtype_bytes, num_stages, build))


def memory_hooks(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int, chunk_size: int = 0,
                 num_kept: int = 1, cp_kv: str = "sharded",
                 cp_placement: str = "split",
                 reforward: str = "recompute", build: Build = Build(),
                 chunkflow: bool = True) -> tuple[Callable, Callable]:
    """(held_bytes_for, state_bytes_for): this memory model as core/step.py's hooks, for a plan
    of `chunk_size`-token chunks with K = `num_kept` (the state hook is for plan_chunkflow only),
    ChunkFlow's standalone chunks placed `cp_placement` under CP, re-forwarded chunks'
    attention kept by `reforward` (--chunkflow-reforward-attention), on `build`; `chunkflow`
    False: a stock baseline's micro-batches."""
    hybrid = cp_placement == "hybrid"
    return (lambda chunks, p: held_bytes_fn(chunks, shape, layout, dtype_bytes, p, hybrid, build,
                                            chunkflow),
            lambda chunks, p: chunkflow_state_bytes(chunks, shape, layout, dtype_bytes, p,
                                                    chunk_size, num_kept, cp_kv, reforward))
