"""ChunkFlowConfig: the one source of truth for ChunkFlow's knobs.

Each field's docstring is its CLI help; `add_config_arguments` derives the flags (`chunk_size` ->
`--chunk-size`), so the help text and the code cannot drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class ChunkFlowConfig:
    """ChunkFlow settings shared by every entry point."""

    chunk_size: int = 8192
    """Tokens per data chunk (C). Sequences longer than C are cut into dependent chunks; shorter ones
    are packed into standalone chunks of capacity C. Peak activation memory follows C."""

    k: int = 1
    """Chunks of one long sequence that keep activations (K). The others run forward without a
    graph and are re-forwarded during the backward pass: more K, more memory, less recompute."""

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")

    def check_layout(self, tensor_parallel: int, sequence_parallel: bool) -> None:
        """Sequence parallelism splits each chunk's tokens over the TP ranks, so every chunk is
        padded to a multiple of TP; full dependent chunks cannot be padded (their K/V is state)."""
        if sequence_parallel and self.chunk_size % tensor_parallel:
            raise ValueError(
                f"--chunk-size {self.chunk_size} is not a multiple of the tensor-parallel size "
                f"{tensor_parallel}, which sequence parallelism requires")

    def pad_multiple(self, tensor_parallel: int, sequence_parallel: bool) -> int:
        """Chunks are padded to a multiple of this many tokens."""
        return tensor_parallel if sequence_parallel else 1

    @classmethod
    def from_args(cls, args: argparse.Namespace, flags: dict | None = None) -> ChunkFlowConfig:
        """Build from parsed flags; `flags` as given to add_config_arguments, so that errors
        name the flag the user typed."""
        try:
            return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
        except ValueError as e:
            message = str(e)
            for name, flag in (flags or {}).items():
                message = message.replace(f"--{name.replace('_', '-')} ", f"{flag} ")
            raise ValueError(message) from None


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


_ANNOTATION_TYPES = {"int": int, "float": float, "str": str}


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = ChunkFlowConfig,
                         prefix: str = "", defaults: dict | None = None,
                         flags: dict | None = None, dest_prefix: str = "") -> None:
    """Add one `--<prefix><field-name>` flag per dataclass field, help from its docstring.

    `defaults` overrides field defaults for one command (e.g. a small chunk size for CPU checks);
    `flags` renames a field's flag (Megatron-LM style `--chunkflow-k` for `k`); `dest_prefix`
    prefixes the argparse destination (`lora_rank` for LoRAConfig.rank). A field whose default is
    None (off unless given) takes its type from its annotation (`int | None` -> int).
    """
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        flag = (flags or {}).get(f.name) or "--" + prefix + f.name.replace("_", "-")
        default = (defaults or {}).get(f.name, f.default)
        kind = type(f.default) if f.default is not None else \
            _ANNOTATION_TYPES[str(f.type).split("|")[0].strip()]
        parser.add_argument(flag, dest=dest_prefix + f.name, type=kind, default=default,
                            metavar=f.name.upper(), help=f"{docs[f.name]} (default: {default})")
