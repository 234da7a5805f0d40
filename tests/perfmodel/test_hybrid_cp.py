"""The megatron-hybrid-cp prediction (perfmodel/hybrid_cp.py): where Megatron's per-sample CP
runs what another baseline runs, the two predictions agree (the same roofline costs, memory and
step end); the search is the brute-force optimum over its candidates."""

import dataclasses

import pytest

from megatron_chunkflow.config import ParallelConfig, Recompute
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.mcore.hybrid_cp import balanced_cp_groups as MEGATRON
from megatron_chunkflow.perfmodel.hardware import get_gpu
from megatron_chunkflow.perfmodel.hybrid_cp import (
    best_hybrid_cp,
    hybrid_layout,
    predict_hybrid_cp,
    seqlen_candidates,
)
from megatron_chunkflow.perfmodel.predict import predict_megatron

HW = get_gpu("h100")
SHAPE = get_model_shape("qwen2.5-7b")


@pytest.mark.parametrize("lengths,m,cp", [([8192, 8192], 8192, 1), ([16384], 8192, 2),
                                          ([30000], 4096, 8)])
def test_one_sequence_per_rank_equals_unpacked(lengths, m, cp):
    """One sequence per rank (CP 1), or one sequence over the whole pool (CP = pool): the same
    micro-batches as megatron-unpacked on TP x CP with DP the rest, so the same step (less the
    barrier's latency) and the same memory."""
    tp, pool = 2, max(2, cp)
    layout = hybrid_layout(tp, pool, "selective")
    h = predict_hybrid_cp(lengths, SHAPE, HW, layout, m, MEGATRON)
    u = predict_megatron(lengths, SHAPE, HW,
                         ParallelConfig.layout(tp=tp, cp=cp, dp=pool // cp, recompute="selective"),
                         max(lengths) + 64, "megatron-unpacked")
    barrier = HW.link(tp * pool)[1]
    assert h.step_s == pytest.approx(u.step_s + barrier, rel=1e-12)
    assert h.peak_mem_bytes == pytest.approx(u.peak_mem_bytes, rel=1e-12)
    assert h.memory == pytest.approx(u.memory, rel=1e-12)
    assert h.model_flops == u.model_flops and h.max_seqlen_per_rank == m


def test_refuses_pipeline_parallelism():
    with pytest.raises(ValueError, match="refuses --hybrid-context-parallel with pipeline"):
        predict_hybrid_cp([100], SHAPE, HW, ParallelConfig.layout(tp=2, pp=2, dp=2), 1024,
                          MEGATRON)
    with pytest.raises(ValueError, match="refuses --hybrid-context-parallel with pipeline"):
        best_hybrid_cp([100], SHAPE, HW, 8, MEGATRON, ParallelConfig.layout(tp=2, pp=2, dp=2))


def test_seqlen_candidates():
    assert seqlen_candidates([100, 5000], 8) == [1024, 2048, 4096, 8192]
    assert seqlen_candidates([100, 100_000], 8) == [16384, 32768, 65536, 131072]


def test_search_is_the_fastest_fitting_candidate():
    """Against every (TP, recompute, M) predicted in full: the fastest that fits, on a budget
    that the cheapest options do not meet."""
    lengths = [min(n, 65536) for n in sample_lengths("C", 48, seed=1)]
    hw = dataclasses.replace(HW, memory_gib=41.6)
    menu = [Recompute.parse(r) for r in ("none", "selective", "selective:mlp", "block:14",
                                         "full")]
    got = best_hybrid_cp(lengths, SHAPE, hw, 16, MEGATRON)
    brute = []
    for tp in (1, 2, 4, 8):
        for rc in Recompute.menu(SHAPE.num_layers):
            if rc not in menu and rc != got.layout.recompute:
                continue
            lay = hybrid_layout(tp, 16 // tp, rc)
            for m in seqlen_candidates(lengths, 16 // tp):
                p = predict_hybrid_cp(lengths, SHAPE, hw, lay, m, MEGATRON)
                if p.fits:
                    brute.append(p)
    assert got.fits and brute
    assert got.step_s == pytest.approx(min(p.step_s for p in brute), rel=1e-12)
    assert not predict_hybrid_cp(lengths, SHAPE, hw, hybrid_layout(1, 16, "none"),
                                 seqlen_candidates(lengths, 16)[-1], MEGATRON).fits


def test_a_given_m_skips_the_pools_too_small_for_it():
    """--max-seqlen-per-dp-cp-rank 8192 on 8 GPUs for a 32K sequence: TP 4 leaves a pool of 2,
    too small for the 4 ranks it needs, so the search keeps TP 1 and 2 instead of failing."""
    lengths = [32768] + [1000] * 40
    got = best_hybrid_cp(lengths, SHAPE, HW, 8, MEGATRON, max_seqlen_per_rank=8192)
    assert got.max_seqlen_per_rank == 8192 and got.layout.dp * got.layout.cp >= 4
    with pytest.raises(ValueError, match="would need a CP group of 16 ranks"):
        best_hybrid_cp(lengths, SHAPE, HW, 8, MEGATRON, max_seqlen_per_rank=4000)
