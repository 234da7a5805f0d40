"""Lower bounds computed without planning, for the exact pruned searches (perfmodel/search.py).

Time floor (time_floor): stage s of a DP rank runs all its ops (F and B of every chunk, R of every
re-forwarded one), cannot start before some chunk has gone forward through stages 0..s-1 and,
after its last B, that chunk still runs backward through stages s-1..0 before stage 0's optimizer
step (or stage s's own, if longer). Sends, bubbles and the DP tail only add to it.
ChunkFlow's long sequences add a second bound, their chain (core/schedule.py): chunk j's F on a
stage follows chunk j - 1's there, its B follows chunk j + 1's there (and its R, if
re-forwarded); so some path runs chunk 0 forward down to a stage t, every chunk's F on t, the last
chunk down to the last stage, its B back up to a stage u, every chunk's B and R on u, then chunk
0's B up to stage 0 and its optimizer step; the floor takes the longest such path over t and u.
With V virtual stages per rank the paths run over the PP x V virtual stages.

The floor is computed from per-rank sums (FloorSums), one pass over the chunks per parallel
layout, then per recompute option in O(stages): the forward sums are exact; a backward's launch
floor is a max per layer and chunk (perfmodel/roofline.py), and a sum of maxima is at least the
max of the sums, so max(roofline sum, kernel sum x launch) bounds it from below; the first
backwards' prefix uses the backward without recompute, which every option's exceeds.
The memory floors are perfmodel/memfloors.py's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from megatron_chunkflow.core.costs import layers_per_stage
from megatron_chunkflow.core.schedule import is_reforwarded
from megatron_chunkflow.core.types import DataChunk
from megatron_chunkflow.perfmodel.footprint import stage_params
from megatron_chunkflow.perfmodel.layer import Work, chunk_work
from megatron_chunkflow.perfmodel.roofline import Roofline

MODULES = ("core_attn", "mlp", "layernorm")


def chunk_work_items(chunks: Sequence[DataChunk], block: int, cp: int = 1, num_kept: int = 1,
                     gather: bool | str = False, multiple: int = 1,
                     placement: str = "hybrid") -> list[tuple[int, bool, Work, int | None]]:
    """(DP rank, re-forwarded, Work, long sequence or None) per chunk: what time_floor needs,
    independent of PP and recompute, so a search computes it once per chunking (and CP);
    `gather`, `multiple`, `placement`: ChunkFlow's CP (perfmodel/layer.py chunk_work)."""
    return [(c.dp_rank, is_reforwarded(c, num_kept),
             chunk_work(c, block, cp, gather, multiple, placement), c.parent) for c in chunks]


@dataclass
class ChainSums:
    """One long sequence's chunks summed, for its chain bound (module docstring): per layer
    roofline seconds and kernels as in RankSums, its first and last chunk's own."""

    n: int = 0
    fwd: float = 0.0  # layer forwards (launch floor applied), F once per chunk
    refwd: float = 0.0  # the same over its re-forwarded chunks (their R)
    num_refwd: int = 0
    bwd: float = 0.0
    bwd_kernels: int = 0
    fwd_roof: float = 0.0
    fwd_kernels: int = 0
    module: dict = field(default_factory=lambda: {m: 0.0 for m in MODULES})
    module_kernels: dict = field(default_factory=lambda: {m: 0 for m in MODULES})
    ends_f: tuple = (0.0, 0.0)  # embedding and head forwards, F of every chunk
    ends_r: tuple = (0.0, 0.0)  # the same for the R of the re-forwarded ones
    ends_b: tuple = (0.0, 0.0)
    first: tuple = ()  # chunk 0: (layer forward, layer backward, embedding f, b, head f, b)
    last: tuple = ()  # the last chunk: the same


def _add_roofline(sums, parts) -> None:
    """Add one chunk's roofline layer pieces to RankSums or ChainSums (the same fields)."""
    sums.bwd += parts.bwd
    sums.bwd_kernels += parts.bwd_kernels
    sums.fwd_roof += parts.fwd
    sums.fwd_kernels += parts.fwd_kernels
    for m, (sec, kernels) in parts.modules.items():
        sums.module[m] += sec
        sums.module_kernels[m] += kernels


@dataclass
class RankSums:
    """One DP rank's chunks summed (FloorSums)."""

    ops: int = 0  # F and R ops, each paying the host time once per stage
    chunks: int = 0
    fwd: float = 0.0  # layer forwards, launch floor applied, R included
    emb_fwd: float = 0.0
    head_fwd: float = 0.0
    emb_bwd: float = 0.0
    head_bwd: float = 0.0
    bwd: float = 0.0  # roofline layer backward, no recompute
    bwd_kernels: int = 0
    fwd_roof: float = 0.0  # roofline layer forward (what full recompute re-runs)
    fwd_kernels: int = 0
    module: dict = field(default_factory=lambda: {m: 0.0 for m in MODULES})
    module_kernels: dict = field(default_factory=lambda: {m: 0 for m in MODULES})
    f_pre: list = field(default_factory=list)  # per stage: least forward through earlier stages
    b_pre: list = field(default_factory=list)  # per stage: least backward through earlier stages
    least: tuple = (math.inf,) * 4  # least layer forward, backward, embedding f, b (any split)
    # upper bounds of one op's duration, for the DP tail (the first F, the last B of a stage)
    max_fwd: float = 0.0  # a layer's forward
    max_bwd: float = 0.0  # a layer's backward under any recompute option
    max_ends: tuple = (0.0, 0.0, 0.0, 0.0)  # embedding and head, forward and backward
    chains: dict = field(default_factory=dict)  # long sequence -> ChainSums (the heaviest kept)


def floor_sums(items: Sequence[tuple[int, bool, Work, int | None]],
               model: Roofline, kept: str = "recompute") -> dict[int, RankSums]:
    """Per DP rank, the sums time_floor combines (re-forwards as `kept` runs them); they depend
    on the layout, not on recompute, so a search shares them between every recompute option."""
    pp, nv, launch = model.layout.pp, model.layout.num_virtual_stages, model.launch_s
    host = model.hw.op_overhead_us * 1e-6
    rows: dict[int, RankSums] = {}
    for rank, reforward, work, parent in items:
        parts = model.layer.parts(work)
        (emb_f, emb_b), (head_f, head_b), layers = model.ends(work.tokens, nv)
        f_layer = max(parts.fwd, parts.fwd_kernels * launch)
        b_layer = max(parts.bwd, parts.bwd_kernels * launch)
        f_layer, r_layer = (model.kept_layer_times(parts, kept) if reforward and kept != "recompute"
                            else (f_layer, f_layer))  # F's and the re-forward's layer
        r = rows.setdefault(rank, RankSums(f_pre=[math.inf] * pp, b_pre=[math.inf] * pp))
        times = 2 if reforward else 1
        r.ops, r.emb_bwd, r.head_bwd = r.ops + times, r.emb_bwd + emb_b, r.head_bwd + head_b
        r.chunks += 1
        r.fwd += f_layer + (r_layer if reforward else 0.0)
        r.emb_fwd += times * emb_f
        r.head_fwd += times * head_f
        _add_roofline(r, parts)
        every = [parts.modules[m] for m in MODULES]  # the costliest selective option
        r.max_fwd = max(r.max_fwd, f_layer)
        r.max_bwd = max(r.max_bwd, parts.bwd + parts.fwd, parts.bwd + sum(e[0] for e in every),
                        (parts.bwd_kernels + parts.fwd_kernels) * launch,
                        (parts.bwd_kernels + sum(e[1] for e in every)) * launch)
        r.max_ends = tuple(map(max, r.max_ends, (emb_f, emb_b, head_f, head_b)))
        r.least = tuple(map(min, r.least, (min(f_layer, r_layer), b_layer, emb_f, emb_b)))
        if parent is not None:
            ch = r.chains.setdefault(parent, ChainSums())
            ch.n += 1
            ch.fwd += f_layer
            _add_roofline(ch, parts)
            ch.ends_f = (ch.ends_f[0] + emb_f, ch.ends_f[1] + head_f)
            ch.ends_b = (ch.ends_b[0] + emb_b, ch.ends_b[1] + head_b)
            if reforward:
                ch.refwd += r_layer
                ch.num_refwd += 1
                ch.ends_r = (ch.ends_r[0] + emb_f, ch.ends_r[1] + head_f)
            own = (f_layer, b_layer, emb_f, emb_b, head_f, head_b)
            if work.prior == 0:
                ch.first = own
            if not work.relayed:  # the sequence's last chunk
                ch.last = own
        f_acc = b_acc = 0.0  # through the virtual stages before rank s's first, s
        for s, n in enumerate(layers[:pp]):
            r.f_pre[s], r.b_pre[s] = min(r.f_pre[s], f_acc), min(r.b_pre[s], b_acc)
            f_acc += n * f_layer + host + (emb_f if s == 0 else 0.0) + \
                (head_f if s == nv - 1 else 0.0)
            b_acc += n * b_layer + host + (emb_b if s == 0 else 0.0) + \
                (head_b if s == nv - 1 else 0.0)
    for r in rows.values():  # any chain bounds the step: keep the heaviest, for speed
        if len(r.chains) > 1:
            key = max(r.chains, key=lambda q: r.chains[q].fwd + r.chains[q].bwd)
            r.chains = {key: r.chains[key]}
    return rows


def time_floor(items: Sequence[tuple[int, bool, Work, int | None]], model: Roofline,
               sums: dict[int, RankSums] | None = None) -> float:
    """A lower bound of the step time without planning (module docstring); `sums` are
    floor_sums(items, model) when the caller has them already. The DP tail counts too: the
    gradient reduce-scatter beyond the stage's last backward (at most one op long) and the
    parameter all-gather beyond its first forward, as perfmodel/predict.py charges them."""
    sums = floor_sums(items, model) if sums is None else sums
    pp, rc, launch = model.layout.pp, model.layout.recompute, model.launch_s
    v = model.layout.vpp  # each rank runs V model chunks: V ops per chunk, F and B
    host = model.hw.op_overhead_us * 1e-6
    params = stage_params(model.shape, pp)
    opt = [model.optimizer_time(p) for p in params]
    dp = [model.dp_times(p) for p in params]
    layers = layers_per_stage(model.shape.num_layers, pp)
    virtual = layers_per_stage(model.shape.num_layers, pp * v)  # recompute's unit
    best = 0.0
    for r in sums.values():
        x_s = sum(r.module[m] for m in rc.modules)
        x_k = sum(r.module_kernels[m] for m in rc.modules)
        keep = max(r.bwd + x_s, (r.bwd_kernels + x_k) * launch)
        full = max(r.bwd + r.fwd_roof, (r.bwd_kernels + r.fwd_kernels) * launch)
        for s, n in enumerate(layers):
            n_re = v * rc.layers_recomputed(virtual[s])
            busy = (n * r.fwd + host * r.ops * v + n_re * full + (n - n_re) * keep
                    + host * r.chunks * v * (1 + n_re / max(n, 1)))
            first_f = virtual[s] * r.max_fwd + host
            last_b = virtual[s] * r.max_bwd + 2 * host
            if s == 0:
                busy += r.emb_fwd + r.emb_bwd
                first_f, last_b = first_f + r.max_ends[0], last_b + r.max_ends[1]
            if s == pp - 1:
                busy += r.head_fwd + r.head_bwd
                first_f, last_b = first_f + r.max_ends[2], last_b + r.max_ends[3]
            rs, ag = dp[s]
            tail = max(0.0, rs - last_b) + opt[s] + max(0.0, ag - first_f)
            f_pre, b_pre = r.f_pre[s], r.b_pre[s]
            if v > 1:  # sums shared with V = 1 (_Floors): a bound of the least over chunks
                f_pre = s * (virtual[s] * r.least[0] + host) + (r.least[2] if s else 0.0)
                b_pre = s * (virtual[s] * r.least[1] + host) + (r.least[3] if s else 0.0)
            best = max(best, busy + f_pre + max(tail, b_pre + opt[0]))
        for ch in r.chains.values():
            best = max(best, _chain_floor(ch, virtual, rc, launch, host) + opt[0])
    return best


def _chain_floor(ch: ChainSums, layers: Sequence[int], rc, launch: float, host: float) -> float:
    """The longest path through one long sequence's chunks (module docstring), without sends."""
    p = len(layers)

    def ops(own, b: int) -> list[float]:  # chunk 0's or the last's F (b = 0) or B (1) per stage
        out = [n * own[b] + host for n in layers]
        out[0] += own[2 + b]
        out[-1] += own[4 + b]
        return out

    x_s = sum(ch.module[m] for m in rc.modules)
    x_k = sum(ch.module_kernels[m] for m in rc.modules)
    keep = max(ch.bwd + x_s, (ch.bwd_kernels + x_k) * launch)
    full = max(ch.bwd + ch.fwd_roof, (ch.bwd_kernels + ch.fwd_kernels) * launch)
    first_f, last_f, first_b, last_b = (ops(ch.first, 0), ops(ch.last, 0), ops(ch.first, 1),
                                        ops(ch.last, 1))
    down = up = 0.0
    for s, n in enumerate(layers):
        emb, head = s == 0, s == p - 1
        fwd = n * ch.fwd + host * ch.n + emb * ch.ends_f[0] + head * ch.ends_f[1]
        n_re = rc.layers_recomputed(n)
        bwd = (n_re * full + (n - n_re) * keep + host * ch.n * (1 + n_re / max(n, 1))
               + emb * ch.ends_b[0] + head * ch.ends_b[1]
               + n * ch.refwd + host * ch.num_refwd + emb * ch.ends_r[0] + head * ch.ends_r[1])
        down = max(down, sum(first_f[:s]) + fwd + sum(last_f[s + 1:]))
        up = max(up, sum(last_b[s + 1:]) + bwd + sum(first_b[:s]))
    return down + up


def relaxed_1f1b_floor(per_rank: Sequence[Sequence[DataChunk]], model: Roofline,
                       costs) -> float:
    """A tighter lower bound of stock Megatron's step for the candidate `model` from its op costs
    (`costs`: StageCosts over the PP x V virtual stages), cheaper than the replay: each rank runs
    its ops in Megatron's (interleaved) 1F1B order, an F no earlier than its micro-batch's
    forwards on the virtual stages before it, a B no earlier than its forward here plus its own
    forwards and backwards on the stages after it; what the ranks do to each other is ignored
    (so it bounds the replay from below), then the DP tail as perfmodel/predict.py charges it."""
    pp, v, best = model.layout.pp, model.layout.vpp, 0.0
    params = stage_params(model.shape, pp)
    opt, dp = [model.optimizer_time(p) for p in params], [model.dp_times(p) for p in params]
    for chunks in filter(None, per_rank):  # ranks with micro-batches
        ids, nv = [c.id for c in chunks], pp * v
        f = {i: [costs("F", i, k) for k in range(nv)] for i in ids}
        b = {i: [costs("B", i, k) for k in range(nv)] for i in ids}
        before = {i: list(accumulate(row, initial=0.0)) for i, row in f.items()}  # [i][k]: < k
        after = {i: list(accumulate(map(sum, zip(row[::-1], b[i][::-1])), initial=0.0))[::-1]
                 for i, row in f.items()}  # [i][k + 1]: F and B on the stages after k
        table = interleaved_order(len(ids), pp, v)
        n = len(table)
        for s in range(pp):  # megatron_interleaved_plan's order: warmup, 1F1B, cooldown
            t, start, f_end = 0.0, 0.0, {}
            w = min(2 * (pp - s - 1) + (v - 1) * pp if v > 1 else pp - s - 1, n)
            for back, j in ([(0, j) for j in range(w)] + [(x, j + w * (1 - x)) for j in range(
                    n - w) for x in (0, 1)] + [(1, j) for j in range(n - w, n)]):
                q, m = table[j]
                i, k = ids[q], (v - 1 - m if back else m) * pp + s
                ready = f_end[i, k] + after[i][k + 1] if back else before[i][k]
                start = max(t, ready)
                t = start + (b[i][k] if back else f[i][k])
                if not back:
                    f_end[i, k] = t
            (rs, ag), first = dp[s], ids[0]
            best = max(best, max(t, start + rs) + opt[s] + max(0.0, ag - f[first][s]))
    return best


def interleaved_order(m: int, pp: int, v: int) -> list[tuple[int, int]]:
    """(micro-batch, model chunk) of each forward in Megatron's interleaved table (groups of PP
    micro-batches, chunks 0..V-1 over each); backwards: the same micro-batches, chunks V-1..0."""
    return [(i, k) for first in range(0, m, pp) for k in range(v)
            for i in range(first, min(first + pp, m))]
