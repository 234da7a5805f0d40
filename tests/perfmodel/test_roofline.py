"""The roofline cost model, memory model and device descriptions (perfmodel/roofline.py,
perfmodel/footprint.py, perfmodel/hardware.py, perfmodel/predict.py): properties that would catch a
wrong formula, not golden numbers."""

import dataclasses
import math
import random

import pytest

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.costs import attention_pairs
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.perfmodel.budget import ActivationRates, state_bound
from megatron_chunkflow.perfmodel.footprint import (
    layer_activation_bytes,
    stage_params,
    static_bytes,
    total_params,
)
from megatron_chunkflow.perfmodel.hardware import (
    get_gpu,
    hardware_from_measurements,
    with_overrides,
)
from megatron_chunkflow.perfmodel.kvstate import kv_state_bytes_per_token, sequence_state_bytes
from megatron_chunkflow.perfmodel.memfloors import chunkflow_memory_floor
from megatron_chunkflow.perfmodel.predict import predict_chunkflow, predict_megatron
from megatron_chunkflow.perfmodel.roofline import (
    attention_tiles,
    computed_pairs,
    gemm_efficiency,
    gemm_shape_factor,
)

P = ParallelConfig.layout  # a layout as the simulator models it (SP when TP > 1)

H100 = get_gpu("h100")
Q7B = get_model_shape("qwen2.5-7b")
Q05B = get_model_shape("qwen2.5-0.5b")
LENGTHS = sample_lengths("B", 300, seed=1)


def test_parameter_counts():
    """Published sizes: Qwen2.5-7B 7.61B, 0.5B 0.49B, 72B 72.7B parameters, and each other
    family's (a transcribed shape that is off by a dimension is off by far more than 0.01B)."""
    assert total_params(Q7B) / 1e9 == pytest.approx(7.61, abs=0.01)
    assert total_params(Q05B) / 1e9 == pytest.approx(0.49, abs=0.01)
    assert total_params(get_model_shape("qwen2.5-72b")) / 1e9 == pytest.approx(72.7, abs=0.1)
    assert sum(stage_params(Q7B, 4)) == total_params(Q7B)  # untied: no copy
    # the other families, against their model cards' counts
    for name, billions in [("llama3.1-8b", 8.03), ("llama3.1-70b", 70.55), ("qwen3-8b", 8.19),
                           ("qwen3-32b", 32.76), ("qwen3-0.6b", 0.60), ("mistral-nemo-12b", 12.25),
                           ("mistral-7b-v0.3", 7.25), ("llama3.2-1b", 1.24)]:
        assert total_params(get_model_shape(name)) / 1e9 == pytest.approx(billions, abs=0.01), name


def test_gemm_efficiency_bounds_and_quantization():
    rng = random.Random(0)
    for _ in range(300):
        m, n, k = (rng.randint(1, 40000) for _ in range(3))
        assert 0 < gemm_efficiency(m, n, k, H100) <= H100.gemm_max_eff
    assert gemm_efficiency(32768, 4608, 3584, H100) > 0.95 * H100.gemm_max_eff
    # wave quantization: one tile more than the SMs can run at once costs a second wave
    full = gemm_shape_factor(128 * 132, 128, 8192, 132)
    one_more = gemm_shape_factor(128 * 133, 128, 8192, 132)
    assert one_more < 0.8 * full  # smaller tiles soften it, but cannot remove it
    # tile quantization: 129 rows pad to 256 in 128-row tiles
    assert gemm_shape_factor(129 * 132, 128, 8192, 132) < gemm_shape_factor(128 * 132, 128,
                                                                               8192, 132)
    assert gemm_shape_factor(7, 9, 11, 0) == 1.0  # CPU: no tiles


def test_attention_tiles_match_brute_force():
    rng = random.Random(1)
    for _ in range(200):
        block = rng.choice([16, 32, 128])
        prefix, q = rng.randint(0, 700), rng.randint(1, 700)
        brute = sum(math.ceil((prefix + min((i + 1) * block, q)) / block)
                    for i in range(math.ceil(q / block)))
        assert attention_tiles(prefix, q, block) == brute
        assert computed_pairs(prefix, q, block) >= attention_pairs(prefix, q)
    for length in (100, 5000):
        for cp in (2, 4):
            assert computed_pairs(0, length, 128, cp) >= attention_pairs(0, length)
    # short sequences waste most of their diagonal tile
    assert attention_pairs(0, 100) / computed_pairs(0, 100, 128) < 0.35


@pytest.mark.parametrize("system", ["megatron", "chunkflow"])
def test_mfu_below_max_efficiency(system):
    ceiling = max(H100.gemm_max_eff, H100.attn_fwd_eff, H100.attn_bwd_eff)
    for layout in (P(tp=1, dp=8), P(tp=2, pp=2, dp=2, recompute="full")):
        if system == "megatron":
            p = predict_megatron(LENGTHS, Q05B, H100, layout, 32768)
        else:
            p = predict_chunkflow(LENGTHS, Q05B, H100, layout, 4096, 2)
        assert 0 < p.mfu <= ceiling
        assert p.step_s >= p.pipeline_s > 0


def test_more_tp_less_weight_memory_per_gpu():
    stat = [static_bytes(total_params(Q7B), P(tp=tp), 2) for tp in (1, 2, 4)]
    assert stat[0] > stat[1] > stat[2] and stat[0] / stat[2] == pytest.approx(4)
    on_8 = [ParallelConfig.on_gpus(tp, 1, 1, "none", 8, Q7B) for tp in (1, 2, 4)]
    preds = [predict_megatron(LENGTHS, Q7B, H100, layout, 32768) for layout in on_8]
    assert preds[0].memory["static"] > preds[1].memory["static"] > preds[2].memory["static"]
    assert preds[0].peak_mem_bytes > preds[2].peak_mem_bytes


def test_full_recompute_costs_about_a_third_more():
    """Full recompute re-runs every layer's forward inside the backward: (F + B + F)/(F + B) =
    4/3 when B = 2F. Without TP it is a bit less (attention's backward is 2.5x its forward, the
    output layer is not recomputed); with TP a bit more (the replayed forward brings its 4
    exposed collectives, while the backward hides 4 of its 6)."""
    for seq in (32768, 131072):
        lengths = [min(n, seq) for n in sample_lengths("B", 200, seed=2)]
        for tp in (1, 4):
            none, full = (predict_megatron(lengths, Q7B, H100, P(tp=tp, recompute=rc), seq)
                          for rc in ("none", "full"))
            ratio = full.pipeline_s / none.pipeline_s
            assert ratio == pytest.approx(4 / 3, abs=0.04)
            if tp == 1:
                assert ratio <= 4 / 3
            assert full.peak_mem_bytes < none.peak_mem_bytes
    assert layer_activation_bytes(Q7B, P(tp=4), 2, "full") == 2 * Q7B.hidden_size / 4


def test_selective_recompute_costs_time_and_saves_only_repeated_kv():
    """Megatron's default selective option (core_attn) re-runs the attention and keeps its
    inputs, as a kernel with grouped-query attention keeps them itself: it saves only the
    log-sum-exp, and where the kernel keeps K and V repeated to every head (torch 2.11's
    varlen) those."""
    lengths = [min(n, 32768) for n in LENGTHS]
    for hw, saving in ((H100, 0.005), (dataclasses.replace(H100, kv_repeat=True), 0.1)):
        none, sel = (predict_megatron(lengths, Q7B, hw, P(tp=4, dp=2, recompute=rc), 32768)
                     for rc in ("none", "selective"))
        assert sel.pipeline_s > none.pipeline_s
        assert 1 - saving < sel.peak_mem_bytes / none.peak_mem_bytes < 1
    assert sel.peak_mem_bytes / none.peak_mem_bytes < 1 - 0.005  # the repeated K/V saved


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_7b_at_256k_without_cp_does_not_fit_on_80gb(tp):
    lengths = [262144] + [1000] * 50
    for recompute in ("none", "full"):
        p = predict_megatron(lengths, Q7B, H100, P(tp=tp, recompute=recompute), 262144)
        assert not p.fits and p.peak_mem_bytes > get_gpu("h100").memory_bytes


def test_chunkflow_memory_floor_is_a_lower_bound():
    lengths = [200000] + [min(n, 8000) for n in LENGTHS]
    for layout in (P(tp=2, dp=2), P(tp=4, pp=2, recompute="full")):
        for c, k in ((4096, 1), (4096, 4), (16384, 2)):
            p = predict_chunkflow(lengths, Q7B, H100, layout, c, k)
            floor = chunkflow_memory_floor(lengths, Q7B, layout, H100.dtype_bytes, c, k)
            assert 0.5 * p.peak_mem_bytes < floor <= p.peak_mem_bytes * (1 + 1e-9)


def test_sequence_state_is_the_measured_peak():
    """docs/exactness.md's exact peak (measured on CPU there, tests/checks/test_memory.py), the K/V
    buffer of L tokens and the accumulator of (n - 1) C: the same for every K; stages after the
    first add the re-forwarded chunks' inputs, fewer with more K."""
    layout, C = P(tp=4, pp=2), 4096
    u = kv_state_bytes_per_token(Q7B, 14, 2, 4, with_grad=False)
    a = kv_state_bytes_per_token(Q7B, 14, 2, 4) - u
    for n in (2, 3, 10):
        L = n * C - 100
        state = sequence_state_bytes(L, C, 1, Q7B, layout, 2, 2)
        assert state[0] == pytest.approx(L * u + (n - 1) * C * a)
        assert state[1] == pytest.approx(state[0] + (n - 1) * C * 2 * Q7B.hidden_size / 4)
        more = sequence_state_bytes(L, C, 2, Q7B, layout, 2, 2)
        assert more[0] == state[0] and more[1] - more[0] < state[1] - state[0]
    assert sequence_state_bytes(C, C, 1, Q7B, layout, 2, 2) == [0.0, 0.0]


def test_modelled_and_measured_rates_share_the_state_formula():
    """The simulator (rates from the shape) and chunkflow bench's budget (measured rates) give
    the same state for the same per-token bytes, for every K and a last chunk cut short."""
    layout = P(tp=2, pp=2)
    u = kv_state_bytes_per_token(Q7B, 14, 2, 2, with_grad=False)
    a = kv_state_bytes_per_token(Q7B, 14, 2, 2) - u
    rates = ActivationRates((0.0, 0.0), (u, u), (a, a), 2 * Q7B.hidden_size / 2)
    for L, C, k in ((10 * 4096 - 100, 4096, 1), (10 * 4096 - 100, 4096, 4), (5000, 4096, 2),
                    (4096, 4096, 1)):
        assert sequence_state_bytes(L, C, k, Q7B, layout, 2, 2) == \
            [state_bound(L, C, k, rates, s) for s in range(2)]


def test_measured_device_scales_with_its_rates():
    """A CPU-like device built from measured rates: doubling every rate halves the step."""
    tiny = get_model_shape("tiny")
    kw = dict(gemm_flops=50e9, attn_fwd_flops=20e9, attn_bwd_flops=15e9, memory_bytes=8e9,
              p2p_bytes_per_s=2e9, p2p_latency_s=0.0, mem_bytes_per_s=10e9)
    slow = hardware_from_measurements(**kw)
    fast = hardware_from_measurements(**{k: (2 * v if k.endswith("_s") or "flops" in k else v)
                                         for k, v in kw.items()})
    assert slow.dtype_bytes == 4 and slow.num_sms == 0 and slow.gemm_max_eff == 1.0
    lengths = [min(n // 8, 4096) for n in LENGTHS]
    layout = P(tp=1, pp=2)
    for predict in (lambda hw: predict_megatron(lengths, tiny, hw, layout, 4096),
                    lambda hw: predict_chunkflow(lengths, tiny, hw, layout, 512, 2)):
        assert predict(fast).step_s == pytest.approx(predict(slow).step_s / 2, rel=1e-9)


def test_overrides():
    hw = with_overrides(H100, ["nvlink_gb_s=400", "num_sms=100", "spec=local"])
    assert hw.nvlink_gb_s == 400.0 and hw.num_sms == 100 and hw.memory_gib == H100.memory_gib
    assert hw.spec == "local"
    for bad, msg in ((["nope=1"], "KEY=VALUE with KEY one of"), (["gemm_max_eff=x"], "not a"),
                     (["gemm_max_eff=1.5"], "fraction of peak"), (["memory_gib=-1"], ">= 0"),
                     (["spec=tf"], "spec must be one of te, local"),
                     (["calibrated=1"], "KEY=VALUE with KEY one of")):
        with pytest.raises(ValueError, match=msg):
            with_overrides(H100, bad)


