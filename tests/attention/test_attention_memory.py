"""The `torch` backend's tiling: exact with tiles smaller than every segment, and memory that
follows the chunk, not the prefix it attends to (measured on the meta device, where a 32K chunk
over a 256K prefix costs no real memory or FLOPs).

Run: python -m pytest tests/attention/test_attention_memory.py -q
"""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_chunkflow.attention import chunk_attention, torch_attention
from tests.attention.test_chunk_attention import (
    CASES,
    cumsum,
    dense_reference,
    make_inputs,
    run_with_grads,
)


@pytest.mark.parametrize("case", CASES)
def test_small_tiles_match_oracle_float64(monkeypatch, case):
    """Tiles of 3 queries x 5 keys cut every segment (and the causal edge) several ways; outputs
    and gradients stay those of the dense oracle to 1e-12."""
    monkeypatch.setattr(torch_attention, "TILE_QUERIES", 3)
    monkeypatch.setattr(torch_attention, "TILE_KEYS", 5)
    lq, lk, nh, ng, hd = CASES[case]
    cu_q, cu_kv = cumsum(lq), cumsum(lk)
    q, k, v, dout = make_inputs(lq, lk, nh, ng, hd, torch.float64)
    got = run_with_grads(lambda *a: chunk_attention(*a, cu_q, cu_kv, backend="torch"), q, k, v,
                         dout)
    ref = run_with_grads(lambda *a: dense_reference(*a, cu_q, cu_kv), q, k, v, dout)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


class PeakLiveBytes(TorchDispatchMode):
    """Bytes of the storages that ATen ops created and that are still alive, and their peak: a
    storage is counted when an op returns it (not one of the op's inputs) and released when its
    last tensor dies."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._held: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._held.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if id(storage) in self._held or storage._cdata in inputs:
                continue
            self._held.add(id(storage))
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, id(storage), storage.nbytes())
        return out


def _peak_bytes(lq: int, lk: int, nh: int, ng: int, hd: int) -> tuple[int, int]:
    """(forward peak, forward + backward peak) of one bf16 segment of lq queries over lk keys."""
    q, k, v = (torch.empty(n, h, hd, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for n, h in ((lq, nh), (lk, ng), (lk, ng)))
    with PeakLiveBytes() as meter:
        out = chunk_attention(q, k, v, [0, lq], [0, lk], backend="torch")
        forward = meter.peak
        out.backward(torch.empty_like(out))
    return forward, meter.peak


@pytest.mark.slow
def test_memory_of_a_32k_chunk_over_a_256k_prefix():
    """Qwen2.5-7B at TP 4 (7 query heads, 1 K/V head, head dim 128), the last 32K chunk of a 256K
    sequence: the scores alone would be 7 x 32K x 256K float32 = 224 GiB; the tiled backend holds
    its float32 copies of q, k, v, out, the gradients and a few tiles, and quadrupling the prefix
    adds only K/V-sized tensors."""
    nh, ng, hd, chunk = 7, 1, 128, 32768
    tile = nh * torch_attention.TILE_QUERIES * torch_attention.TILE_KEYS * 4
    per_token = {"q": nh * hd * 4, "kv": 2 * ng * hd * 4}  # float32 bytes per token
    peaks = {}
    for prefix in (65536, 262144):
        forward, whole = _peak_bytes(chunk, prefix, nh, ng, hd)
        bound = 4 * (chunk * per_token["q"] + prefix * per_token["kv"]) + 8 * tile
        assert forward <= whole <= bound, (prefix, forward, whole, bound)
        peaks[prefix] = whole
    dense_scores = nh * chunk * 262144 * 4
    assert peaks[262144] < dense_scores / 100
    assert peaks[262144] - peaks[65536] <= 4 * (262144 - 65536) * per_token["kv"]
