"""FLOPs of data chunks, and the per-op cost table the planner and simulator run on.

Attention is counted per segment: a segment of q query tokens that starts after `prefix` tokens of
its sequence attends to q*prefix + q*(q+1)/2 (query, key) pairs (causal, bottom-right aligned).
Packing short sequences therefore costs sum(L^2)/2, not (sum L)^2/2, and a late dependent chunk
of a long sequence costs about C*prefix. Recompute is not counted here: the planner adds R ops.
Memory is not modelled here (the planner works on time): perfmodel/footprint.py holds the memory
model and passes it to core/step.py as hooks.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.types import DataChunk


def attention_pairs(prefix: int, num_q: int) -> int:
    """(query, key) pairs of one segment: causal over itself, full over its prefix."""
    return num_q * prefix + num_q * (num_q + 1) // 2


def chunk_attention_pairs(chunk: DataChunk) -> int:
    """(query, key) pairs a chunk's forward computes: a dependent chunk attends to its sequence's
    prefix; a segment's padding is attended as part of it."""
    return sum(attention_pairs(s.start if chunk.is_dependent else 0, s.computed_tokens)
               for s in chunk.segments)


def linear_weights_per_layer(shape: ModelShape) -> int:
    """Matmul weights of one layer (biases and norms excluded): QKV, output projection, SwiGLU
    MLP (fc1 of width 2 ffn, fc2)."""
    h, kv = shape.hidden_size, shape.kv_dim
    attn_width = shape.num_attention_heads * shape.head_dim
    return h * (attn_width + 2 * kv) + attn_width * h + 3 * h * shape.ffn_hidden_size


def linear_flops_per_token_per_layer(shape: ModelShape) -> int:
    """Matmul FLOPs per token per layer: QKV, output projection, SwiGLU MLP (2 per MAC); in a
    mixture of experts the router and the experts a token is routed to (and the shared expert
    and its gate) instead of the dense MLP."""
    if not shape.is_moe:
        return 2 * linear_weights_per_layer(shape)
    h = shape.hidden_size
    dense_mlp = 3 * h * shape.ffn_hidden_size
    shared = 3 * h * shape.moe_shared_expert_size + h if shape.moe_shared_expert_size else 0
    active = 3 * h * shape.moe_ffn_hidden_size * shape.moe_topk + h * shape.num_experts + shared
    return 2 * (linear_weights_per_layer(shape) - dense_mlp + active)


def attention_flops_per_pair_per_layer(shape: ModelShape, tp: int = 1) -> int:
    """QK^T and PV, 2 FLOPs per MAC each, over the query heads of one of `tp` tensor-parallel
    ranks (all of them by default)."""
    return 4 * (shape.num_attention_heads // tp) * shape.head_dim


def logits_flops_per_token(shape: ModelShape) -> int:
    """The output layer's matmul (2 per MAC)."""
    return 2 * shape.hidden_size * shape.vocab_size


@dataclass(frozen=True)
class ChunkFlops:
    """Forward FLOPs of one chunk, split so a pipeline stage can take its share."""

    per_layer: float  # linear + attention, one layer
    logits: float  # output layer (last stage)

    def forward(self, num_layers: int, with_logits: bool = True) -> float:
        return self.per_layer * num_layers + (self.logits if with_logits else 0.0)


def chunk_flops(chunk: DataChunk, shape: ModelShape) -> ChunkFlops:
    """Forward FLOPs of `chunk`, per layer and of the output layer."""
    tokens = chunk.computed_tokens
    per_layer = (tokens * linear_flops_per_token_per_layer(shape)
                 + chunk_attention_pairs(chunk) * attention_flops_per_pair_per_layer(shape))
    return ChunkFlops(float(per_layer), float(tokens * logits_flops_per_token(shape)))


def sequence_model_flops(lengths, shape: ModelShape) -> float:
    """Model FLOPs of one training step on whole sequences: forward + backward (2x), attention per
    sequence, recompute not counted."""
    per_token = shape.num_layers * linear_flops_per_token_per_layer(shape) \
        + logits_flops_per_token(shape)
    pairs = sum(attention_pairs(0, n) for n in lengths)
    attention = shape.num_layers * attention_flops_per_pair_per_layer(shape) * pairs
    return 3.0 * (sum(lengths) * per_token + attention)


def layers_per_stage(num_layers: int, num_stages: int) -> list[int]:
    """Megatron's even split; a remainder goes to the first stages."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


@dataclass
class OpCosts:
    """Time of each plan op on each stage, in arbitrary units (FLOPs by default).

    F and R cost the chunk's forward on that stage; B costs `backward_factor` times it. `comm` is
    the latency of one point-to-point transfer between neighbouring stages.
    """

    forward: dict[int, list[float]]  # chunk id -> forward cost per stage
    backward_factor: float = 2.0
    comm: float = 0.0

    def __call__(self, kind: str, chunk: int, stage: int) -> float:
        f = self.forward[chunk][stage]
        return f * self.backward_factor if kind == "B" else f

    @classmethod
    def from_model(cls, chunks, shape: ModelShape, num_stages: int, **kw) -> OpCosts:
        layers = layers_per_stage(shape.num_layers, num_stages)
        table = {}
        for c in chunks:
            fl = chunk_flops(c, shape)
            table[c.id] = [fl.forward(n, with_logits=(s == num_stages - 1))
                           for s, n in enumerate(layers)]
        return cls(table, **kw)

    @classmethod
    def uniform(cls, chunk_ids, num_stages: int, forward: float = 1.0, **kw) -> OpCosts:
        return cls({c: [forward] * num_stages for c in chunk_ids}, **kw)
