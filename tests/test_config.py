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
    ({"ep": 0}, None, "--expert-model-parallel-size (--ep) must be >= 1"),
    ({"ep": 4, "tp": 2}, 4, "--expert-model-parallel-size (--ep) 4 x expert TP 2 must divide "
                            "TP x CP x DP = 4"),
    ({"tp": 2, "etp": 1}, None, "--expert-tensor-parallel-size (--etp) 1 != "
                                "--tensor-model-parallel-size (--tp) 2 needs EP > 1"),
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


def test_a_simulated_layout_runs_sequence_parallel_whenever_tp_splits():
    """ParallelConfig.layout is how the simulator and bench describe a layout (Megatron-LM users
    run TP with sequence parallelism); `parse` reads the TP,CP,PP,RECOMPUTE text."""
    from megatron_chunkflow.core.models import get_model_shape

    assert ParallelConfig.layout(tp=2).sequence_parallel
    assert not ParallelConfig.layout().sequence_parallel
    lay = ParallelConfig.parse("2,2,2,block:3", 32, get_model_shape("qwen2.5-7b"), "--flag")
    assert (lay.tp, lay.cp, lay.pp, lay.dp, str(lay.recompute)) == (2, 2, 2, 4, "block:3")
    assert lay.degrees == ParallelConfig.layout(tp=2, cp=2, pp=2, dp=4)
    assert (lay.span("tp"), lay.span("cp"), lay.span("dp"), lay.span("pp")) == (2, 4, 16, 32)
    # segments cut into 2 x CP pieces; a chunk's tokens, and so C, split 2 x CP x TP ways
    assert (lay.segment_multiple, lay.chunk_multiple, lay.chunk_padding) == (4, 8, 8)
    assert ParallelConfig.layout(tp=2).chunk_padding == 1  # SP alone: a padding segment
    assert ParallelConfig(recompute="full").recompute.kind == "full"  # text accepted
    with pytest.raises(ValueError, match=r"--flag 2,1,1,block:29: RECOMPUTE block:29: a pipeline "
                                         r"stage has only 28 layers"):
        ParallelConfig.parse("2,1,1,block:29", 8, get_model_shape("qwen2.5-7b"), "--flag")


@pytest.mark.parametrize("naming,expected", [
    ("flags", "--chunk-size 100 is not a multiple of 2 x --context-parallel-size (--cp) 2 x "
              "--tensor-model-parallel-size (--tp) 2 (--sequence-parallel) = 8"),
    ("megatron-lm", "--chunk-size 100 is not a multiple of 2 x --context-parallel-size 2 x "
                    "--tensor-model-parallel-size 2 (--sequence-parallel) = 8"),
    ("axes", "--chunk-size 100 is not a multiple of 2 x CP 2 x TP 2 (sequence parallelism) = 8"),
])
def test_the_chunk_size_rule_is_one_rule_named_for_its_caller(naming, expected):
    """train and verify name the flags with their aliases, the Megatron-LM launcher its own
    flags, simulate the layout text's axes: one rule, one message."""
    layout = ParallelConfig(tp=2, cp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=re.escape(expected + ": context parallelism cuts every "
                                                   "chunk into 2 x CP equal pieces; give "
                                                   "--chunk-size 96")):
        layout.check_chunk_size(100, naming=naming)
    layout.check_chunk_size(104)
    with pytest.raises(ValueError, match="which --sequence-parallel requires"):
        ParallelConfig(tp=4, sequence_parallel=True).check_chunk_size(130)
    ParallelConfig(tp=4).check_chunk_size(130)  # without sequence parallelism nothing splits



@pytest.mark.parametrize("model, kw, message", [
    ("tiny", {"ep": 2}, "--expert-model-parallel-size (--ep) is for a mixture-of-experts model"),
    ("tiny", {"etp": 1}, "--expert-tensor-parallel-size (--etp) is for a mixture-of-experts"),
    ("tiny-qwen3-moe", {"ep": 3}, "--expert-model-parallel-size (--ep) 3 must divide the 4 "
                                  "experts"),
])
def test_expert_parallelism_is_checked_against_the_model(model, kw, message):
    from megatron_chunkflow.core.models import get_model_shape

    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelConfig(**kw).check_model(get_model_shape(model))
    ParallelConfig(ep=2, etp=1, tp=2).with_world(4).check_model(get_model_shape("tiny-qwen3-moe"))
