"""What each op of a plan does to its stage's memory beyond the activations its chunk holds: the
K/V state's allocation and release, and the working memory while the op runs. core/simulate.py
replays them op by op, so a stage's peak is the bytes at its worst moment, not the sum of the
largest of each kind (memtrace/ shows the moments apart: a long sequence's gradient accumulators
are allocated by its first backward, when its kept chunks' losses are done; the largest chunk's
loss need not run while the most chunks are held).

Per op, (state allocated as it starts, state released when it ends, working memory while it
runs):
- F of a sequence's chunk 0 allocates the sequence's K/V buffer (L u); F of a re-forwarded chunk
  keeps its stage input (and, with --chunkflow-reforward-attention keep, its attention output)
  until its R (C (h + o)); the sequence's first B allocates the fp32 accumulators over the last
  chunk's prefix ((n - 1) C a); B of chunk 0 frees buffer and accumulators (runtime/state.py;
  per-token bytes as perfmodel/kvstate.py's sequence_state_bytes, per virtual stage).
- F on the last stage: the loss's forward (the compute-dtype logits beside the kept fp32 softmax,
  or without a graph the logits and their fp32 copy; with the loss in pieces one piece's);
  B: one layer's backward working set, on the last stage the loss's backward if larger, with
  tied embeddings on one stage the output weight's gradient waiting for the embedding's
  (perfmodel/footprint.py transient_bytes' terms); R as its chunk's F. Under CP each F and B adds
  the attention's gathered K/V (kvstate.gather_transient_bytes).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

from megatron_chunkflow.config import NO_RECOMPUTE, ParallelConfig
from megatron_chunkflow.core.costs import layers_per_stage
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.types import DataChunk, Op
from megatron_chunkflow.perfmodel.footprint import (
    Build,
    dropped_bytes,
    layer_activation_bytes,
    layer_input_bytes,
)
from megatron_chunkflow.perfmodel.held import chunk_tokens
from megatron_chunkflow.perfmodel.kvstate import gather_transient_bytes, kv_state_bytes_per_token

OpBytes = Callable[[Op, int], tuple[float, float, float]]


def backward_work_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                        layers: int, build: Build = Build()) -> float:
    """Working memory per token of one layer's backward on a (virtual) stage of `layers` layers:
    the gradient working set (a layer's full activations) plus what recompute re-creates then
    (footprint.transient_bytes' layer part)."""
    full = layer_activation_bytes(shape, layout, dtype_bytes, NO_RECOMPUTE, build)
    r = layout.recompute.layers_recomputed(layers)
    if r and r == layers:
        return 2 * full - layer_input_bytes(shape, layout, dtype_bytes)
    return full + (0.0 if r else dropped_bytes(shape, layout, dtype_bytes, build=build))


def loss_bytes(tokens: int, shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
               build: Build, kind: str, holds: bool = True) -> float:
    """The loss's working memory beside what the head keeps, for a `kind` "F" (forward; `holds`:
    with a graph, the fp32 softmax then being kept) or "B" (backward) of `tokens` tokens: the
    whole loss's compute-dtype logits (and their fp32 copy without a graph), or its gradient's
    cast beside the fp32 softmax turned gradient in place (the output weight's gradient comes
    once that is freed); the pieced loss's piece (and in the backward the output weight's
    gradient and the hidden states' fp32 gradient)."""
    v, h = math.ceil(shape.vocab_size / layout.tp), shape.hidden_size
    acc = max(4, dtype_bytes)
    if build.loss_piece:
        piece = (dtype_bytes + acc) * min(build.loss_piece, tokens) * v
        return piece if kind == "F" else piece + dtype_bytes * v * h + acc * tokens * h
    if kind == "F":
        return tokens * v * (dtype_bytes + (0 if holds or dtype_bytes >= 4 else 4))
    return tokens * v * dtype_bytes


def running_bytes(kind: str, tokens: int, shape: ModelShape, layout: ParallelConfig,
                  dtype_bytes: int, layers: int, last: bool, build: Build = Build(),
                  holds: bool = True, work: float | None = None) -> float:
    """Working memory while an op of `kind` ("F", "R", "B") runs on a chunk of `tokens` tokens
    on a (virtual) stage of `layers` layers, the `last` one (module docstring); `holds`: an F
    with a graph; `work`: backward_work_bytes, when the caller has it."""
    if kind != "B":
        return loss_bytes(tokens, shape, layout, dtype_bytes, build, "F", holds) if last else 0.0
    if work is None:
        work = backward_work_bytes(shape, layout, dtype_bytes, layers, build)
    if not last:
        return tokens * work
    v = math.ceil(shape.vocab_size / layout.tp)
    # past the loss, its fp32 softmax is freed; the tied output weight's gradient waits for the
    # embedding's through the layers' backward on a one-stage model
    softmax = 0.0 if build.loss_piece else 4 * v * tokens
    tied = dtype_bytes * v * shape.hidden_size if shape.tie_embeddings and layout.pp == 1 else 0.0
    return max(loss_bytes(tokens, shape, layout, dtype_bytes, build, "B"),
               tokens * work + tied - softmax)


def op_bytes_fn(chunks: Sequence[DataChunk], shape: ModelShape, layout: ParallelConfig,
                dtype_bytes: int, num_virtual: int, build: Build = Build(), *,
                num_kept: int = 1, cp_kv: str = "sharded", reforward: str = "recompute",
                hybrid: bool = False, chunkflow: bool = True) -> OpBytes:
    """op_bytes(op, virtual stage) -> (state allocated at its start, state released at its end,
    working memory while it runs) for core/simulate.py, for one DP rank's `chunks` on
    `num_virtual` virtual stages (module docstring); `hybrid`: ChunkFlow's hybrid CP placement;
    `chunkflow` False: a stock baseline's micro-batches (no state, Megatron's own CP
    attention)."""
    cp, last = layout.cp, num_virtual - 1
    layers = layers_per_stage(shape.num_layers, num_virtual)
    tokens = {c.id: chunk_tokens(c, cp, layout.pad_multiple if hybrid else 0) for c in chunks}
    work = [backward_work_bytes(shape, layout, dtype_bytes, n, build) for n in layers]
    gathered = {c.id: gather_transient_bytes([c], shape, layout, dtype_bytes) if chunkflow else 0.0
                for c in chunks}
    events: dict[tuple[str, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    sequences: dict[int, list[DataChunk]] = defaultdict(list)
    for c in chunks:
        if c.is_dependent:
            sequences[c.parent].append(c)
    whole = 1 if cp_kv == "replicated" else cp
    heads = shape.num_attention_heads // layout.tp
    unkept: set[int] = set()  # chunks forwarded without a graph, re-forwarded later
    for members in sequences.values():
        members.sort(key=lambda c: c.index)
        unkept.update(c.id for c in members[:max(0, len(members) - num_kept)])
        n, length = len(members), sum(tokens[c.id] for c in members) * cp // whole
        prefix = length - tokens[members[-1].id] * cp // whole
        first, final = members[0].id, members[-1].id
        for k, num_layers in enumerate(layers):
            u = kv_state_bytes_per_token(shape, num_layers, dtype_bytes, layout.tp, False)
            a = kv_state_bytes_per_token(shape, num_layers, dtype_bytes, layout.tp) - u
            h = dtype_bytes * shape.hidden_size / layout.tp if k > 0 else 0.0
            o = (num_layers * heads * (shape.head_dim * dtype_bytes + max(4, dtype_bytes))
                 if reforward == "keep" else 0.0)
            events[("F", first, k)][0] += length * u
            events[("B", final, k)][0] += prefix * a
            events[("B", first, k)][1] -= length * u + prefix * a
            for c in members[:max(0, n - num_kept)]:
                kept = tokens[c.id] * (h + o)
                events[("F", c.id, k)][1] += kept
                events[("R", c.id, k)][0] -= kept

    def op_bytes(op: Op, k: int) -> tuple[float, float, float]:
        start, end = events.get((op.kind, op.chunk, k), (0.0, 0.0))
        holds = op.kind == "R" or op.chunk not in unkept  # an R computes the loss again
        running = running_bytes(op.kind, tokens[op.chunk], shape, layout, dtype_bytes, layers[k],
                                k == last, build, holds, work[k])
        return start, end, running + gathered[op.chunk]

    return op_bytes

