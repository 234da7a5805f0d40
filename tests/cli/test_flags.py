"""One spelling per knob in every subcommand and in the Megatron-LM launcher's flags.

    python -m pytest tests/cli/test_flags.py -q
"""

import argparse

import pytest

from megatron_chunkflow.cli import SUBCOMMANDS, build_parser

CHUNKING = ["plan", "simulate", "verify", "train", "bench", "memory"]  # every command that chunks


def parse(argv):
    return build_parser().parse_args(argv)


def test_every_subcommand_is_covered():
    assert set(CHUNKING) | {"calibrate"} == set(SUBCOMMANDS)  # calibrate times kernels only


@pytest.mark.parametrize("command", CHUNKING)
def test_chunk_size_and_k_are_spelled_the_same_everywhere(command):
    args = parse([command, "--chunk-size", "512", "--chunkflow-k", "2"])
    assert (args.chunk_size, args.num_kept) == (512, 2)


@pytest.mark.parametrize("command", ["verify", "train", "bench", "memory"])
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


@pytest.mark.parametrize("command", ["plan", "simulate", "verify", "bench", "memory"])
def test_length_flags_and_seed_are_one_config(command):
    """--profile, --lengths-file, --global-batch-size, --seed, --step, --scale come from one
    dataclass (core/lengths.py) in every command that draws lengths, with one help text."""
    from megatron_chunkflow.core.lengths import LengthsConfig
    from megatron_chunkflow.flags import config_from_args

    args = parse([command, "--profile", "A", "--global-batch-size", "9", "--seed", "3",
                  "--step", "2", "--scale", "0.5"])
    cfg = config_from_args(LengthsConfig, args)
    assert (cfg.profile, cfg.global_batch_size, cfg.seed, cfg.step, cfg.scale) == \
        ("A", 9, 3, 2, 0.5)
    sub = next(a for a in build_parser()._subparsers._actions
               if isinstance(a, argparse._SubParsersAction)).choices[command]
    seed_help = next(a.help for a in sub._actions if "--seed" in a.option_strings)
    assert seed_help.startswith("Seed of everything the command draws at random")


def test_train_seed_has_the_same_meaning_and_megatron_lms_default():
    args = parse(["train"])
    assert args.seed == 1234  # Megatron-LM's default (the embedded scenario, README "Defaults")


@pytest.mark.parametrize("argv,expected", [
    (["--bf16"], "bfloat16"), (["--fp64"], "float64"), (["--dtype", "float64"], "float64"),
])
def test_precision_is_one_flag(capsys, argv, expected):
    assert parse(["train", *argv]).dtype == expected
    if argv[0] != "--dtype":
        assert f"{argv[0]} is deprecated; use --dtype {expected}" in capsys.readouterr().err


@pytest.mark.parametrize("argv,expected", [
    (["--recompute", "block:2"], "block:2"),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "2"], "block:2"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm"],
     "selective:mlp+layernorm"),
    (["--recompute-granularity", "full"], "full"),
])
def test_recompute_is_one_flag_megatrons_spelling_still_works(capsys, argv, expected):
    from megatron_chunkflow.cli.train import settings_from_args

    assert str(settings_from_args(parse(["train", *argv])).parallel.recompute) == expected
    if argv[0] != "--recompute":
        assert "--recompute-granularity is deprecated; use --recompute OPTION" in \
            capsys.readouterr().err


def test_recompute_spelled_both_ways_is_refused():
    from megatron_chunkflow.cli.train import settings_from_args

    with pytest.raises(ValueError, match="--recompute and Megatron-LM's --recompute-\\* flags"):
        settings_from_args(parse(["train", "--recompute", "full",
                                  "--recompute-granularity", "full"]))


def test_bad_recompute_text_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["verify", "--recompute", "sometimes"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--recompute" in err and "expected none, full, block:N" in err


def test_data_flags_are_one_config_in_train_and_the_launcher():
    """--overlong and --skip-bad-records: DataConfig's fields (data/config.py) in `chunkflow
    train` and in Megatron-LM's parser, with the same help."""
    from megatron_chunkflow.megatron_lm.args import add_chunkflow_arguments

    launcher = add_chunkflow_arguments(argparse.ArgumentParser())
    train = next(a for a in build_parser()._subparsers._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["train"]
    for flag in ("--overlong", "--skip-bad-records"):
        helps = [next(a.help for a in p._actions if flag in a.option_strings)
                 for p in (launcher, train)]
        assert helps[0] == helps[1], flag
    args = launcher.parse_args(["--overlong", "split", "--skip-bad-records"])
    assert (args.overlong, args.skip_bad_records) == ("split", True)


def _readme_defaults() -> dict[str, list[str]]:
    """README's "Defaults" table: subcommand -> the flags and values of its embedded scenario."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = text[text.index("### Defaults"):].split("\n\n")[2]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| `([^`]+)`", table, re.M)
    return {command: flags.split() for command, flags in rows}


@pytest.mark.parametrize("command", CHUNKING)
def test_every_embedded_scenario_default_is_documented_and_applied(command):
    """One default per knob, its field's, unless a subcommand's embedded scenario sets one: then
    README's table says so, and the parser applies it."""
    import importlib

    scenario = importlib.import_module(f"megatron_chunkflow.cli.{command}").SCENARIO
    documented = _readme_defaults()[command]
    flags = dict(zip(documented[::2], documented[1::2]))
    args = parse([command])
    for key, value in scenario.items():
        flag = "--" + key.replace("_", "-")
        assert flag in flags, f"README's Defaults table lacks {command} {flag}"
        assert float(flags[flag]) == value if isinstance(value, (int, float)) else \
            flags[flag] == value, (command, flag)
        if getattr(args, key) is None:  # drawn by the command at its scenario's size
            sub = next(a for a in build_parser()._subparsers._actions
                       if isinstance(a, argparse._SubParsersAction)).choices[command]
            text = next(a.help for a in sub._actions if flag in a.option_strings)
            assert f"{value}" in text.split("(default:")[-1], (command, flag, text)
        else:
            assert getattr(args, key) == value, (command, key)
    assert set(flags) == {"--" + k.replace("_", "-") for k in scenario}, command


def test_recompute_none_typed_with_megatrons_flags_is_refused_and_their_n_named():
    from megatron_chunkflow.cli.train import settings_from_args

    with pytest.raises(ValueError, match="--recompute and Megatron-LM's --recompute-\\* flags"):
        settings_from_args(parse(["train", "--recompute", "none",
                                  "--recompute-granularity", "full"]))
    with pytest.raises(ValueError, match="--recompute-num-layers block:9: a pipeline stage has "
                                         "only 4 layers"):
        settings_from_args(parse(["train", "--recompute-granularity", "full",
                                  "--recompute-method", "block", "--recompute-num-layers", "9"]))


def test_exit_interval_zero_is_off_as_in_megatron_lm(capsys):
    from megatron_chunkflow.cli.train import settings_from_args

    assert settings_from_args(parse(["train", "--exit-interval", "0"])).exit_interval == 0
    from megatron_chunkflow.cli import main

    assert main(["train", "--exit-interval", "-1"]) == 2
    assert "--exit-interval must be >= 0, got -1" in capsys.readouterr().err
    help_text = " ".join(_help("train").split())
    assert "0, as in Megatron-LM: off" in help_text


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command].format_help()


# every integer size flag of every subcommand: (command, flag, a value below, a value above)
SIZE_FLAGS = [
    ("plan", "--seed", "-1", "99999999999999999999999"), ("plan", "--global-batch-size", "0", None),
    ("plan", "--seq-length", "0", str(1 << 30)), ("plan", "--chunk-size", "0", str(1 << 30)),
    ("simulate", "--gpus", "0", "1000000"), ("simulate", "--seed", "-1", str(2**32)),
    ("simulate", "--seq-length", "-5", str(1 << 30)),
    ("memory", "--world", "0", "1000000"), ("memory", "--world", "-8", None),
    ("memory", "--seed", "-1", "9" * 20), ("memory", "--seq-length", "0", None),
    ("verify", "--steps", "0", str(1 << 30)), ("verify", "--seed", "-1", None),
    ("bench", "--nproc", "0", "100000"), ("bench", "--repeats", "0", None),
    ("calibrate", "--repeats", "0", str(1 << 30)), ("calibrate", "--warmup", "-1", None),
    ("train", "--train-iters", "0", str(1 << 30)), ("train", "--exit-interval", "-1", None),
    ("train", "--seed", "-1", "99999999999999999999999"),
    ("train", "--pipeline-model-parallel-size", "0", "1000000"),
]


@pytest.mark.parametrize("command,flag,low,high", SIZE_FLAGS,
                         ids=[f"{c} {f} {lo}" for c, f, lo, _ in SIZE_FLAGS])
def test_every_size_flag_is_bounded_by_its_own_name(capsys, command, flag, low, high):
    """One validator (flags.py check_int) for every integer size: zero, negative and past-bound
    values refused before any work, in one line naming the flag as typed (exit 2)."""
    from megatron_chunkflow.cli import main

    for value, words in ((low, "must be >="), (high, "must be at most")):
        if value is None:
            continue
        assert main([command, flag, value]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err  # one line, no usage screen
        assert err.startswith(f"chunkflow {command}: error: {flag} {words}"), err


def test_a_refusal_under_torchrun_is_printed_once(capsys, monkeypatch):
    """Every rank of a torchrun job refuses the same input; rank 0 alone says so, one line."""
    from megatron_chunkflow.cli import main

    monkeypatch.setenv("RANK", "3")
    assert main(["plan", "--seq-length", "10", "--global-batch-size", "4"]) == 2
    assert main(["plan", "--seed", "-1"]) == 2
    assert main(["plan", "--model", "gpt-17"]) == 2  # argparse's own usage error
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["plan", "--seq-length", "10", "--global-batch-size", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n")
    # the stock baseline's length, not the virtual stages, is what stops it
    assert err.startswith("chunkflow plan: error: stock Megatron: sequence ")
    assert "--vpp" not in err


@pytest.mark.parametrize("argv,said", [
    (["simulate", "--model", "qwen2.5-7B"], "invalid choice: 'qwen2.5-7B' (choose from "),
    (["plan", "--chunk-sise", "4096"], "unrecognized arguments: --chunk-sise 4096"),
    (["memory", "--gpu", "h2000"], "invalid choice: 'h2000'"),
])
def test_a_mistyped_name_gets_the_closest_one_in_one_line(capsys, argv, said):
    """No usage screen: one line, what was wrong, and the closest spelling the command knows."""
    from megatron_chunkflow.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"chunkflow {argv[0]}: error: "), err
    assert said in err
    closest = {"simulate": "did you mean qwen2.5-7b?", "plan": "did you mean --chunk-size?",
               "memory": "did you mean h200?"}[argv[0]]
    assert closest in err
