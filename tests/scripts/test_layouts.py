"""scripts/slurm/layouts.py: the run files' LAYOUT tables are the simulator's search.

    .venv/bin/python -m pytest tests/scripts/test_layouts.py -q
"""

from __future__ import annotations

import importlib.util
import re
import shutil

import pytest

from tests.scripts.test_configs import REPO

spec = importlib.util.spec_from_file_location("layouts", REPO / "scripts" / "slurm" / "layouts.py")
layouts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layouts)


@pytest.mark.parametrize("context", sorted(layouts.CONTEXTS))
def test_search_draws_the_chunkflow_runs_global_batch(context):
    """The search sees the batch the ChunkFlow run trains: its mock profile and global batch."""
    text = (layouts.RUNS / f"h100_{context}_chunkflow.sh").read_text()
    profile, batch = layouts.CONTEXTS[context]
    assert re.search(rf"^MOCK_PROFILE={profile}\b", text, re.M)
    assert re.search(rf"^GLOBAL_BATCH_SIZE={batch}\b", text, re.M)
    assert "scripts/slurm/layouts.py" in text
    assert "scripts/slurm/layouts.py" in (layouts.RUNS / f"h100_{context}_stock.sh").read_text()


@pytest.mark.slow
def test_shipped_rows_are_the_search_and_a_stale_row_is_named(tmp_path, monkeypatch, capsys):
    """qwen2.5-7b at 32K (the quickest search; `layouts.py --check` runs them all): the shipped
    ChunkFlow row is the search's; a stock row edited by hand is named with what the search
    gives."""
    runs = tmp_path / "runs"
    shutil.copytree(layouts.RUNS, runs)
    stock = runs / "h100_32k_stock.sh"
    shipped = layouts.table("32k", "stock")["qwen2.5-7b"]
    edited = shipped.replace(shipped.split()[1], "8", 1)
    stock.write_text(re.sub(r'(\[qwen2\.5-7b\]=")[^"]*"', rf'\g<1>{edited}"', stock.read_text()))
    monkeypatch.setattr(layouts, "RUNS", runs)
    assert layouts.table("32k", "stock")["qwen2.5-7b"] == edited
    assert layouts.main(["--context", "32k", "--model", "qwen2.5-7b", "--check"]) == 1
    err = capsys.readouterr().err
    assert f"h100_32k_stock.sh qwen2.5-7b: {edited!r}, the search gives {shipped!r}" in err
    assert "h100_32k_chunkflow.sh" not in err


def test_the_readme_table_is_the_run_files():
    """configs/README.md's table of the runs says what the run files hold: every row, each
    system's layout, chunk size and K (`layouts.py --readme` regenerates it, predictions too)."""
    block = layouts.readme_block(layouts.README.read_text()).splitlines()
    assert block[0] == layouts.HEADER
    shown = [[c.strip() for c in line.strip("|").split("|")][:5] for line in block[2:]]
    assert shown == layouts.readme_rows(predict=False)
    assert all(re.fullmatch(r"\d\.\d\dx", line.split("|")[6].strip()) for line in block[2:])
