"""The K/V state store and gradient relay (runtime/state.py), on a toy chunked computation.

A "sequence" of 4 chunks; chunk j's K/V are a function of its input and a shared weight, and its
loss reads cat(K_0..K_j). Chunked execution (no-grad forwards, descending re-forward + backward)
must give the gradients of one graph over the whole sequence, with the K/V written once into one
buffer per sequence and layer (no copy of the prefix per chunk), freed after the last backward.
"""

import pytest
import torch

from megatron_chunkflow.runtime.state import ChunkMeta, KVStateStore

C, N, H = 3, 4, 5


def chunk_kv(x, w):
    k = torch.tanh(x @ w)
    return k, 2 * k + 1


def chunk_loss(k_all, v_all, x):
    return ((k_all.sum(0) * v_all.mean(0)).sum() + (x ** 2).sum()) * (1 + k_all.shape[0] / 10)


def meta(j):
    return ChunkMeta(chunk_id=j, cu_seqlens=(0, C), position_ids=torch.arange(j * C, (j + 1) * C),
                     seq_id=7, index=j, num_siblings=N, chunk_size=C)


def reference_grads(xs, w):
    w = w.clone().requires_grad_()
    ks, vs, total = [], [], 0
    for x in xs:
        k, v = chunk_kv(x, w)
        ks.append(k)
        vs.append(v)
        total = total + chunk_loss(torch.cat(ks), torch.cat(vs), x)
    total.backward()
    return w.grad


@pytest.mark.parametrize("k_keep", [1, 2, 4])
def test_relay_matches_one_graph_and_frees_state(k_keep):
    torch.manual_seed(0)
    xs = [torch.randn(C, H, dtype=torch.float64) for _ in range(N)]
    w0 = torch.randn(H, H, dtype=torch.float64)
    w = w0.clone().requires_grad_()
    store = KVStateStore()

    def forward(j, grad, reforward=False):
        store.begin(meta(j), reforward=reforward)
        with torch.set_grad_enabled(grad):
            k, v = chunk_kv(xs[j], w)
            k_all, v_all = store.kv_with_state(layer=1, k=k, v=v)
            loss = chunk_loss(k_all, v_all, xs[j])
        store.end()
        return loss

    kept = {j: forward(j, grad=j >= N - k_keep) for j in range(N)}
    entry = store._kv[(1, 7)]
    assert entry.kv.shape == (2, N * C, H) and entry.acc is None
    assert store.nbytes() == 2 * N * C * H * 8
    assert store.storages == {entry.kv.untyped_storage().data_ptr()}
    for j in reversed(range(N)):
        loss = kept[j] if j >= N - k_keep else forward(j, grad=True, reforward=True)
        loss.backward()
        if j:  # one accumulator over the prefix of the first chunk back-propagated
            assert entry.acc.shape == (2, (N - 1) * C, H)
            assert store.nbytes() == 2 * (2 * N - 1) * C * H * 8
    assert store.is_empty() and not store.storages  # chunk 0's backward dropped the sequence
    torch.testing.assert_close(w.grad, reference_grads(xs, w0), rtol=1e-13, atol=1e-13)


def test_chunks_read_views_of_one_buffer_written_in_place():
    """Each chunk's K/V are the buffer's rows [0, own end): no concatenation, no copy; a later
    chunk's write leaves an earlier chunk's saved view usable (autograd's version check)."""
    torch.manual_seed(1)
    store = KVStateStore()
    w = torch.randn(H, H, dtype=torch.float64, requires_grad=True)
    outs, ptrs = [], set()
    for j in range(N):
        store.begin(meta(j))
        k, v = chunk_kv(torch.randn(C, H, dtype=torch.float64), w)
        k_all, v_all = store.kv_with_state(layer=1, k=k, v=v)
        store.end()
        assert k_all.shape == ((j + 1) * C, H) and k_all._base is not None
        torch.testing.assert_close(k_all[j * C:], k, rtol=0, atol=0)
        ptrs.update({k_all.untyped_storage().data_ptr(), v_all.untyped_storage().data_ptr()})
        outs.append((k_all * v_all).sum())  # saves both views
    assert ptrs == store.storages
    sum(outs).backward()  # raises if a write had bumped a saved view's version
    assert store.is_empty()


def test_a_first_forward_twice_is_refused():
    """Rows under saved views must never be written again: a sequence whose state was not
    cleared cannot run its chunks' first forwards again."""
    store = KVStateStore()
    for j in (0, 1, 1):
        store.begin(meta(j))
        if j == 1 and store._kv[(1, 7)].written == 2 * C:
            with pytest.raises(RuntimeError, match="chunk 1 of sequence 7 ran its first forward "
                                                   "out of order in layer 1"):
                store.kv_with_state(1, torch.zeros(C, H), torch.zeros(C, H))
        else:
            store.kv_with_state(1, torch.zeros(C, H), torch.zeros(C, H))
        store.end()


def test_a_chunk_longer_than_chunk_0_is_refused():
    store = KVStateStore()
    for j, t in enumerate((C, C + 1)):
        store.begin(meta(j))
        if j == 0:
            store.kv_with_state(1, torch.zeros(t, H), torch.zeros(t, H))
        else:
            with pytest.raises(RuntimeError, match="chunk 1 of sequence 7 has 4 tokens here"):
                store.kv_with_state(1, torch.zeros(t, H), torch.zeros(t, H))
        store.end()


def test_bf16_relay_accumulates_in_fp32():
    """The prefix gradients of bf16 chunks add up in an fp32 accumulator: 256 + 1 is not
    representable in bf16, 256 + 8 x 1 is exact in fp32 (and in bf16): chunk 0 receives 264."""
    store, n = KVStateStore(), 10
    metas = [ChunkMeta(chunk_id=j, cu_seqlens=(0, 1), position_ids=torch.tensor([j]), seq_id=0,
                       index=j, num_siblings=n, chunk_size=1) for j in range(n)]
    ks = [torch.zeros(1, 3, dtype=torch.bfloat16, requires_grad=True) for _ in range(n)]
    outs = []
    for j in range(n):
        store.begin(metas[j])
        outs.append(store.kv_with_state(1, ks[j], ks[j] * 1)[0])
        store.end()
    for j in reversed(range(n)):
        grad = torch.full_like(outs[j], 1.0 if j else 0.0)
        if j == 1:
            grad[0] = 256.0  # chunk 1 sends 256 to chunk 0, chunks 2..9 send 1 each
        outs[j].backward(grad)
        if j == 1:
            assert store._kv[(1, 0)].acc.dtype == torch.float32
    assert ks[0].grad[0, 0].item() == 256 + 8
