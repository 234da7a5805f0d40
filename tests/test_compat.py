"""compat.py: the supported megatron-core releases and the API differences between them, on the
installed release (CI runs the suite on two: README "Tests")."""

import pytest
import torch

from megatron_chunkflow import compat


@pytest.mark.parametrize("text,release", [("0.16.1", (0, 16, 1)), ("0.19.2+855d539", (0, 19, 2)),
                                          ("0.17.0rc0", (0, 17, 0)), ("1.0", (1, 0, 0))])
def test_versions_parse_without_local_or_pre_release_parts(text, release):
    assert compat.parse_version(text) == release


def test_the_installed_release_is_in_the_range():
    assert compat.OLDEST <= compat.check_release() <= compat.NEWEST


def test_the_release_is_read_where_import_would_find_it_without_importing_it(tmp_path):
    """`make` asks for the release (the Megatron-LM tag to fetch): megatron/core/package_info.py
    of the first megatron/core on the path, read without running megatron.core's imports."""
    import os
    import subprocess
    import sys

    for name, minor in (("first", 17), ("second", 18)):
        core = tmp_path / name / "megatron" / "core"
        core.mkdir(parents=True)
        (core / "__init__.py").write_text("raise ImportError('imported')\n")
        (core / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 1\n"
                                              "PRE_RELEASE = 'rc0'\nimport nothing_of_this\n")
    code = ("import sys; from megatron_chunkflow import compat; "
            "print(compat.installed(), compat.megatron_lm_tag(), 'megatron.core' in sys.modules)")
    path = os.pathsep.join([str(tmp_path / "first"), str(tmp_path / "second"),
                            os.environ.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["(0,", "17,", "1)", "core_v0.17.1", "False"]


@pytest.mark.parametrize("release", [(0, 15, 3), (0, 16, 0), (0, 20, 0)])
def test_a_release_outside_the_range_is_refused_in_one_line(monkeypatch, release):
    monkeypatch.setattr(compat, "installed", lambda: release)
    monkeypatch.delenv(compat.ALLOW_UNTESTED, raising=False)
    with pytest.raises(compat.UnsupportedRelease) as e:
        compat.check_release()
    message = str(e.value)
    assert "\n" not in message and compat.RANGE in message
    assert f"megatron-core {compat.version_text(release)} is installed" in message
    assert ("CHUNKFLOW_ALLOW_UNTESTED_MEGATRON" in message) == (release > compat.NEWEST)


def test_a_newer_release_runs_with_a_warning_when_allowed(monkeypatch):
    monkeypatch.setattr(compat, "installed", lambda: (0, 20, 1))
    monkeypatch.setenv(compat.ALLOW_UNTESTED, "1")
    with pytest.warns(UserWarning, match="0.20.1 is installed"):
        assert compat.check_release() == (0, 20, 1)
    monkeypatch.setattr(compat, "installed", lambda: (0, 15, 0))
    with pytest.raises(compat.UnsupportedRelease):  # older ones never
        compat.check_release()


def test_the_cli_refuses_an_unsupported_release_before_any_work(monkeypatch, capsys):
    from megatron_chunkflow.cli import main

    monkeypatch.setattr(compat, "installed", lambda: (0, 15, 0))
    assert main(["verify"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("chunkflow verify: error: megatron-core 0.15.0 ")
    assert main(["plan", "--json"]) == 0  # the planner needs no megatron-core


def test_a_megatron_lm_checkout_must_match_the_installed_release_line(monkeypatch):
    monkeypatch.setattr(compat, "installed", lambda: (0, 19, 2))
    assert compat.megatron_lm_problem((0, 19, 0)) is None
    assert "needs megatron-core 0.16.x" in compat.megatron_lm_problem((0, 16, 1))
    assert "core_v0.16.1 and core_v0.19.0" in compat.megatron_lm_problem((0, 20, 0))
    monkeypatch.setattr(compat, "installed", lambda: (0, 16, 1))
    assert compat.megatron_lm_problem((0, 16, 1)) is None
    assert "needs megatron-core 0.19.x" in compat.megatron_lm_problem((0, 19, 0))


def test_the_model_class_follows_the_release(monkeypatch):
    recommended = compat.recommended_model_class()
    assert recommended == ("hybrid" if compat.installed() >= (0, 19, 0) else "gpt")
    assert compat.resolve_model_class("auto") == recommended
    assert compat.resolve_model_class("gpt") == "gpt"
    with pytest.raises(ValueError, match="--model-class transformer: choose one of auto"):
        compat.resolve_model_class("transformer")
    monkeypatch.setattr(compat, "has_hybrid_model", lambda: False)
    with pytest.raises(ValueError, match="--model-class hybrid: megatron-core .* has no "
                                         "HybridModel"):
        compat.resolve_model_class("hybrid")


def test_backward_step_on_this_release():
    """Megatron's own backward_step, whichever signature the release has: the last stage's
    backward of its loss, the input's gradient returned."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    x = torch.tensor([1.0, 2.0], requires_grad=True)
    out = (3 * x).sum()
    grad = compat.backward_step(x, out, None, ModelParallelConfig())
    assert torch.equal(grad, torch.tensor([3.0, 3.0]))


def test_typing_override_is_there_for_megatron_lm():
    import typing

    compat.backport_typing_override()
    assert callable(typing.override)
