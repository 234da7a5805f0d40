"""Sequences -> data chunks -> the tensors one forward of each chunk consumes.

A `TokenSequence` is one training sample: token ids and a loss mask aligned with the *targets*:
loss_mask[t] = 1 when predicting token t+1 from tokens[:t+1] counts (an assistant token in SFT). The
last position has no target and is always masked. A chunk holding tokens [s, e) of a sequence gets
labels tokens[s+1 : e+1]; for a dependent chunk the label of its last token is the first token of the
next chunk, so no target is lost at chunk boundaries.

Megatron shapes: tokens/labels/loss_mask/position_ids [b=1, t]; THD PackedSeqParams with the chunk's
own segment boundaries (the core attention adds the K/V prefix itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_chunkflow.core.types import DataChunk, StagePlan
from megatron_chunkflow.integration.state import ChunkMeta


@dataclass(frozen=True)
class TokenSequence:
    tokens: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] target-aligned; loss_mask[L-1] == 0

    def __len__(self) -> int:
        return self.tokens.numel()


@dataclass
class ChunkInput:
    """One data chunk's forward inputs (a Megatron micro-batch in THD layout)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: object  # megatron.core.packed_seq_params.PackedSeqParams


@dataclass
class ChunkedStep:
    """What ChunkFlow's forward_backward function consumes for one step on one DP rank."""

    plan: StagePlan
    metas: dict[int, ChunkMeta]
    inputs: dict[int, ChunkInput]

    @property
    def num_tokens(self) -> int:
        return sum(m.num_tokens for m in self.metas.values())


def chunk_meta(chunk: DataChunk, chunk_size: int) -> ChunkMeta:
    pos = torch.tensor(chunk.position_ids(), dtype=torch.long)
    return ChunkMeta(
        chunk_id=chunk.id,
        cu_seqlens=tuple(chunk.cu_seqlens()),
        position_ids=pos,
        seq_id=chunk.parent if chunk.is_dependent else None,
        index=chunk.index if chunk.is_dependent else 0,
        num_siblings=chunk.num_siblings if chunk.is_dependent else 1,
        chunk_size=chunk_size,
    )


def chunk_input(chunk: DataChunk, sequences: Sequence[TokenSequence], meta: ChunkMeta,
                device=None) -> ChunkInput:
    from megatron.core.packed_seq_params import PackedSeqParams

    tokens, labels, mask = [], [], []
    for seg in chunk.segments:
        seq = sequences[seg.seq_id]
        tokens.append(seq.tokens[seg.start:seg.end])
        nxt = seq.tokens[seg.start + 1:seg.end + 1]
        if nxt.numel() < seg.num_tokens:  # the sequence's last token has no target
            nxt = torch.cat([nxt, nxt.new_zeros(seg.num_tokens - nxt.numel())])
        labels.append(nxt)
        mask.append(seq.loss_mask[seg.start:seg.end])
    cu = torch.tensor(meta.cu_seqlens, dtype=torch.int32, device=device)
    max_len = int((cu[1:] - cu[:-1]).max())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max_len, max_seqlen_kv=max_len)
    return ChunkInput(
        tokens=torch.cat(tokens).view(1, -1).to(device),
        labels=torch.cat(labels).view(1, -1).to(device),
        loss_mask=torch.cat(mask).view(1, -1).to(device),
        position_ids=meta.position_ids.view(1, -1).to(device),
        packed_seq_params=packed,
    )


def build_step(plan: StagePlan, sequences: Sequence[TokenSequence], chunk_size: int,
               device=None) -> ChunkedStep:
    metas = {c.id: chunk_meta(c, chunk_size) for c in plan.chunks}
    inputs = {c.id: chunk_input(c, sequences, metas[c.id], device) for c in plan.chunks}
    return ChunkedStep(plan, metas, inputs)
