"""`chunkflow bench` without running it: bad flags exit 2 naming the flag, before any process
starts (in-process: cli.main). The budget rules are tests/perfmodel/test_budget.py's; a real run is
tests/bench/test_bench.py's."""

import pytest

from megatron_chunkflow.cli import main


@pytest.mark.parametrize("argv,flag", [
    (["--pp", "0"], "--pp"),
    (["--repeats", "0"], "--repeats"),
    (["--warmup", "-1"], "--warmup"),
    (["--budget-mib", "0"], "--budget-mib"),
    (["--chunkflow-budget-mib", "-1"], "--chunkflow-budget-mib"),
    (["--chunk-size", "65536"], "--chunk-size"),
    (["--chunkflow-k", "0"], "--chunkflow-k"),
    (["--chunk-size", "0"], "--chunk-size"),
    (["--threads", "0"], "--threads"),
    (["--nproc", "3"], "--nproc"),
    (["--pp", "3", "--nproc", "3"], "--pp"),
    (["--global-batch-size", "0"], "--global-batch-size"),
    (["--lengths-file", "/nonexistent/lengths.txt"], "--lengths-file"),
    (["--sharegpt", "--lengths-file", "/nonexistent/lengths.txt"], "--sharegpt"),
    (["--pp", "1", "--global-batch-size", "4", "--scale", "0.01"], "--global-batch-size"),
    (["--megatron-recompute", "sometimes"], "--megatron-recompute"),
    (["--megatron-recompute", "block:3"], "--megatron-recompute"),  # 2 layers per stage
    (["--chunkflow-recompute", "selective:attention"], "--chunkflow-recompute"),
    (["--chunkflow-recompute", "block:0"], "--chunkflow-recompute"),
    (["--png", "/proc/version"], "--png"),
])
def test_bad_flags_exit_2_naming_the_flag(capsys, argv, flag):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("chunkflow bench: error:") and flag in err


@pytest.mark.parametrize("flag", ["--baseline", "--attention-backend"])
def test_unknown_choice_is_argparse_exit_2(capsys, flag):
    assert main(["bench", flag, "sometimes"]) == 2
    assert flag in capsys.readouterr().err
