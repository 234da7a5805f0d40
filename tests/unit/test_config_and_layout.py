"""ChunkFlowConfig and the package's import boundaries."""

import argparse
import ast
import pathlib

import pytest

from megatron_chunkflow.config import ChunkFlowConfig, add_config_arguments, field_docs

PKG = pathlib.Path(__file__).resolve().parents[2] / "megatron_chunkflow"


def test_flags_derive_from_fields():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--chunk-size", "4096", "--k", "3"])
    assert ChunkFlowConfig.from_args(args) == ChunkFlowConfig(chunk_size=4096, k=3)
    help_text = parser.format_help()
    for doc in field_docs(ChunkFlowConfig).values():
        assert doc.split(".")[0][:40] in " ".join(help_text.split())


def test_every_field_documented():
    import dataclasses

    assert set(field_docs(ChunkFlowConfig)) == {f.name for f in dataclasses.fields(ChunkFlowConfig)}


@pytest.mark.parametrize("kw,flag", [({"chunk_size": 0}, "--chunk-size"), ({"k": 0}, "--k")])
def test_validation_names_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        ChunkFlowConfig(**kw)


def imports_of(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_core_is_pure():
    """core/ never imports megatron, flash_attn, transformer_engine or torch (DESIGN.md 3)."""
    for path in (PKG / "core").rglob("*.py"):
        for mod in imports_of(path):
            top = mod.split(".")[0]
            assert top not in {"megatron", "flash_attn", "transformer_engine", "torch"}, (path, mod)
            if top == "megatron_chunkflow":
                assert mod.startswith("megatron_chunkflow.core"), (path, mod)
