"""One transformer layer on one GPU, in seconds and in kernels: the pieces perfmodel/roofline.py
composes into per-op costs (recompute, launch floor), for a micro-batch of T tokens on the GPU
(T / CP under CP; padding included).

- GEMMs (QKV, projection, fc1, fc2) take max(FLOPs / (peak * eff), bytes / (mem bw)).
  eff = gemm_max_eff * tile * wave * k_eff, from first principles: the output is cut into tiles
  (the best of a few CUTLASS-like shapes, with split-K when there are fewer tiles than SMs);
  tile quantization wastes the padded part of edge tiles, wave quantization the idle SMs of the
  last wave, and k_eff = K / (K + 128) charges each tile a pipeline fill and epilogue worth 128
  K-elements. Backward = data-gradient GEMM + weight-gradient GEMM, each with its own shape.
- Attention (fused, flash-style): 4 * pairs * heads * head_dim FLOPs forward, 2.5x that backward
  (5 matmuls instead of 2), pairs counted per segment as core/costs.py does. The kernel computes
  whole 128x128 tiles, so each segment is charged its tiles (a short sequence wastes most of its
  diagonal tiles) at attn_fwd_eff / attn_bwd_eff of peak.
- Elementwise work (RMSNorms, residual adds, rotary, SwiGLU) is memory-bound: bytes / (mem bw *
  mem_eff). Under Transformer Engine's spec (Hardware.spec "te") its bytes are counted by hand
  below, the backward moving twice the forward's; under megatron-core's local spec ("local") they
  and the layer's kernels are what the traced step moves and launches (perfmodel/kernels.py).
- TP with sequence parallelism: forward 4 exposed ring collectives (all-gather before QKV and
  fc1, reduce-scatter after projection and fc2) of T*h activations; backward the two
  row-parallel all-gathers are exposed and, as in Megatron's linear layers, the all-gather of a
  column-parallel input overlaps its data-gradient GEMM and the reduce-scatter of its input
  gradient overlaps its weight-gradient GEMM. Ring time = (n-1) * (latency + bytes/n/bw), NVLink
  inside a node, network across.
- CP, stock Megatron: ring attention passes K/V of T/CP tokens CP-1 times forward (K/V and
  their gradients backward) beside the attention compute; Hardware.cp_overlap is the hidden
  fraction: time = compute + transfer - cp_overlap * min(compute, transfer). Every sequence is
  split into 2*CP pieces (load-balanced causal), so tiles are charged on pieces of L / (2 CP).
- CP, ChunkFlow (runtime/cp.py): every segment of a chunk is padded to a multiple of 2*CP (the
  chunk to 2*CP*TP under SP) and cut into 2*CP pieces, rank r holding pieces r and 2*CP-1-r
  (zigzag), so each rank computes T/CP tokens. Per layer and chunk the K/V shards of [its
  sequence's earlier chunks ++ the chunk] (G = prefix + T tokens, whole) go around the CP ranks
  in CP - 1 steps (--chunkflow-cp-attention ring, the default and what this model charges):
  each step's kernel attends the local pieces over the keys of the block at hand (the own block
  bottom-right causal, the others' keys all before the pieces: whole tiles,
  pairs.zigzag_split_pairs; the slowest rank's pairs) while the next block travels, the partial
  results merged by log-sum-exp. The local Q, K, V, the output and log-sum-exp are saved, so the
  backward runs the ring again, each step's kernel backward from them, and each block's fp32
  gradient travels the ring back to its owner (under bf16: twice the K/V bytes). Time =
  overlapped(kernel, transfer, cp_overlap) as for Megatron's ring, the last step's gradient block
  exposed, plus per step after the first the merge's copies of query-side tensors
  (RING_MERGE_BYTES). That is the path of the flash-style kernels modelled here (flash, varlen:
  attention/lse.py); a backend without that pair (te) would gather first and recompute the
  kernel forward in the backward, which this model does not charge. `gather` (all-gather
  first, one kernel call, reduce-scatter after: gather + kernel, gather + bwd + reduce-scatter)
  is the path of replicated state's own-chunk gather below.
  Collectives are rings on hw.link(layout.span("cp")), as the TP ones. With replicated state
  (--chunkflow-cp-kv replicated) a dependent chunk gathers only its own K/V (G = T tokens)
  forward, not overlapped (before the relay), keeps [prefix ++ chunk] whole (the cat, the
  selection and the relay on whole chunks) and in the backward gathers nothing: bwd +
  reduce-scatter of its own dK/dV; its standalone chunks run the ring. Under the hybrid
  placement (--chunkflow-cp-placement hybrid, the default: core/cp_place.py) a standalone
  chunk's segments held whole attend on their rank alone: the chunk's tokens per rank are the
  placement's (padding included), its pairs the busiest rank's, and only the split segments
  are gathered (G) and merged; the whole segments' kernel runs before the ring starts, so none
  of it hides the ring's transfers; a chunk with none split runs as without CP (HYBRID_KERNELS:
  the whole segments' own kernel and the join beside a ring).
- ChunkFlow's own traffic (runtime/state.py, every layer): a dependent chunk's first forward
  writes its own K and V into its sequence's buffer (read and write; its attention reads the
  prefix there in place, nothing is concatenated); the re-forward writes nothing but is charged
  the write too (2 kernels per layer, a bound); its backward adds the prefix part of the K/V
  gradient into the sequence's fp32 accumulator in one add per K and V (read the gradient,
  read-modify-write fp32: the first touch is a cheaper zero-fill and add, charged as a
  read-modify-write too) and, for every chunk but its sequence's last, adds its rows of the
  accumulator to its own gradient (read fp32, cast, add). Under CP
  all of it is on the rank's 1/CP shards, plus the CP path's copies: forward the stack of the
  local K and V (read and write the local shards) and the K and V selections (read and write S
  rows); backward those again (the gather is redone), the selections' gradients index-added into
  zeros of the gathered K and V shape and copied into the gathered K/V's (write, read and write G
  twice, read S, read-modify-write S), the cast of that to fp32 and of the rank's shard back.

Recomputed pieces (what a recompute option re-runs inside the backward, megatron-core 0.16.1):
core_attn the attention core forward (its CP ring and ChunkFlow's CP path included; the K/V write
into the buffer is not redone); mlp fc1 and fc2 GEMMs, SwiGLU and the MLP's two TP collectives (the
whole MLP under tensor_parallel.checkpoint); layernorm the two RMSNorms and the copy of each output
back into its released storage (CheckpointWithoutOutput._recompute); full the whole layer forward.

Kernels per layer (KERNELS_*; the local spec's: perfmodel/kernels.py), counted from
Megatron-LM's GPU layer as its run files use it
(Transformer Engine spec, bf16, fusions on), module by module (transformer_layer.py,
attention.py, mlp.py; TE's LayerNormLinear fuses the norm with the linear):
  forward 12: RMSNorm + QKV GEMM with its bias in the epilogue (2), RoPE on Q and on K (2),
  attention (1), projection GEMM (1), bias-dropout-add (1), RMSNorm + fc1 GEMM (2), SwiGLU (1),
  fc2 GEMM (1), bias-dropout-add (1);
  backward 22: fc2 data and weight gradients (2), SwiGLU (1), fc1 data and weight gradients (2),
  RMSNorm data and weight gradients (2), residual gradient add (1), projection (2), attention
  (3: flash-attention's dO.O pre-pass, the kernel, the dQ conversion), RoPE (2), Q/K/V gradients
  into one tensor (1), QKV data and weight gradients (2), QKV bias gradient (1), RMSNorm (2),
  residual gradient add (1).
  TP > 1 adds its collectives: 4 forward, 6 backward (the 4 reversed, and the column-parallel
  linears' input all-gathers again for their weight gradients). CP > 1 runs the attention once
  per ring step, with a send/receive and an output correction per extra step: 3 more kernels per
  step, forward and backward. ChunkFlow adds 2 forward (the K and V writes into the buffer) and,
  backward, 2 with a prefix (the accumulator adds, K and V) and 3 (its rows of the accumulator
  cast, added to K's and V's gradients).
  ChunkFlow under CP has no ring steps: forward +4 (stack, all-gather, the K and V selections),
  backward +13 (those 4; for K and for V the selection's gradient zero-filled, index-added and
  copied into the gathered shape; cast to fp32, reduce-scatter, cast back), +11 with replicated
  state (no stack and gather again); the ring, per step after the first, forward +4 more (the
  queries' selection, the kernel, the merge's two) and backward +5 (three selections, the
  kernel, the dq add).
  Recompute re-launches what it re-runs: core_attn 1 (+3 per CP step; +4 for ChunkFlow's CP),
  mlp 3 (+2 collectives), layernorm 4 (two norms, two copies), full the forward's.
  megatron-core's local spec launches more: 37-43 forward and 37-46 backward on a GPU
  (perfmodel/kernels.py, counted from the traced step), so 12 / 22 is Transformer Engine's floor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.costs import (
    attention_flops_per_pair_per_layer,
)
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.perfmodel.gemm import (  # noqa: F401  (re-exported)
    gemm_efficiency,
    gemm_shape_factor,
    gemm_time,
)
from megatron_chunkflow.perfmodel.hardware import Hardware
from megatron_chunkflow.perfmodel.kernels import local_layer
from megatron_chunkflow.perfmodel.pairs import (  # noqa: F401  (re-exported)
    attention_tiles,
    computed_pairs,
    gather_extent,
    piece_pairs,
    zigzag_pairs,
    zigzag_split_pairs,
)
from megatron_chunkflow.perfmodel.work import Work, chunk_work  # noqa: F401  (re-exported)

ATTN_BWD_FLOPS = 2.5  # flash backward: 5 matmuls (QK^T again, dP, dV, dQ, dK) vs 2 forward
KERNELS_FWD, KERNELS_BWD = 12, 22  # one layer, TE spec, fused (module docstring)
TP_KERNELS_FWD, TP_KERNELS_BWD = 4, 6  # its collectives under TP > 1
CP_KERNELS_PER_STEP = 3  # attention, send/receive, correction per extra ring step
GATHER_KERNELS_FWD, GATHER_KERNELS_BWD = 4, 13  # ChunkFlow's CP attention (module docstring)
RING_KERNELS_PER_STEP = (4, 5)  # the ring's, per step after the first (module docstring)
# the ring's merge per step, in query-side tensors ([t, heads, head dim]) read or written:
# forward the queries' selection (2), both outputs read and the result written (3); backward
# dout, q and out selected (6), the two dq added (3)
RING_MERGE_BYTES = (5, 9)
HYBRID_KERNELS = (2, 3)  # hybrid CP beside the split segments: local attention, join (+ slices)
RECOMPUTE_KERNELS = {"core_attn": 1, "mlp": 3, "layernorm": 4}
PARTS_CACHE = 50_000  # Parts kept per LayerModel


def ring_time(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """All-gather or reduce-scatter of a tensor of `nbytes` (whole) over a ring of n ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, latency = link
    return (n - 1) * (latency + nbytes / n / bw)


class Dense(NamedTuple):
    """Seconds of one layer's GEMMs, elementwise work and TP collectives (no attention core)."""

    fwd: float
    bwd: float
    mlp_fwd: float  # the MLP's forward: what selective mlp re-runs
    norms_fwd: float  # the two norms and the copy-back: what selective layernorm re-runs


@dataclass(frozen=True)
class Parts:
    """One layer of one chunk: roofline seconds and kernels of its forward and backward (no
    recompute), and per selective module what a recompute of it re-runs (seconds, kernels)."""

    fwd: float
    bwd: float
    fwd_kernels: int
    bwd_kernels: int
    modules: dict  # module -> (seconds, kernels)
    # what a re-forward that skips attention (--chunkflow-reforward-attention keep / offload)
    # leaves out: the attention core's forward seconds (its CP exchange included; replicated
    # state still gathers the chunk's own K/V) and kernels; and what it keeps per layer (bytes
    # of the output and log-sum-exp on this GPU)
    skipped: float = 0.0
    skipped_kernels: int = 0
    kept_bytes: float = 0.0


class LayerModel:
    """One layer's pieces on one parallel layout and device (see the module docstring); caches
    the dense part by token count. Independent of recompute, so shared by every option."""

    def __init__(self, shape: ModelShape, layout: ParallelConfig, hw: Hardware):
        self.shape, self.layout, self.hw = shape, layout, hw
        t = layout.tp  # per-GPU widths: heads, K/V groups and the MLP are split over TP
        self.kv = shape.kv_dim // t
        self.attn_width = shape.num_attention_heads * shape.head_dim // t
        self.qkv_out = self.attn_width + 2 * self.kv
        self.ffn = shape.ffn_hidden_size // t
        self.mem_bw = hw.hbm_gb_s * 1e9 * hw.mem_eff
        self.tp_link = hw.link(layout.span("tp"))
        self.cp_link = hw.link(layout.span("cp"))
        # fp32 reduce-scatter of dK/dV under half precision (runtime/cp_comm.py _GatherKV)
        self.grad_bytes = 4 if hw.dtype_bytes < 4 else hw.dtype_bytes
        # the dense part depends on neither CP overlap nor launch cost: shared across both
        self._dense = _dense_cache(shape, t, dataclasses.replace(hw, cp_overlap=0.0,
                                                                 kernel_launch_us=0.0))
        self._parts: dict[Work, Parts] = {}
        self.ends_cache: dict = {}  # perfmodel/roofline.py's embedding and head, by loss piece
        tp, cp = (t > 1), layout.cp - 1
        # megatron-core's local spec: its memory-bound work and kernels as the traced step counts
        # them (perfmodel/kernels.py); Transformer Engine's: counted by hand (module docstring)
        self.local = (local_layer(shape, t, layout.sequence_parallel, hw.fused_swiglu,
                                  hw.kv_repeat) if hw.spec == "local" else None)
        fwd_k, bwd_k = ((self.local.fwd_kernels, self.local.bwd_kernels) if self.local
                        else (KERNELS_FWD, KERNELS_BWD))
        self.base_kernels = (fwd_k + TP_KERNELS_FWD * tp, bwd_k + TP_KERNELS_BWD * tp)
        self.kernels_fwd = self.base_kernels[0] + CP_KERNELS_PER_STEP * cp
        self.kernels_bwd = self.base_kernels[1] + CP_KERNELS_PER_STEP * cp
        self.module_kernels = {"core_attn": RECOMPUTE_KERNELS["core_attn"]
                               + CP_KERNELS_PER_STEP * cp,
                               "mlp": RECOMPUTE_KERNELS["mlp"] + 2 * tp,
                               "layernorm": RECOMPUTE_KERNELS["layernorm"]}

    def dense(self, tokens: int) -> Dense:
        """The dense part of one layer for `tokens` tokens on this GPU (already divided by CP)."""
        if tokens in self._dense:
            return self._dense[tokens]
        hw, h, T = self.hw, self.shape.hidden_size, tokens
        col = [(self.qkv_out, h), (2 * self.ffn, h)]  # (N out, K in): QKV, fc1
        row = [(h, self.attn_width), (h, self.ffn)]  # projection, fc2
        fwd = sum(gemm_time(T, n, k, hw) for n, k in col + row)
        ag = ring_time(T * h * hw.dtype_bytes, self.layout.tp, self.tp_link)
        bwd = 2 * ag
        for n, k in col:  # dgrad overlaps the input all-gather, wgrad the grad reduce-scatter
            bwd += max(gemm_time(T, k, n, hw), ag) + max(gemm_time(k, n, T, hw), ag)
        for n, k in row:
            bwd += gemm_time(T, k, n, hw) + gemm_time(k, n, T, hw)
        # elements moved per token: 2 RMSNorms (read + write h) and 2 residual adds (2 reads, 1
        # write) on the SP-split h; rotary on Q and K, SwiGLU (read 2f, write f) on TP-split heads
        per_elem = T * hw.dtype_bytes / self.mem_bw
        norms = 8 * h / self.layout.tp * per_elem  # 2 norms (read + write), 2 copy-backs
        if self.local:  # the local spec's kernels as traced (perfmodel/kernels.py), bf16
            swiglu = self.local.swiglu_bytes * T / self.mem_bw
            ew_fwd, ew_bwd = self.local.fwd_bytes * T / self.mem_bw, \
                self.local.bwd_bytes * T / self.mem_bw
        else:
            swiglu = 3 * self.ffn * per_elem
            ew_fwd = (10 * h / self.layout.tp + 2 * (self.attn_width + self.kv)) * per_elem \
                + swiglu
            ew_bwd = 2 * ew_fwd
        mlp = gemm_time(T, 2 * self.ffn, h, hw) + gemm_time(T, h, self.ffn, hw) + 2 * ag + swiglu
        out = Dense(fwd + 4 * ag + ew_fwd, bwd + ew_bwd, mlp, norms)
        self._dense[tokens] = out
        return out

    def attention(self, tokens: int, pairs: float, gathered: int = 0,
                  replicated: bool = False, ring: bool = False, whole: int = 0,
                  whole_pairs: float = 0.0) -> tuple[float, float]:
        """(forward, backward) seconds of one layer's attention core on one GPU for `tokens`
        tokens and `pairs` computed (query, key) pairs on it (chunk_work), CP included: Megatron's
        ring, or with `gathered` K/V tokens ChunkFlow's all-gather (module docstring), gathered
        again in the backward unless the state is `replicated`, or passed around the `ring`;
        under hybrid CP the `whole` tokens of segments held here attend without CP, their
        `whole_pairs` before the ring starts (nothing of it overlaps the ring's transfers)."""
        hw, cp = self.hw, self.layout.cp
        flops = pairs * attention_flops_per_pair_per_layer(self.shape, self.layout.tp)
        fwd = flops / (hw.peak_flops * hw.attn_fwd_eff)
        bwd = ATTN_BWD_FLOPS * flops / (hw.peak_flops * hw.attn_bwd_eff)
        if cp > 1 and whole >= tokens:  # hybrid CP, every segment here whole: no traffic
            return fwd, bwd
        if cp > 1 and gathered and ring:
            gather, scatter = self.gather_times(gathered)  # the same bytes, in CP - 1 steps
            last = scatter / (cp - 1)  # the last step's gradient block: nothing left to hide it
            merge = (cp - 1) * (tokens - whole) * self.attn_width * hw.dtype_bytes / self.mem_bw
            alone = whole_pairs / pairs if pairs else 0.0  # the whole segments' share: no overlap
            return (alone * fwd + overlapped((1 - alone) * fwd, gather, hw.cp_overlap)
                    + RING_MERGE_BYTES[0] * merge,
                    alone * bwd + overlapped((1 - alone) * bwd, gather + scatter - last,
                                             hw.cp_overlap) + last + RING_MERGE_BYTES[1] * merge)
        if cp > 1 and gathered:
            gather, scatter = self.gather_times(gathered)
            # backward from the saved lse; replicated state: from the saved [prefix ++ chunk]
            return gather + fwd, (0.0 if replicated else gather) + bwd + scatter
        if cp > 1:
            bw, latency = self.cp_link
            kv_bytes = tokens * 2 * self.kv * hw.dtype_bytes
            fwd = overlapped(fwd, (cp - 1) * kv_bytes / bw, hw.cp_overlap) + latency
            bwd = overlapped(bwd, (cp - 1) * 2 * kv_bytes / bw, hw.cp_overlap) + latency
        return fwd, bwd

    def gather_times(self, gathered: int) -> tuple[float, float]:
        """(all-gather, reduce-scatter) seconds of ChunkFlow's CP attention in one layer: the K/V
        of `gathered` tokens (whole) over the CP ring, the gradient in fp32 under half
        precision."""
        elems = gathered * 2 * self.kv
        return (ring_time(elems * self.hw.dtype_bytes, self.layout.cp, self.cp_link),
                ring_time(elems * self.grad_bytes, self.layout.cp, self.cp_link))

    def kv_write(self, work: Work) -> float:
        """Seconds of a dependent chunk's first forward writing its own K/V into its sequence's
        buffer, one layer (read and write; whole chunks with replicated state); 0 for others."""
        if not (work.prefix or work.relayed):
            return 0.0
        own = work.gathered if work.replicated else work.tokens
        return 2 * own * self.hw.dtype_bytes * 2 * self.kv / self.mem_bw

    def state_traffic(self, work: Work) -> tuple[float, float]:
        """(forward, backward) seconds of ChunkFlow's K/V state for one layer of a dependent
        chunk (the write into the buffer, kv_write; the fp32 accumulator), and under CP of its
        gather path's copies (module docstring); 0 for other chunks without CP."""
        d, elems = self.hw.dtype_bytes, 2 * self.kv  # K and V per token on this TP rank
        write = self.kv_write(work)
        if work.replicated:  # whole chunks: gathered own, selection; index-add, fp32 relay
            cp, own, s = self.layout.cp, work.gathered, work.selected
            whole = work.prefix + own
            cast = (d + self.grad_bytes) * own if self.grad_bytes != d else 0.0
            fwd = 2 * own / cp * d + 2 * s * d
            bwd = (2 * s * d + 3 * whole * d + 3 * s * d + cast + work.prefix * (d + 8)
                   + (own * (4 + 4 * d) if work.relayed else 0.0))
            return fwd * elems / self.mem_bw + write, bwd * elems / self.mem_bw
        if work.gathered:
            cp, g, s = self.layout.cp, work.gathered, work.selected
            local = g / cp  # this rank's shards of [prefix ++ chunk]
            cast = (d + self.grad_bytes) * (g + local) if self.grad_bytes != d else 0.0
            path = 2 * local * d + 2 * s * d  # stack, selection
            bwd = (path + (3 * g + 3 * s) * d + cast + work.prefix / cp * (d + 8)
                   + (work.tokens * (4 + 4 * d) if work.relayed else 0.0))
            return path * elems / self.mem_bw + write, bwd * elems / self.mem_bw
        bwd = work.prefix * elems * (d + 8) + (work.tokens * elems * (4 + 4 * d)
                                                 if work.relayed else 0.0)
        return write, bwd / self.mem_bw

    def parts(self, work: Work) -> Parts:
        """Roofline seconds and kernels of one layer of a chunk doing `work` (no recompute), with
        what each selective module's recompute would add; cached (every recompute option of a
        search asks again)."""
        out = self._parts.get(work)
        if out is None:
            if len(self._parts) >= PARTS_CACHE:
                self._parts.clear()  # bounded: a search's chunkings come and go
            out = self._parts[work] = self._compute_parts(work)
        return out

    def _compute_parts(self, work: Work) -> Parts:
        d = self.dense(work.tokens)
        a_fwd, a_bwd = self.attention(work.tokens, work.pairs, work.gathered, work.replicated,
                                      work.ring, work.whole, work.whole_pairs)
        s_fwd, s_bwd = self.state_traffic(work)
        write_kernels = 2 if work.prefix or work.relayed else 0  # own K and V into the buffer
        acc_kernels = (2 if work.prior else 0) + (3 if work.relayed else 0)
        mk = self.module_kernels
        fwd_k, bwd_k, attn_k = self.kernels_fwd, self.kernels_bwd, mk["core_attn"]
        if work.whole and not work.gathered:  # hybrid CP, every segment whole: no CP kernels
            fwd_k, bwd_k, attn_k = *self.base_kernels, RECOMPUTE_KERNELS["core_attn"]
        elif work.gathered:
            extra = ((RING_KERNELS_PER_STEP[0] * (self.layout.cp - 1),
                      RING_KERNELS_PER_STEP[1] * (self.layout.cp - 1)) if work.ring else (0, 0))
            fwd_k = self.base_kernels[0] + GATHER_KERNELS_FWD + extra[0]
            bwd_k = self.base_kernels[1] + GATHER_KERNELS_BWD - 2 * work.replicated + extra[1]
            attn_k = RECOMPUTE_KERNELS["core_attn"] + GATHER_KERNELS_FWD + extra[0]
            if work.whole:  # hybrid CP: the whole segments' own kernel, the outputs joined
                fwd_k, bwd_k, attn_k = (fwd_k + HYBRID_KERNELS[0], bwd_k + HYBRID_KERNELS[1],
                                        attn_k + HYBRID_KERNELS[0])
        # a recompute of the core attention runs the CP path again but writes no K/V
        modules = {"core_attn": (a_fwd + s_fwd - self.kv_write(work), attn_k),
                   "mlp": (d.mlp_fwd, mk["mlp"]), "layernorm": (d.norms_fwd, mk["layernorm"])}
        own_gather = self.gather_times(work.gathered)[0] if work.replicated else 0.0
        heads = self.shape.num_attention_heads // self.layout.tp
        kept = work.tokens * (self.attn_width * self.hw.dtype_bytes + heads * self.grad_bytes)
        return Parts(d.fwd + a_fwd + s_fwd, d.bwd + a_bwd + s_bwd,
                     fwd_k + write_kernels, bwd_k + acc_kernels, modules,
                     a_fwd - own_gather, attn_k - 1 - (GATHER_KERNELS_FWD if work.replicated
                                                      else 0), kept)


@lru_cache(maxsize=256)
def _dense_cache(shape: ModelShape, tp: int, hw: Hardware) -> dict[int, Dense]:
    return {}


def overlapped(compute: float, transfer: float, overlap: float) -> float:
    """compute and transfer running side by side, `overlap` of the shorter one hidden."""
    return compute + transfer - overlap * min(compute, transfer)


@lru_cache(maxsize=256)
def layer_model(shape: ModelShape, layout: ParallelConfig, hw: Hardware) -> LayerModel:
    """One LayerModel per (model, parallel layout without recompute, device)."""
    return LayerModel(shape, layout.degrees, hw)
