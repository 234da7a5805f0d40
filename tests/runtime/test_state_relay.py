"""The K/V state store and gradient relay (runtime/state.py), on a toy chunked computation.

A "sequence" of 4 chunks; chunk j's K/V are a function of its input and a shared weight, and its
loss reads cat(K_0..K_j). Chunked execution (no-grad forwards, descending re-forward + backward)
must give the gradients of one graph over the whole sequence, and free the state as it goes.
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
    assert len(store._kv) == N - 1  # the last chunk's K/V are never read again
    for j in reversed(range(N)):
        loss = kept[j] if j >= N - k_keep else forward(j, grad=True, reforward=True)
        loss.backward()
        assert (1, 7, j) not in store._grad  # this chunk's relayed gradient was consumed
        assert (1, 7, j - 1) not in store._kv  # its predecessor's K/V were read for the last time
    assert store.is_empty()
    torch.testing.assert_close(w.grad, reference_grads(xs, w0), rtol=1e-13, atol=1e-13)


def test_bf16_relay_accumulates_in_fp32():
    store = KVStateStore()
    key = (1, 0, 0)
    big = torch.full((2, 3), 256.0, dtype=torch.bfloat16)
    store._accumulate(key, big, big)
    for _ in range(8):  # 256 + 1 is not representable in bf16, but 256 + 8 * 1 is exact in fp32
        store._accumulate(key, torch.ones(2, 3, dtype=torch.bfloat16), big)
    assert store._grad[key][0].dtype == torch.float32
    assert store._grad[key][0][0, 0].item() == 264.0
