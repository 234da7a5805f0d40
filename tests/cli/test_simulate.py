"""`chunkflow simulate`: JSON contract, memory verdicts, --auto, and bad flags (exit 2 naming the
flag). Small batches and fixed layouts keep each run well under a second."""

import json

import pytest

from megatron_chunkflow.cli import main
from megatron_chunkflow.cli.simulate import NAMES
from megatron_chunkflow.core.step import BASELINES

SMALL = ["--global-batch-size", "200", "--gpus", "8"]


def run_json(capsys, *argv):
    rc = main(["simulate", *argv, "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def test_json_contract(capsys):
    rc, obj, err = run_json(capsys, *SMALL, "--megatron-parallel", "4,1,1,none",
                            "--chunkflow-parallel", "2,1,2,selective", "--chunk-size", "4096",
                            "--chunkflow-k", "2")
    assert rc == 0 and "megatron-packed" in err and "ChunkFlow" in err
    assert {"megatron", "chunkflow", "speedup", "chunk_size", "k", "baselines", "speedups",
            "cp_overlap"} <= set(obj)
    assert set(obj["baselines"]) == set(obj["speedups"]) == set(NAMES)
    for p in (obj["chunkflow"], *obj["baselines"].values()):
        assert {"step_s", "mfu", "peak_mem_gib", "fits", "tokens_per_s", "bubble", "layout",
                "padding_fraction"} <= set(p)
        assert p["step_s"] > 0 and 0 < p["mfu"] < 1 and p["peak_mem_gib"] > 0 and p["fits"]
    # "megatron" and "speedup" stay the strongest baseline's, megatron-packed
    assert obj["megatron"] == obj["baselines"]["megatron-packed"]
    assert obj["megatron"]["baseline"] == "megatron-packed"
    assert obj["speedup"] == obj["speedups"]["megatron-packed"]
    for name, p in obj["baselines"].items():
        assert p["layout"] == {"tp": 4, "cp": 1, "pp": 1, "dp": 2, "recompute": "none"}
        assert obj["speedups"][name] == pytest.approx(p["step_s"] / obj["chunkflow"]["step_s"])
        # same sequences, so the speedup is also the ratio of MFUs
        assert obj["speedups"][name] == pytest.approx(obj["chunkflow"]["mfu"] / p["mfu"])
    assert obj["baselines"]["megatron-sft"]["padding_fraction"] > 0
    assert obj["chunkflow"]["layout"] == {"tp": 2, "cp": 1, "pp": 2, "dp": 2,
                                          "recompute": "selective"}
    assert (obj["chunk_size"], obj["k"]) == (4096, 2)
    assert obj["setup"]["global_batch_size"] == 200 and obj["setup"]["gpu"] == "h100"
    assert obj["setup"]["baseline"] == "all"


def test_virtual_stages_for_both_systems(tmp_path, capsys):
    """PP written PPxV: V virtual stages per pipeline rank, in the JSON layouts, the table and the
    chosen-layout flags; Megatron's refusal of a micro-batch count is an error naming the
    baseline."""
    argv = [*SMALL, "--megatron-parallel", "2,1,2x2,none", "--chunkflow-parallel",
            "2,1,2x7,none", "--chunk-size", "4096"]
    rc, obj, err = run_json(capsys, *argv)
    assert rc == 0 and " 2 1 2x2 2 none " in err and " 2 1 2x7 2 none " in err
    for p in obj["baselines"].values():
        assert p["layout"] == {"tp": 2, "cp": 1, "pp": 2, "dp": 2, "recompute": "none", "vpp": 2}
    assert obj["chunkflow"]["layout"]["vpp"] == 7
    _, plain, _ = run_json(capsys, *SMALL, "--megatron-parallel", "2,1,2,none",
                           "--chunkflow-parallel", "2,1,2,none", "--chunk-size", "4096")
    assert "vpp" not in plain["megatron"]["layout"]
    assert plain["megatron"]["step_s"] != obj["megatron"]["step_s"]
    # 5 micro-batches on one pipeline: Megatron wants a multiple of PP 4 or a last group >= 4
    f = tmp_path / "lengths.txt"
    f.write_text("30000\n" * 5)
    assert main(["simulate", "--lengths-file", str(f), "--gpus", "8", "--baseline",
                 "megatron-packed", "--megatron-parallel", "2,1,4x7,none"]) == 2
    assert "--baseline megatron-packed: 5 micro-batches per pipeline" in capsys.readouterr().err


def test_one_baseline_and_recompute_options(capsys):
    rc, obj, err = run_json(capsys, *SMALL, "--baseline", "megatron-sft",
                            "--megatron-parallel", "2,2,2,block:3",
                            "--chunkflow-parallel", "2,1,2,selective:mlp+layernorm")
    assert rc == 0 and set(obj["baselines"]) == {"megatron-sft"}
    assert obj["megatron"] == obj["baselines"]["megatron-sft"]
    assert obj["megatron"]["layout"]["recompute"] == "block:3"
    assert obj["chunkflow"]["layout"]["recompute"] == "selective:mlp+layernorm"
    assert "megatron-packed" not in err and "block:3" in err and "selective:mlp+layernorm" in err


def test_cp_overlap_range(capsys):
    """Every stock prediction again at CP overlap 0 and 1: slower to faster under CP, the same
    without; the default is the Hardware's, overridable."""
    rc, obj, err = run_json(capsys, *SMALL, "--megatron-parallel", "2,4,1,none",
                            "--chunkflow-parallel", "2,1,1,none")
    rng = obj["cp_overlap"]
    assert rc == 0 and rng["value"] == 0.8 and set(rng["range"]) == {"0", "1"}
    for name in BASELINES:  # megatron-hybrid-cp: see test_hybrid_cp_baseline
        p = obj["baselines"][name]
        lo, hi = rng["range"]["0"][name], rng["range"]["1"][name]
        assert lo["step_s"] > p["step_s"] > hi["step_s"]
        assert lo["speedup"] > obj["speedups"][name] > hi["speedup"]
        assert f"vs {name}: {obj['speedups'][name]:.2f}x (CP overlap 0.8; at 0: " in err
    _, one, _ = run_json(capsys, *SMALL, "--megatron-parallel", "2,4,1,none",
                         "--chunkflow-parallel", "2,1,1,none", "--gpu-set", "cp_overlap=1")
    assert one["megatron"]["step_s"] == pytest.approx(rng["range"]["1"]["megatron-packed"]
                                                      ["step_s"])
    _, flat, _ = run_json(capsys, *SMALL, "--megatron-parallel", "2,1,1,none",
                          "--chunkflow-parallel", "2,1,1,none")
    for name in BASELINES:
        assert (flat["cp_overlap"]["range"]["0"][name]["step_s"]
                == flat["baselines"][name]["step_s"])


def test_hybrid_cp_baseline(capsys):
    """megatron-hybrid-cp: searched (TP, recompute, M) and reported with its M; the chosen flags
    reproduce it; a CP size per sequence makes it slower at CP overlap 0 than at 1; the
    strongest fitting baseline is named; PP > 1 leaves it out of "all" with a note, and is an
    error when it is asked for by name."""
    rc, obj, err = run_json(capsys, *SMALL, "--chunkflow-parallel", "2,1,1,none")
    h = obj["baselines"]["megatron-hybrid-cp"]
    m = h["max_seqlen_per_dp_cp_rank"]
    assert rc == 0 and h["layout"]["pp"] == 1 and h["layout"]["cp"] == 1 and h["fits"]
    assert m & (m - 1) == 0 and f"M={m}" in err and "hybrid-cp " in err
    pinned = f"--megatron-parallel {h['layout']['tp']},1,1,{h['layout']['recompute']} " \
             f"--max-seqlen-per-dp-cp-rank {m} (megatron-hybrid-cp)"
    assert pinned in err
    fastest = min((n for n, p in obj["baselines"].items() if p["fits"]),
                  key=lambda n: obj["baselines"][n]["step_s"])
    assert obj["strongest"] == fastest
    assert obj["speedup_vs_strongest"] == obj["speedups"][fastest]
    assert f"strongest stock baseline: {fastest}" in err
    _, again, _ = run_json(capsys, *SMALL, "--chunkflow-parallel", "2,1,1,none", "--baseline",
                           "megatron-hybrid-cp", "--megatron-parallel",
                           f"{h['layout']['tp']},1,1,{h['layout']['recompute']}",
                           "--max-seqlen-per-dp-cp-rank", str(m))
    assert again["baselines"]["megatron-hybrid-cp"] == h
    lo, hi = (obj["cp_overlap"]["range"][e]["megatron-hybrid-cp"]["step_s"] for e in "01")
    assert lo >= h["step_s"] >= hi
    rc, obj, err = run_json(capsys, *SMALL, "--megatron-parallel", "2,1,2,none",
                            "--chunkflow-parallel", "2,1,1,none")
    assert rc == 0 and set(obj["baselines"]) == set(BASELINES)
    assert "megatron-hybrid-cp not predicted: --megatron-parallel 2,1,2,none has PP > 1" in err


def test_chunkflow_with_cp(capsys):
    """ChunkFlow's layout may use CP: shown like the stock ones, its per-GPU state halved
    against the same layout with DP instead, its step faster where more of its overlapped
    gathers is hidden."""
    argv = [*SMALL, "--baseline", "megatron-packed", "--megatron-parallel", "2,2,1,none",
            "--chunk-size", "8192", "--chunkflow-reforward-attention", "recompute"]
    rc, obj, err = run_json(capsys, *argv, "--chunkflow-parallel", "2,2,1,none",
                            "--chunkflow-cp-kv", "sharded")
    cf = obj["chunkflow"]
    assert rc == 0 and cf["layout"] == {"tp": 2, "cp": 2, "pp": 1, "dp": 2, "recompute": "none"}
    assert "ChunkFlow         2 2 1 2 none  C=8192 K=1 kv=sharded" in err
    _, dp, _ = run_json(capsys, *argv, "--chunkflow-parallel", "2,1,1,none")
    assert cf["memory_gib"]["kv_state"] == pytest.approx(
        dp["chunkflow"]["memory_gib"]["kv_state"] / 2, rel=0.01)
    # replicated state: the whole sequence's on every CP rank, and less traffic; auto picks the
    # faster that fits and names it in the chosen flags
    _, rep, _ = run_json(capsys, *argv, "--chunkflow-parallel", "2,2,1,none",
                         "--chunkflow-cp-kv", "replicated")
    assert rep["chunkflow"]["cp_kv"] == "replicated" and cf["cp_kv"] == "sharded"
    assert rep["chunkflow"]["memory_gib"]["kv_state"] == pytest.approx(
        dp["chunkflow"]["memory_gib"]["kv_state"], rel=0.01)
    assert rep["chunkflow"]["step_s"] < cf["step_s"]
    _, auto, err = run_json(capsys, *argv, "--chunkflow-parallel", "2,2,1,none")
    assert auto["chunkflow"] == rep["chunkflow"] and "--chunkflow-cp-kv replicated" in err
    _, one, _ = run_json(capsys, *argv, "--chunkflow-parallel", "2,2,1,none",
                         "--chunkflow-cp-kv", "sharded", "--gpu-set", "cp_overlap=1")
    assert one["chunkflow"]["step_s"] < cf["step_s"]
    assert one["megatron"]["step_s"] < obj["megatron"]["step_s"]
    # every segment split (--chunkflow-cp-placement split) instead of short ones held whole
    _, split, _ = run_json(capsys, *argv, "--chunkflow-parallel", "2,2,1,none",
                           "--chunkflow-cp-kv", "sharded", "--chunkflow-cp-placement", "split")
    assert (split["chunkflow"]["cp_placement"], cf["cp_placement"]) == ("split", "hybrid")
    assert split["chunkflow"]["step_s"] > cf["step_s"]


def test_does_not_fit_is_reported(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(["250000"] + ["800"] * 100) + "\n")
    rc, obj, err = run_json(capsys, "--lengths-file", str(f), "--seq-length", "262144",
                            "--megatron-parallel", "4,1,1,full",
                            "--chunkflow-parallel", "4,1,1,none")
    assert rc == 0
    assert obj["megatron"]["fits"] is False and obj["chunkflow"]["fits"] is True
    assert obj["megatron"]["peak_mem_gib"] > obj["setup"]["usable_gib"]
    assert obj["speedup"] is None and "step_time_ratio" not in obj
    assert all(obj["speedups"][name] is None for name in BASELINES)
    assert "vs megatron-packed: megatron-packed does not fit on 32 GPUs: its best plan needs " \
        in err and "(no ratio)" in err and " NO" in err and "ignoring memory" not in err
    # per-sample CP splits the long sequence over its pool's ranks: it fits, and is the one
    # the verdict weighs ChunkFlow against
    assert obj["baselines"]["megatron-hybrid-cp"]["fits"] is True
    assert obj["verdict"]["against"] == obj["strongest"] == "megatron-hybrid-cp"


def test_the_default_searches_chunkflow_as_it_searches_stock(capsys):
    """With no chunking flag ChunkFlow's chunk size, K and re-forward mode are searched, as each
    stock baseline's layout and recompute are: never slower than its old fixed default (C 8192,
    K 1, attention recomputed), which --chunk-size and --chunkflow-k still give. The verdict
    names the strongest stock baseline that fits, a plan to run and a cause; the search says
    what it does on stderr (nothing extra under --json)."""
    small = ["--model", "qwen2.5-0.5b", "--gpus", "4", "--global-batch-size", "64",
             "--seq-length", "16384"]
    rc, fair, err = run_json(capsys, *small)
    assert rc == 0 and fair["setup"]["searched_chunking"]
    rc, fixed, _ = run_json(capsys, *small, "--chunk-size", "8192", "--chunkflow-k", "1",
                            "--chunkflow-reforward-attention", "recompute")
    assert rc == 0 and not fixed["setup"]["searched_chunking"]
    assert (fixed["chunk_size"], fixed["k"]) == (8192, 1)
    assert fair["chunkflow"]["step_s"] <= fixed["chunkflow"]["step_s"] * (1 + 1e-12)
    v = fair["verdict"]
    assert v["against"] == fair["strongest"] and v["speedup"] == \
        pytest.approx(fair["speedup_vs_strongest"])
    assert v["text"].startswith("ChunkFlow helps here" if v["helps"] else
                                "ChunkFlow does not help here")
    assert f"--chunk-size {fair['chunk_size']} --chunkflow-k {fair['k']}" in v["text"]
    assert v["cause"].startswith(f"per step, ChunkFlow against {v['against']}: ")
    assert all(f"{part} " in v["cause"] for part in ("compute", "bubbles", "step end"))
    assert "searching" not in err  # --json: one object, no progress
    assert main(["simulate", *small]) == 0
    out = capsys.readouterr()
    assert v["text"] in out.out and "searching megatron-packed" in out.err
    assert "searching ChunkFlow's layouts, recompute, chunk size, K and re-forward" in out.err
    assert main(["simulate", *small, "--auto", "--chunk-size", "4096"]) == 2
    assert "--auto searches the chunk size and K: leave out --chunk-size" in \
        capsys.readouterr().err


def test_auto_fits_the_budget(capsys):
    rc, obj, err = run_json(capsys, "--model", "qwen2.5-1.5b", *SMALL, "--seq-length", "65536",
                            "--megatron-parallel", "2,1,1,none",
                            "--chunkflow-parallel", "1,1,1,none", "--auto")
    cf = obj["chunkflow"]
    assert rc == 0 and cf["fits"] and cf["peak_mem_gib"] <= obj["setup"]["usable_gib"]
    assert (cf["chunk_size"], cf["k"]) == (obj["chunk_size"], obj["k"])
    assert f"--chunk-size {obj['chunk_size']} --chunkflow-k {obj['k']}" in err
    # a tighter budget still gets a fitting choice, with a smaller footprint
    rc, tight, _ = run_json(capsys, "--model", "qwen2.5-1.5b", *SMALL, "--seq-length", "65536",
                            "--megatron-parallel", "2,1,1,none", "--chunkflow-parallel",
                            "1,1,1,none", "--auto", "--gpu-set", "memory_gib=33.6")
    assert tight["chunkflow"]["fits"]
    assert tight["chunkflow"]["peak_mem_gib"] <= tight["setup"]["usable_gib"] < cf["peak_mem_gib"]


def test_auto_layouts_and_lengths_file(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(["900"] * 60 + ["20000", "3000"]) + "\n")
    rc, obj, err = run_json(capsys, "--model", "qwen2.5-0.5b", "--gpus", "4", "--lengths-file",
                            str(f), "--seq-length", "16384", "--chunk-size", "4096")
    assert rc == 0 and obj["setup"]["truncated"] == 1 and obj["setup"]["tokens"] == 73384
    cf = obj["chunkflow"]["layout"]
    assert 4096 % (2 * cf["cp"] * cf["tp"]) == 0 and obj["megatron"]["fits"]
    assert "chosen by search" in err and "--megatron-parallel" in err
    pp = f"{cf['pp']}x{cf['vpp']}" if "vpp" in cf else f"{cf['pp']}"
    assert f"--chunkflow-parallel {cf['tp']},{cf['cp']},{pp},{cf['recompute']}" in err


@pytest.mark.parametrize("argv,message", [
    (["--megatron-parallel", "3,1,1,none"], "does not divide --gpus 8"),
    (["--megatron-parallel", "8,1,1,none"], "--megatron-parallel 8,1,1,none: TP 8 must divide"),
    (["--megatron-parallel", "2,1,1,some"],
     "--megatron-parallel 2,1,1,some: RECOMPUTE 'some': expected none, full, block:N, selective"),
    (["--megatron-parallel", "2,1,1,block:29"],
     "2,1,1,block:29: RECOMPUTE block:29: a pipeline stage has only 28 layers"),
    (["--megatron-parallel", "2,1,1,selective:attn"], "modules must be a non-empty subset"),
    (["--megatron-parallel", "1,1,8,none"], "PP 8 must divide the model's 28 layers"),
    (["--megatron-parallel", "2,1"], "--megatron-parallel '2,1': expected TP,CP,PP,RECOMPUTE"),
    (["--megatron-parallel", "2,1,4x0,none"], "--megatron-parallel 2,1,4x0,none: V must be >= 1"),
    (["--chunkflow-parallel", "2,1,1x2,none"],
     "--chunkflow-parallel 2,1,1x2,none: V 2 virtual stages per pipeline rank need PP >= 2"),
    (["--megatron-parallel", "2,1,2xa,none"],
     "--megatron-parallel '2,1,2xa,none': TP, CP and PP must be integers, PP optionally PPxV"),
    (["--megatron-parallel", "1,1,2x4,none"], "VPP 4 must divide the model's 14 layers per"),
    (["--chunkflow-parallel", "2,2,1,none", "--chunk-size", "4100"],
     "--chunk-size 4100 is not a multiple of 2 x CP 2 x TP 2 (sequence parallelism) = 8: "
     "context parallelism cuts"),
    (["--chunkflow-parallel", "4,1,1,none", "--chunk-size", "4098"],
     "--chunk-size 4098 is not a multiple of the tensor-parallel size 4"),
    (["--gpus", "0"], "--gpus must be >= 1"),
    (["--seq-length", "0"], "--seq-length must be >= 1"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1"),
    (["--baseline", "megatron-hybrid-cp", "--megatron-parallel", "2,1,2,none"],
     "--baseline megatron-hybrid-cp: Megatron-LM refuses --hybrid-context-parallel with "
     "pipeline parallelism"),
    (["--gpus", "12", "--baseline", "megatron-hybrid-cp", "--megatron-parallel", "2,3,1,none"],
     "--baseline megatron-hybrid-cp: TP2 CP3 PP1 DP2 none: the DP x CP pool of 6 ranks must be "
     "a power of two >= 2"),
    (["--baseline", "megatron-hybrid-cp", "--max-seqlen-per-dp-cp-rank", "256"],
     "--max-seqlen-per-dp-cp-rank 256: the longest sequence (32768 tokens) would need a CP "
     "group of 128 ranks, more than the DP x CP pool of 8; raise it to at least 4096"),
    (["--baseline", "megatron-packed", "--max-seqlen-per-dp-cp-rank", "4096"],
     "--max-seqlen-per-dp-cp-rank applies to --baseline megatron-hybrid-cp"),
    (["--chunkflow-k", "0"], "--chunkflow-k must be >= 1"),
    (["--gpu-set", "tflops=3"], "--gpu-set 'tflops=3': expected KEY=VALUE"),
    (["--gpu-set", "memory_gib=lots"], "--gpu-set 'memory_gib=lots': 'lots' is not a valid float"),
    (["--gpus", "1000000"], "--gpus must be at most 131,072, got 1,000,000"),
    (["--global-batch-size", "100000"], "--global-batch-size 100,000: at most 65,536 sequences"),
    (["--gpu-set", "peak_tflops=inf"], "peak_tflops must be a finite number >= 0, got inf"),
    (["--gpu-set", "hbm_gb_s=nan"], "hbm_gb_s must be a finite number >= 0, got nan"),
    (["--gpu-profile", "/nonexistent.json"], "--gpu-profile '/nonexistent.json': neither a "),
    (["--lengths-file", "/nonexistent"], "--lengths-file /nonexistent: no such file"),
    (["--lengths-file", "x", "--global-batch-size", "9"], "with --lengths-file the file is"),
    (["--lengths-file", "x", "--scale", "0.5"], "--scale shapes the lengths drawn from --profile"),
    (["--lengths-file", "x", "--step", "3"], "--step shapes the lengths drawn from --profile"),
])
def test_bad_input_exits_2(capsys, argv, message):
    assert main(["simulate", "--gpus", "8", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [(["--gpu", "v100"], "--gpu"),
                                       (["--baseline", "megatron"], "--baseline"),
                                       (["--model", "gpt-9"], "--model"),
                                       (["--seq-length", "long"], "--seq-length")])
def test_usage_errors_exit_2(capsys, argv, flag):
    assert main(["simulate", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_a_gpu_profile_sets_the_clock_and_is_named(tmp_path, capsys):
    argv = [*SMALL, "--megatron-parallel", "2,1,1,none", "--chunkflow-parallel", "2,1,1,none"]
    _, base, err = run_json(capsys, *argv)
    assert base["setup"]["gpu_profile"] == "h100" and base["setup"]["calibrated"] is False
    assert "h100 (datasheet; efficiencies assumed, not calibrated" in err
    f = tmp_path / "slow.json"
    f.write_text(json.dumps({"name": "slow-h100", "gpu": "h100", "stack": "x", "calibrated": True,
                             "rates": {"gemm_max_eff": {"value": 0.5, "label": "measured",
                                                        "source": "a test"}}}))
    _, cal, err = run_json(capsys, *argv, "--gpu-profile", str(f))
    assert cal["megatron"]["step_s"] > 1.2 * base["megatron"]["step_s"]
    assert cal["setup"]["hardware"]["gemm_max_eff"] == 0.5
    assert cal["setup"]["gpu_profile"] == "slow-h100" and cal["setup"]["calibrated"] is True
    assert "device profile slow-h100 (calibrated)" in err
    _, h200, err = run_json(capsys, *argv, "--gpu-profile", "h200-torch2.11-local")
    assert h200["setup"]["gpu"] == "h200" and h200["setup"]["hardware"]["spec"] == "local"
    assert main(["simulate", *argv, "--gpu", "a100", "--gpu-profile", str(f)]) == 2
    assert "name different devices" in capsys.readouterr().err
