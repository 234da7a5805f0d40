"""SpaCO on megatron-core (float64, CPU, gloo): exactly unbiased; the mean converges as 1/sqrt(N).

    python -m pytest tests/checks/test_sparse.py -q

The exact gradient g is stock Megatron's (checks/verify.py). A 2-layer model (so gradient paths
cross several chunks' backwards) and a batch with a 3-chunk and a 2-chunk sequence at C = 16, T = 1
(inclusion probabilities 1/3 and 1/2): 32 selections in all.
- exhaustive: sum over every selection of P(selection) x its gradient == g to 1e-10 (K = 1; and
  K = 2 with LoRA, where the kept chunks are the ones dropped);
- random draws (a batch with four long sequences, 11 random chunks; 128 draws): the mean squared
  error of the means of disjoint blocks of N = 1, 4, 16 draws is sigma^2 / N (sigma^2: one draw's),
  and the mean of all 128 is within 3 sigma / sqrt(128) of g;
- TP = 2 (sequence parallel) and PP = 2 draw the same chunks and give the same mean as PP = 1.
"""

import math

import pytest

pytestmark = pytest.mark.slow

LENGTHS = [48, 20, 9, 5]  # 3 and 2 dependent chunks, 1 standalone chunk
C, T = 16, 1
DRAW_LENGTHS = [48, 40, 33, 20, 9, 5]  # 3 + 3 + 3 + 2 dependent chunks
DRAWS = 128
BLOCKS = (1, 4, 16)


def _shape(layers: int = 2):
    from megatron_chunkflow.core.models import ModelShape

    return ModelShape(layers, 32, 64, 4, 2, 128, tie_embeddings=True)


def _single():
    from megatron_chunkflow.checks.sparse_verify import run_sparse_verify
    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.mcore.dist import shutdown
    from megatron_chunkflow.mcore.lora import LoRAConfig

    k1, k2 = ChunkFlowConfig(C, 1, "torch"), ChunkFlowConfig(C, 2, "torch")
    out = {"exhaustive_k1": run_sparse_verify(_shape(), LENGTHS, k1, T, exhaustive=True, seed=3),
           "exhaustive_k2_lora": run_sparse_verify(_shape(), LENGTHS, k2, T, exhaustive=True,
                                                   seed=3, lora=LoRAConfig(rank=4))}
    out["draws"] = run_sparse_verify(_shape(), DRAW_LENGTHS, k1, T, DRAWS, seed=3, blocks=BLOCKS)
    shutdown()
    return out


@pytest.fixture(scope="module")
def results(gloo):
    return gloo.run(_single, 1, timeout=900)[0]


@pytest.mark.parametrize("name", ["exhaustive_k1", "exhaustive_k2_lora"])
def test_expected_sparse_gradient_is_the_exact_gradient(results, name):
    r = results[name]
    assert r.draws == 2 ** 5
    assert r.rel_err_of_mean <= 1e-10, r
    assert r.rel_std > 0.1  # a single draw is far from exact: the check is not vacuous
    assert r.loss_sparse == pytest.approx(r.loss_ref, rel=1e-12)


def test_mean_converges_like_one_over_sqrt_draws(results):
    r = results["draws"]
    mse = {b: sum(e) / len(e) for b, e in r.block_sq_errors.items()}
    assert [len(r.block_sq_errors[b]) for b in BLOCKS] == [DRAWS // b for b in BLOCKS]
    sigma2 = mse[1]  # one draw's mean squared relative error (128 samples)
    for b in BLOCKS[1:]:
        assert 0.5 < mse[b] * b / sigma2 < 2, (b, mse)  # sigma^2 / N
    assert r.rel_err_of_mean <= 3 * math.sqrt(sigma2 / DRAWS), (r.rel_err_of_mean, sigma2)
    assert 0.5 < r.expected_rel_err / math.sqrt(sigma2 / DRAWS) < 2, (r.expected_rel_err, sigma2)
    assert r.rel_err_of_mean <= 4 * r.expected_rel_err  # what `chunkflow verify` checks


def _layout(tp, pp, sp, vpp=1, layers=2):
    from megatron_chunkflow.checks.sparse_verify import run_sparse_verify
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.mcore.dist import shutdown

    r = run_sparse_verify(_shape(layers), LENGTHS + [70], ChunkFlowConfig(C, 1, "torch"), 2,
                          draws=4, seed=3, draw_seed=7,
                          parallel=ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp, vpp=vpp))
    shutdown()
    return r.curve, r.loss_sparse, r.backward_fraction


@pytest.fixture(scope="module")
def single_process_draws(gloo):
    return gloo.run(_layout, 1, 1, 1, False, timeout=600)[0]


@pytest.mark.parametrize("tp,pp,sp", [(2, 1, True), (1, 2, False)])
def test_same_draws_under_tensor_and_pipeline_parallelism(gloo, single_process_draws, tp, pp, sp):
    base = single_process_draws
    for curve, loss, fraction in gloo.run(_layout, tp * pp, tp, pp, sp, timeout=600):
        assert fraction == base[2] and loss == pytest.approx(base[1], rel=1e-12)
        for (n, err), (n0, err0) in zip(curve, base[0]):
            assert n == n0 and err == pytest.approx(err0, rel=1e-9)


def test_same_draws_with_virtual_stages(gloo):
    """PP 2 x V 2 (a 4-layer model, one layer per model chunk): the same draws, loss and errors
    as one process."""
    base = gloo.run(_layout, 1, 1, 1, False, 1, 4, timeout=600)[0]
    for curve, loss, fraction in gloo.run(_layout, 2, 1, 2, False, 2, 4, timeout=600):
        assert fraction == base[2] and loss == pytest.approx(base[1], rel=1e-12)
        for (n, err), (n0, err0) in zip(curve, base[0]):
            assert n == n0 and err == pytest.approx(err0, rel=1e-9)
