"""Searches: the fastest prediction that fits in memory, over parallel layouts and, for
ChunkFlow, (chunk size, K).

Candidates: every (TP, CP, PP) Megatron accepts (TP inside a node, dividing the attention heads
and K/V groups; CP 1 for ChunkFlow) with recompute none or full, and for --auto every chunk size
2K..seq_length (powers of two) with K = 1, 2, 4, 8 while K is below the longest sequence's
number of chunks. Selective recompute is not a candidate: with a fused attention kernel it saves
only the log-sum-exp (perfmodel/footprint.py) and costs an attention forward.

The search is exhaustive but prunes exactly, with two lower bounds computed without planning:
a memory floor (perfmodel/footprint.py: *_memory_floor) drops candidates that cannot fit, and a time
floor (perfmodel/predict.py: time_floor) orders the rest; candidates are simulated in that order
until the next floor is no faster than the fastest fitting prediction so far. If nothing fits,
the result is the candidate needing the least memory, reported as not fitting.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.step import baseline_microbatches
from megatron_chunkflow.perfmodel.footprint import chunkflow_memory_floor, megatron_memory_floor
from megatron_chunkflow.perfmodel.hardware import Hardware
from megatron_chunkflow.perfmodel.layout import Layout, make_layout
from megatron_chunkflow.perfmodel.predict import (
    Prediction,
    chunk_work_items,
    predict_chunkflow,
    predict_megatron,
    roofline,
    time_floor,
)

CHUNK_SIZES = (2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
KS = (1, 2, 4, 8)


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidate_layouts(shape: ModelShape, hw: Hardware, num_gpus: int, allow_cp: bool,
                      max_pp: int = 16, max_cp: int = 32) -> list[Layout]:
    heads = math.gcd(shape.num_attention_heads, shape.num_query_groups)
    out = []
    for tp in _divisors(math.gcd(heads, num_gpus), hw.gpus_per_node):
        for cp in (_divisors(num_gpus // tp, max_cp) if allow_cp else [1]):
            for pp in _divisors(num_gpus // (tp * cp), min(max_pp, shape.num_layers)):
                for recompute in ("none", "full"):
                    out.append(make_layout(tp, cp, pp, recompute, num_gpus, shape))
    return out


def chunking_candidates(lengths: Sequence[int], seq_length: int, tp: int) -> list[tuple[int, int]]:
    """(chunk size, K) pairs worth simulating: C up to seq_length and a multiple of TP (sequence
    parallelism), K only while it changes something."""
    longest = max(lengths)
    out = []
    for c in CHUNK_SIZES:
        if c > max(seq_length, CHUNK_SIZES[0]) or c % tp:
            continue
        n = math.ceil(longest / c)
        out.extend((c, k) for k in KS if k == 1 or k < n)
    return out


def search(candidates: list, predict: Callable[..., Prediction],
           time_floor_of: Callable[..., float], memory_floor_of: Callable[..., float],
           budget: float) -> Prediction:
    """The fastest fitting prediction among `candidates` (see the module docstring)."""
    if not candidates:
        raise ValueError("no candidate layout suits this model, GPU count and chunk size")
    memory = [memory_floor_of(c) for c in candidates]
    hopeful = [c for c, m in zip(candidates, memory) if m <= budget]
    if not hopeful:
        return predict(candidates[min(range(len(candidates)), key=memory.__getitem__)])
    ordered = sorted((time_floor_of(c), i) for i, c in enumerate(hopeful))
    best, tried = None, []
    for floor, i in ordered:
        if best is not None and floor >= best.step_s:
            break
        p = predict(hopeful[i])
        tried.append(p)
        if p.fits and (best is None or p.step_s < best.step_s):
            best = p
    return best or min(tried, key=lambda p: p.peak_mem_bytes)


def best_megatron(lengths: Sequence[int], shape: ModelShape, hw: Hardware, num_gpus: int,
                  seq_length: int, layout: Layout | None = None) -> Prediction:
    """Stock Megatron on `layout`, or on the fastest layout that fits."""
    if layout is not None:
        return predict_megatron(lengths, shape, hw, layout, seq_length)

    def floor(lay: Layout) -> float:
        mbs = baseline_microbatches(lengths, seq_length, lay.dp)
        return time_floor(chunk_work_items(mbs, hw.attn_block, lay.cp), roofline(shape, lay, hw))

    return search(candidate_layouts(shape, hw, num_gpus, allow_cp=True),
                  lambda lay: predict_megatron(lengths, shape, hw, lay, seq_length), floor,
                  lambda lay: megatron_memory_floor(lengths, shape, lay, hw.dtype_bytes),
                  hw.usable_bytes)


def best_chunkflow(lengths: Sequence[int], shape: ModelShape, hw: Hardware, num_gpus: int,
                   seq_length: int, layout: Layout | None = None, chunk_size: int = 8192,
                   k: int = 1, auto_chunking: bool = False) -> Prediction:
    """ChunkFlow on `layout` (or the fastest fitting one) with (chunk_size, k), or with the
    fastest fitting (chunk size, K) when `auto_chunking`."""
    if layout is not None and not auto_chunking:
        return predict_chunkflow(lengths, shape, hw, layout, chunk_size, k)
    layouts = [layout] if layout else candidate_layouts(shape, hw, num_gpus, allow_cp=False)
    candidates = [(lay, c, kk) for lay in layouts
                  for c, kk in (chunking_candidates(lengths, seq_length, lay.tp) if auto_chunking
                                else [(chunk_size, k)] if chunk_size % lay.tp == 0 else [])]

    work = {}  # (chunk size, DP, K) -> chunk_work_items, shared by layouts with the same DP

    def floor(cand) -> float:
        lay, c, kk = cand
        if (c, lay.dp, kk) not in work:
            chunks = build_chunks(lengths, c, lay.dp, kk, shape).chunks
            work[c, lay.dp, kk] = chunk_work_items(chunks, hw.attn_block, 1, kk)
        return time_floor(work[c, lay.dp, kk], roofline(shape, lay, hw))

    return search(candidates, lambda cand: predict_chunkflow(lengths, shape, hw, *cand), floor,
                  lambda cand: chunkflow_memory_floor(lengths, shape, cand[0], hw.dtype_bytes,
                                                     *cand[1:]),
                  hw.usable_bytes)
