"""SpaCO on the K/V relay (runtime/state.py with sparse metas), on a toy two-layer sequence.

Chunk j's layer-2 K/V depend on the layer-1 K/V of every earlier chunk, so gradient paths run
through the backwards of several chunks (m_i -> chunk j -> m_j -> loss of chunk l). Enumerating
every selection with its probability gives E[gradient] exactly: independent draws with 1/p weights
are unbiased (docs/sparse.md); exactly T of k without replacement with the same weights is not.
"""

import itertools
import math

import pytest
import torch

from megatron_chunkflow.runtime.sparse import inclusion_probability
from megatron_chunkflow.runtime.state import ChunkMeta, KVStateStore

C, N, H = 3, 4, 5


def layer(h, w, kv):
    """kv(k, v) -> cat(prefix, own): a mixing 'attention' that reads the whole prefix."""
    k = torch.tanh(h @ w)
    k_all, v_all = kv(k, 2 * k + 1)
    return h + 0.5 * torch.tanh(k_all.mean(0) * v_all.sum(0) / k_all.shape[0])


def chunk_loss(x, ws, kvs):
    h = x
    for w, kv in zip(ws, kvs):
        h = layer(h, w, kv)
    return (h ** 2).sum() * (1 + 0.1 * x.sum())


def reference_grads(xs, ws0):
    ws = [w.clone().requires_grad_() for w in ws0]
    prefix = [([], []) for _ in ws]

    def kv_of(i):
        def kv(k, v):
            prefix[i][0].append(k)
            prefix[i][1].append(v)
            return torch.cat(prefix[i][0]), torch.cat(prefix[i][1])
        return kv

    total = sum(chunk_loss(x, ws, [kv_of(i) for i in range(len(ws))]) for x in xs)
    total.backward()
    return [w.grad for w in ws]


def sparse_grads(xs, ws0, mask, weight):
    """One SpaCO step: every chunk forward (dropped ones without graph), then the drawn chunks
    backward in descending order, loss scaled by `weight`; the store must end empty."""
    ws = [w.clone().requires_grad_() for w in ws0]
    store = KVStateStore()
    dropped = frozenset(j for j in range(N) if not mask[j])

    def forward(j, grad, reforward=False):
        meta = ChunkMeta(chunk_id=j, cu_seqlens=(0, C), position_ids=torch.arange(C), seq_id=7,
                         index=j, num_siblings=N, chunk_size=C, grad_weight=weight,
                         dropped=dropped)
        store.begin(meta, reforward=reforward)
        with torch.set_grad_enabled(grad):
            kvs = [lambda k, v, i=i: store.kv_with_state(i, k, v) for i in range(len(ws))]
            loss = chunk_loss(xs[j], ws, kvs)
        store.end()
        return loss

    losses = {j: forward(j, grad=(j == N - 1 and mask[j])) for j in range(N)}
    for j in reversed(range(N)):
        if mask[j]:
            loss = losses[j] if j == N - 1 else forward(j, grad=True, reforward=True)
            (loss * weight).backward()
    assert store.is_empty(), (mask, store._kv.keys(), store._grad.keys())
    return [w.grad if w.grad is not None else torch.zeros_like(w) for w in ws]


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(C, H, dtype=torch.float64, generator=g) for _ in range(N)]
    ws = [torch.randn(H, H, dtype=torch.float64, generator=g) * 0.7 for _ in range(2)]
    return xs, ws, reference_grads(xs, ws)


@pytest.mark.parametrize("t", [1, 2, 3])
def test_independent_draws_are_exactly_unbiased(problem, t):
    xs, ws, ref = problem
    p = inclusion_probability(N, t)
    expected = [torch.zeros_like(w) for w in ws]
    for mask in itertools.product([False, True], repeat=N):
        prob = math.prod(p if m else 1 - p for m in mask)
        for e, g in zip(expected, sparse_grads(xs, ws, mask, 1 / p)):
            e += prob * g
    for e, r in zip(expected, ref):
        torch.testing.assert_close(e, r, rtol=1e-12, atol=1e-12)


def test_every_chunk_drawn_is_the_exact_gradient(problem):
    xs, ws, ref = problem
    for g, r in zip(sparse_grads(xs, ws, (True,) * N, 1.0), ref):
        torch.testing.assert_close(g, r, rtol=1e-13, atol=1e-13)


def test_fixed_count_without_replacement_is_biased(problem):
    """The alternative docs/sparse.md rejects: exactly T = 2 of 4 chunks, weight k/T = 2. Paths
    through two chunks' backwards get expected weight (1/6)/(1/4) = 2/3, so E[g] != g."""
    xs, ws, ref = problem
    subsets = list(itertools.combinations(range(N), 2))
    expected = [torch.zeros_like(w) for w in ws]
    for subset in subsets:
        mask = tuple(j in subset for j in range(N))
        for e, g in zip(expected, sparse_grads(xs, ws, mask, N / 2)):
            e += g / len(subsets)
    err = max(float((e - r).norm() / r.norm()) for e, r in zip(expected, ref))
    assert err > 0.05  # 0.31 here
