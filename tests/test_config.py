"""config.py: ChunkFlowConfig and ParallelConfig, the CLI flags derived from their fields, their
validation. (The package's import boundaries are tests/test_layout.py's.)"""

import argparse
import re

import pytest

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.flags import add_config_arguments, config_from_args, field_docs
def test_flags_derive_from_fields():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, ChunkFlowConfig)
    args = parser.parse_args(["--chunk-size", "4096", "--chunkflow-k", "3",
                              "--attention-backend", "sdpa"])
    assert config_from_args(ChunkFlowConfig, args) == ChunkFlowConfig(4096, 3, "sdpa")
    help_text = parser.format_help()
    for doc in field_docs(ChunkFlowConfig).values():
        assert doc.split(".")[0][:40] in " ".join(help_text.split())


def test_deprecated_spellings_work_and_warn(capsys):
    parser = argparse.ArgumentParser(prog="chunkflow verify")
    add_config_arguments(parser, ChunkFlowConfig)
    args = parser.parse_args(["--k", "2", "--backend", "torch"])
    assert config_from_args(ChunkFlowConfig, args) == ChunkFlowConfig(num_kept=2,
                                                                      attention_backend="torch")
    err = capsys.readouterr().err
    assert "--k is deprecated; use --chunkflow-k" in err
    assert "--backend is deprecated; use --attention-backend" in err
    assert "--k " not in parser.format_help()  # hidden from the help


def test_parallel_flags_have_megatron_names_and_short_aliases():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, ParallelConfig)
    long = parser.parse_args(["--tensor-model-parallel-size", "2",
                              "--pipeline-model-parallel-size", "4", "--sequence-parallel"])
    short = parser.parse_args(["--tp", "2", "--pp", "4", "--sequence-parallel"])
    assert config_from_args(ParallelConfig, long) == config_from_args(ParallelConfig, short) \
        == ParallelConfig(tp=2, pp=4, sequence_parallel=True)
    assert ParallelConfig(tp=2, pp=4, sequence_parallel=True).pad_multiple == 2
    assert ParallelConfig(tp=2).pad_multiple == 1
    assert ParallelConfig(tp=2, pp=2).with_world(8).dp == 2


@pytest.mark.parametrize("kw,world,message", [
    ({"tp": 0}, None, "--tensor-model-parallel-size (--tp) must be >= 1"),
    ({"sequence_parallel": True}, None, "--sequence-parallel needs"),
    ({"tp": 2, "pp": 2}, 6, "world size 6 is not a multiple"),
    ({"tp": 2, "dp": 3}, 4, "--data-parallel-size (--dp) 3 does not match"),
])
def test_parallel_errors_name_the_flags(kw, world, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelConfig(**kw).with_world(world or 1)


@pytest.mark.parametrize("cls", [ChunkFlowConfig, ParallelConfig])
def test_every_field_documented(cls):
    import dataclasses

    assert set(field_docs(cls)) == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("kw,flag", [({"chunk_size": 0}, "--chunk-size"),
                                     ({"num_kept": 0}, "--chunkflow-k")])
def test_validation_names_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        ChunkFlowConfig(**kw)
