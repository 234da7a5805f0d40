"""Mixture of experts under ChunkFlow (runtime/moe.py), float64, against unchunked megatron-core
(checks/verify.py: each sequence its own micro-batch): every gradient, the loss and the
per-sequence balancing loss (`seq_aux_loss`), for Qwen3-MoE's, Qwen2-MoE's and Mixtral's switches,
K 1 and 2, long sequences cut into 3 and 4 chunks, and under TP (sequence parallelism), PP, CP, DP
and expert parallelism (over DP, beside TP with expert TP 1, PP and CP). The models have two
layers (tests/models.py).
"""

import pytest

from tests.models import tiny

C = 32
# even lengths: megatron-core runs MoE under TP only with sequence parallelism, which the
# unchunked reference then needs too (every sequence a multiple of TP)
MIXED = [70, 6, 34, 100, 12, 64, 2, 16, 48, 10]  # packed segments, a 2-token sequence, 3-4 chunks
DEPENDENT = [100, 70]  # only long sequences: 4 and 3 chunks
FAMILIES = ("tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral")
# one process: the three families, and Megatron's activation recompute (its first pass routes the
# tokens without a graph, its second with one: they count once)
SINGLE = {**{f: (f, "none") for f in FAMILIES},
          "full_recompute": ("tiny-qwen3-moe", "full"),
          "mlp_recompute": ("tiny-qwen3-moe", "selective:mlp")}
LAYOUTS = {"tp2_sequence_parallel": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2),
           "cp2": dict(cp=2), "dp2": dict(),
           # expert parallelism: over the DP ranks (their chunks run in step: core/ep_align.py),
           # beside TP with expert TP 1 (the group inside a TP group), beside PP (over DP on each
           # stage), beside CP (inside the CP group)
           "ep2": dict(ep=2)}
LAYOUTS_4 = {"ep2_tp2_sequence_parallel": dict(ep=2, etp=1, tp=2, sequence_parallel=True),
             "ep2_pp2": dict(ep=2, pp=2), "ep2_cp2": dict(ep=2, cp=2)}
BOUND = 1e-10


def _summary(results):
    return [(r.max_rel_grad_err, r.worst_param, r.loss_ref, r.loss_chunked, r.balance_ref,
             r.balance_chunked) for r in results]


def _verify(model, layout, ks=(1, 2)):
    import torch

    from megatron_chunkflow.checks.verify import run_verify
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig

    results = run_verify(tiny(model), [MIXED, DEPENDENT],
                         [ChunkFlowConfig(C, k, "torch") for k in ks], ParallelConfig(**layout),
                         torch.float64, seed=1)
    return {k: _summary(rows) for k, rows in zip(ks, results)}


def _families(names):
    from megatron_chunkflow.mcore.dist import shutdown

    out = {}
    for name in names:
        model, recompute = SINGLE[name]
        out[name] = _verify(model, dict(recompute=recompute))
    shutdown()
    return out


def _layouts(names):
    from megatron_chunkflow.mcore.dist import shutdown

    out = {name: _verify("tiny-qwen3-moe", {**LAYOUTS, **LAYOUTS_4}[name]) for name in names}
    shutdown()
    return out


def _check(rows):
    for step, (err, worst, loss_ref, loss_cf, balance_ref, balance_cf) in enumerate(rows):
        assert err <= BOUND, f"step {step}: max relative grad error {err:.2e} at {worst}"
        assert loss_cf == pytest.approx(loss_ref, rel=BOUND)
        # the balancing loss of every whole sequence, as Megatron's tracker sums it (float32)
        assert balance_ref > 0 and balance_cf == pytest.approx(balance_ref, rel=1e-6)


@pytest.fixture(scope="module")
def families(gloo):
    return gloo.run(_families, 1, list(SINGLE), timeout=600)[0]


@pytest.mark.slow
@pytest.mark.medium
@pytest.mark.release
@pytest.mark.parametrize("name", list(SINGLE))
def test_every_family_and_recompute_is_exact_at_k1_and_k2(families, name):
    for k in (1, 2):
        _check(families[name][k])


@pytest.fixture(scope="module")
def layouts(gloo):
    return gloo.run(_layouts, 2, list(LAYOUTS), timeout=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_is_exact(layouts, name):
    for k in (1, 2):
        _check(layouts[name][k])


@pytest.fixture(scope="module")
def layouts_4(gloo):
    return gloo.run(_layouts, 4, list(LAYOUTS_4), timeout=900)[0]


@pytest.mark.slow
@pytest.mark.release
@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_expert_parallel_layouts_on_four_ranks_are_exact(layouts_4, name):
    for k in (1, 2):
        _check(layouts_4[name][k])


def _without_the_per_sequence_loss():
    """ChunkFlow with Megatron's own seq_aux_loss left in place: it would count each packed chunk
    as one sequence (the control: the bound above sees the difference)."""
    from megatron_chunkflow.mcore.dist import shutdown
    from megatron_chunkflow.runtime import moe

    moe.apply_moe, original = (lambda gpt, store: 0), moe.apply_moe
    try:
        return _verify("tiny-qwen3-moe", {}, ks=(1,))[1]
    finally:
        moe.apply_moe = original
        shutdown()


@pytest.mark.slow
def test_the_control_without_per_sequence_counts_is_caught(gloo):
    packed, dependent = gloo.run(_without_the_per_sequence_loss, 1, timeout=600)[0]
    assert packed[0] > 1e-6  # packed chunks: several sequences counted as one
    assert packed[5] != pytest.approx(packed[4], rel=1e-4)


def _two_depths():
    """A 2-layer MoE model, then the 4-layer preset, in one process (Megatron's MoE logging
    tracker is process-wide, sized by the first model's layers)."""
    import torch

    from megatron_chunkflow.checks.verify import run_verify
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.mcore.dist import shutdown

    out = [_summary(run_verify(shape, [DEPENDENT], ChunkFlowConfig(C, 1, "torch"), ParallelConfig(),
                               torch.float64, seed=1))
           for shape in (tiny("tiny-qwen3-moe"), get_model_shape("tiny-qwen3-moe"))]
    shutdown()
    return out


@pytest.mark.slow
def test_models_of_other_depths_run_one_after_another_in_one_process(gloo):
    shallow, deep = gloo.run(_two_depths, 1, timeout=600)[0]
    _check(shallow)
    _check(deep)


@pytest.mark.parametrize("overrides, flag", [
    (dict(moe_router_load_balancing_type="aux_loss"), "--moe-router-load-balancing-type aux_loss"),
    (dict(moe_router_load_balancing_type="global_aux_loss"),
     "--moe-router-load-balancing-type global_aux_loss"),
    (dict(moe_expert_capacity_factor=1.25), "--moe-expert-capacity-factor 1.25"),
    (dict(moe_z_loss_coeff=1e-3), "--moe-z-loss-coeff 0.001"),
    (dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
     "--moe-router-enable-expert-bias")])
def test_what_chunking_cannot_keep_exact_is_refused_by_flag(overrides, flag):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_chunkflow.runtime.moe import check_moe_config

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                               add_bias_linear=False, **overrides)
    with pytest.raises(ValueError, match=flag.replace("+", r"\+").replace(".", r"\.")):
        check_moe_config(config)


@pytest.mark.slow
def test_train_on_sharegpt_logs_the_balancing_loss_and_each_experts_load(gloo, tmp_path):
    """`chunkflow train --model qwen3-moe-tiny` (Qwen3-MoE's switches, the Qwen vocabulary) on the
    embedded ShareGPT conversations (the first, every step): the loss falls; every record holds the balancing loss and
    each expert's share of the routed tokens, which the progress line shows too."""
    import json

    log = tmp_path / "steps.jsonl"
    code, out, err = gloo.cli(1, "train", "--model", "qwen3-moe-tiny", "--train-iters", "3",
                              "--lr-warmup-iters", "0", "--global-batch-size", "1",
                              "--max-samples", "1", "--chunk-size", "256", "--json",
                              "--log-json", str(log))
    assert code == 0, err[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    for row in rows:
        assert row["balancing_loss"] > 0 and len(row["expert_load"]) == 4
        assert sum(row["expert_load"]) == pytest.approx(1.0, abs=1e-3)
    assert "| balancing loss " in err and "expert load max " in err


def _training_losses(layout):
    """Six float64 steps of `chunkflow train`'s loop, ChunkFlow and stock megatron-unpacked (each
    sequence its own micro-batch: the grouping the per-sequence balancing loss is), same data."""
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
    from megatron_chunkflow.training.loop import train

    lengths = [70, 6, 34, 100, 12, 64, 2, 16, 48, 10, 130, 22, 8, 90, 4, 40, 56, 12]
    out = []
    for system in ("chunkflow", "megatron-unpacked"):
        s = TrainSettings(shape=tiny("tiny-qwen3-moe"), model_name="tiny-qwen3-moe",
                          train_iters=6, global_batch_size=6, seq_length=160,
                          chunkflow=ChunkFlowConfig(16, 1), dtype="float64", seed=5,
                          optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=1),
                          parallel=ParallelConfig(**layout), system=system)
        job = init_distributed(s.parallel, s.seed)
        out.append([m["loss"] for m in train(s, job, make_sequences(lengths, 1000, seed=3))])
    shutdown()
    return out


@pytest.mark.slow
def test_expert_parallel_training_is_stock_megatrons_step_by_step(gloo):
    """TP 2 with sequence parallelism, EP 2, expert TP 1 (experts split over the TP pair): six
    Adam steps of ChunkFlow and of stock Megatron, float64, the same loss at every step (the
    gradients, their reduction over the expert data-parallel group and the optimizer's state)."""
    chunkflow, stock = gloo.run(_training_losses, 2, dict(tp=2, sequence_parallel=True, ep=2,
                                                          etp=1), timeout=900)[0]
    assert chunkflow[-1] < chunkflow[0]
    for step, (a, b) in enumerate(zip(chunkflow, stock), start=1):
        assert a == pytest.approx(b, rel=1e-10), f"step {step}: {a} vs {b}"


@pytest.mark.parametrize("command", ["simulate", "plan", "memory"])
def test_the_cost_and_memory_models_refuse_an_moe_model_by_name(command, capsys):
    """Their formulas are a dense model's: an MoE model gets an error naming it, not numbers."""
    from megatron_chunkflow.cli import main

    assert main([command, "--model", "tiny-qwen3-moe"]) == 2
    err = capsys.readouterr().err
    assert "--model tiny-qwen3-moe: a mixture-of-experts model" in err
    assert f"`chunkflow {command}` does not model experts yet" in err


def test_moe_builds_gptmodel_and_refuses_hybrid_by_flag():
    """`--model-class auto` gives an MoE model GPTModel (0.19 recommends HybridModel, whose 'E'
    layers ChunkFlow does not build: it must not train a dense model instead); `hybrid` is
    refused naming the flag."""
    from megatron_chunkflow import compat

    assert compat.resolve_model_class("auto", moe=True) == "gpt"
    with pytest.raises(ValueError, match="--model-class hybrid: ChunkFlow builds mixture-of-"):
        compat.resolve_model_class("hybrid", moe=True)
