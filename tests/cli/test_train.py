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
])
def test_bad_flags(capsys, argv, message):
    rc, err = run_train(capsys, *argv)
    assert rc == 2 and message in err, err[-2000:]
