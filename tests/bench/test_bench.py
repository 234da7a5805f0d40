"""`chunkflow bench`: the JSON contract of a small run under 2 spawned processes (PP=2), and what
the meters see. Behaviour only, never wall-clock: the numbers asserted are bytes, counts and
decisions, not speeds."""

import json

import pytest

from megatron_chunkflow.cli import main
from megatron_chunkflow.config import ParallelConfig, Recompute

pytestmark = pytest.mark.slow

SMALL = ["--model", "tiny", "--global-batch-size", "24", "--scale", "0.0625", "--seq-length", "1024",
         "--warmup", "0", "--repeats", "1", "--threads", "1"]


def _run(capsys, *argv) -> dict:
    rc = main(["bench", *SMALL, "--json", *argv])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_json_contract_and_budget(capsys, tmp_path):
    """PP=2 over 2 spawned processes, all three baselines, a budget under the largest packed
    micro-batch's activations without recompute: every system runs the fastest option that fits
    as modelled (near ties to the smaller peak) and stays within the budget as measured; the
    speedups and memory ratios are per baseline; the plots are written."""
    r = _run(capsys, "--budget-mib", "8", "--png", str(tmp_path))
    assert {"baseline", "baseline_name", "baselines", "chunkflow", "speedup", "speedups",
            "activation_memory_ratio", "activation_memory_ratios", "not_run", "setup"} <= set(r)
    names = ["megatron-sft", "megatron-packed", "megatron-unpacked"]
    assert list(r["baselines"]) == names and r["not_run"] == {}
    assert r["baseline_name"] == "megatron-packed" and r["baseline"] == r["baselines"][names[1]]
    cf, setup = r["chunkflow"], r["setup"]
    budget = setup["budget_bytes"]
    for name, x in [*r["baselines"].items(), ("chunkflow", cf)]:
        assert {"step_s", "tokens_per_s", "model_tflops", "peak_activation_bytes", "recompute",
                "peak_rss_bytes", "bubble", "recompute_fraction", "predicted_step_s",
                "recompute_candidates", "timeline"} <= set(x)
        assert x["step_s"] > 0 and x["peak_activation_bytes"] > 0 and 0 <= x["bubble"] < 1
        assert len(x["timeline"]) == 2  # one per pipeline stage
        assert x["tokens_per_s"] == pytest.approx(setup["tokens"] / x["step_s"])
        str(Recompute.parse(x["recompute"]))  # a menu option's text form
        # the rule: fastest that fits, ties (3%) to the smaller peak, measured within budget
        fitting = [c for c in x["recompute_candidates"] if c["predicted_s"] is not None]
        assert all(c["peak_bytes"] <= budget for c in fitting)
        fastest = min(c["predicted_s"] for c in fitting)
        chosen = [c for c in fitting if c["recompute"] == x["recompute"]
                  and c.get("chunk_size") == x.get("chunk_size") and c.get("k") == x.get("k")]
        assert len(chosen) == 1 and chosen[0]["predicted_s"] <= fastest * 1.03
        assert chosen[0]["peak_bytes"] == min(c["peak_bytes"] for c in fitting
                                              if c["predicted_s"] <= fastest * 1.03)
        assert x["modelled_peak_activation_bytes"] == chosen[0]["peak_bytes"] <= budget
        assert x["peak_activation_bytes"] <= budget
    for b in names:
        mg = r["baselines"][b]
        assert r["speedups"][b] == pytest.approx(mg["step_s"] / cf["step_s"])
        assert r["activation_memory_ratios"][b] == pytest.approx(
            cf["peak_activation_bytes"] / mg["peak_activation_bytes"])
        assert len(mg["recompute_candidates"]) == 10  # Megatron's menu for 2 layers per stage
    assert r["speedup"] == r["speedups"]["megatron-packed"]
    # the packed baseline's largest micro-batch does not fit without recompute
    packed = r["baselines"]["megatron-packed"]
    assert packed["recompute"] != "none"
    assert packed["recompute_working_set_bytes"] > 0 and packed["recompute_fraction"] > 0
    assert setup["layout"] == {"tp": 1, "pp": 2, "dp": 1, "world": 2}
    assert set(setup["activation_bytes_per_token_by_recompute"]) == {
        c["recompute"] for c in packed["recompute_candidates"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.png", "throughput.png",
                                                          "timelines.png"]


def test_fixed_choices_and_a_baseline_that_does_not_fit(capsys):
    """--baseline, --megatron-recompute, --chunkflow-recompute, --chunk-size and --chunkflow-k
    fix the choices; without recompute ChunkFlow's backwards save only the loss scaling's scalar
    (grad_scale_func on the last stage). A budget that the named recompute does not meet for a
    baseline is an error naming --budget-mib."""
    r = _run(capsys, "--baseline", "megatron-sft", "--megatron-recompute", "block:1",
             "--chunkflow-recompute", "none", "--chunk-size", "128", "--chunkflow-k", "2",
             "--budget-mib", "1000")
    assert list(r["baselines"]) == ["megatron-sft"] and r["baseline_name"] == "megatron-sft"
    sft, cf = r["baselines"]["megatron-sft"], r["chunkflow"]
    assert sft["recompute"] == "block:1" and len(sft["recompute_candidates"]) == 1
    assert sft["recompute_working_set_bytes"] > 0
    assert (cf["recompute"], cf["chunk_size"], cf["k"]) == ("none", 128, 2)
    assert cf["recompute_working_set_bytes"] <= 16
    assert main(["bench", *SMALL, "--baseline", "megatron-packed", "--megatron-recompute",
                 "none", "--budget-mib", "4"]) == 2
    assert "--budget-mib 4: no recompute option for megatron-packed fits" in \
        capsys.readouterr().err


def _peaks(lengths_list):
    """Per batch: (stock Megatron's and ChunkFlow's peak activation bytes without state, and
    ChunkFlow's peak state) on this stage, no recompute, C = 64, K = 1."""
    from megatron_chunkflow.bench.settings import BenchSettings
    from megatron_chunkflow.bench.systems import build_system, step_system, train_settings
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.runtime.meter import ActivationMeter
    from megatron_chunkflow.runtime.observe import StageTimeline

    parallel = ParallelConfig(pp=2)
    job = init_distributed(parallel)
    s = BenchSettings(shape=get_model_shape("tiny"), model_name="tiny", lengths=[1],
                      seq_length=1024, budget_bytes=2**30, parallel=parallel)
    systems = [build_system("megatron-packed", train_settings(s, "megatron-packed"), job),
               build_system("chunkflow", train_settings(s, "chunkflow", chunk_size=64), job)]
    out = []
    for lengths in lengths_list:
        sequences = make_sequences(lengths, 1000, seed=0)
        row = []
        for system in systems:
            meter = ActivationMeter(system.training.model, system.training.store)
            step_system(system, sequences, [StageTimeline(), meter])
            row.append((meter.peak_activation, meter.peak_state))
        out.append(row)
    shutdown()
    return out


def test_baseline_activations_grow_with_length_chunkflow_flat(gloo):
    """One sequence of 256 then 512 tokens: stock Megatron's metered activations double with the
    micro-batch, ChunkFlow's (C = 64, K = 1) stay the same; only its K/V state grows."""
    for stage in gloo.run(_peaks, 2, [[256], [512]], timeout=300):
        (mg_short, cf_short), (mg_long, cf_long) = stage
        assert mg_long[0] == pytest.approx(2 * mg_short[0], rel=0.05)
        assert cf_long[0] == cf_short[0]
        assert cf_long[1] > cf_short[1] > 0
        assert mg_short[1] == mg_long[1] == 0
