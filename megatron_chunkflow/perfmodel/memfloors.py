"""Lower bounds of a candidate's peak memory per GPU without planning it, for the searches
(perfmodel/search.py): a candidate whose floor does not fit is never simulated.

Stock Megatron's (megatron_memory_floor), given the micro-batches in flight (inflight_tokens):
under Megatron's 1F1B, stage s of p holds min(p - s, m) consecutive micro-batches of its rank at
once (core/schedule.py megatron_1f1b_plan), so the held peak is the largest window of that many
(interleaved: the plan's order walked); and every micro-batch is held while its own backward runs
(perfmodel/moments.py running_bytes). ChunkFlow's (chunkflow_memory_floor): the last K chunks of
the longest sequence are held at once (1/CP of them per GPU) beside its K/V buffer, and under CP
its last chunk gathers the sequence's K/V. Both are at most the replay's peak
(perfmodel/predict.py), which tests/perfmodel checks on every candidate of several searches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.costs import layers_per_stage
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.types import DataChunk
from megatron_chunkflow.perfmodel.floors import interleaved_order
from megatron_chunkflow.perfmodel.footprint import (
    Build,
    head_activation_bytes,
    per_token_bytes,
    stage_params,
    static_bytes,
)
from megatron_chunkflow.perfmodel.held import chunk_tokens
from megatron_chunkflow.perfmodel.kvstate import kv_state_bytes_per_token, sequence_state_bytes
from megatron_chunkflow.perfmodel.moments import running_bytes


def inflight_tokens(microbatches: Sequence[DataChunk], num_dp_ranks: int, cp: int,
                    num_stages: int, num_model_chunks: int = 1
                    ) -> list[tuple[tuple[tuple[tuple[int, int], ...], ...], int]]:
    """Per DP rank: (per pipeline rank the moments that matter of what Megatron's 1F1B holds, as
    (tokens on a GPU (after CP) held over all model chunks, of which by the last virtual stage),
    the largest micro-batch's tokens). Without virtual stages the largest window of min(p - s, m)
    consecutive micro-batches. With V, Megatron's interleaved order (core/schedule.py
    megatron_interleaved_plan: forwards in table order, backwards in the same micro-batch order)
    holds after each steady forward a window of w = 2 (p - s - 1) + (V - 1) p + 1 consecutive
    table entries; the moments the two counts peak (held bytes do not depend on timing; exact
    but where the last rank peaks elsewhere)."""
    out, p, v = [], num_stages, num_model_chunks
    for rank in range(num_dp_ranks):
        tokens = [chunk_tokens(c, cp) for c in microbatches if c.dp_rank == rank]
        m, stages = len(tokens), []
        table = interleaved_order(m, p, v)
        size = [tokens[i] for i, _ in table]
        pre = list(accumulate(size, initial=0))
        fy = list(accumulate((n * (k == v - 1) for n, (_, k) in zip(size, table)), initial=0))
        by = list(accumulate((n * (k == 0) for n, (_, k) in zip(size, table)), initial=0))
        for s in range(p):
            if v > 1:
                w = min(2 * (p - s - 1) + (v - 1) * p + 1, len(size))
                at = [(pre[j + w] - pre[j], (fy[j + w] - by[j]) * (s == p - 1))
                      for j in range(len(size) - w + 1)]
                stages.append((max(at), max(at, key=lambda xy: xy[1])))
                continue
            w = min(p - s, m)
            acc = best = sum(tokens[:w])
            for i in range(w, m):
                acc += tokens[i] - tokens[i - w]
                best = max(best, acc)
            stages.append(((best, best if s == p - 1 else 0),))
        out.append((tuple(stages), max(tokens, default=0)))
    return out


def megatron_memory_floor(lengths: Sequence[int], shape: ModelShape, layout: ParallelConfig,
                          dtype_bytes: int, inflight: list | None = None,
                          build: Build = Build()) -> float:
    """A lower bound of stock Megatron's peak memory per GPU, without planning. With `inflight`
    (inflight_tokens of the baseline's micro-batches on this layout) the larger of two moments
    every schedule has: its 1F1B holding the most activations (see there), and the rank's largest
    micro-batch held while its backward runs (or on the last stage its loss's forward,
    moments.running_bytes); without, the longest sequence's micro-batch (padded to 2 x CP) on
    every stage."""
    static, per_token = _stage_bytes(shape, layout, dtype_bytes, build)
    head, last_virtual = head_activation_bytes(shape, layout, dtype_bytes, build), len(per_token) - 1
    body = [per_token[s] - head * (s == last_virtual) for s in range(layout.pp)]  # model chunk 0
    if inflight is None:
        multiple = 2 * layout.cp if layout.cp > 1 else 1
        tokens = math.ceil(-(-max(lengths) // multiple) * multiple / layout.cp)
        last = layout.pp - 1
        inflight = [(tuple(((tokens, tokens if s == last else 0),) for s in range(layout.pp)),
                     tokens)]
    layers = layers_per_stage(shape.num_layers, layout.num_virtual_stages)

    def alone(k: int, tokens: int) -> float:  # virtual stage k, one micro-batch held and running
        last = k == last_virtual
        return tokens * per_token[k] + max(
            running_bytes(kind, tokens, shape, layout, dtype_bytes, layers[k], last, build)
            for kind in (("F", "B") if last else ("B",)))

    return max(static[s] + max(max(x * body[s] + y * head for x, y in moments[s]),
                               alone(s, largest), alone(last_virtual, largest)
                               if s == layout.pp - 1 else 0.0)
               for moments, largest in inflight for s in range(layout.pp))


def chunkflow_memory_floor(lengths: Sequence[int], shape: ModelShape, layout: ParallelConfig,
                           dtype_bytes: int, chunk_size: int, num_kept: int,
                           build: Build = Build()) -> float:
    """A lower bound of ChunkFlow's peak memory per GPU, without planning: while the longest
    sequence's last chunk runs forward on a (virtual) stage, its last K chunks hold activations
    (all are forwarded before the first of them runs backward) beside its K/V buffer and the
    inputs kept for its re-forwards (not yet its gradient accumulators, which its first backward
    allocates: moments.py) and the static memory; under CP 1/CP of the tokens per GPU and the
    transient of the last chunk's CP attention, which gathers all its K/V (at least G x (dtype +
    4 under half precision) per K/V element, kvstate.gather_transient_bytes)."""
    longest, cp = max(lengths), layout.cp
    if longest > chunk_size:
        n = math.ceil(longest / chunk_size)
        held = longest - (n - min(num_kept, n)) * chunk_size
    else:
        held = longest
    static, per_token = _stage_bytes(shape, layout, dtype_bytes, build)
    per_token = [max(per_token[s::layout.pp]) for s in range(layout.pp)]  # a rank's costliest
    state, gathered = sequence_state_bytes(longest, chunk_size, num_kept, shape, layout,
                                           dtype_bytes, layout.pp, accumulators=False), 0.0
    if cp > 1:
        wide = 4 if dtype_bytes < 4 else 0
        gathered = longest * (dtype_bytes + wide) / dtype_bytes * kv_state_bytes_per_token(
            shape, 1, dtype_bytes, layout.tp, with_grad=False)
    return max(static[s] + held / cp * per_token[s] + state[s] + gathered
               for s in range(layout.pp))


@lru_cache(maxsize=4096)
def _stage_bytes(shape: ModelShape, layout: ParallelConfig, dtype_bytes: int,
                 build: Build) -> tuple[list, list]:
    """Per pipeline rank static bytes, per virtual stage activation bytes per token; a search
    asks once per layout."""
    params = stage_params(shape, layout.pp)
    return ([static_bytes(p, layout, dtype_bytes) for p in params],
            per_token_bytes(shape, layout, dtype_bytes, layout.num_virtual_stages, build))
