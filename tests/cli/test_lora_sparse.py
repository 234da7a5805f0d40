"""Bad LoRA and SpaCO flags stop `chunkflow train` / `chunkflow verify` with exit 2 and a message
naming the flag (in-process: validation happens before any process group starts)."""

import pytest

from megatron_chunkflow.cli import main

LORA_CASES = [
    (["--lora-rank", "0"], "--lora-rank must be >= 1, got 0"),
    (["--lora-rank", "-4"], "--lora-rank must be >= 1, got -4"),
    (["--lora-rank", "8", "--lora-targets", "qkv,mlp"],
     "--lora-targets 'qkv,mlp': unknown entry 'mlp'; choose from qkv, proj, fc1, fc2"),
    (["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha must be a finite number > 0"),
    (["--lora-alpha", "32"], "--lora-alpha needs --lora-rank"),
]


@pytest.mark.parametrize("argv,message", LORA_CASES + [
    (["--chunkflow-sparse-backward", "0"], "--chunkflow-sparse-backward must be >= 1, got 0"),
    (["--chunkflow-sparse-backward", "2", "--no-chunkflow"],
     "--chunkflow-sparse-backward needs ChunkFlow's chunked schedule"),
    (["--chunkflow-sparse-backward", "4", "--seq-length", "4096", "--chunk-size", "1024"],
     "--chunkflow-sparse-backward 4: a sequence has at most 4 chunks (--seq-length 4096 / "
     "--chunk-size 1024)"),
])
def test_train_bad_flags(capsys, argv, message):
    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", LORA_CASES + [
    (["--chunkflow-sparse-backward", "0"], "--chunkflow-sparse-backward must be >= 1, got 0"),
    (["--chunkflow-sparse-backward", "9", "--lengths-file", "{lengths}", "--chunk-size", "16"],
     "--chunkflow-sparse-backward 9: a sequence has at most 7 chunks in this batch (longest 100 tokens"),
    (["--chunkflow-sparse-backward", "2", "--draws", "1"], "--draws must be >= 2"),
    (["--draws", "8"], "--draws needs --chunkflow-sparse-backward"),
    (["--chunkflow-sparse-backward", "2", "--memory"], "--chunkflow-sparse-backward cannot be combined with --memory"),
    (["--chunkflow-sparse-backward", "2", "--steps", "2"], "--steps must be 1"),
])
def test_verify_bad_flags(capsys, tmp_path, argv, message):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n20\n5\n")
    argv = [a.replace("{lengths}", str(lengths)) for a in argv]
    assert main(["verify", *argv]) == 2
    assert message in capsys.readouterr().err
