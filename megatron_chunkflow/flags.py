"""Command-line flags derived from frozen dataclasses: each field's attribute docstring is its
help, its metadata may name its flag (`--chunkflow-k` for `k`), aliases that are equally valid
(`--tp`) and deprecated spellings that still work but warn (`--k`). One spelling per knob in every
subcommand, and in the Megatron-LM launcher's parser.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import sys
import typing
from functools import cache
from typing import Literal


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


def flag_of(cls: type, name: str, prefix: str = "") -> str:
    """The command-line flag of field `name` of `cls`."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.metadata.get("flag") or "--" + prefix + name.replace("_", "-")


class _Deprecated(argparse.Action):
    """An old spelling of a flag: works, and says which spelling to use instead."""

    def __init__(self, option_strings, dest, canonical: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.canonical = canonical

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.canonical}",
              file=sys.stderr)
        if self.nargs == 0:
            values = True if self.const is None else self.const
        setattr(namespace, self.dest, values)
        _note_given(namespace, self.dest)


def add_config_arguments(parser, cls: type, *, fields: tuple[str, ...] | None = None,
                         defaults: dict | None = None, default_help: dict | None = None,
                         flags: dict | None = None, prefix: str = "", dest_prefix: str = "",
                         aliases: bool = True) -> None:
    """Add one flag per field of dataclass `cls` (or of `fields`), help from its docstring.

    `defaults` overrides field defaults for one command (None: chosen by the command, which
    `default_help` can say in words); `flags`
    renames a field's flag (the Megatron-LM launcher's `--chunkflow-attention-backend`);
    `dest_prefix` prefixes the argparse destination (`lora_rank` for LoRAConfig.rank); without
    `aliases` only the canonical flag is registered (inside Megatron-LM's own parser)."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if fields is not None and f.name not in fields:
            continue
        flag = (flags or {}).get(f.name) or flag_of(cls, f.name, prefix)
        default = (defaults or {}).get(f.name, f.default)
        kind, choices = _kind(hints[f.name])
        bounds = {"bounds": f.metadata["bounds"]} if "bounds" in f.metadata else {}
        names = [flag, *(f.metadata.get("aliases", ()) if aliases else ())]
        shown = (default_help or {}).get(f.name, default)
        help_text = f"{docs[f.name]}" + (f" (default: {shown})" if kind is not bool else "")
        dest = dest_prefix + f.name
        if kind is bool:
            parser.add_argument(*names, dest=dest, action=_GivenTrue, default=default,
                                help=help_text)
        else:
            parser.add_argument(*names, dest=dest, type=kind, default=default, choices=choices,
                                action=Bounded if bounds else _Given,
                                metavar=None if choices else f.name.upper(), help=help_text,
                                **bounds)
        for old in f.metadata.get("deprecated", ()) if aliases else ():
            deprecated_alias(parser, old, flag, dest=dest, type=None if kind is bool else kind,
                             choices=choices, **({"nargs": 0} if kind is bool else {}))


def deprecated_alias(parser, old: str, canonical: str, **kwargs) -> None:
    """Register `old` as a hidden spelling of `canonical` that warns when used (argparse keyword
    arguments as for the canonical flag; dest defaults to the canonical flag's; nargs=0 with
    `const` makes a switch that stands for one value, `--bf16` for `--dtype bfloat16`)."""
    kwargs.setdefault("dest", canonical.lstrip("-").replace("-", "_"))
    parser.add_argument(old, action=_Deprecated, canonical=canonical,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def config_from_args(cls: type, args: argparse.Namespace, dest_prefix: str = "", **overrides):
    """An instance of `cls` from parsed flags (its ValueErrors name the flags); a class with a
    `check_given(names)` is shown which of its fields were given on the command line."""
    values = {f.name: getattr(args, dest_prefix + f.name) for f in dataclasses.fields(cls)
              if hasattr(args, dest_prefix + f.name)}
    out = cls(**{**values, **overrides})
    if hasattr(out, "check_given"):
        given = getattr(args, GIVEN, set())
        out.check_given({f.name for f in dataclasses.fields(cls)
                         if dest_prefix + f.name in given})
    return out


GIVEN = "_flags_given"  # the Namespace attribute: destinations given on the command line


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the flag stored in `dest` was given on the command line (a flag made by
    add_config_arguments or with a Bounded action), not left at its default."""
    return dest in getattr(args, GIVEN, set())


def _note_given(namespace, dest: str) -> None:
    if not hasattr(namespace, GIVEN):
        setattr(namespace, GIVEN, set())
    getattr(namespace, GIVEN).add(dest)


class _Given(argparse._StoreAction):
    """store, and note that the flag was given (config_from_args's check_given)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _note_given(namespace, self.dest)


class _GivenTrue(argparse._StoreTrueAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _note_given(namespace, self.dest)


def _kind(annotation) -> tuple[type, tuple | None]:
    """(argparse type, choices) of a field annotation: int, float, str, bool, Literal[...], a
    class with a `parse(text)` classmethod (config.Recompute) or `X | None`."""
    if hasattr(annotation, "parse"):
        return _parsed_by(annotation), None
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return type(args[0]), tuple(args)
    if args:  # X | None
        return _kind(args[0])
    return (finite_float if annotation is float else annotation), None


# The bounds of every integer size flag, one validator for all (`bounded`): what a command can
# start on and answer in minutes. Zero and negative sizes are refused by the flag's own name.
MAX_GPUS = 1 << 17  # 131,072 GPUs (--gpus, --world): past the largest clusters
MAX_TOKENS = 1 << 24  # 16,777,216 tokens in a sequence or a chunk (--seq-length, --chunk-size)
MAX_COUNT = 1 << 20  # sequences in a global batch, steps, repeats, draws, processes
MAX_SEED = 2**32 - 1  # numpy's and torch's generators take [0, 2**32)


def check_int(flag: str, value: int, low: int, high: int) -> None:
    """The one rule of every integer size: ValueError naming `flag` outside [low, high]."""
    if value < low:
        raise ValueError(f"{flag} must be >= {low}, got {value}")
    if value > high:
        raise ValueError(f"{flag} must be at most {high:,}, got {value:,}")


FLAG_ERRORS = "_flag_errors"  # the Namespace attribute: size flags outside their bounds


class Bounded(argparse._StoreAction):
    """store an int flag checked by check_int (add_argument(..., type=int, action=Bounded,
    bounds=(low, high))), named as typed; a value outside is noted, not stored, and
    flag_errors() returns it, so the command refuses it in one line before any work (not
    argparse's usage screen)."""

    def __init__(self, *args, bounds: tuple[int, int], **kwargs):
        super().__init__(*args, **kwargs)
        self.bounds = bounds

    def __call__(self, parser, namespace, values, option_string=None):
        if values is not None:
            try:
                check_int(option_string or self.option_strings[0], values, *self.bounds)
            except ValueError as e:
                if not hasattr(namespace, FLAG_ERRORS):
                    setattr(namespace, FLAG_ERRORS, [])
                getattr(namespace, FLAG_ERRORS).append(str(e))
        super().__call__(parser, namespace, values, option_string)
        _note_given(namespace, self.dest)


def flag_errors(args: argparse.Namespace) -> list[str]:
    """The size flags of `args` outside their bounds, one message each (Bounded)."""
    return list(getattr(args, FLAG_ERRORS, []))


def finite_float(text: str) -> float:
    """argparse type of every float flag: a number, never inf or nan (a flag that means "off"
    says so with 0)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def read_json_file(path, what: str):
    """The JSON value in file `path`; ValueError starting with `what` (a flag and the path, or
    the path) when the file is missing, not UTF-8 or not JSON (with its line)."""
    import json
    from pathlib import Path

    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ValueError(f"{what}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{what}: is a directory, not a JSON file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: not UTF-8 text (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}:{e.lineno}: not valid JSON ({e.msg})") from None


def _parsed_by(cls: type):
    """An argparse type that reads a value with `cls.parse`, its ValueError shown as the usage
    error (argparse would otherwise say only "invalid value")."""
    def parse(text: str):
        try:
            return cls.parse(text, "")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).strip()) from None

    parse.__name__ = cls.__name__
    return parse


def check_output_file(flag: str, path: str | None) -> None:
    """A file a command will write, checked before any work: ValueError naming `flag` when it is
    a directory or its directory is missing or not writable."""
    import os

    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: directory {parent} is not writable")


def check_output_dir(flag: str, path: str | None) -> None:
    """A directory a command will create or write into: ValueError naming `flag` when it is an
    existing file, or when it is missing and so is its nearest existing ancestor's write access."""
    import os

    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a file, not a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"{flag} {path}: {existing} is not writable")
