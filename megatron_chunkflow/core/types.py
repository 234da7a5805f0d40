"""Plain data types shared by the planner, the schedules and the integration layer.

Vocabulary (also in README.md, "Glossary"):
- A *sequence* is one training sample (a conversation), `num_tokens` long.
- A *data chunk* is what one forward pass runs on: at most `chunk_size` tokens. We say "data chunk"
  because Megatron's "model chunk" means a virtual pipeline stage.
- A *dependent* data chunk is a piece of a sequence longer than the chunk size; its queries attend to
  the keys/values of the earlier chunks of the same sequence (the *state*).
- A *standalone* data chunk packs whole short sequences; each attends only to itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ChunkKind = Literal["standalone", "dependent"]


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of sequence `seq_id`, placed contiguously inside one data chunk, then
    `padding` pad tokens computed as part of it (a stock baseline's: Megatron-LM's SFT dataset
    pads a packed line to --seq-length and each sequence to a multiple of 2 x CP): they are
    attended causally like the sequence's own tokens, continue its positions and carry no loss."""

    seq_id: int
    start: int
    end: int
    padding: int = 0

    @property
    def num_tokens(self) -> int:
        """The sequence's tokens (what the model is trained on)."""
        return self.end - self.start

    @property
    def computed_tokens(self) -> int:
        """Tokens the model computes for this segment: its own plus the padding."""
        return self.end - self.start + self.padding


@dataclass(frozen=True)
class DataChunk:
    """One data chunk: the unit of a forward pass (a Megatron micro-batch).

    `segments` lie back to back in the chunk. A dependent chunk has exactly one segment, whose
    `start` is the length of the prefix (earlier chunks of the same sequence) it attends to.
    """

    id: int
    kind: ChunkKind
    segments: tuple[Segment, ...]
    parent: int | None = None  # seq_id of the long sequence (dependent chunks only)
    index: int | None = None  # position among the parent's dependent chunks, 0-based
    num_siblings: int | None = None  # how many dependent chunks the parent has
    dp_rank: int = 0

    @property
    def num_tokens(self) -> int:
        """Sequence tokens in the chunk (padding excluded)."""
        return sum(s.num_tokens for s in self.segments)

    @property
    def computed_tokens(self) -> int:
        """Tokens the forward pass computes: sequence tokens plus padding."""
        return sum(s.computed_tokens for s in self.segments)

    @property
    def is_dependent(self) -> bool:
        return self.kind == "dependent"

    @property
    def prefix_len(self) -> int:
        """Tokens of state this chunk attends to before its own (0 for standalone chunks)."""
        return self.segments[0].start if self.is_dependent else 0

    def cu_seqlens(self) -> list[int]:
        """Cumulative segment boundaries inside the chunk, [0, len0, len0+len1, ...] (a segment's
        padding inside its boundaries)."""
        out = [0]
        for s in self.segments:
            out.append(out[-1] + s.computed_tokens)
        return out

    def position_ids(self) -> list[int]:
        """RoPE positions per token: continuing across a sequence's chunks, restarting per
        segment, continuing through a segment's padding."""
        return [p for s in self.segments for p in range(s.start, s.end + s.padding)]

    def to_json(self) -> dict:
        out = {
            "id": self.id,
            "kind": self.kind,
            "parent": self.parent,
            "index": self.index,
            "segments": [[s.seq_id, s.start, s.end] for s in self.segments],
            "tokens": self.num_tokens,
            "dp_rank": self.dp_rank,
        }
        if self.computed_tokens != self.num_tokens:
            out["padding"] = [s.padding for s in self.segments]
        return out


@dataclass(frozen=True)
class ChunkBatch:
    """The chunks of one global batch (all DP ranks), as built by `core.packer.build_chunks`."""

    chunks: tuple[DataChunk, ...]
    seq_lengths: tuple[int, ...]
    chunk_size: int
    num_dp_ranks: int
    bins_lower_bound: int  # ceil(short tokens / chunk_size): no packing can use fewer standalone chunks

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lengths)

    @property
    def num_standalone(self) -> int:
        return sum(1 for c in self.chunks if not c.is_dependent)

    @property
    def padding_fraction(self) -> float:
        """Share of chunk capacity (num_chunks * chunk_size) left empty."""
        if not self.chunks:
            return 0.0
        return 1.0 - self.num_tokens / (len(self.chunks) * self.chunk_size)

    def chunks_for_rank(self, dp_rank: int) -> list[DataChunk]:
        return [c for c in self.chunks if c.dp_rank == dp_rank]


OpKind = Literal["F", "R", "B"]


@dataclass(frozen=True)
class Op:
    """One step of a stage's plan.

    F: the chunk's first forward (without an autograd graph when the chunk is re-forwarded later);
    R: its re-forward with grad; B: its backward. `model_chunk` is Megatron's model chunk (virtual
    pipeline stage) of the rank the op runs on: model chunk v of pipeline rank r is virtual stage
    v x PP + r; always 0 without virtual stages.
    """

    kind: OpKind
    chunk: int
    model_chunk: int = 0

    def to_json(self) -> dict:
        out = {"op": self.kind, "chunk": self.chunk}
        if self.model_chunk:
            out["model_chunk"] = self.model_chunk
        return out


@dataclass(frozen=True)
class PipelinePlan:
    """One DP rank's step for the whole pipeline: per pipeline rank (stage), the ordered ops it
    executes; with virtual stages (`num_model_chunks` V > 1) a rank's ops run on V model chunks
    and a data chunk passes through the PP x V virtual stages in order (Op.model_chunk)."""

    stages: tuple[tuple[Op, ...], ...]
    chunks: tuple[DataChunk, ...]  # the chunks this plan runs (one DP rank's)
    num_model_chunks: int = 1

    @property
    def num_stages(self) -> int:
        """Pipeline ranks (PP)."""
        return len(self.stages)

    @property
    def num_virtual_stages(self) -> int:
        """PP x V: the stages a data chunk's forward passes through."""
        return len(self.stages) * self.num_model_chunks

    def virtual_stage(self, stage: int, op: Op) -> int:
        """The virtual stage of `op` on pipeline rank `stage`."""
        return op.model_chunk * len(self.stages) + stage

    @property
    def recomputed(self) -> frozenset[int]:
        """Chunk ids whose F runs without a graph (they have an R)."""
        if not self.stages:
            return frozenset()
        return frozenset(op.chunk for op in self.stages[0] if op.kind == "R")

    def to_json(self) -> list[list[dict]]:
        return [[op.to_json() for op in stage] for stage in self.stages]
