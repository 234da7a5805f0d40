"""`chunkflow plan`: JSON contract, exit codes, error messages."""

import json
import subprocess
import sys

import pytest

from megatron_chunkflow.cli import main
from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.step import BASELINES
from megatron_chunkflow.perfmodel.footprint import per_token_bytes
from megatron_chunkflow.perfmodel.held import own_view_bytes
from megatron_chunkflow.perfmodel.kvstate import kv_state_bytes_per_token


def run_json(capsys, *argv):
    rc = main(["plan", *argv, "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def test_json_contract(capsys):
    rc, obj, err = run_json(capsys, "--profile", "A", "--global-batch-size", "400",
                            "--chunk-size", "4096", "--chunkflow-k", "2", "--pp", "2", "--dp", "2",
                            "--dp-rank", "1", "--model", "qwen2.5-0.5b")
    assert rc == 0 and "ChunkFlow" in err  # human text on stderr
    stats = obj["stats"]
    assert {"num_chunks", "num_sequences", "tokens", "padding_fraction", "bins_lower_bound",
            "bubble_ratio", "peak_held_chunks", "recompute_chunks"} <= set(stats)
    assert stats["num_sequences"] == 400 and stats["num_chunks"] == len(obj["chunks"])
    assert sum(c["tokens"] for c in obj["chunks"]) == stats["tokens"]
    c0 = obj["chunks"][0]
    assert set(c0) == {"id", "kind", "parent", "index", "segments", "tokens", "dp_rank"}
    assert len(obj["stages"]) == 2
    rank1 = {c["id"] for c in obj["chunks"] if c["dp_rank"] == 1}
    for stage in obj["stages"]:
        assert {op["chunk"] for op in stage} == rank1
        assert {op["op"] for op in stage} <= {"F", "R", "B"}
    assert {"num_microbatches", "bubble_ratio"} <= set(obj["baseline"])
    assert obj["speedup"] > 0 and obj["stats"]["fits"] and obj["baseline"]["fits"]
    assert obj["device"]["gpu"] == "h100"


def test_no_ratio_against_a_plan_that_does_not_fit(capsys):
    """Qwen2.5-1.5B at TP 1 without recompute, 32K micro-batches on PP 2: stock's packed lines
    need more than an H100 holds, so no speedup is given against them; one sequence per
    micro-batch fits and gets its ratio. Memory counts weights, gradients and optimizer states
    on top of the activations."""
    rc, obj, err = run_json(capsys, "--global-batch-size", "300", "--seq-length", "32768",
                            "--pp", "2", "--dp", "2", "--model", "qwen2.5-1.5b")
    assert rc == 0 and obj["stats"]["fits"]
    packed, unpacked = obj["baselines"]["megatron-packed"], obj["baselines"]["megatron-unpacked"]
    assert not packed["fits"] and obj["speedups"]["megatron-packed"] is None
    assert obj["speedup"] is None and obj["baseline"]["fits"] is False
    assert unpacked["fits"] and obj["speedups"]["megatron-unpacked"] > 1
    assert max(packed["peak_total_gib"]) > obj["device"]["usable_gib"]
    for a, b in zip(packed["peak_total_gib"], packed["peak_memory_gib"]):
        assert a > b  # the static bytes on top
    assert "megatron-packed   seq-length 32768" in err and "does NOT fit on 4 h100 GPUs" in err
    assert "no ratio" in err and "chunkflow simulate --model qwen2.5-1.5b --gpus 4 --gpu h100 " \
        "--seq-length 32768 --global-batch-size 300" in err


def test_context_parallel_plan_is_per_gpu(capsys):
    """--cp 2: ChunkFlow's segments are padded to 2 x CP pieces (nothing lost), and per GPU the
    step's FLOPs and the long sequence's state halve (the footprint model's per-rank bytes)."""
    argv = ("--global-batch-size", "300", "--chunk-size", "8192", "--pp", "2")
    _, one, _ = run_json(capsys, *argv)
    rc, two, err = run_json(capsys, *argv, "--cp", "2")
    assert rc == 0 and "CP=2" in err and two["setup"]["cp"] == 2
    assert two["stats"]["tokens"] == one["stats"]["tokens"]
    for chunk in two["chunks"]:
        padding = chunk.get("padding", [0] * len(chunk["segments"]))
        assert all((end - start + pad) % 4 == 0
                   for (_, start, end), pad in zip(chunk["segments"], padding))
    assert two["stats"]["step_time"] == pytest.approx(one["stats"]["step_time"] / 2, rel=0.02)
    for a, b in zip(two["stats"]["peak_memory_gib"], one["stats"]["peak_memory_gib"]):
        assert a < 0.6 * b
    assert two["baseline"]["step_time"] == pytest.approx(one["baseline"]["step_time"] / 2,
                                                         rel=0.02)


def test_four_baselines(capsys):
    """"baselines" has each stock baseline's plan in numbers; "baseline" stays megatron-packed's.
    megatron-sft pads its lines to --seq-length, megatron-unpacked runs a sequence per
    micro-batch, megatron-hybrid-cp runs on all PP x DP GPUs as its pool."""
    rc, obj, err = run_json(capsys, "--global-batch-size", "300", "--seq-length", "32768",
                            "--pp", "2", "--dp", "2", "--model", "qwen2.5-0.5b")
    names = {*BASELINES, "megatron-hybrid-cp"}
    assert rc == 0 and set(obj["baselines"]) == names == set(obj["speedups"])
    assert obj["notes"] == []
    for name, b in obj["baselines"].items():
        assert {"num_microbatches", "padding_fraction", "bubble_ratio", "step_time",
                "peak_memory_gib"} <= set(b)
        assert f"Stock {name}" in err
        assert obj["speedups"][name] == pytest.approx(b["step_time"] / obj["stats"]["step_time"])
    packed, sft = obj["baselines"]["megatron-packed"], obj["baselines"]["megatron-sft"]
    for key in ("num_microbatches", "bubble_ratio", "step_time", "peak_memory_gib"):
        assert obj["baseline"][key] == packed[key]
    assert obj["baseline"]["name"] == "megatron-packed" and obj["speedup"] == \
        obj["speedups"]["megatron-packed"]
    assert packed["padding_fraction"] == 0 < sft["padding_fraction"]
    assert sft["step_time"] > packed["step_time"]
    assert obj["baselines"]["megatron-unpacked"]["num_microbatches"] == 300


def test_lengths_file_and_png(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("# one long, several short\n100\n7\n\n33  # comment\n5\n")
    png = tmp_path / "plan.png"
    rc, obj, _ = run_json(capsys, "--lengths-file", str(f), "--chunk-size", "32", "--pp", "2",
                          "--png", str(png))
    assert rc == 0 and obj["stats"]["num_sequences"] == 4 and obj["stats"]["tokens"] == 145
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_memory_is_the_simulators_model(tmp_path, capsys):
    """The printed peaks are perfmodel/'s bf16 model. One 100,000-token sequence on PP=1: stock
    Megatron holds it whole (its K and V kept as views of the QKV output); ChunkFlow (K=1) holds
    one 8K chunk at a time beside the state L u + (n - 1) C a (the K/V buffer, fp32 accumulators
    of n - 1 = 12 chunks)."""
    f = tmp_path / "lengths.txt"
    f.write_text("100000\n")
    rc, obj, _ = run_json(capsys, "--lengths-file", str(f), "--chunk-size", "8192",
                          "--chunkflow-k", "1")
    shape = get_model_shape("qwen2.5-7b")
    per_token = per_token_bytes(shape, ParallelConfig.layout(), 2, 1)[0]
    views = own_view_bytes(shape, ParallelConfig.layout(), 2, 1)[0]  # a whole sequence's K, V
    u = kv_state_bytes_per_token(shape, shape.num_layers, 2, with_grad=False)
    a = kv_state_bytes_per_token(shape, shape.num_layers, 2) - u
    assert rc == 0
    assert obj["baseline"]["peak_memory_gib"] == [round(100_000 * (per_token + views) / 2**30, 3)]
    assert obj["stats"]["peak_memory_gib"] == [
        round((8192 * per_token + 100_000 * u + 12 * 8192 * a) / 2**30, 3)]


@pytest.mark.parametrize("content,message", [
    ("", "no lengths"),
    ("12\n0\n", ":2: length 0 must be positive"),
    ("12\n4\n-3\n", ":3: length -3 must be positive"),
    ("12\nabc\n", ":2: 'abc' is not an integer"),
    ("12\n3.5\n", ":2: '3.5' is not an integer"),
    ("12\n1000000000000\n", ":2: length 1,000,000,000,000 is more than the 16,777,216"),
    ("7\n" * 200_000, ":65537: more than 65,536 lengths, the most one global batch may have"),
])
def test_bad_lengths_file(tmp_path, capsys, content, message):
    f = tmp_path / "l.txt"
    f.write_text(content)
    assert main(["plan", "--lengths-file", str(f)]) == 2
    assert message in capsys.readouterr().err


def test_lengths_file_not_utf8_names_the_file(tmp_path, capsys):
    f = tmp_path / "l.txt"
    f.write_bytes(b"12\n\xff\xfe3\n")
    assert main(["plan", "--lengths-file", str(f)]) == 2
    assert f"--lengths-file {f}: not UTF-8 text (byte 3)" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--chunk-size", "0"], "--chunk-size must be >= 1, got 0"),
    (["--chunkflow-k", "0"], "--chunkflow-k must be >= 1, got 0"),
    (["--pp", "0"], "--pp must be >= 1, got 0"),
    (["--dp", "0"], "--dp must be >= 1, got 0"),
    (["--dp", "2", "--dp-rank", "2"], "--dp-rank must be in [0, 2)"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1"),
    (["--lengths-file", "/nonexistent/x"], "/nonexistent/x: no such file"),
    (["--seq-length", "10"], "more than --seq-length 10"),
    (["--scale", "inf"], "argument --scale: must be a finite number, got 'inf'"),
    (["--scale", "0"], "--scale must be a finite number > 0, got 0.0"),
    (["--scale", "1e12"], "--scale 1e+12: length"),
    (["--step", "-1"], "--step must be >= 0, got -1"),
    (["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
    (["--pp", "64"], "--pipeline-model-parallel-size (--pp) 64 must divide the model's"),
    (["--png", "/nonexistent/dir/plan.png"], "--png /nonexistent/dir/plan.png: directory"),
    (["--cp", "2", "--chunk-size", "4098"], "--chunk-size 4098 is not a multiple of 2 x "
                                            "--context-parallel-size (--cp) 2 = 4"),
])
def test_bad_input_exits_2(capsys, argv, message):
    batch = [] if "--lengths-file" in argv else ["--global-batch-size", "50"]
    try:
        rc = main(["plan", *batch, *argv])
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_a_lengths_file_is_the_whole_batch(capsys, tmp_path):
    """--global-batch-size and --profile draw lengths; with --lengths-file they would be ignored,
    so giving both is refused (in every command that reads lengths)."""
    f = tmp_path / "l.txt"
    f.write_text("30\n40\n")
    for flag in (["--global-batch-size", "50"], ["--profile", "A"]):
        assert main(["plan", "--lengths-file", str(f), *flag]) == 2
        assert f"{flag[0]} draws the lengths; with --lengths-file" in capsys.readouterr().err


def test_usage_error_exits_2(capsys):
    assert main(["plan", "--chunk-size", "many"]) == 2
    assert "--chunk-size" in capsys.readouterr().err


def test_more_stages_than_chunks_still_plans(tmp_path, capsys):
    f = tmp_path / "l.txt"
    f.write_text("3\n4\n")
    rc, obj, err = run_json(capsys, "--lengths-file", str(f), "--chunk-size", "16", "--pp", "4")
    assert rc == 0 and obj["stats"]["num_chunks"] == 1 and len(obj["stages"]) == 4
    assert "cannot fill" in err


def test_module_and_help():
    out = subprocess.run([sys.executable, "-m", "megatron_chunkflow", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "plan" in out and "cut, pack and schedule" in out


def test_a_reader_that_leaves_ends_the_command_without_a_traceback(tmp_path):
    """`chunkflow plan ... --json | head -c 10`: the pipe's reader gone before the JSON is
    written; exit 1, nothing on stderr but the run's own lines."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("3000\n900\n")
    run = subprocess.Popen([sys.executable, "-m", "megatron_chunkflow", "plan", "--lengths-file",
                            str(lengths), "--model", "tiny", "--chunk-size", "512", "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run.stdout.close()  # the reader leaves first
    err = run.stderr.read()
    assert run.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_virtual_stages(capsys, tmp_path):
    """--vpp V: both systems interleave V model chunks per pipeline rank: each rank runs every
    chunk's F and B once per model chunk, the bubble shrinks; Megatron's refusal of a
    micro-batch count exits 2 naming --vpp."""
    lengths = tmp_path / "batch.txt"
    lengths.write_text("3000\n" * 16 + "12000\n" * 4)  # 8 packed micro-batches, 20 unpacked
    argv = ["--lengths-file", str(lengths), "--chunk-size", "4096", "--pp", "4"]
    _, flat, _ = run_json(capsys, *argv)
    rc, obj, err = run_json(capsys, *argv, "--vpp", "7")  # qwen2.5-7b: 28 layers, 7 per stage
    assert rc == 0 and "V=7" in err and obj["setup"]["vpp"] == 7
    for ops, flat_ops in zip(obj["stages"], flat["stages"]):
        assert len(ops) == 7 * len(flat_ops)  # every F, R and B once per model chunk
    assert obj["stats"]["bubble_ratio"] < flat["stats"]["bubble_ratio"]
    assert obj["baselines"]["megatron-packed"]["bubble_ratio"] < \
        flat["baselines"]["megatron-packed"]["bubble_ratio"]
    f = tmp_path / "lengths.txt"
    f.write_text("3000\n" * 5)  # 5 micro-batches: not a multiple of PP 4, last group < 4
    assert main(["plan", "--lengths-file", str(f), "--pp", "4", "--vpp", "7"]) == 2
    assert "--vpp 7: stock Megatron: 5 micro-batches per pipeline" in capsys.readouterr().err
    assert main(["plan", "--pp", "4", "--vpp", "3"]) == 2
    assert "must divide the model's 7 layers per pipeline stage" in capsys.readouterr().err
