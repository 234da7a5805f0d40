"""Sequences -> data chunks -> the tensors one forward of each chunk consumes.

A `TokenSequence` (data/sequence.py) is one training sample: token ids and a loss mask aligned with
the *targets*. A chunk holding tokens [s, e) of a sequence gets
labels tokens[s+1 : e+1]; for a dependent chunk the label of its last token is the first token of the
next chunk, so no target is lost at chunk boundaries.

Megatron shapes: tokens/labels/loss_mask/position_ids [b=1, t]; THD PackedSeqParams with the chunk's
own segment boundaries (the core attention adds the K/V prefix itself). Under context parallelism a
rank's inputs are its zigzag shard of the chunk (runtime/cp.py: t = chunk tokens / CP), while the
PackedSeqParams keep the whole chunk's boundaries, as Megatron's THD RoPE expects; under a hybrid
placement (core/cp_place.py) the rank's segments held whole come first, then its zigzag pieces of
the split ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.cp_place import place_segments
from megatron_chunkflow.core.types import ChunkBatch, DataChunk, PipelinePlan
from megatron_chunkflow.data.sequence import TokenSequence
from megatron_chunkflow.runtime.state import ChunkMeta


@dataclass
class ChunkInput:
    """One data chunk's forward inputs (a Megatron micro-batch in THD layout)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: object  # megatron.core.packed_seq_params.PackedSeqParams

    def to(self, device) -> "ChunkInput":
        """These inputs on `device` (the model's). The packed-sequence offsets stay on the host:
        chunk attention reads them as lists (a device copy would cost a sync per layer)."""
        return ChunkInput(self.tokens.to(device), self.labels.to(device),
                          self.loss_mask.to(device), self.position_ids.to(device),
                          self.packed_seq_params)


@dataclass
class ChunkedStep:
    """What ChunkFlow's forward_backward function consumes for one step on one DP rank."""

    plan: PipelinePlan
    metas: dict[int, ChunkMeta]
    inputs: dict[int, ChunkInput]
    forward_only: frozenset[int] = frozenset()  # SpaCO: chunks without backward (sparse.py)
    batch: ChunkBatch | None = None  # the global batch's chunks (every DP rank's)
    costs: OpCosts | None = None  # the cost model the plan was built with

    @property
    def num_tokens(self) -> int:
        return sum(m.num_tokens for m in self.metas.values())


def chunk_meta(chunk: DataChunk, chunk_size: int, pad_multiple: int = 1, cp_size: int = 1,
               cp_rank: int = 0, cp_placement: str = "hybrid") -> ChunkMeta:
    """`pad_multiple`: pad the chunk to a multiple of this many tokens (the TP size under sequence
    parallelism) with a padding segment that attends only to itself and has no loss. `cp_size`,
    `cp_rank`: this rank's share under context parallelism (the chunk's segments are already
    padded to 2 x CP pieces by core/packer); `cp_placement` hybrid keeps a standalone chunk's
    segments whole on one rank where they fit (core/cp_place.py), each rank's shortfall padded
    with a segment of its own; split cuts every segment over every rank."""
    computed = chunk.computed_tokens
    num_padding = -computed % pad_multiple
    assert not (num_padding and chunk.is_dependent and chunk.index + 1 < chunk.num_siblings), \
        "only a sequence's last chunk can need padding (C is a multiple of the TP size)"
    cu = chunk.cu_seqlens() + ([computed + num_padding] if num_padding else [])
    pads, owners = [num_padding] if num_padding else [], ()
    if cp_size > 1 and cp_placement == "hybrid" and not chunk.is_dependent:
        placed = place_segments([b - a for a, b in zip(cu[:-1], cu[1:])], cp_size, pad_multiple)
        if placed is not None:  # each rank's shortfall: a padding segment of its own
            mine = [n for n in placed.padding if n]
            owners = placed.owners + tuple(r for r, n in enumerate(placed.padding) if n)
            num_padding += sum(mine)
            for n in mine:
                cu.append(cu[-1] + n)
            pads += mine
    positions = chunk.position_ids() + [p for n in pads for p in range(n)]
    return ChunkMeta(
        chunk_id=chunk.id,
        cu_seqlens=tuple(cu),
        position_ids=torch.tensor(positions, dtype=torch.long),
        seq_id=chunk.parent if chunk.is_dependent else None,
        index=chunk.index if chunk.is_dependent else 0,
        num_siblings=chunk.num_siblings if chunk.is_dependent else 1,
        chunk_size=chunk_size,
        num_padding=num_padding,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_owners=owners,
        segment_padding=tuple(seg.padding for seg in chunk.segments),
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
        _pad(tokens, labels, mask, seg.padding)  # a baseline's padding, part of the segment
    _pad(tokens, labels, mask, meta.num_padding)  # a segment of its own
    # Megatron's THD RoPE under CP picks each segment's zigzag pieces of these boundaries; a
    # hybrid chunk's rank holds other tokens, so it sees one segment (runtime/model.py's RoPE)
    cu = torch.tensor(meta.cu_seqlens if not meta.cp_owners else (0, meta.num_tokens),
                      dtype=torch.int32, device=device)
    max_len = int((cu[1:] - cu[:-1]).max())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max_len, max_seqlen_kv=max_len)
    columns = [torch.cat(tokens), torch.cat(labels), torch.cat(mask), meta.position_ids]
    if meta.cp_size > 1:
        from megatron_chunkflow.runtime.cp_keys import local_index

        mine = local_index(meta.cu_seqlens, meta.cp_size, meta.cp_rank, meta.cp_owners)
        columns = [c[mine] for c in columns]
    tokens, labels, mask, positions = (c.view(1, -1).to(device) for c in columns)
    return ChunkInput(tokens=tokens, labels=labels, loss_mask=mask, position_ids=positions,
                      packed_seq_params=packed)


def _pad(tokens: list, labels: list, mask: list, n: int) -> None:
    """Append `n` padding tokens (id 0, target 0, no loss)."""
    if n:
        pad = torch.zeros(n, dtype=torch.long)
        tokens.append(pad)
        labels.append(pad)
        mask.append(torch.zeros(n, dtype=mask[0].dtype))


def build_step(plan: PipelinePlan, sequences: Sequence[TokenSequence], chunk_size: int,
               device=None, pad_multiple: int = 1, batch: ChunkBatch | None = None,
               costs: OpCosts | None = None, cp_size: int = 1, cp_rank: int = 0,
               cp_placement: str = "hybrid") -> ChunkedStep:
    """The ChunkedStep of `plan` (one DP rank's chunks) over `sequences` (the global batch), this
    CP rank's share of it."""
    metas = {c.id: chunk_meta(c, chunk_size, pad_multiple, cp_size, cp_rank, cp_placement)
             for c in plan.chunks}
    seq_tokens: dict[int, int] = {}  # a long sequence's chunks all run on this DP rank
    for m in metas.values():
        if m.dependent:
            seq_tokens[m.seq_id] = seq_tokens.get(m.seq_id, 0) + m.num_tokens
    metas = {i: dataclasses.replace(m, seq_tokens=seq_tokens[m.seq_id]) if m.dependent else m
             for i, m in metas.items()}
    inputs = {c.id: chunk_input(c, sequences, metas[c.id], device) for c in plan.chunks}
    return ChunkedStep(plan, metas, inputs, batch=batch, costs=costs)


def whole_sequence_input(seq: TokenSequence) -> ChunkInput:
    """One sequence as a Megatron micro-batch [b=1, s] in SBHD layout (no packing)."""
    n = len(seq)
    labels = torch.cat([seq.tokens[1:], seq.tokens.new_zeros(1)])
    return ChunkInput(seq.tokens.view(1, -1), labels.view(1, -1), seq.loss_mask.view(1, -1),
                      torch.arange(n).view(1, -1), None)
