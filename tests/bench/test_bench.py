"""`chunkflow bench`: the JSON contract of a small run under 2 spawned processes (PP=2), and what
the meters see. Behaviour only, never wall-clock: the numbers asserted are bytes, counts and
decisions, not speeds."""

import json

import pytest

from megatron_chunkflow.cli import main
from megatron_chunkflow.training.dist import run_processes

pytestmark = pytest.mark.slow

SMALL = ["--model", "tiny", "--global-batch-size", "24", "--scale", "0.0625", "--seq-length", "1024",
         "--warmup", "0", "--repeats", "1", "--threads", "1"]


def test_json_contract_and_budget(capsys, tmp_path):
    """PP=2 over 2 spawned processes; a budget under the largest micro-batch's activations: stock
    Megatron runs full recompute (and the meter sees its working set), ChunkFlow's chosen
    (C, K) fits the budget as modelled and as measured; the plots are written."""
    rc = main(["bench", *SMALL, "--budget-mib", "6", "--json", "--png", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    r = json.loads(out.out)
    assert {"baseline", "chunkflow", "speedup", "activation_memory_ratio", "setup"} <= set(r)
    mg, cf, setup = r["baseline"], r["chunkflow"], r["setup"]
    for x in (mg, cf):
        assert {"step_s", "tokens_per_s", "model_tflops", "peak_activation_bytes",
                "peak_rss_bytes", "bubble", "recompute_fraction", "predicted_step_s",
                "timeline"} <= set(x)
        assert x["step_s"] > 0 and x["peak_activation_bytes"] > 0 and 0 <= x["bubble"] < 1
        assert len(x["timeline"]) == 2  # one per pipeline stage
        assert x["tokens_per_s"] == pytest.approx(setup["tokens"] / x["step_s"])
    assert r["speedup"] == pytest.approx(mg["step_s"] / cf["step_s"])
    assert r["activation_memory_ratio"] == pytest.approx(
        cf["peak_activation_bytes"] / mg["peak_activation_bytes"])
    assert setup["layout"] == {"tp": 1, "pp": 2, "dp": 1, "world": 2}
    budget = setup["budget_bytes"]
    largest = 1024 * max(setup["activation_bytes_per_token"])
    assert largest > budget and mg["recompute"] == "full"
    assert mg["recompute_working_set_bytes"] > 0 and mg["recompute_fraction"] > 0
    # ChunkFlow's backwards go through the same meter; without Megatron's recompute they save only
    # the loss scaling's scalar (grad_scale_func on the last stage)
    assert cf["recompute_working_set_bytes"] <= 16
    assert cf["modelled_peak_activation_bytes"] <= budget
    assert cf["peak_activation_bytes"] <= budget
    chosen = [c for c in setup["chunking_candidates"]
              if (c["chunk_size"], c["k"]) == (cf["chunk_size"], cf["k"])]
    assert chosen and chosen[0]["predicted_s"] == min(
        c["predicted_s"] for c in setup["chunking_candidates"] if c["predicted_s"] is not None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.png", "throughput.png",
                                                          "timelines.png"]


def _peaks(lengths_list):
    """Per batch: (stock Megatron's and ChunkFlow's peak activation bytes without state, and
    ChunkFlow's peak state) on this stage, no recompute, C = 64, K = 1."""
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.bench.systems import (
        BenchSettings,
        build_system,
        step_system,
        train_settings,
    )
    from megatron_chunkflow.training.dist import init_distributed, shutdown
    from megatron_chunkflow.bench.instrument import BenchMeter
    from megatron_chunkflow.runtime.observe import StageTimeline
    from megatron_chunkflow.data.synthetic import make_sequences

    init_distributed(pp=2)
    s = BenchSettings(shape=get_model_shape("tiny"), model_name="tiny", lengths=[1],
                      seq_length=1024, budget_bytes=0)
    systems = [build_system("megatron", train_settings(s, "megatron")),
               build_system("chunkflow", train_settings(s, "chunkflow", chunk_size=64))]
    out = []
    for lengths in lengths_list:
        sequences = make_sequences(lengths, 1000, seed=0)
        row = []
        for system in systems:
            meter = BenchMeter(system.model, system.store)
            step_system(system, sequences, [StageTimeline(), meter])
            row.append((meter.peak_activation, meter.peak_state))
        out.append(row)
    shutdown()
    return out


def test_baseline_activations_grow_with_length_chunkflow_flat():
    """One sequence of 256 then 512 tokens: stock Megatron's metered activations double with the
    micro-batch, ChunkFlow's (C = 64, K = 1) stay the same; only its K/V state grows."""
    for stage in run_processes(_peaks, 2, [[256], [512]], timeout=300):
        (mg_short, cf_short), (mg_long, cf_long) = stage
        assert mg_long[0] == pytest.approx(2 * mg_short[0], rel=0.05)
        assert cf_long[0] == cf_short[0]
        assert cf_long[1] > cf_short[1] > 0
        assert mg_short[1] == mg_long[1] == 0
