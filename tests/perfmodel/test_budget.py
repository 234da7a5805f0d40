"""`chunkflow bench`'s budget rules (perfmodel/budget.py): when stock Megatron recomputes, the
K/V-state bound, the choice of (chunk size, K); and the CPU device's host time per op."""

import pytest

from megatron_chunkflow.checks.memory import kv_state_formula
from megatron_chunkflow.config import Recompute
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.perfmodel.budget import (
    ActivationRates,
    OptionRates,
    baseline_peak,
    choose_chunking,
    choose_recompute,
    chunk_size_candidates,
    chunkflow_peak,
    num_kept_candidates,
    state_bound,
)

SHAPE = get_model_shape("tiny-bench")
FULL = Recompute.parse("full")
BLOCK = Recompute.parse("block:1")
# full recompute holds 100 / 100 bytes per token between forward and backward and adds a working
# set of 2,900 / 3,400 while a backward re-runs; block:1 sits between none and full
RATES = ActivationRates(per_token=(40_000.0, 45_000.0), kv_per_token=(1024.0, 1024.0),
                        acc_per_token=(1024.0, 1024.0), hidden_per_token=512.0,
                        options={"full": OptionRates((100.0, 100.0), (3000.0, 3500.0)),
                                 "block:1": OptionRates((20_000.0, 22_000.0),
                                                        (30_000.0, 33_000.0))})
LENGTHS = [20_000] + [500] * 60  # one long sequence; 32K micro-batches: 20K + 25 x 500, 17.5K


def test_baseline_peak_replays_the_1f1b_schedule():
    """Stage 0 of 2 holds both packed micro-batches at once under 1F1B, stage 1 one; each
    baseline's micro-batches: megatron-sft's lines are padded to --seq-length, megatron-unpacked
    holds one sequence per micro-batch."""
    assert baseline_peak(LENGTHS, 32768, 1, SHAPE, RATES) == max(
        (32_500 + 17_500) * 40_000.0, 32_500 * 45_000.0)
    assert baseline_peak(LENGTHS, 32768, 1, SHAPE, RATES, baseline="megatron-sft") == \
        2 * 32768 * 40_000.0
    assert baseline_peak(LENGTHS, 32768, 1, SHAPE, RATES, baseline="megatron-unpacked") == max(
        (20_000 + 500) * 40_000.0, 20_000 * 45_000.0)


def test_baseline_peak_adds_one_backward_working_set():
    """Under recompute the bytes held are replayed at the option's held rate and the largest
    micro-batch's backward adds its working set (peak - held) once."""
    stage0 = (32_500 + 17_500) * 100.0 + 32_500 * 2900.0
    stage1 = 32_500 * 100.0 + 32_500 * 3400.0
    assert baseline_peak(LENGTHS, 32768, 1, SHAPE, RATES, FULL) == max(stage0, stage1)
    with pytest.raises(ValueError, match="selective:mlp was not measured"):
        baseline_peak(LENGTHS, 32768, 1, SHAPE, RATES, Recompute.parse("selective:mlp"))


def test_choose_recompute_takes_the_fastest_option_that_fits():
    menu = [Recompute(), BLOCK, FULL]
    times = {"none": 1.0, "block:1": 1.1, "full": 1.3}
    peaks = {str(o): baseline_peak(LENGTHS, 32768, 1, SHAPE, RATES, o) for o in menu}
    assert peaks["full"] < peaks["block:1"] < peaks["none"]

    def choose(budget, **kw):
        return choose_recompute(LENGTHS, 32768, 1, SHAPE, RATES, budget,
                                lambda o: times[str(o)], menu, **kw)

    assert str(choose(peaks["none"]).recompute) == "none"
    chosen = choose(peaks["none"] - 1)
    assert str(chosen.recompute) == "block:1" and chosen.peak_bytes == peaks["block:1"]
    assert [c.fits for c in chosen.candidates] == [False, True, True]
    assert str(choose(peaks["block:1"] - 1).recompute) == "full"
    with pytest.raises(ValueError, match=r"--budget-mib 1: no recompute option for "
                                         r"megatron-packed fits.*recompute=full"):
        choose(2**20)
    # within 3% of the fastest is a tie, which goes to the smaller peak
    times["block:1"] = 1.02
    assert str(choose(peaks["none"]).recompute) == "block:1"
    assert str(choose(peaks["none"], tie=0.01).recompute) == "none"


def test_state_bound_is_the_exact_peak():
    """The bound is docs/exactness.md's exact peak (checks/memory.py's kv_state_formula, measured
    in tests/checks/test_memory.py): K/V buffer and accumulators; zero for a sequence that is not
    cut; stage inputs only after the first stage."""
    u, a = RATES.kv_per_token[0], RATES.acc_per_token[0]
    for length, c in [(20_000, 1024), (4096, 1024), (3000, 2048)]:
        for k in (1, 2):
            assert state_bound(length, c, k, RATES, 0) == kv_state_formula(length, c, u, a)
    assert state_bound(1000, 1024, 1, RATES, 1) == 0.0
    assert state_bound(4096, 1024, 1, RATES, 1) - state_bound(4096, 1024, 1, RATES, 0) == \
        (4096 - 1024) * RATES.hidden_per_token
    # the n - K re-forwarded chunks are full even when the last one is short
    assert state_bound(4000, 1024, 1, RATES, 1) - state_bound(4000, 1024, 1, RATES, 0) == \
        3 * 1024 * RATES.hidden_per_token


def test_state_bound_holds_one_chunk_fewer_of_inputs_per_held_chunk():
    """Each more chunk holding activations keeps one chunk fewer of stage inputs; it copies no K/V
    (its attention saves a view of the sequence's buffer)."""
    h = RATES.hidden_per_token
    c, length = 1024, 20_000
    assert state_bound(length, c, 2, RATES, 1) - state_bound(length, c, 1, RATES, 1) == -c * h


def test_choose_chunking_takes_the_fastest_that_fits():
    budget = 300 * 2**20
    chosen = choose_chunking(LENGTHS, 32768, 1, SHAPE, RATES, budget,
                             predict_s=lambda c, k, o: 1.0 / c + 0.01 / k)  # big C, K fastest
    fitting = [x for x in chosen.candidates if x.fits]
    assert fitting and all(x.peak_bytes <= budget for x in fitting)
    assert all(x.predicted_s is None for x in chosen.candidates if x.peak_bytes > budget)
    assert chosen.peak_bytes <= budget
    assert chosen.predicted_s == min(x.predicted_s for x in fitting)  # no ties here
    assert any(x.chunk_size > chosen.chunk_size for x in chosen.candidates)  # too big to fit
    assert chosen.peak_bytes == chunkflow_peak(LENGTHS, chosen.chunk_size, chosen.num_kept, 1,
                                               SHAPE, RATES)
    # a peak grows with C at fixed K
    peaks = [chunkflow_peak(LENGTHS, c, 1, 1, SHAPE, RATES) for c in (1024, 2048, 4096)]
    assert peaks == sorted(peaks)


def test_choose_chunking_near_ties_go_to_the_smaller_peak():
    """Predictions within 3% of the fastest are a tie: the smallest modelled peak wins."""
    budget = 2**40
    times = {1024: 1.02, 2048: 1.0, 4096: 1.05, 8192: 1.2, 16384: 1.3, 32768: 1.4}
    chosen = choose_chunking(LENGTHS, 32768, 1, SHAPE, RATES, budget, kept_counts=(1,),
                             predict_s=lambda c, k, o: times[c])
    assert (chosen.chunk_size, chosen.num_kept) == (1024, 1)
    chosen = choose_chunking(LENGTHS, 32768, 1, SHAPE, RATES, budget, kept_counts=(1,), tie=0.01,
                             predict_s=lambda c, k, o: times[c])
    assert (chosen.chunk_size, chosen.num_kept) == (2048, 1)


def test_choose_chunking_nothing_fits_names_the_budget():
    with pytest.raises(ValueError, match=r"--budget-mib 1: no \(chunk size, K, recompute\) fits"):
        choose_chunking(LENGTHS, 32768, 1, SHAPE, RATES, 2**20, predict_s=lambda c, k, o: 1.0)


def test_choose_chunking_searches_the_recompute_menu_inside_chunks():
    """With a budget that only full recompute inside the chunks meets at the fastest size, the
    choice is (that size, full) when full costs less time than the smaller chunks do."""
    options = [Recompute(), FULL]
    peaks = {(c, str(o)): chunkflow_peak(LENGTHS, c, 1, 1, SHAPE, RATES, o)
             for c in (1024, 2048) for o in options}
    assert peaks[(2048, "full")] < peaks[(2048, "none")]
    budget = (peaks[(2048, "full")] + min(peaks[(2048, "none")], peaks[(1024, "none")])) / 2
    budget = min(budget, peaks[(2048, "none")] - 1)
    chosen = choose_chunking(LENGTHS, 32768, 1, SHAPE, RATES, budget, sizes=[1024, 2048],
                             kept_counts=(1,), options=options,
                             predict_s=lambda c, k, o: (2.0 if c == 1024 else 1.0)
                             + (0.5 if o.kind == "full" else 0.0))
    assert chosen.peak_bytes <= budget
    fitting = {(c.chunk_size, str(c.recompute)) for c in chosen.candidates if c.fits}
    assert (2048, "none") not in fitting and (2048, "full") in fitting
    assert (chosen.chunk_size, str(chosen.recompute)) == (2048, "full")


def test_k_candidates_end_with_no_reforward():
    assert num_kept_candidates(1) == [1]
    assert num_kept_candidates(4) == [1, 2, 4]
    assert num_kept_candidates(5) == [1, 2, 4, 5]
    # K = n re-forwards nothing: its peak holds every chunk's activations, no kept stage inputs
    c = 1024
    n = -(-max(LENGTHS) // c)
    assert state_bound(max(LENGTHS), c, n, RATES, 1) == state_bound(max(LENGTHS), c, n, RATES, 0)


def test_chunk_size_candidates():
    assert chunk_size_candidates(32768) == [1024, 2048, 4096, 8192, 16384, 32768]
    assert chunk_size_candidates(1000) == [64, 128, 256, 512]


def test_cpu_device_host_time_per_op():
    """The CPU device's host time per op adds once to every F/R and B of every stage (twice to
    a B that re-runs the forward under full recompute), and nothing on GPUs (default 0)."""
    from megatron_chunkflow.config import ParallelConfig
    from megatron_chunkflow.core.types import DataChunk, Segment
    from megatron_chunkflow.perfmodel.hardware import hardware_from_measurements
    from megatron_chunkflow.perfmodel.roofline import Roofline

    kw = dict(gemm_flops=1e11, attn_fwd_flops=5e10, attn_bwd_flops=5e10, memory_bytes=1e10,
              p2p_bytes_per_s=1e9)
    chunk = DataChunk(id=0, kind="standalone", segments=(Segment(0, 0, 500),))
    for recompute, extra in (("none", 1), ("full", 2)):
        layout = ParallelConfig.layout(pp=2, recompute=recompute)
        f0, b0 = Roofline(SHAPE, layout, hardware_from_measurements(**kw)).chunk_costs(chunk, 2)
        f1, b1 = Roofline(SHAPE, layout, hardware_from_measurements(
            **kw, op_overhead_s=0.01)).chunk_costs(chunk, 2)
        assert [b - a for a, b in zip(f0, f1)] == pytest.approx([0.01, 0.01])
        assert [b - a for a, b in zip(b0, b1)] == pytest.approx([0.01 * extra] * 2)
