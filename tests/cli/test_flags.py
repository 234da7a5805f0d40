"""One spelling per knob in every subcommand and in the Megatron-LM launcher's flags.

    python -m pytest tests/cli/test_flags.py -q
"""

import argparse

import pytest

from megatron_chunkflow.cli import SUBCOMMANDS, build_parser

CHUNKING = ["plan", "simulate", "verify", "train", "bench"]  # every command that chunks


def parse(argv):
    return build_parser().parse_args(argv)


def test_every_subcommand_is_covered():
    assert set(CHUNKING) == set(SUBCOMMANDS)


@pytest.mark.parametrize("command", CHUNKING)
def test_chunk_size_and_k_are_spelled_the_same_everywhere(command):
    args = parse([command, "--chunk-size", "512", "--chunkflow-k", "2"])
    assert (args.chunk_size, args.num_kept) == (512, 2)


@pytest.mark.parametrize("command", ["verify", "train", "bench"])
def test_attention_backend_and_parallel_flags(command):
    args = parse([command, "--attention-backend", "sdpa", "--tensor-model-parallel-size", "2",
                  "--pipeline-model-parallel-size", "2"])
    short = parse([command, "--tp", "2", "--pp", "2"])
    assert args.attention_backend == "sdpa" and (args.tp, args.pp) == (short.tp, short.pp) == (2, 2)
    assert parse([command]).attention_backend == "auto"  # one default


@pytest.mark.parametrize("command,old,new,dest,value", [
    ("plan", "--k", "--chunkflow-k", "num_kept", 3),
    ("bench", "--backend", "--attention-backend", "attention_backend", "torch"),
    ("verify", "--num-sequences", "--global-batch-size", "global_batch_size", 7),
    ("verify", "--sparse-backward", "--chunkflow-sparse-backward", "sparse_backward", 2),
])
def test_old_spellings_still_work_and_warn(capsys, command, old, new, dest, value):
    args = parse([command, old, str(value)])
    assert getattr(args, dest) == value
    assert f"{old} is deprecated; use {new}" in capsys.readouterr().err


def test_launcher_flags_live_in_the_chunkflow_namespace():
    """Inside Megatron-LM's parser: --chunk-size, --chunkflow-k, --chunkflow-attention-backend
    (Megatron has its own --attention-backend), destinations prefixed chunkflow_, no aliases."""
    from megatron_chunkflow.megatron_lm.args import add_chunkflow_arguments, chunkflow_config

    parser = add_chunkflow_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--chunkflow", "--chunk-size", "4096", "--chunkflow-k", "2",
                              "--chunkflow-attention-backend", "torch"])
    cfg = chunkflow_config(args)
    assert (cfg.chunk_size, cfg.num_kept, cfg.attention_backend) == (4096, 2, "torch")
    with pytest.raises(SystemExit):
        parser.parse_args(["--k", "2"])  # no deprecated spellings in Megatron's namespace
