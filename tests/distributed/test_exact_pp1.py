"""float64 exactness of ChunkFlow (PP=1) against unchunked megatron-core, on CPU with gloo.

    python -m pytest tests/distributed/test_exact_pp1.py -q

Each world runs its cases in one set of spawned processes (real GPTModel, DDP, Megatron's
forward_backward_no_pipelining as the reference); the tests then assert on the results.
"""

import pytest
import torch

from tests.distributed._dist import run_gloo

C = 16
MIXED = [70, 5, 33, 100, 12, 64, 1, 16, 48, 9]  # not multiples of C, 1 token, C, 3C, 4C, ...
# name: (model, lengths, K, dtype, backend, fully masked sequences)
SINGLE = {
    "mixed_k1": ("tiny", MIXED, 1, torch.float64, "torch", ()),
    "mixed_k2": ("tiny", MIXED, 2, torch.float64, "torch", ()),
    "mixed_k_ge_n": ("tiny", MIXED, 8, torch.float64, "torch", ()),
    "untied_embeddings": ("tiny-untied", MIXED, 1, torch.float64, "torch", ()),
    "masked_sequences": ("tiny", MIXED, 1, torch.float64, "torch", (3, 1)),
    "dependent_only": ("tiny", [100, 37, 17], 2, torch.float64, "torch", ()),
    "standalone_only": ("tiny", [5, 9, 16, 3, 11], 1, torch.float64, "torch", ()),
    "sdpa_backend": ("tiny", MIXED, 1, torch.float64, "sdpa", ()),
    "float32": ("tiny", MIXED, 1, torch.float32, "torch", ()),
}
PAIR = {  # world of 2: (model, lengths, K, TP, sequence parallel)
    "tp2": ("tiny", MIXED, 2, 2, False),
    "tp2_sequence_parallel": ("tiny", MIXED, 1, 2, True),  # odd chunk lengths get padded
    "dp2": ("tiny", MIXED, 1, 1, False),
}
BOUND = {torch.float64: 1e-10, torch.float32: 1e-4}


def _run_single(rank):
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.integration.dist import init_distributed, shutdown
    from megatron_chunkflow.integration.verify import run_verify

    init_distributed(tp=1)
    out = {}
    for name, (model, lengths, k, dtype, backend, masked) in SINGLE.items():
        r = run_verify(get_model_shape(model), lengths, C, k, dtype, seed=1, backend=backend,
                       fully_masked=masked)
        out[name] = (r.max_rel_grad_err, r.worst_param, r.loss_ref, r.loss_chunked)
    shutdown()
    return out


def _run_pair(rank, name):
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.integration.dist import init_distributed, shutdown
    from megatron_chunkflow.integration.verify import run_verify

    model, lengths, k, tp, sp = PAIR[name]
    init_distributed(tp=tp)
    r = run_verify(get_model_shape(model), lengths, C, k, torch.float64, seed=2,
                   sequence_parallel=sp)
    shutdown()
    return r.max_rel_grad_err, r.worst_param, r.loss_ref, r.loss_chunked


@pytest.fixture(scope="module")
def single_results():
    return run_gloo(_run_single, 1, timeout=600)[0]


@pytest.mark.parametrize("name", SINGLE)
def test_exact_single_process(single_results, name):
    err, worst, loss_ref, loss_cf = single_results[name]
    bound = BOUND[SINGLE[name][3]]
    assert err <= bound, f"{name}: max relative grad error {err:.2e} at {worst}"
    assert loss_cf == pytest.approx(loss_ref, rel=bound, abs=bound)
    assert loss_ref > 0  # the masked sequences contribute nothing, and nothing is NaN


@pytest.mark.parametrize("name", PAIR)
def test_exact_two_processes(name):
    results = run_gloo(_run_pair, 2, name, timeout=600)
    for err, worst, loss_ref, loss_cf in results:
        assert err <= 1e-10, f"{name}: max relative grad error {err:.2e} at {worst}"
        assert loss_cf == pytest.approx(loss_ref, rel=1e-12)
