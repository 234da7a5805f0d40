"""`chunkflow train` stops on bad input with exit 2 and a message naming the flag, file or line."""

import subprocess
import sys

import pytest


def run_train(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_chunkflow", "train", *argv],
                          capture_output=True, text=True, timeout=300)


def test_malformed_jsonl_line(tmp_path):
    data = tmp_path / "sft.jsonl"
    good = ('{"messages": [{"role": "user", "content": "hi"}, '
            '{"role": "assistant", "content": "yo"}]}')
    data.write_text(good + "\n" + good + "\n{not json\n")
    proc = run_train("--data-path", str(data))
    assert proc.returncode == 2 and f"{data}:3" in proc.stderr, proc.stderr[-2000:]
    assert "--skip-bad-records" in proc.stderr


def test_empty_dataset(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    proc = run_train("--data-path", str(data))
    assert proc.returncode == 2 and str(data) in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("argv,message", [
    (["--model", "qwen9-1t"], "invalid choice: 'qwen9-1t'"),
    (["--chunk-size", "4096", "--seq-length", "2048"], "--chunk-size 4096 is larger than "
                                                       "--seq-length 2048"),
    (["--tokenizer", "/nonexistent/tokenizer-dir"], "--tokenizer"),
    (["--lr-warmup-iters", "50", "--train-iters", "10"], "--lr-warmup-iters 50"),
    (["--chunkflow-k", "0"], "--chunkflow-k must be >= 1"),
])
def test_bad_flags(argv, message):
    proc = run_train(*argv)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
