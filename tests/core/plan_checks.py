"""Independent checks of chunk batches and plans, shared by the planner tests."""

from __future__ import annotations

from collections import defaultdict

from megatron_chunkflow.core.types import ChunkBatch, PipelinePlan


def check_batch(batch: ChunkBatch) -> None:
    """Every token in exactly one chunk, in order; sizes; dependent chunks together."""
    C = batch.chunk_size
    pieces = defaultdict(list)
    for c in batch.chunks:
        assert 0 < c.num_tokens <= C, (c, C)
        assert 0 <= c.dp_rank < batch.num_dp_ranks
        if c.is_dependent:
            assert len(c.segments) == 1 and c.parent == c.segments[0].seq_id
        for s in c.segments:
            pieces[s.seq_id].append((s.start, s.end, c))
    assert sorted(pieces) == list(range(len(batch.seq_lengths)))
    for seq_id, L in enumerate(batch.seq_lengths):
        parts = sorted(pieces[seq_id], key=lambda x: x[0])
        assert parts[0][0] == 0 and parts[-1][1] == L
        for (s0, e0, _), (s1, e1, _) in zip(parts, parts[1:]):
            assert e0 == s1, f"sequence {seq_id}: gap or overlap at {e0}/{s1}"
        chunks = [c for _, _, c in parts]
        if L > C:
            assert all(c.is_dependent for c in chunks)
            assert [c.index for c in chunks] == list(range(len(chunks)))
            assert all(c.num_siblings == len(chunks) for c in chunks)
            assert len({c.dp_rank for c in chunks}) == 1, "dependent chunks split across DP"
            ids = [c.id for c in chunks]
            assert ids == list(range(ids[0], ids[0] + len(ids))), "dependent ids not consecutive"
            assert all(c.num_tokens == C for c in chunks[:-1])
        else:
            assert len(chunks) == 1 and not chunks[0].is_dependent


def check_plan(plan: PipelinePlan, k: int) -> None:
    """Op counts, per-sequence order, the K window, one forward and one backward order for all
    (virtual) stages, so point-to-point messages between neighbours arrive in the order they are
    sent; with virtual stages also at most K x V (model chunk) activations of a sequence per rank."""
    chunks = {c.id: c for c in plan.chunks}
    by_stage = defaultdict(list)
    for r, ops in enumerate(plan.stages):
        rank_held = defaultdict(int)
        for op in ops:
            assert 0 <= op.model_chunk < plan.num_model_chunks
            by_stage[plan.virtual_stage(r, op)].append(op)
            c = chunks[op.chunk]
            if c.is_dependent:
                recompute = c.index < c.num_siblings - k
                rank_held[c.parent] += -1 if op.kind == "B" else \
                    int(op.kind == "R" or not recompute)
                assert rank_held[c.parent] <= k * plan.num_model_chunks
    assert sorted(by_stage) == list(range(plan.num_virtual_stages))
    forward_orders, backward_orders = [], []
    for s in range(plan.num_virtual_stages):
        ops = by_stage[s]
        seen = defaultdict(list)
        for i, op in enumerate(ops):
            seen[op.chunk].append(op.kind)
        assert set(seen) == set(chunks), f"stage {s}: chunks missing or extra"
        for cid, kinds in seen.items():
            c = chunks[cid]
            recompute = c.is_dependent and c.index < c.num_siblings - k
            assert kinds == (["F", "R", "B"] if recompute else ["F", "B"]), (s, cid, kinds)
        forward_orders.append([op.chunk for op in ops if op.kind == "F"])
        backward_orders.append([op.chunk for op in ops if op.kind == "B"])
        # per sequence: forwards ascend, backwards strictly descend, at most K hold activations
        by_seq_f, by_seq_b, held = defaultdict(list), defaultdict(list), defaultdict(int)
        for op in ops:
            c = chunks[op.chunk]
            if not c.is_dependent:
                continue
            recompute = c.index < c.num_siblings - k
            if op.kind == "F":
                by_seq_f[c.parent].append(c.index)
            if op.kind == "B":
                by_seq_b[c.parent].append(c.index)
                held[c.parent] -= 1
            if op.kind == "R" or (op.kind == "F" and not recompute):
                held[c.parent] += 1
                assert held[c.parent] <= k, f"stage {s}: sequence {c.parent} holds > K chunks"
        for parent, idx in by_seq_f.items():
            assert idx == sorted(idx)
        for parent, idx in by_seq_b.items():
            assert idx == sorted(idx, reverse=True)
    assert all(o == forward_orders[0] for o in forward_orders), "stages forward in different orders"
    assert all(o == backward_orders[0] for o in backward_orders), \
        "stages backward in different orders"
