"""Context parallelism (runtime/cp.py): in one process, the zigzag shards and that the gathered-K/V
index gives every local query exactly the keys it has without CP; in a 2-process gloo job,
cp_attention's backward (from the saved log-sum-exp, or recomputing) against unsharded attention.

The whole model at CP runs in tests/checks/test_exact.py (CP layouts, gloo) and
tests/megatron_lm/test_pretrain_gpt.py (the launcher at CP 2).
"""

import pytest
import torch

from megatron_chunkflow.attention import attention_with_lse, chunk_attention, merge_lse
from megatron_chunkflow.core.cp_place import SPLIT
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.runtime.cp_keys import (
    hybrid_cu,
    key_selection,
    local_index,
    ring_selection,
    shard_ranges,
)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_shards_cover_each_token_once_and_balance_causal_work(cp):
    cu = (0, 2 * cp, 6 * cp, 16 * cp)
    shards = [local_index(cu, cp, r) for r in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(cu[-1]))
    starts = torch.tensor(cu[:-1])

    def causal_pairs(idx):  # keys a query sees: its position within its segment + 1
        seg = torch.searchsorted(starts, idx, right=True) - 1
        return int((idx - starts[seg] + 1).sum())

    assert len({causal_pairs(s) for s in shards}) == 1
    assert all(s.numel() == cu[-1] // cp for s in shards)


def test_a_segment_the_split_cannot_cut_is_refused():
    with pytest.raises(ValueError, match="6 tokens, which do not cut into 2 x CP = 4"):
        shard_ranges((0, 6), 2, 0)


def _attention_by_rank(q, k, v, cu, prefix_chunks, chunk_size, cp, replicated=False):
    """Each rank's output through the layout, the gathered K/V built by hand as all_gather
    would (rank after rank: its shards of the prefix chunks, then of the chunk), or with
    `replicated` state as the relay concatenates whole chunks (chunk after chunk, each gathered:
    rank after rank)."""
    blocks = [((0, chunk_size), i * chunk_size) for i in range(prefix_chunks)]
    blocks.append((cu, prefix_chunks * chunk_size))
    if replicated:
        rows = torch.cat([local_index(c, cp, r) + off for c, off in blocks for r in range(cp)])
    else:
        rows = torch.cat([local_index(c, cp, r) + off for r in range(cp) for c, off in blocks])
    k_gathered, v_gathered = k[rows], v[rows]
    prefix = prefix_chunks * chunk_size
    outs = []
    for r in range(cp):
        layout = key_selection(cu, prefix_chunks, chunk_size, cp, r, replicated)
        q_local = q[prefix + local_index(cu, cp, r)]
        outs.append(chunk_attention(q_local, k_gathered[layout.index], v_gathered[layout.index],
                                    layout.cu_q, layout.cu_kv, backend="sdpa"))
    return outs


@pytest.mark.parametrize("replicated", [False, True], ids=["sharded", "replicated"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", ["standalone", "dependent"])
def test_every_query_sees_its_unsplit_keys(cp, case, replicated):
    torch.manual_seed(0)
    c = 8 * cp
    if case == "standalone":  # three packed sequences, no prefix
        cu, prefix_chunks = (0, 2 * cp, 4 * cp, c), 0
    else:  # the third chunk of a sequence: 2 C of prefix, then a shorter last chunk
        cu, prefix_chunks = (0, 4 * cp), 2
    prefix = prefix_chunks * c
    n = prefix + cu[-1]
    q, k, v = (torch.randn(n, h, 4, dtype=torch.float64) for h in (4, 2, 2))
    if prefix:  # the whole sequence unsplit: the chunk's queries after the prefix
        whole = chunk_attention(q[prefix:], k, v, [0, cu[-1]], [0, n], backend="sdpa")
    else:
        whole = chunk_attention(q, k, v, list(cu), list(cu), backend="sdpa")
    for r, out in enumerate(_attention_by_rank(q, k, v, cu, prefix_chunks, c, cp, replicated)):
        torch.testing.assert_close(out, whole[local_index(cu, cp, r)], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("case", ["standalone", "dependent"])
def test_ring_blocks_give_every_query_its_unsplit_keys(cp, case):
    """ring_selection: step s reads the block of rank (r - s) mod CP (its shards of [prefix ++
    chunk]); the own block bottom-right causal (each piece's own keys last), the others without
    a mask (all their keys precede the pieces that read them); merged step by step by
    log-sum-exp, every query gets its unsplit attention, and the blocks hold each selected key
    once."""
    torch.manual_seed(1)
    c = 8 * cp
    cu, prefix_chunks = ((0, 2 * cp, 4 * cp, c), 0) if case == "standalone" else ((0, 4 * cp), 2)
    prefix = prefix_chunks * c
    n = prefix + cu[-1]
    q, k, v = (torch.randn(n, h, 4, dtype=torch.float64) for h in (4, 2, 2))
    if prefix:
        whole = chunk_attention(q[prefix:], k, v, [0, cu[-1]], [0, n], backend="sdpa")
    else:
        whole = chunk_attention(q, k, v, list(cu), list(cu), backend="sdpa")
    blocks = [((0, c), i * c) for i in range(prefix_chunks)] + [(cu, prefix)]
    held = [torch.cat([local_index(b, cp, j) + off for b, off in blocks]) for j in range(cp)]
    for r in range(cp):
        ring = ring_selection(cu, prefix_chunks, c, cp, r)
        full = key_selection(cu, prefix_chunks, c, cp, r)
        assert sum(b.keys.index.numel() for b in ring.blocks) == full.index.numel()
        q_local = q[prefix + local_index(cu, cp, r)]
        assert ring.blocks[0].rows.tolist() == list(range(q_local.shape[0]))
        out = lse = None
        for step, block in enumerate(ring.blocks):
            j = (r - step) % cp
            if not block.rows.numel():
                continue
            rows = held[j][block.keys.index]
            part = attention_with_lse(q_local[block.rows], k[rows], v[rows], block.keys.cu_q,
                                      block.keys.cu_kv, backend="torch", causal=step == 0)
            if step == 0:
                out, lse = part
            else:
                merge_lse(out, lse, block.rows, *part)
        torch.testing.assert_close(out, whole[local_index(cu, cp, r)], rtol=1e-12, atol=1e-12)
    # rank 0's first piece of a standalone segment reads no other rank's keys
    if not prefix:
        ring = ring_selection(cu, 0, c, cp, 0)
        assert all(0 not in b.rows.tolist() for b in ring.blocks[1:])


def test_packer_pads_every_segment_for_the_split():
    shape = get_model_shape("tiny")
    batch = build_chunks([70, 5, 33, 1, 16], 16, 1, 1, shape, segment_multiple=4,
                         chunk_multiple=8)  # CP 2, TP 2 under sequence parallelism
    for chunk in batch.chunks:
        assert all(s.computed_tokens % 4 == 0 for s in chunk.segments)
        assert chunk.computed_tokens <= 16 and chunk.computed_tokens % 8 == 0
        if chunk.is_dependent and chunk.index + 1 < chunk.num_siblings:
            assert chunk.segments[0].padding == 0  # full chunks hold state: never padded
    assert sum(c.num_tokens for c in batch.chunks) == 70 + 5 + 33 + 1 + 16  # nothing lost
    with pytest.raises(ValueError, match="chunk size 18 is not a multiple"):
        build_chunks([70], 18, 1, 1, shape, segment_multiple=4)
    with pytest.raises(ValueError, match="chunk size 12 is not a multiple of the padding "
                                         "multiple 8"):
        build_chunks([70], 12, 1, 1, shape, segment_multiple=4, chunk_multiple=8)


def _cp_backward_on_rank(cases):
    """On each rank of a 2-process gloo job, for each case (cu, prefix chunks, chunk size): the
    rank's gradients of q and of its K/V shards through cp_attention, by path, as the largest
    relative error against unsharded sdpa attention and against the recompute path of the same
    backend; and the attention forwards each path's backward ran (counted at our own forward
    entry points: cpu_flash_forward, torch_forward, the sdpa backend)."""
    import torch.distributed as dist

    from megatron_chunkflow.attention import backends, cpu_flash, torch_attention
    from megatron_chunkflow.runtime import cp as cp_module

    cp, rank, group = 2, dist.get_rank(), dist.group.WORLD
    calls = {"cpu_flash": 0, "torch": 0, "sdpa": 0}
    wrapped = [(cpu_flash, "cpu_flash_forward", "cpu_flash"),
               (torch_attention, "torch_forward", "torch"), (backends.BACKENDS, "sdpa", "sdpa")]
    saved = []

    def counting(fn, name):
        def run(*args):
            calls[name] += 1
            return fn(*args)
        return run

    for owner, attr, name in wrapped:
        get, put = ((owner.__getitem__, owner.__setitem__) if isinstance(owner, dict) else
                    (lambda a, o=owner: getattr(o, a), lambda a, f, o=owner: setattr(o, a, f)))
        saved.append((put, attr, get(attr)))
        put(attr, counting(get(attr), name))
    paths = {"cpu_flash": (cp_module.cp_attention, "cpu_flash"),
             "torch": (cp_module.cp_attention, "torch"),
             "sdpa": (cp_module.cp_attention, "sdpa"),
             "cpu_flash recompute": (cp_module._RecomputedAttention.apply, "cpu_flash"),
             "torch recompute": (cp_module._RecomputedAttention.apply, "torch"),
             "cpu_flash ring": (cp_module.cp_attention, "cpu_flash"),
             "torch ring": (cp_module.cp_attention, "torch")}
    out = []
    try:
        for cu, prefix_chunks, c in cases:
            g = torch.Generator().manual_seed(len(cu) + prefix_chunks)
            prefix = prefix_chunks * c
            n = prefix + cu[-1]
            q, k, v = (torch.randn(n, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
            dout = torch.randn(cu[-1], 4, 8, generator=g, dtype=torch.float64)
            blocks = [((0, c), i * c) for i in range(prefix_chunks)] + [(cu, prefix)]
            mine = torch.cat([local_index(b, cp, rank) + off for b, off in blocks])
            rows = local_index(cu, cp, rank)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            qf, kf, vf = leaves
            if prefix:
                whole = chunk_attention(qf[prefix:], kf, vf, [0, cu[-1]], [0, n], backend="sdpa")
            else:
                whole = chunk_attention(qf, kf, vf, list(cu), list(cu), backend="sdpa")
            whole.backward(dout)
            ref = (whole.detach()[rows], qf.grad[prefix + rows], kf.grad[mine], vf.grad[mine])
            layout = key_selection(cu, prefix_chunks, c, cp, rank)
            ring = ring_selection(cu, prefix_chunks, c, cp, rank)
            grads, forwards = {}, {}
            for path, (fn, backend) in paths.items():
                ql, kl, vl = (x.clone().requires_grad_() for x in (q[prefix + rows], k[mine],
                                                                   v[mine]))
                o = fn(ql, kl, vl, ring if path.endswith("ring") else layout, group, 8 ** -0.5,
                       backend, None)
                before = dict(calls)
                o.backward(dout[rows])
                forwards[path] = {b: calls[b] - before[b] for b in calls}
                grads[path] = (o.detach(), ql.grad, kl.grad, vl.grad)

            def err(xs, refs):
                return max(((x - r).abs().max() / r.abs().max()).item() for x, r in zip(xs, refs))

            out.append({path: (err(grads[path], ref),
                               err(grads[path], grads.get(f"{paths[path][1]} recompute", ref)),
                               forwards[path]) for path in paths})
    finally:
        for put, attr, fn in saved:
            put(attr, fn)
    return out


@pytest.mark.slow
def test_cp_backward_from_the_lse_runs_no_forward_and_is_exact(gloo):
    """CP 2 over gloo, float64: a standalone chunk of three segments and a dependent chunk over two
    chunks of prefix. cpu_flash and torch take the backward from the saved log-sum-exp: their
    gradients equal unsharded attention's and the recompute path's within 1e-12, and their
    backward runs no attention forward; sdpa (no pair) recomputes it. The ring attention (K/V
    blocks passed around, merged by log-sum-exp; gradients passed back) likewise, output
    included."""
    cases = [((0, 4, 12, 20), 0, 20), ((0, 16), 2, 16)]
    for per_case in zip(*gloo.run(_cp_backward_on_rank, 2, cases)):
        for rank_result in per_case:
            for path, (vs_whole, vs_recompute, forwards) in rank_result.items():
                assert vs_whole <= 1e-12 and vs_recompute <= 1e-12, (path, vs_whole, vs_recompute)
                backend = path.split()[0]
                if path in ("cpu_flash", "torch") or path.endswith("ring"):
                    assert forwards == {"cpu_flash": 0, "torch": 0, "sdpa": 0}, (path, forwards)
                else:  # the recompute path: one forward of its backend in the backward
                    assert forwards[backend] > 0, (path, forwards)


def test_a_hybrid_placement_holds_whole_segments_first_then_the_split_pieces():
    """Under a hybrid placement (core/cp_place.py) each rank holds its whole segments, then its
    zigzag pieces of the split ones; all ranks together hold every token once, and hybrid_cu
    packs the two parts from 0 (the split part as a chunk of its own for the CP attention)."""
    cu, owners = (0, 28, 44, 56, 64, 68), (SPLIT, 0, 1, 1, 0)  # the last: rank 0's padding
    assert shard_ranges(cu, 2, 0, owners) == [(28, 44), (64, 68), (0, 7), (21, 28)]
    assert shard_ranges(cu, 2, 1, owners) == [(44, 56), (56, 64), (7, 14), (14, 21)]
    shards = [local_index(cu, 2, r, owners) for r in range(2)]
    assert sorted(torch.cat(shards).tolist()) == list(range(68))
    assert [s.numel() for s in shards] == [34, 34]
    assert hybrid_cu(cu, owners, 0) == ((0, 16, 20), (0, 28))
    assert hybrid_cu(cu, owners, 1) == ((0, 12, 20), (0, 28))


def test_chunk_meta_places_standalone_chunks_only_when_hybrid():
    from megatron_chunkflow.runtime.inputs import chunk_meta

    batch = build_chunks([42, 9, 25, 29, 31, 19, 58, 12, 11, 100], 128, 1, 1,
                         get_model_shape("tiny"), segment_multiple=4, chunk_multiple=4)
    metas = {p: [chunk_meta(c, 128, 1, 2, 1, p) for c in batch.chunks]
             for p in ("hybrid", "split")}
    # 100 | 28: the 28 alone would leave the other rank 28 short, so the chunk stays split;
    # 60 | 44 + 20, rank 0 padded by 4; 32 split, 32 | 12 + 12 + 12, rank 0 padded by 4
    assert [m.cp_owners for m in metas["hybrid"]] == [(), (0, 1, 1, 0), (SPLIT, 0, 1, 1, 1, 0)]
    assert metas["hybrid"][1].cu_seqlens == (0, 60, 104, 124, 128)
    assert [m.num_padding for m in metas["hybrid"]] == [0, 4, 4]
    assert [m.local_tokens for m in metas["hybrid"]] == [64, 64, 52]
    assert all(not m.cp_owners for m in metas["split"])
    assert [m.num_tokens for m in metas["split"]] == [128, 124, 100]


def test_a_hybrid_chunk_keeps_the_sequence_parallel_padding_positions():
    """A chunk padded for sequence parallelism (a segment of its own) and then placed: every
    token, the padding segments' included, has a position (chunk_meta called with a pad multiple
    the packer did not pad to)."""
    from megatron_chunkflow.runtime.inputs import chunk_meta

    chunk = build_chunks([32, 28, 24, 20, 16, 4], 128, 1, 1, get_model_shape("tiny"),
                         segment_multiple=4, chunk_multiple=4).chunks[0]
    meta = chunk_meta(chunk, 128, 8, 2, 0)
    assert meta.cp_owners and meta.position_ids.numel() == meta.cu_seqlens[-1]
    assert meta.num_padding == meta.cu_seqlens[-1] - chunk.computed_tokens
