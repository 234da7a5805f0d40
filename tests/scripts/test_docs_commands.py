"""scripts/docs_commands.py: every command of README.md and docs/ parses with today's flags, and
the quick ones run as written (the slow ones: `python scripts/docs_commands.py --all`).

    python -m pytest tests/scripts/test_docs_commands.py -q
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from megatron_chunkflow.cli import parse
from tests.scripts.test_configs import REPO

spec = importlib.util.spec_from_file_location("docs_commands", REPO / "scripts/docs_commands.py")
docs = importlib.util.module_from_spec(spec)
sys.modules["docs_commands"] = docs  # its dataclass looks its module up
spec.loader.exec_module(docs)
COMMANDS = docs.commands()


def test_every_document_is_read_and_every_command_classed():
    paths = {c.path for c in COMMANDS}
    assert {"README.md", "docs/train.md", "docs/megatron-lm.md", "docs/hf.md"} <= paths
    kinds = {c.kind.split(":")[0] for c in COMMANDS}
    assert kinds == {"quick", "slow", "skip"}
    assert any(c.text.startswith("make demo") and c.kind.startswith("skip") for c in COMMANDS)


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if docs.chunkflow_argv(c.text) is not None
                                 and not c.kind.startswith("skip")],
                         ids=lambda c: f"{c.path}:{c.line}")
def test_every_chunkflow_command_parses(cmd):
    """A flag renamed or removed fails here, for slow commands too (argparse only, no run)."""
    try:
        parse(docs.chunkflow_argv(cmd.text))
    except SystemExit as e:
        pytest.fail(f"{cmd.path}:{cmd.line}: {cmd.text}: argparse exit {e.code}")


@pytest.mark.slow
def test_the_quick_commands_run_as_written():
    run = subprocess.run([sys.executable, str(REPO / "scripts/docs_commands.py")], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert run.stdout.count(" quick ok ") >= 4
