"""Searches: the fastest prediction that fits in memory, over parallel layouts and Megatron's whole
recompute menu, per stock baseline, and for ChunkFlow over the same and (chunk size, K).

Candidates: every (TP, CP, PP, V) Megatron accepts (TP inside a node, dividing the attention
heads and K/V groups; PP dividing the layers; CP up to 32; V virtual stages per rank up to
MAX_VPP = 2, dividing the layers per stage, when PP >= 2), each with every option of
config.Recompute.menu for its layers per (virtual) stage (none, the 7 selective module sets,
block 1 .. layers - 1, full); ChunkFlow's option applies inside every chunk. Both systems search
V: stock Megatron runs its interleaved 1F1B there, skipped where Megatron refuses the micro-batch
count (core/schedule.py interleaving_problem); ChunkFlow's interleaved plan takes any chunk
count. Under CP ChunkFlow also tries both places for a long sequence's K/V state (CP_KV:
sharded, or replicated on every CP rank: more memory, less traffic; --chunkflow-cp-kv), and
asked to, every way of running a re-forward's attention (REFORWARD: recompute, keep, offload;
--chunkflow-reforward-attention). For --auto, every chunk size 2K..seq_length (powers of two)
that splits as the layout needs (ParallelConfig.chunk_multiple: 2 x CP, x TP under sequence
parallelism) with K = 1, 2, 4, 8 while K is below the longest sequence's number of chunks.

The search is exhaustive but prunes exactly, with two lower bounds computed without planning
(perfmodel/floors.py): a memory floor drops candidates that cannot fit (for stock Megatron it is
the peak itself), and a time floor orders the rest; candidates are simulated in that order until
the next floor is no faster than the fastest fitting prediction so far. If nothing fits, the
result is the candidate needing the least memory, reported as not fitting. The floors' per-chunk
sums are shared by every recompute option of a parallel layout.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Sequence

from megatron_chunkflow.config import ParallelConfig, Recompute, ReforwardAttention
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.schedule import interleaving_problem
from megatron_chunkflow.core.step import Baseline, baseline_microbatches
from megatron_chunkflow.core.types import DataChunk
from megatron_chunkflow.perfmodel.floors import (
    chunk_work_items,
    floor_sums,
    relaxed_1f1b_floor,
    time_floor,
)
from megatron_chunkflow.perfmodel.hardware import Hardware
from megatron_chunkflow.perfmodel.memfloors import (
    chunkflow_memory_floor,
    inflight_tokens,
    megatron_memory_floor,
)
from megatron_chunkflow.perfmodel.predict import (
    Prediction,
    predict_chunkflow,
    predict_megatron,
    roofline,
    runtime_layout,
)

CHUNK_SIZES = (2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
KS = (1, 2, 4, 8)
# virtual stages per rank searched (V = 2 with PP >= 2): on qwen2.5-32b at 32K, V = 4 won 0.1-0.4%
# over V = 2 and doubled the search time again (each V multiplies a plan's ops)
MAX_VPP = 2
REFORWARD = typing.get_args(ReforwardAttention)  # --chunkflow-reforward-attention, searched
CP_KV = ("sharded", "replicated")  # ChunkFlow's K/V state under CP (--chunkflow-cp-kv), searched
# the loss whole or in pieces of this many tokens (--chunkflow-loss-piece), searched when asked:
# a piece's logits on a 152K vocabulary are 0.9 GiB, the GEMMs of 2048 rows still efficient
LOSS_PIECES = (0, 2048)


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidate_layouts(shape: ModelShape, hw: Hardware, num_gpus: int, allow_cp: bool,
                      max_pp: int = 16, max_cp: int = 32,
                      recompute: Sequence[Recompute] | None = None,
                      max_vpp: int = MAX_VPP) -> list[ParallelConfig]:
    """Every layout Megatron accepts on `num_gpus` GPUs (V up to `max_vpp` when PP >= 2), each
    with every recompute option of the menu for its layers per virtual stage (or only those in
    `recompute`)."""
    heads = math.gcd(shape.num_attention_heads, shape.num_query_groups)
    out = []
    for tp in _divisors(math.gcd(heads, num_gpus), hw.gpus_per_node):
        for cp in (_divisors(num_gpus // tp, max_cp) if allow_cp else [1]):
            for pp in _divisors(num_gpus // (tp * cp), min(max_pp, shape.num_layers)):
                if shape.num_layers % pp:
                    continue  # Megatron-LM asserts that PP divides the layers
                for v in (_divisors(shape.num_layers // pp, max_vpp) if pp > 1 else [1]):
                    menu = Recompute.menu(shape.num_layers // (pp * v))
                    for rc in (menu if recompute is None else [r for r in recompute if r in menu]):
                        out.append(ParallelConfig.on_gpus(tp, cp, pp, rc, num_gpus, shape, vpp=v))
    return out


def chunking_candidates(lengths: Sequence[int], seq_length: int,
                        multiple: int) -> list[tuple[int, int]]:
    """(chunk size, K) pairs worth simulating: C up to seq_length and a multiple of `multiple`
    (ParallelConfig.chunk_multiple: TP under sequence parallelism, 2 x CP (x TP) under CP), K only
    while it changes something."""
    longest = max(lengths)
    out = []
    for c in CHUNK_SIZES:
        if c > max(seq_length, CHUNK_SIZES[0]) or c % multiple:
            continue
        n = math.ceil(longest / c)
        out.extend((c, num_kept) for num_kept in KS if num_kept == 1 or num_kept < n)
    return out


def search(candidates: list, predict: Callable[..., Prediction],
           time_floor_of: Callable[..., float], memory_floor_of: Callable[..., float],
           budget: float, refine: Callable[..., float] | None = None,
           dominates: Callable[..., bool] | None = None) -> Prediction:
    """The fastest fitting prediction among `candidates` (see the module docstring). Optional,
    both exact: `refine(c)` a tighter (costlier) lower bound of c's step time, tried before
    simulating c once something fits; `dominates(a, c)`: every op of c costs at least a's, so
    c's step time and its refined floor are at least a's (both are monotone in op costs), and c
    is skipped once a fits or its refined floor has ruled it out."""
    if not candidates:
        raise ValueError("no candidate layout suits this model, GPU count and chunk size")
    memory = [memory_floor_of(c) for c in candidates]
    hopeful = [c for c, m in zip(candidates, memory) if m <= budget]
    if not hopeful:
        return predict(candidates[min(range(len(candidates)), key=memory.__getitem__)])
    ordered = sorted((time_floor_of(c), i) for i, c in enumerate(hopeful))
    best, tried, settled = None, [], []  # settled: fitting, or ruled out by their refined floor
    for floor, i in ordered:
        if best is not None and floor >= best.step_s:
            break
        cand = hopeful[i]
        if dominates is not None and any(dominates(a, cand) for a in settled):
            continue
        if refine is not None and best is not None and refine(cand) >= best.step_s:
            settled.append(cand)
            continue
        p = predict(cand)
        tried.append(p)
        if p.fits:
            settled.append(cand)
            if best is None or p.step_s < best.step_s:
                best = p
    return best or min(tried, key=lambda p: p.peak_mem_bytes)


def recompute_dominates(a: Recompute, b: Recompute) -> bool:
    """Every op of a layout under `b` costs at least what it costs under `a` (same parallel
    layout, perfmodel/roofline.py): none is cheapest; a selective set is cheaper than its
    supersets and than full; block:N than block:M for M >= N and than full (a recomputed layer's
    backward exceeds any selective one's: the layer's forward holds every module's)."""
    if a == b or a.kind == "none":
        return True
    if b.kind == "full":
        return a.kind in ("selective", "block")
    if a.kind == "selective" and b.kind == "selective":
        return set(a.modules) <= set(b.modules)
    return a.kind == b.kind == "block" and b.num_layers >= a.num_layers


class _Floors:
    """Time-floor sums cached per (chunking key, parallel layout)."""

    def __init__(self, shape: ModelShape, hw: Hardware):
        self.shape, self.hw, self.sums = shape, hw, {}

    def time(self, key, items, layout: ParallelConfig, kept: str = "recompute") -> float:
        flat = dataclasses.replace(layout.degrees, vpp=1)  # V only splits the same sums
        if (key, flat, kept) not in self.sums:
            self.sums[key, flat, kept] = floor_sums(items, roofline(self.shape, flat, self.hw),
                                                    kept)
        return time_floor(items, roofline(self.shape, layout, self.hw),
                          self.sums[key, flat, kept])


def unsupported_interleaving(microbatches: Sequence[DataChunk],
                             layout: ParallelConfig) -> str | None:
    """Why Megatron's interleaved 1F1B refuses a baseline's `microbatches` (every DP rank's) on
    `layout` (core/schedule.py interleaving_problem, per DP rank), or None."""
    if layout.vpp == 1:
        return None
    counts = {sum(c.dp_rank == r for c in microbatches) for r in range(layout.dp)}
    return next((f"{layout.describe()}: {why}" for m in sorted(counts)
                 if (why := interleaving_problem(m, layout.pp, layout.vpp))), None)


def best_megatron(lengths: Sequence[int], shape: ModelShape, hw: Hardware, num_gpus: int,
                  seq_length: int, layout: ParallelConfig | None = None,
                  baseline: Baseline = "megatron-packed", loss_piece: int = 0) -> Prediction:
    """Stock Megatron as `baseline` on `layout`, or on the fastest layout and recompute option
    that fits. Layouts whose CP padding makes a sequence longer than `seq_length` are skipped,
    and so are interleaved ones whose micro-batch count per pipeline Megatron refuses
    (unsupported_interleaving says why). `loss_piece`: ChunkFlow's loss in token pieces given to
    the baseline too (0: Megatron's own, as shipped)."""
    if layout is not None:
        return predict_megatron(lengths, shape, hw, layout, seq_length, baseline, loss_piece)
    build = dataclasses.replace(hw.build, loss_piece=loss_piece)
    mbs: dict[tuple[int, int], list | None] = {}  # (DP, CP) -> micro-batches

    def microbatches(lay: ParallelConfig):
        if (lay.dp, lay.cp) not in mbs:
            try:
                mbs[lay.dp, lay.cp] = baseline_microbatches(lengths, seq_length, lay.dp,
                                                            baseline, lay.cp)
            except ValueError:
                mbs[lay.dp, lay.cp] = None
        return mbs[lay.dp, lay.cp]

    items, inflight, ranks, floors = {}, {}, {}, _Floors(shape, hw)
    sends = "fixed" if baseline == "megatron-sft" else "variable"

    def time_of(lay: ParallelConfig) -> float:
        key = (lay.dp, lay.cp)
        if key not in items:
            items[key] = chunk_work_items(microbatches(lay), hw.attn_block, lay.cp)
        return floors.time(key, items[key], lay)

    def memory_of(lay: ParallelConfig) -> float:
        key = (lay.dp, lay.cp, lay.pp, lay.vpp)
        if key not in inflight:
            inflight[key] = inflight_tokens(microbatches(lay), lay.dp, lay.cp, lay.pp, lay.vpp)
        return megatron_memory_floor(lengths, shape, lay, hw.dtype_bytes, inflight[key], build)

    def refine(lay: ParallelConfig) -> float:
        chunks = microbatches(lay)
        if (lay.dp, lay.cp) not in ranks:
            ranks[lay.dp, lay.cp] = [[c for c in chunks if c.dp_rank == r]
                                     for r in range(lay.dp)]
        model = roofline(shape, lay, hw)
        return relaxed_1f1b_floor(ranks[lay.dp, lay.cp], model,
                                  model.stage_costs(chunks, lay.num_virtual_stages, seq_length,
                                                    sends))

    def dominates(a: ParallelConfig, b: ParallelConfig) -> bool:
        # exact for Megatron's fixed 1F1B order: its replay is monotone in the op costs, and
        # recompute changes only backward costs (the first forward, which the DP tail reads,
        # costs the same)
        return a.degrees == b.degrees and recompute_dominates(a.recompute, b.recompute)

    layouts = [lay for lay in candidate_layouts(shape, hw, num_gpus, allow_cp=True)
               if microbatches(lay) is not None
               and unsupported_interleaving(microbatches(lay), lay) is None]
    return search(layouts,
                  lambda lay: predict_megatron(lengths, shape, hw, lay, seq_length, baseline,
                                               loss_piece),
                  time_of, memory_of, hw.usable_bytes, refine, dominates)


def best_chunkflow(lengths: Sequence[int], shape: ModelShape, hw: Hardware, num_gpus: int,
                   seq_length: int, layout: ParallelConfig | None = None, chunk_size: int = 8192,
                   num_kept: int = 1, auto_chunking: bool = False,
                   cp_kv: str | None = None, cp_placement: str = "hybrid",
                   reforward: str | None = "recompute", loss_piece: int | None = 0
                   ) -> Prediction:
    """ChunkFlow on `layout` (or the fastest fitting layout and recompute option) with
    (chunk_size, num_kept), or with the fastest fitting (chunk size, K) when `auto_chunking`;
    under CP its K/V state `cp_kv` ("sharded" or "replicated"), or (None) the faster that fits,
    standalone chunks' segments placed `cp_placement`, re-forwarded chunks' attention
    `reforward` (REFORWARD), or (None) the fastest that fits, the loss in pieces of
    `loss_piece` tokens, or (None) whole or in pieces (LOSS_PIECES), the faster that fits
    (predict_chunkflow)."""
    kv_modes = CP_KV if cp_kv is None else (cp_kv,)
    modes = REFORWARD if reforward is None else (reforward,)
    pieces = LOSS_PIECES if loss_piece is None else (loss_piece,)
    if layout is not None and not auto_chunking and (layout.cp == 1 or len(kv_modes) == 1) \
            and len(modes) == 1 and len(pieces) == 1:
        return predict_chunkflow(lengths, shape, hw, layout, chunk_size, num_kept, kv_modes[0],
                                 cp_placement, modes[0], pieces[0])
    # under CP a core_attn recompute is what the option without it runs (runtime_layout): the
    # search keeps the option without it, whose time floor is the exact one
    layouts = [layout] if layout else [
        lay for lay in candidate_layouts(shape, hw, num_gpus, allow_cp=True)
        if runtime_layout(lay) == lay]
    candidates = [(lay, c, kk, kv, ra, piece) for lay in layouts
                  for c, kk in (chunking_candidates(lengths, seq_length, lay.chunk_multiple)
                                if auto_chunking else [(chunk_size, num_kept)]
                                if chunk_size % lay.chunk_multiple == 0 else [])
                  for kv in (kv_modes if lay.cp > 1 else kv_modes[:1])
                  for ra in modes for piece in pieces]
    chunkings, work = {}, {}  # (chunk size, DP, K, padding) -> chunks; (.., CP, K/V) -> work
    floors, times = _Floors(shape, hw), {}
    builds = {piece: dataclasses.replace(hw.build, loss_piece=piece) for piece in pieces}

    def time_of(cand) -> float:  # the whole loss's floor, a floor of the pieced loss's too
        if cand[:5] not in times:
            lay, c, kk, kv, ra, _ = cand
            m = (lay.segment_multiple, lay.chunk_padding)
            key = (c, lay.dp, kk, m, lay.cp, kv)
            if key not in work:
                if key[:4] not in chunkings:
                    chunkings[key[:4]] = build_chunks(lengths, c, lay.dp, kk, shape, *m).chunks
                work[key] = chunk_work_items(chunkings[key[:4]], hw.attn_block, lay.cp, kk,
                                             kv, lay.pad_multiple, cp_placement)
            times[cand[:5]] = floors.time(key, work[key], lay, ra)
        return times[cand[:5]]

    def pieces_cost_more(a, c) -> bool:
        # the same plan with its loss in pieces: every op costs at least the whole loss's
        return a[:5] == c[:5] and a[5] == 0 < c[5]

    # the memory floor is sharded state's, a lower bound of replicated's too
    return search(candidates,
                  lambda cand: predict_chunkflow(lengths, shape, hw, *cand[:4], cp_placement,
                                                 *cand[4:]), time_of,
                  lambda cand: chunkflow_memory_floor(lengths, shape, cand[0], hw.dtype_bytes,
                                                      *cand[1:3], builds[cand[5]]),
                  hw.usable_bytes, dominates=pieces_cost_more if len(pieces) > 1 else None)
