"""A roofline cost model: seconds per plan op (F, R, B) of a data chunk on a pipeline stage.

One layer's pieces (GEMMs, attention, elementwise, TP and CP traffic, ChunkFlow's K/V traffic)
and its kernel counts come from perfmodel/layer.py; here they become op times:

- Recompute (the layout's config.Recompute, megatron-core 0.16.1): the backward of a layer adds
  the forward of what it re-runs: selective core_attn the attention core (CP ring included;
  under ChunkFlow's CP nothing: runtime/model.py turns Megatron's core_attn checkpoint off there,
  its attention runs its own backward, and predict.runtime_layout drops core_attn from the option);
  mlp the MLP's GEMMs, SwiGLU and its two TP collectives; layernorm the two norms; full the
  whole layer forward with its TP collectives, about 4/3 of forward + backward; block:N full
  for the first N layers of each stage and nothing for the others. ChunkFlow's layout applies
  the same option inside every chunk.
- Launch floor: the host launches a layer's kernels one by one (Hardware.kernel_launch_us each;
  perfmodel/layer.py counts them), so a layer's forward takes max(roofline, kernels x launch),
  and its backward the same with the recomputed kernels added. Per layer, because that is where
  the GPU would idle: the host runs ahead of the GPU while kernels are long and falls behind
  when they are short; with identical layers, per layer and per op are the same bound, and it
  is a floor (the host may be slower still: Python, the dispatcher).
- Per stage: layers x per-layer time, plus the embedding on the first stage and the output layer
  and loss on the last (no launch floor there: large GEMMs and the vocabulary), plus the device's
  host time per op (`op_overhead_us`: 0 on GPUs, measured by `chunkflow bench` on a CPU, where
  Python runs between the kernels). With V virtual stages per rank (ParallelConfig.vpp) the
  stages are the PP x V virtual ones (core/step.py asks for that many): layers / (PP x V) each,
  the embedding on virtual stage 0 (rank 0), the output layer on PP x V - 1 (the last rank), and
  every chunk crosses PP x V - 1 stage boundaries, each a send as below (V times PP's traffic).
- PP point-to-point per micro-batch: the SP-split activation (T / CP / TP) * h. ChunkFlow sends
  each chunk's exact shape asynchronously (runtime/p2p.py), so a receiver waits for the message
  (charged at the chunk size, the largest). Megatron's non-interleaved 1F1B waits on its sends
  and receives (p2p_communication.py `_communicate`, wait_on_reqs), so a stock stage is busy for
  its send: megatron-sft sends the fixed --seq-length shape; megatron-packed and -unpacked send
  each micro-batch's own shape after the shape handshake of variable_seq_lengths
  (`_communicate_shapes`: one more small message, latency only, before every transfer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.costs import layers_per_stage
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.schedule import is_reforwarded
from megatron_chunkflow.core.types import DataChunk
from megatron_chunkflow.perfmodel.footprint import layer_params, total_params
from megatron_chunkflow.perfmodel.hardware import Hardware
from megatron_chunkflow.perfmodel.kernels import (
    GRAD_ACCUM_BYTES,
    GRAD_BUFFER_BYTES,
    LOSS_BYTES,
    OPTIMIZER_BYTES,
    OPTIMIZER_KERNELS_PER_TENSOR,
    param_tensors,
)
from megatron_chunkflow.perfmodel.layer import (  # noqa: F401  (re-exported: older imports)
    ATTN_BWD_FLOPS,
    Parts,
    Work,
    attention_tiles,
    chunk_work,
    computed_pairs,
    gemm_efficiency,
    gemm_shape_factor,
    gemm_time,
    layer_model,
    ring_time,
)

SENDS = ("async", "fixed", "variable")  # ChunkFlow's; megatron-sft's; megatron-packed/-unpacked's


@dataclass
class StageCosts:
    """Seconds per op, per chunk and stage: the planner's and simulator's cost callable. `send`
    (per chunk and stage) is a blocking send's transfer, charged to the sending op: F on every
    stage but the last, B on every stage but the first."""

    forward: dict[int, list[float]]
    backward: dict[int, list[float]]
    comm: float = 0.0  # one point-to-point message between neighbouring stages
    send: dict[int, float] | None = None
    reforward: dict[int, list[float]] | None = None  # R where it is not F's (kept attention)

    def __call__(self, kind: str, chunk: int, stage: int) -> float:
        if kind == "B":
            out = self.backward[chunk][stage]
            return out + self.send[chunk] if self.send and stage > 0 else out
        if kind == "R" and self.reforward and chunk in self.reforward:
            return self.reforward[chunk][stage]
        out = self.forward[chunk][stage]
        if kind == "F" and self.send and stage < len(self.forward[chunk]) - 1:
            out += self.send[chunk]
        return out


@dataclass(frozen=True)
class LayerTimes:
    """One layer of one chunk under the layout's recompute, launch floor applied: forward,
    backward of a layer that keeps its activations (selective modules re-run), backward of a
    fully recomputed layer."""

    fwd: float
    bwd_keep: float
    bwd_full: float


def layer_times(parts: Parts, recompute, launch_s: float) -> LayerTimes:
    """LayerTimes of a layer with these Parts (perfmodel/layer.py) under `recompute`."""
    extra = [parts.modules[m] for m in recompute.modules]
    x_s, x_k = sum(e[0] for e in extra), sum(e[1] for e in extra)
    return LayerTimes(
        max(parts.fwd, parts.fwd_kernels * launch_s),
        max(parts.bwd + x_s, (parts.bwd_kernels + x_k) * launch_s),
        max(parts.bwd + parts.fwd, (parts.bwd_kernels + parts.fwd_kernels) * launch_s))


class Roofline:
    """Op times of one model on one layout and device (see the module docstring)."""

    def __init__(self, shape: ModelShape, layout: ParallelConfig, hw: Hardware,
                 loss_piece: int = 0):
        self.shape, self.layout, self.hw = shape, layout, hw
        self.loss_piece = loss_piece  # --chunkflow-loss-piece: the head's cost (head)
        self.layer = layer_model(shape, layout, hw)  # shared by every recompute option
        self.vocab = math.ceil(shape.vocab_size / layout.tp)
        self.mem_bw = self.layer.mem_bw
        self.tp_link = self.layer.tp_link
        self.pp_link = hw.link(layout.span("pp"))
        self.dp_link = hw.link(layout.span("dp"))
        self.launch_s = hw.kernel_launch_us * 1e-6
        # the local build adds each weight's gradient into its fp32 main_grad, per chunk and layer
        self.grad_accum_s = (layer_params(shape) / layout.tp * GRAD_ACCUM_BYTES / self.mem_bw
                             if self.layer.local else 0.0)
        # (tokens, stages) -> embedding, head, layers; the head depends on the loss piece
        self._ends = self.layer.ends_cache.setdefault(loss_piece, {})

    def attention(self, tokens: int, pairs: float, gathered: int = 0) -> tuple[float, float]:
        """(forward, backward) seconds of one layer's attention core (perfmodel/layer.py)."""
        return self.layer.attention(tokens, pairs, gathered)

    # ---- embedding and output layer ----------------------------------------------------------
    def embedding(self, tokens: int) -> tuple[float, float]:
        """(forward, backward) seconds of the embedding (its TP reduce-scatter included)."""
        hw, h = self.hw, self.shape.hidden_size
        comm = ring_time(tokens * h * hw.dtype_bytes, self.layout.tp, self.tp_link)
        move = tokens * h * hw.dtype_bytes / self.layout.tp / self.mem_bw
        return comm + move, comm + 2 * move

    def head(self, tokens: int) -> tuple[float, float]:
        """Final norm, output layer and vocabulary-parallel cross entropy (fp32 softmax). With the
        loss in pieces (runtime/pieced_loss.py) the backward makes the logits again (one more
        logits GEMM) and both passes stream the fp32 softmax per piece or vocabulary block."""
        hw, h, T = self.hw, self.shape.hidden_size, tokens
        comm = ring_time(T * h * hw.dtype_bytes, self.layout.tp, self.tp_link)
        logits = gemm_time(T, self.vocab, h, hw)
        # bytes per logit moved, F and B: Megatron's cross entropy as traced (perfmodel/kernels.py);
        # in pieces the fp32 softmax streams per piece or vocabulary block
        streamed = (30, 36) if self.loss_piece else LOSS_BYTES
        fwd = logits + comm + T * self.vocab * streamed[0] / self.mem_bw
        bwd = (gemm_time(T, h, self.vocab, hw) + gemm_time(h, self.vocab, T, hw) + comm
               + T * self.vocab * streamed[1] / self.mem_bw + (logits if self.loss_piece else 0))
        return fwd, bwd

    def ends(self, tokens: int, num_stages: int) -> tuple:
        """(embedding, head, layers per stage) for a chunk of `tokens` tokens, cached;
        `num_stages`: the (virtual) stages, PP x V."""
        key = (tokens, num_stages)
        if key not in self._ends:
            self._ends[key] = (self.embedding(tokens), self.head(tokens),
                               layers_per_stage(self.shape.num_layers, num_stages))
        return self._ends[key]

    # ---- per chunk, per stage ----------------------------------------------------------------
    def chunk_costs(self, chunk: DataChunk, num_stages: int, gather: bool | str = False,
                    placement: str = "hybrid") -> tuple[list[float], list[float]]:
        """Forward (F and R) and backward (B, recompute included) seconds per stage; `gather`:
        ChunkFlow's CP attention instead of Megatron's ring, its state sharded (True) or
        "replicated", a standalone chunk's segments placed `placement` (perfmodel/layer.py
        chunk_work)."""
        return self.work_costs(chunk_work(chunk, self.hw.attn_block, self.layout.cp, gather,
                                          self.layout.pad_multiple, placement), num_stages)

    def work_costs(self, work: Work, num_stages: int) -> tuple[list[float], list[float]]:
        """chunk_costs of a chunk doing `work` (perfmodel/layer.py: chunk_work)."""
        emb, head, layers = self.ends(work.tokens, num_stages)
        t = layer_times(self.layer.parts(work), self.layout.recompute, self.launch_s)
        host = self.hw.op_overhead_us * 1e-6  # per op and stage; recompute adds forwards
        fwd, bwd = [], []
        for n in layers:
            r = self.layout.recompute.layers_recomputed(n)
            fwd.append(n * t.fwd + host)
            bwd.append(r * t.bwd_full + (n - r) * t.bwd_keep + host * (1 + r / max(n, 1))
                       + n * self.grad_accum_s)
        fwd[0], bwd[0] = fwd[0] + emb[0], bwd[0] + emb[1]
        fwd[-1], bwd[-1] = fwd[-1] + head[0], bwd[-1] + head[1]
        return fwd, bwd

    def kept_attention_costs(self, work: Work, num_stages: int,
                             mode: str) -> tuple[list[float], list[float]]:
        """(F, R) seconds per stage of a re-forwarded chunk doing `work` whose attention is kept
        (--chunkflow-reforward-attention `mode`, runtime/reforward.py): R runs each layer but its
        attention core; offload adds a copy of the kept output and log-sum-exp to host memory in
        F and back in R, on the compute stream (not overlapped)."""
        emb, head, layers = self.ends(work.tokens, num_stages)
        first, again = self.kept_layer_times(self.layer.parts(work), mode)
        host = self.hw.op_overhead_us * 1e-6
        fwd, refwd = [n * first + host for n in layers], [n * again + host for n in layers]
        for out in (fwd, refwd):
            out[0] += emb[0]
            out[-1] += head[0]
        return fwd, refwd

    def kept_layer_times(self, parts: Parts, mode: str) -> tuple[float, float]:
        """(F, R) seconds of one layer of a re-forwarded chunk with these Parts whose attention
        is kept `mode` (keep or offload; launch floor applied)."""
        copy = parts.kept_bytes / (self.hw.host_gb_s * 1e9) if mode == "offload" else 0.0
        return (max(parts.fwd, parts.fwd_kernels * self.launch_s) + copy,
                max(parts.fwd - parts.skipped,
                    (parts.fwd_kernels - parts.skipped_kernels) * self.launch_s) + copy)

    def p2p_bytes_time(self, tokens: int) -> float:
        """Transfer time of one stage-to-stage send of a micro-batch of `tokens` (whole, before
        CP and SP), latency excluded."""
        bw, _ = self.pp_link
        nbytes = tokens / self.layout.cp / self.layout.tp * self.shape.hidden_size
        return nbytes * self.hw.dtype_bytes / bw

    def p2p_time(self, tokens: int) -> float:
        """One stage-to-stage send of a micro-batch of `tokens` (whole, before CP and SP)."""
        if self.layout.pp == 1:
            return 0.0
        return self.pp_link[1] + self.p2p_bytes_time(tokens)

    def stage_costs(self, chunks, num_stages: int, p2p_tokens: int,
                    sends: str = "async", gather: bool | str = False,
                    placement: str = "hybrid", kept: tuple[str, int] | None = None
                    ) -> StageCosts:
        """StageCosts of `chunks`; `sends` (SENDS, module docstring): "async" messages of
        `p2p_tokens` tokens a receiver waits for, or Megatron's blocking sends of the fixed
        `p2p_tokens` shape or of each chunk's own computed shape after a handshake; `gather`:
        ChunkFlow's CP attention, `placement` its standalone chunks' (chunk_costs); `kept`:
        (--chunkflow-reforward-attention, K), the re-forwarded chunks' F and R when it is keep
        or offload (kept_attention_costs)."""
        if sends not in SENDS:
            raise ValueError(f"sends must be one of {', '.join(SENDS)}, got {sends!r}")
        fwd, bwd, refwd = {}, {}, {}
        for c in chunks:
            fwd[c.id], bwd[c.id] = self.chunk_costs(c, num_stages, gather, placement)
            if kept is not None and kept[0] != "recompute" and is_reforwarded(c, kept[1]):
                work = chunk_work(c, self.hw.attn_block, self.layout.cp, gather,
                                  self.layout.pad_multiple, placement)
                fwd[c.id], refwd[c.id] = self.kept_attention_costs(work, num_stages, kept[0])
        if sends == "async" or self.layout.pp == 1:
            return StageCosts(fwd, bwd, comm=self.p2p_time(p2p_tokens), reforward=refwd)
        latency = self.pp_link[1]
        if sends == "fixed":
            fixed = self.p2p_bytes_time(p2p_tokens)
            return StageCosts(fwd, bwd, comm=latency, send={c.id: fixed for c in chunks},
                              reforward=refwd)
        return StageCosts(fwd, bwd, comm=2 * latency,
                          send={c.id: self.p2p_bytes_time(c.computed_tokens) for c in chunks},
                          reforward=refwd)

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
        """Adam on this rank's 1/(DP x CP) shard, memory-bound, plus zeroing the whole fp32
        gradient buffer and scaling it by 1 / tokens (GRAD_BUFFER_BYTES per local parameter).
        Transformer Engine's fused Adam: read grad,
        master, m, v (16 bytes), write master, m, v and the param (12 + 2), read grads once more
        for the norm (4). The local build's torch AdamW (foreach): OPTIMIZER_BYTES as traced, and
        its kernels (two per parameter tensor) launched one by one (perfmodel/kernels.py)."""
        local = stage_params / self.layout.tp
        shard = local / (self.layout.dp * self.layout.cp)
        if not self.layer.local:
            return (shard * 34 + local * GRAD_BUFFER_BYTES) / self.mem_bw
        layers = self.shape.num_layers * stage_params / max(total_params(self.shape), 1)
        launches = OPTIMIZER_KERNELS_PER_TENSOR * param_tensors(self.shape, math.ceil(layers))
        return max((shard * OPTIMIZER_BYTES + local * GRAD_BUFFER_BYTES) / self.mem_bw,
                   launches * self.launch_s)
