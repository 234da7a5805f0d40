"""A roofline cost model: seconds per plan op (F, R, B) of a data chunk on a pipeline stage.

Per transformer layer, per micro-batch of T tokens on one GPU (T / CP tokens under CP):

- GEMMs (QKV, projection, fc1, fc2; the output layer on the last stage) take
  max(FLOPs / (peak * eff), bytes / (mem bw)). eff = gemm_max_eff * tile * wave * k_eff, from
  first principles: the output is cut into tiles (the best of a few CUTLASS-like shapes, with
  split-K when there are fewer tiles than SMs); tile quantization wastes the padded part of
  edge tiles, wave quantization the idle SMs of the last wave, and k_eff = K / (K + 128) charges
  each tile a pipeline fill and epilogue worth 128 K-elements. Backward = data-gradient GEMM +
  weight-gradient GEMM, each with its own shape.
- Attention (fused, flash-style): 4 * pairs * heads * head_dim FLOPs forward, 2.5x that backward
  (5 matmuls instead of 2), pairs counted per segment as core/costs.py does. The kernel computes
  whole 128x128 tiles, so each segment is charged its tiles (a short sequence wastes most of its
  diagonal tiles) at attn_fwd_eff / attn_bwd_eff of peak.
- Elementwise work (RMSNorms, residual adds, rotary, SwiGLU; cross entropy on the last stage) is
  memory-bound: bytes / (mem bw * mem_eff); the backward moves twice the bytes.
- TP with sequence parallelism: forward 4 exposed ring collectives (all-gather before QKV and
  fc1, reduce-scatter after projection and fc2) of T*h activations; backward the two
  row-parallel all-gathers are exposed and, as in Megatron's linear layers, the all-gather of a
  column-parallel input overlaps its data-gradient GEMM and the reduce-scatter of its input
  gradient overlaps its weight-gradient GEMM. Ring time = (n-1) * (latency + bytes/n/bw), NVLink
  inside a node, network across.
- CP (stock Megatron only): ring attention passes K/V of T/CP tokens CP-1 times forward (K/V and
  their gradients backward), overlapped with the attention compute: time = max(compute, comm).
  Every sequence is split into 2*CP pieces (load-balanced causal), so tiles are charged on
  pieces of L / (2 CP) tokens. On packed short sequences CP is costly: little attention to hide
  the transfers behind (across nodes when TP * CP exceeds a node), and mostly-padding tiles.
- Recompute: selective re-runs core attention forward inside B; full re-runs the whole layer
  forward (with its TP collectives) inside B, about 4/3 of forward + backward.

Per stage: layers * per-layer time, plus the embedding on the first stage and the output layer
and loss on the last, plus the device's host time per op (`op_overhead_us`: 0 on GPUs, measured
by `chunkflow bench` on a CPU, where Python runs between the kernels). PP point-to-point per
micro-batch: the SP-split activation (T / CP / TP) * h, sent as fixed-shape tensors of the
longest micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from megatron_chunkflow.core.costs import (
    attention_flops_per_pair_per_layer,
    attention_pairs,
    layers_per_stage,
)
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.types import DataChunk
from megatron_chunkflow.perfmodel.hardware import Hardware
from megatron_chunkflow.perfmodel.layout import Layout

GEMM_TILES = ((128, 256), (256, 128), (128, 128), (64, 128), (128, 64))
SPLIT_K = (1, 2, 4, 8, 16)
K_OVERHEAD = 128  # per-tile fill + epilogue, in K elements (about two 64-wide main-loop steps)
ATTN_BWD_FLOPS = 2.5  # flash backward: 5 matmuls (QK^T again, dP, dV, dQ, dK) vs 2 forward


@lru_cache(maxsize=65536)
def gemm_shape_factor(m: int, n: int, k: int, num_sms: int) -> float:
    """Tile x wave x k efficiency of an (m x k) @ (k x n) GEMM, in (0, 1]; 1 when num_sms = 0."""
    if num_sms == 0:
        return 1.0
    best = 0.0
    for tm, tn in GEMM_TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        tile_eff = m * n / (tiles * tm * tn)
        for split in SPLIT_K:
            k_slice = math.ceil(k / split)
            if split > 1 and (k_slice < 4 * K_OVERHEAD or tiles >= num_sms):
                break
            units = tiles * split
            wave_eff = units / (math.ceil(units / num_sms) * num_sms)
            best = max(best, tile_eff * wave_eff * k_slice / (k_slice + K_OVERHEAD))
    return best


def gemm_efficiency(m: int, n: int, k: int, hw: Hardware) -> float:
    """Fraction of peak an (m x k) @ (k x n) GEMM reaches on `hw` (<= hw.gemm_max_eff)."""
    return hw.gemm_max_eff * gemm_shape_factor(m, n, k, hw.num_sms)


def gemm_time(m: int, n: int, k: int, hw: Hardware) -> float:
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    nbytes = hw.dtype_bytes * (m * k + k * n + m * n)
    return max(flops / (hw.peak_flops * gemm_efficiency(m, n, k, hw)),
               nbytes / (hw.hbm_gb_s * 1e9 * hw.mem_eff))


def attention_tiles(prefix: int, num_q: int, block: int) -> int:
    """block x block tiles a causal, bottom-right-aligned kernel computes for `num_q` queries
    after `prefix` keys: query block i sees ceil((prefix + min((i+1) block, q)) / block)."""
    nq = math.ceil(num_q / block)
    return ((nq - 1) * math.ceil(prefix / block) + (nq - 1) * nq // 2
            + math.ceil((prefix + num_q) / block))


def computed_pairs(prefix: int, num_q: int, block: int, cp: int = 1) -> float:
    """(query, key) pairs the kernel computes for one segment, tiles included, summed over the CP
    ranks: with CP the segment is cut into 2*CP pieces and every (piece, earlier piece) pair
    is a full block, every piece with itself a causal one."""
    if block == 0:
        return float(attention_pairs(prefix, num_q))
    if cp == 1:
        return float(attention_tiles(prefix, num_q, block) * block * block)
    assert prefix == 0, "CP splits whole sequences only"
    pieces = 2 * cp
    piece = math.ceil(num_q / pieces)
    full = pieces * (pieces - 1) // 2 * math.ceil(piece / block) ** 2
    return float((full + pieces * attention_tiles(0, piece, block)) * block * block)


def chunk_work(chunk: DataChunk, block: int, cp: int = 1) -> tuple[int, float]:
    """(tokens, computed attention pairs) of a chunk on one of its CP ranks: what its op costs
    depend on."""
    dep = chunk.is_dependent
    pairs = sum(computed_pairs(s.start if dep else 0, s.num_tokens, block, cp)
                for s in chunk.segments)
    return math.ceil(chunk.num_tokens / cp), pairs / cp


def ring_time(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """All-gather or reduce-scatter of a tensor of `nbytes` (whole) over a ring of n ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, latency = link
    return (n - 1) * (latency + nbytes / n / bw)


@dataclass
class StageCosts:
    """Seconds per op, per chunk and stage: the planner's and simulator's cost callable."""

    forward: dict[int, list[float]]
    backward: dict[int, list[float]]
    comm: float = 0.0  # one point-to-point send between neighbouring stages

    def __call__(self, kind: str, chunk: int, stage: int) -> float:
        return self.backward[chunk][stage] if kind == "B" else self.forward[chunk][stage]


class Roofline:
    """Op times of one model on one layout and device (see the module docstring)."""

    def __init__(self, shape: ModelShape, layout: Layout, hw: Hardware):
        self.shape, self.layout, self.hw = shape, layout, hw
        t = layout.tp  # per-GPU widths: heads, K/V groups and the MLP are split over TP
        self.kv = shape.kv_dim // t
        self.attn_width = shape.num_attention_heads * shape.head_dim // t
        self.qkv_out = self.attn_width + 2 * self.kv
        self.ffn = shape.ffn_hidden_size // t
        self.vocab = math.ceil(shape.vocab_size / t)
        self.mem_bw = hw.hbm_gb_s * 1e9 * hw.mem_eff
        self.tp_link = hw.link(layout.span("tp"))
        self.cp_link = hw.link(layout.span("cp"))
        self.pp_link = hw.link(layout.span("pp"))
        self.dp_link = hw.link(layout.span("dp"))
        self._layer: dict[int, tuple[float, float]] = {}  # caches, by tokens
        self._dense: dict[tuple[int, int], tuple] = {}

    # ---- one layer, without the attention core --------------------------------------------------
    def dense_layer(self, tokens: int) -> tuple[float, float]:
        """(forward, backward) seconds of one layer's GEMMs, elementwise work and TP
        collectives for `tokens` tokens on this GPU (already divided by CP)."""
        if tokens in self._layer:
            return self._layer[tokens]
        hw, h, T = self.hw, self.shape.hidden_size, tokens
        col = [(self.qkv_out, h), (2 * self.ffn, h)]  # (N out, K in): QKV, fc1
        row = [(h, self.attn_width), (h, self.ffn)]  # projection, fc2
        fwd = sum(gemm_time(T, n, k, hw) for n, k in col + row)
        ag = ring_time(T * h * hw.dtype_bytes, self.layout.tp, self.tp_link)
        tp_fwd = 4 * ag  # all-gather and reduce-scatter move the same bytes
        bwd = 2 * ag
        for n, k in col:  # dgrad overlaps the input all-gather, wgrad the grad reduce-scatter
            bwd += max(gemm_time(T, k, n, hw), ag) + max(gemm_time(k, n, T, hw), ag)
        for n, k in row:
            bwd += gemm_time(T, k, n, hw) + gemm_time(k, n, T, hw)
        # elements moved per token: 2 RMSNorms (read + write h) and 2 residual adds (2 reads, 1
        # write) on the SP-split h; rotary on Q and K, SwiGLU (read 2f, write f) on TP-split heads
        elems = 10 * h / self.layout.tp + 2 * (self.attn_width + self.kv) + 3 * self.ffn
        ew = T * elems * hw.dtype_bytes / self.mem_bw
        out = (fwd + tp_fwd + ew, bwd + 2 * ew)
        self._layer[tokens] = out
        return out

    # ---- attention core --------------------------------------------------------------------------
    def attention(self, tokens: int, pairs: float) -> tuple[float, float]:
        """(forward, backward) seconds of one layer's attention core on one GPU for `tokens`
        tokens and `pairs` computed (query, key) pairs on it (chunk_work), CP ring included."""
        hw, cp = self.hw, self.layout.cp
        flops = pairs * attention_flops_per_pair_per_layer(self.shape, self.layout.tp)
        fwd = flops / (hw.peak_flops * hw.attn_fwd_eff)
        bwd = ATTN_BWD_FLOPS * flops / (hw.peak_flops * hw.attn_bwd_eff)
        if cp > 1:
            bw, latency = self.cp_link
            kv_bytes = tokens * 2 * self.kv * hw.dtype_bytes
            fwd = max(fwd, (cp - 1) * kv_bytes / bw) + latency
            bwd = max(bwd, (cp - 1) * 2 * kv_bytes / bw) + latency
        return fwd, bwd

    # ---- embedding and output layer ----------------------------------------------------------
    def embedding(self, tokens: int) -> tuple[float, float]:
        hw, h = self.hw, self.shape.hidden_size
        comm = ring_time(tokens * h * hw.dtype_bytes, self.layout.tp, self.tp_link)
        move = tokens * h * hw.dtype_bytes / self.layout.tp / self.mem_bw
        return comm + move, comm + 2 * move

    def head(self, tokens: int) -> tuple[float, float]:
        """Final norm, output layer and vocabulary-parallel cross entropy (fp32 softmax)."""
        hw, h, T = self.hw, self.shape.hidden_size, tokens
        comm = ring_time(T * h * hw.dtype_bytes, self.layout.tp, self.tp_link)
        fwd = gemm_time(T, self.vocab, h, hw) + comm + T * self.vocab * 18 / self.mem_bw
        bwd = (gemm_time(T, h, self.vocab, hw) + gemm_time(h, self.vocab, T, hw) + comm
               + T * self.vocab * 6 / self.mem_bw)
        return fwd, bwd

    # ---- per chunk, per stage ----------------------------------------------------------------
    def chunk_costs(self, chunk: DataChunk, num_stages: int) -> tuple[list[float], list[float]]:
        """Forward (F and R) and backward (B, recompute included) seconds per stage."""
        return self.work_costs(*chunk_work(chunk, self.hw.attn_block, self.layout.cp),
                               num_stages)

    def work_costs(self, tokens: int, pairs: float,
                   num_stages: int) -> tuple[list[float], list[float]]:
        """chunk_costs of a chunk with `tokens` tokens and `pairs` computed pairs per GPU."""
        key = (tokens, num_stages)
        if key not in self._dense:
            layers = layers_per_stage(self.shape.num_layers, num_stages)
            self._dense[key] = (self.dense_layer(tokens), self.embedding(tokens),
                                self.head(tokens), layers)
        (d_fwd, d_bwd), emb, head, layers = self._dense[key]
        a_fwd, a_bwd = self.attention(tokens, pairs)
        layer_fwd, layer_bwd = d_fwd + a_fwd, d_bwd + a_bwd
        if self.layout.recompute == "full":
            layer_bwd += layer_fwd
        elif self.layout.recompute == "selective":
            layer_bwd += a_fwd
        host = self.hw.op_overhead_us * 1e-6  # per op and stage; full recompute adds a forward
        fwd = [n * layer_fwd + host for n in layers]
        bwd = [n * layer_bwd + host * (2 if self.layout.recompute == "full" else 1)
               for n in layers]
        fwd[0], bwd[0] = fwd[0] + emb[0], bwd[0] + emb[1]
        fwd[-1], bwd[-1] = fwd[-1] + head[0], bwd[-1] + head[1]
        return fwd, bwd

    def p2p_time(self, tokens: int) -> float:
        """One stage-to-stage send of a micro-batch of `tokens` (whole, before CP and SP)."""
        if self.layout.pp == 1:
            return 0.0
        bw, latency = self.pp_link
        nbytes = tokens / self.layout.cp / self.layout.tp * self.shape.hidden_size
        return latency + nbytes * self.hw.dtype_bytes / bw

    def stage_costs(self, chunks, num_stages: int, p2p_tokens: int) -> StageCosts:
        fwd, bwd = {}, {}
        for c in chunks:
            fwd[c.id], bwd[c.id] = self.chunk_costs(c, num_stages)
        return StageCosts(fwd, bwd, comm=self.p2p_time(p2p_tokens))

    # ---- step end: data-parallel collectives and optimizer -----------------------------------
    def dp_times(self, stage_params: float) -> tuple[float, float]:
        """(gradient reduce-scatter, parameter all-gather) seconds of the distributed optimizer
        for a stage holding `stage_params` parameters (before TP), over the DP x CP ranks that
        share weights: fp32 gradients, as Megatron reduces them under bf16, and compute-dtype
        parameters."""
        local = stage_params / self.layout.tp
        n = self.layout.dp * self.layout.cp
        rs = ring_time(local * 4, n, self.dp_link)
        ag = ring_time(local * self.hw.dtype_bytes, n, self.dp_link)
        return rs, ag

    def optimizer_time(self, stage_params: float) -> float:
        """Adam on this rank's 1/(DP x CP) shard, memory-bound: read grad, master, m, v (16 bytes),
        write master, m, v and the param (12 + 2), read grads once more for the norm (4); plus
        zeroing the whole fp32 gradient buffer (4 per local parameter)."""
        local = stage_params / self.layout.tp
        return (local / (self.layout.dp * self.layout.cp) * 34 + local * 4) / self.mem_bw
