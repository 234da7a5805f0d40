"""Megatron's recompute menu in the cost and memory model (perfmodel/footprint.py, layer.py,
roofline.py): what each option keeps and re-runs, and the orders that implies."""

import dataclasses

import pytest

from megatron_chunkflow.config import ParallelConfig, Recompute
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.perfmodel.footprint import (
    Build,
    RECOMPUTE_DROPS,
    activation_terms,
    dropped_bytes,
    layer_activation_bytes,
    per_token_bytes,
)
from megatron_chunkflow.perfmodel.hardware import get_gpu
from megatron_chunkflow.perfmodel.kvstate import sequence_state_bytes
from megatron_chunkflow.perfmodel.moments import backward_work_bytes
from megatron_chunkflow.perfmodel.predict import predict_chunkflow, predict_megatron

P = ParallelConfig.layout  # a layout as the simulator models it (SP when TP > 1)

H100 = get_gpu("h100")
Q7B = get_model_shape("qwen2.5-7b")
LENGTHS = [min(n, 32768) for n in sample_lengths("B", 300, seed=1)]
SEL = {m: Recompute("selective", m) for m in (("core_attn",), ("mlp",), ("layernorm",),
                                                ("core_attn", "mlp", "layernorm"))}


def test_terms_add_up_to_the_documented_count():
    """4h + 2a + 2kv + 3f elements plus the fp32 log-sum-exp and the norms' rstd; the head
    dimensions split over TP, the hidden ones under sequence parallelism only; unfused SwiGLU
    keeps 2f more; each module drops its own terms; full keeps the layer input."""
    h, kv, f, nh = Q7B.hidden_size, Q7B.kv_dim, Q7B.ffn_hidden_size, Q7B.num_attention_heads
    a = nh * Q7B.head_dim
    for tp, sp in ((1, False), (4, False), (4, True)):
        layout = dataclasses.replace(P(tp=tp), sequence_parallel=sp)
        split = tp if sp else 1
        terms = activation_terms(Q7B, layout, 2)
        assert sum(terms.values()) == pytest.approx(
            2 * (4 * h / split + (2 * a + 2 * kv + 3 * f) / tp) + 4 * nh / tp + 8 / split)
        unfused = activation_terms(Q7B, layout, 2, Build(fused_swiglu=False))
        assert sum(unfused.values()) - sum(terms.values()) == pytest.approx(2 * 2 * f / tp)
        assert layer_activation_bytes(Q7B, layout, 2) == pytest.approx(sum(terms.values()))
        for module, names in RECOMPUTE_DROPS.items():
            assert dropped_bytes(Q7B, layout, 2, Recompute("selective", (module,))) == \
                pytest.approx(sum(terms[n] for n in names))
        assert layer_activation_bytes(Q7B, layout, 2, "full") == 2 * h / split
    # mlp + layernorm share fc1's input (the pre-MLP norm's output): counted once
    both = dropped_bytes(Q7B, P(), 2, Recompute("selective", ("mlp", "layernorm")))
    assert both == 2 * (h + h + 2 * f + f) + 8


def test_block_keeps_inputs_for_its_first_n_layers():
    layout = P(tp=4, pp=2, recompute="block:3")
    kept, inp = (layer_activation_bytes(Q7B, layout, 2, rc) for rc in ("none", "full"))
    per_token = per_token_bytes(Q7B, layout, 2, 2)
    assert per_token[0] == pytest.approx(3 * inp + 11 * kept)
    assert per_token_bytes(Q7B, P(tp=4, pp=2, recompute="block:14"), 2, 2) == \
        per_token_bytes(Q7B, P(tp=4, pp=2, recompute="full"), 2, 2)


def test_backward_work_is_what_the_backward_recreates():
    """Selective modules re-create their drops for the layer in backward; full re-creates the
    whole layer; block with N below the stage's layers adds nothing (its kept layers have freed
    more by then)."""
    def work(rc):
        return 1000 * backward_work_bytes(Q7B, P(tp=4, recompute=rc), 2, 28)

    base, full = work("none"), work("full")
    inp = layer_activation_bytes(Q7B, P(tp=4), 2, "full")
    assert full == pytest.approx(2 * base - 1000 * inp)  # its gradients and itself, less input
    assert work("block:5") == base and work("block:28") == full
    assert work(SEL[("mlp",)]) == pytest.approx(
        base + 1000 * dropped_bytes(Q7B, P(tp=4), 2, SEL[("mlp",)]))


def _pair(system, rc, pp=2):
    layout = P(tp=4, pp=pp, dp=2, recompute=rc)
    if system == "megatron":
        p = predict_megatron(LENGTHS, Q7B, H100, layout, 32768)
    else:
        p = predict_chunkflow(LENGTHS, Q7B, H100, layout, 4096, 2)
    return p.step_s, p.peak_mem_bytes


@pytest.mark.parametrize("system", ["megatron", "chunkflow"])
def test_more_recompute_less_memory_more_time(system):
    """Along each chain of the menu, memory falls and time rises: none, block:1 .. block:13,
    full; none, mlp, mlp + layernorm; none, layernorm, mlp + layernorm. core_attn costs time and,
    with a kernel that keeps no repeated K/V, memory too: its checkpoint keeps K and the QKV
    output that V views, where the kernel kept copies of K and V (memtrace/ shows it)."""
    chains = [["none"] + [f"block:{n}" for n in range(1, 14)] + ["full"],
              ["none", SEL[("mlp",)], Recompute("selective", ("mlp", "layernorm"))],
              ["none", SEL[("layernorm",)], Recompute("selective", ("mlp", "layernorm"))]]
    for chain in chains:
        points = [_pair(system, rc) for rc in chain]
        for (t0, m0), (t1, m1) in zip(points, points[1:]):
            assert t1 > t0 and m1 < m0
    # block:1 lies between none and full, and mlp saves the most of the selective modules
    (tn, mn), (tb, mb), (tf, mf) = (_pair(system, rc) for rc in ("none", "block:1", "full"))
    assert tn < tb < tf and mn > mb > mf
    savings = {m: _pair(system, "none")[1] - _pair(system, SEL[(m,)])[1]
               for m in ("core_attn", "mlp", "layernorm")}
    assert savings["mlp"] > savings["layernorm"] > 0
    assert abs(savings["core_attn"]) < 0.1 * savings["mlp"]
    assert _pair(system, SEL[("core_attn",)])[0] > tn


@pytest.mark.parametrize("system", ["megatron", "chunkflow"])
def test_block_with_every_layer_is_full(system):
    assert _pair(system, "block:14") == _pair(system, "full")


def test_full_recompute_re_runs_the_forward():
    """Full adds the whole layer forward to every backward (with its TP collectives): about
    4/3 of forward + backward; selective mlp most of that (the MLP holds most GEMM FLOPs)."""
    t_none, t_mlp, t_full = (_pair("megatron", rc, pp=1)[0]
                             for rc in ("none", SEL[("mlp",)], "full"))
    assert t_full / t_none == pytest.approx(4 / 3, abs=0.05)
    assert t_none < t_mlp < t_full


def test_chunkflow_state_does_not_follow_recompute():
    """The K/V state is the sequence's buffer and accumulator whatever is recomputed: a recomputed
    core attention reads the buffer again, it re-creates no K/V copy."""
    L, C = 10 * 4096, 4096
    none = sequence_state_bytes(L, C, 1, Q7B, P(tp=4, pp=2), 2, 2)
    for rc in (SEL[("core_attn",)], SEL[("mlp",)], "full"):
        assert sequence_state_bytes(L, C, 1, Q7B, P(tp=4, pp=2, recompute=rc), 2, 2) == none


def test_layout_text_forms_and_validation():
    lay = ParallelConfig.on_gpus(4, 1, 2, "selective:mlp+layernorm", 32, Q7B)
    assert lay.recompute == Recompute("selective", ("mlp", "layernorm"))
    assert lay.to_flag() == "4,1,2,selective:mlp+layernorm"
    assert lay.to_json()["recompute"] == "selective:mlp+layernorm"
    assert lay.describe() == "TP4 CP1 PP2 DP4 selective:mlp+layernorm"
    assert ParallelConfig.on_gpus(4, 1, 2, "block:14", 32, Q7B).recompute.num_layers == 14
    with pytest.raises(ValueError, match="a pipeline stage has only 14 layers"):
        ParallelConfig.on_gpus(4, 1, 2, "block:15", 32, Q7B)
    with pytest.raises(ValueError, match="PP 8 must divide the model's 28 layers"):
        ParallelConfig.on_gpus(1, 1, 8, "none", 32, Q7B)
    assert P(recompute="full").recompute == Recompute("full")  # text accepted
