"""megatron-core's BalancedCPScheduler (mcore/hybrid_cp.py) on long-tailed batches, read back
into groups and CP sizes (core/hybrid_cp.py): every sequence runs once, on a power-of-two group of
consecutive ranks at least as large as its length needs."""

import pytest

from megatron_chunkflow.core.hybrid_cp import cp_size_needed, hybrid_schedule
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.mcore.hybrid_cp import balanced_cp_groups


@pytest.mark.parametrize("profile,n,pool,m", [("B", 400, 16, 4096), ("B", 400, 8, 8192),
                                              ("C", 64, 32, 4096), ("A", 100, 4, 2048)])
def test_every_sequence_once_on_its_cp_group(profile, n, pool, m):
    """Each sequence runs in exactly one group, on cp[i] ranks, a power of two at least what its
    length needs and at most the pool; the ranks sharing it are consecutive (Megatron's groups
    tile the pool)."""
    lengths = [min(x, m * pool) for x in sample_lengths(profile, n, seed=3)]
    s = hybrid_schedule(lengths, pool, m, balanced_cp_groups)
    assert s.pool == pool and len(s.cp) == len(lengths)
    seen = {}
    for g, ranks in enumerate(s.groups):
        assert len(ranks) == pool
        for r, ids in enumerate(ranks):
            assert len(set(ids)) == len(ids)
            for i in ids:
                seen.setdefault(i, set()).add((g, r))
    assert set(seen) == set(range(len(lengths)))
    for i, where in seen.items():
        groups = {g for g, _ in where}
        ranks = sorted(r for _, r in where)
        c = s.cp[i]
        assert len(groups) == 1 and len(ranks) == c
        assert c & (c - 1) == 0 and cp_size_needed(lengths[i], m) <= c <= pool
        assert ranks == list(range(ranks[0], ranks[0] + c))
    assert max(s.cp) > 1  # the batches above have sequences longer than M


def test_groups_are_megatrons():
    """The read-back keeps Megatron's order: rank r of group g runs what the scheduler listed."""
    lengths = sample_lengths("B", 200, seed=5)
    raw = balanced_cp_groups(tuple(lengths), 8, 4096)
    s = hybrid_schedule(lengths, 8, 4096, balanced_cp_groups)
    assert [[list(ids) for ids in g] for g in s.groups] == [[list(ids) for ids in g] for g in raw]
