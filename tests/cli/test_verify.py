"""`chunkflow verify` stops on bad input with exit 2 and a message naming the flag or file, before
any process group starts (in-process: cli.main)."""

import json

import pytest

from megatron_chunkflow.cli import main


def run_verify(capsys, *argv):
    """(exit code, stderr) of `chunkflow verify ARGV`."""
    rc = main(["verify", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--chunkflow-k", "0"], "--chunkflow-k must be >= 1"),
    (["--chunk-size", "0"], "--chunk-size must be >= 1"),
    (["--tp", "3"], "--tensor-model-parallel-size (--tp) 3 must divide the attention heads"),
    (["--tp", "2", "--sequence-parallel", "--chunk-size", "15"],
     "--chunk-size 15 is not a multiple of the tensor-parallel size 2"),
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size (--tp) > 1"),
    (["--model-config", "/nonexistent.json"], "no such file"),
    (["--memory", "--lengths", "100000000"], "more than the 1,048,576 the memory check runs"),
    (["--cp", "2", "--chunk-size", "130"], "--chunk-size 130 is not a multiple of 2 x "
                                           "--context-parallel-size (--cp) 2 = 4"),
    (["--cp", "2", "--attention-backend", "flex"], "--attention-backend flex: context "
                                                   "parallelism recomputes attention"),
    (["--cp", "2", "--lora-rank", "4"], "--lora-rank is not checked with --context-parallel-size"),
    (["--memory", "--tp", "2"], "--memory measures at TP = PP = 1"),
    (["--lengths", "70,6"], "--lengths 70,6: the sequences of the --memory check, and this run "
                            "has no --memory"),  # never silently the profile's batch instead
    (["--min-long", "1000", "--global-batch-size", "4"], "--min-long 1000 is more than the "
                                                         "global batch's 4 sequences"),
    (["--lengths-file", "x", "--min-long", "2"], "--min-long shapes the lengths drawn from "
                                                 "--profile; with --lengths-file"),
])
def test_verify_bad_input_exits_2(capsys, argv, message):
    rc, err = run_verify(capsys, *argv)
    assert rc == 2 and message in err, err[-2000:]


def test_model_config_file_errors(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 64,\n "num_layers": }')
    rc, err = run_verify(capsys, "--model-config", str(bad))
    assert rc == 2 and f"{bad}:2" in err
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"hidden_size": 64, "num_layers": 2}))
    rc, err = run_verify(capsys, "--model-config", str(partial))
    assert rc == 2 and "missing ffn_hidden_size" in err
    partial.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    rc, err = run_verify(capsys, "--model-config", str(partial))
    assert rc == 2 and "missing intermediate_size, num_attention_heads" in err


@pytest.mark.parametrize("content,message", [
    (b"[1, 2]", "expected a JSON object with the model's fields, got list"),
    (b'{"num_layers": 0, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, '
     b'"num_query_groups": 2, "vocab_size": 100}', "num_layers must be a positive integer, got 0"),
    (b'{"num_layers": "2", "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, '
     b'"num_query_groups": 2, "vocab_size": 100}', "num_layers must be a positive integer, got '2'"),
    (b'{"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, '
     b'"num_query_groups": 2, "vocab_size": 100, "tie_embeddings": "yes"}',
     "tie_embeddings must be true or false"),
    (b"\xff\xfe{}", "not UTF-8 text (byte 0)"),
    (b'{"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, '
     b'"num_query_groups": 2, "vocab_size": 100, "rotary_base": 1e400}',
     "rotary_base must be a finite positive number, got inf"),
])
def test_model_config_values_are_checked(capsys, tmp_path, content, message):
    bad = tmp_path / "model.json"
    bad.write_bytes(content)
    rc, err = run_verify(capsys, "--model-config", str(bad))
    assert rc == 2 and f"--model-config {bad}" in err and message in err, err[-2000:]


@pytest.mark.slow
def test_verify_with_virtual_stages(gloo):
    """`verify --pp 2 --vpp 2 --json` on a 2-process job (the command line's path: its activation
    meter over both model chunks, the plan's predicted bubble): exact, and both stages report."""
    code, out, err = gloo.cli(2, "verify", "--pp", 2, "--vpp", 2, "--json")
    assert code == 0, err[-3000:]
    result = json.loads(out)
    assert result["passed"] is True and result["vpp"] == 2 and result["pp"] == 2
    assert result["max_rel_grad_err"] <= 1e-10
    assert len(result["activation_bytes_per_stage"]) == 2
