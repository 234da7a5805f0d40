"""Expert parallelism across data-parallel ranks: one op sequence for the whole expert group.

An MoE layer's token dispatch is a collective of its expert-parallel (EP) group (an all-gather of
the expert counts and two all-to-alls in forward, two all-to-alls in backward): every rank of the
group must enter it the same number of times, a forward with a forward, a backward with a
backward. Where the EP group spans DP ranks, those ranks hold different chunks, and their own
plans would differ in length and order. `aligned_plan` gives all of them one plan shape:

- a template of the group's chunk structure: per long sequence, ranked by chunk count, the most
  chunks any rank of the group has in that rank; as many standalone chunks as the rank with most;
- the template planned once (core/schedule.py, state-aware), every rank with the same synthetic
  costs (full chunks), so every rank's plan has the same ops in the same order on every stage;
- each rank's own chunks put in the template's slots: a long sequence's n chunks in the last n
  slots of its template sequence (so that exactly its own last K chunks keep activations and the
  others are re-forwarded, as in its own plan), its standalone chunks in order; a slot left over
  runs a filler chunk: padding only (no token of any sequence, no loss, no balancing-loss row),
  which enters the collectives for this rank.

The gradients stay those of ordinary training (a filler contributes zero to every gradient); the
cost is the fillers' compute, bounded by the chunk-structure differences between DP ranks, which
the packer's balancing keeps small.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.schedule import state_aware_plan
from megatron_chunkflow.core.types import ChunkBatch, DataChunk, Op, PipelinePlan, Segment


def _structure(chunks: Sequence[DataChunk]) -> tuple[list[list[DataChunk]], list[DataChunk]]:
    """A rank's long sequences (each its chunks in order), most chunks first (then by sequence
    id), and its standalone chunks in order."""
    sequences: dict[int, list[DataChunk]] = {}
    standalone = []
    for c in chunks:
        if c.is_dependent:
            sequences.setdefault(c.parent, []).append(c)
        else:
            standalone.append(c)
    ordered = sorted(sequences.values(), key=lambda s: (-len(s), s[0].parent))
    return [sorted(s, key=lambda c: c.index) for s in ordered], standalone


def filler_chunk(chunk_id: int, num_tokens: int, dp_rank: int) -> DataChunk:
    """A chunk of `num_tokens` padding tokens and nothing else (sequence 0's segment [0, 0))."""
    return DataChunk(chunk_id, "standalone", (Segment(0, 0, 0, padding=num_tokens),),
                     dp_rank=dp_rank)


def aligned_plan(batch: ChunkBatch, dp_ranks: Sequence[int], dp_rank: int, num_stages: int,
                 num_kept: int, shape: ModelShape, num_model_chunks: int = 1,
                 filler_tokens: int = 1) -> tuple[PipelinePlan, OpCosts]:
    """The plan of DP rank `dp_rank` (one of `dp_ranks`, an expert group's) whose ops, stage by
    stage, have the kinds and order of every other rank's of the group (module docstring), and
    its costs. Fillers are `filler_tokens` long (a multiple the layout's padding needs)."""
    if dp_rank not in dp_ranks:
        raise ValueError(f"DP rank {dp_rank} is not among its expert group's {tuple(dp_ranks)}")
    structures = {r: _structure(batch.chunks_for_rank(r)) for r in dp_ranks}
    num_sequences = max(len(s[0]) for s in structures.values())
    lengths = [max((len(s[0][j]) if j < len(s[0]) else 0) for s in structures.values())
               for j in range(num_sequences)]
    num_standalone = max(len(s[1]) for s in structures.values())
    size = batch.chunk_size
    template: list[DataChunk] = []
    for j, n in enumerate(lengths):  # dependent chunks first, as the packer numbers them
        template += [DataChunk(len(template) + i, "dependent",
                               (Segment(j, i * size, (i + 1) * size),), parent=j, index=i,
                               num_siblings=n) for i in range(n)]
    template += [DataChunk(len(template) + i, "standalone", (Segment(num_sequences, 0, size),))
                 for i in range(num_standalone)]
    virtual = num_stages * num_model_chunks
    costs = OpCosts.from_model(template, shape, virtual)
    plan = state_aware_plan(template, num_stages, num_kept, costs, num_model_chunks)

    sequences, standalone = structures[dp_rank]
    ids = itertools.count(len(batch.chunks))  # fillers numbered after the global batch's chunks

    def fillers(n: int) -> list[DataChunk]:
        return [filler_chunk(next(ids), filler_tokens, dp_rank) for _ in range(n)]

    slots: list[DataChunk] = []
    for j, n in enumerate(lengths):
        own = sequences[j] if j < len(sequences) else []
        slots += fillers(n - len(own)) + own
    slots += standalone + fillers(num_standalone - len(standalone))
    stages = tuple(tuple(Op(op.kind, slots[op.chunk].id, op.model_chunk) for op in ops)
                   for ops in plan.stages)
    own_costs = OpCosts.from_model(slots, shape, virtual)
    return PipelinePlan(stages, tuple(slots), num_model_chunks), own_costs
