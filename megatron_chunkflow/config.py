"""ChunkFlowConfig and ParallelConfig: the knobs every entry point shares, carried whole to where
they are used.

Each field's attribute docstring is its command-line help, and its flag is derived from it
(`add_config_arguments`): one spelling per knob in every subcommand. A field's metadata may name
its flag (`--chunkflow-k` for `k`, Megatron-LM's names for the parallel sizes), aliases that are
equally valid (`--tp`), and deprecated spellings that still work but warn (`--k`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Literal

AttentionBackend = Literal["auto", "torch", "cpu_flash", "sdpa", "flex", "varlen", "flash", "te"]
RecomputeModule = Literal["core_attn", "mlp", "layernorm"]
RECOMPUTE_MODULES: tuple[str, ...] = typing.get_args(RecomputeModule)


@dataclass(frozen=True)
class ChunkFlowConfig:
    """ChunkFlow settings shared by every entry point."""

    chunk_size: int = 8192
    """Tokens per data chunk (C). Sequences longer than C are cut into dependent chunks; shorter ones
    are packed into standalone chunks of capacity C. Peak activation memory follows C."""

    k: int = field(default=1, metadata={"flag": "--chunkflow-k", "deprecated": ("--k",)})
    """Chunks of one long sequence that keep activations (K). The others run forward without a
    graph and are re-forwarded during the backward pass: more K, more memory, less recompute."""

    attention_backend: AttentionBackend = field(default="auto",
                                                metadata={"deprecated": ("--backend",)})
    """Chunk attention kernel: auto = the fastest installed kernel verified on this device type
    (cpu_flash, ATen's fused CPU kernel, on CPU; on a GPU, torch until a GPU check verifies
    flash-attn, Transformer Engine or flex: attention/backends.py VERIFIED); torch is exact
    attention in plain torch (any device, saves only q, k, v, out and the log-sum-exp); sdpa the
    reference (a loop of F.scaled_dot_product_attention); flex torch's flex_attention; varlen
    torch's own varlen flash kernel (CUDA)."""

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.k < 1:
            raise ValueError(f"--chunkflow-k must be >= 1, got {self.k}")
        choices = typing.get_args(AttentionBackend)
        if self.attention_backend not in choices:
            raise ValueError(f"--attention-backend {self.attention_backend!r}: choose from "
                             f"{', '.join(choices)}")

    def check_parallel(self, parallel: ParallelConfig) -> None:
        """Sequence parallelism splits each chunk's tokens over the TP ranks, so every chunk is
        padded to a multiple of TP; context parallelism cuts every segment into 2 x CP pieces (x TP
        under sequence parallelism). Full dependent chunks cannot be padded (their K/V is state),
        so the chunk size must be a multiple of what the split needs."""
        m = parallel.segment_multiple
        if parallel.cp > 1 and self.chunk_size % m:
            sp = f" x {_named('tp')} {parallel.tp}" if parallel.sequence_parallel else ""
            raise ValueError(
                f"--chunk-size {self.chunk_size} is not a multiple of 2 x {_named('cp')} "
                f"{parallel.cp}{sp} = {m}: context parallelism cuts every chunk into 2 x CP equal "
                f"pieces; give --chunk-size {max(m, self.chunk_size // m * m)}")
        if self.chunk_size % parallel.pad_multiple:
            raise ValueError(
                f"--chunk-size {self.chunk_size} is not a multiple of the tensor-parallel size "
                f"{parallel.tp}, which sequence parallelism requires")


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of parallelism of one job (Megatron-LM's flags; DP is what the world leaves)."""

    tp: int = field(default=1, metadata={"flag": "--tensor-model-parallel-size",
                                         "aliases": ("--tp",)})
    """Tensor-parallel size (TP): each layer's weights split over TP ranks."""

    pp: int = field(default=1, metadata={"flag": "--pipeline-model-parallel-size",
                                         "aliases": ("--pp",)})
    """Pipeline-parallel size (PP): the layers split into PP stages."""

    cp: int = field(default=1, metadata={"flag": "--context-parallel-size", "aliases": ("--cp",)})
    """Context-parallel size (CP): every chunk's tokens split over CP ranks (2 x CP zigzag pieces
    per segment), a long sequence's K/V state sharded with them; attention all-gathers K/V."""

    dp: int | None = field(default=None, metadata={"flag": "--data-parallel-size",
                                                   "aliases": ("--dp",)})
    """Data-parallel size (DP); in a job it is world size / (TP x CP x PP)."""

    sequence_parallel: bool = False
    """Sequence parallelism: activations between TP regions split over the TP ranks (needs TP > 1;
    every chunk is padded to a multiple of TP)."""

    def __post_init__(self):
        for name in ("tp", "pp", "cp", "dp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{_named(name)} must be >= 1, got {value}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(f"--sequence-parallel needs {_named('tp')} > 1")

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one model replica (one DP rank's share of the batch): TP x CP x PP."""
        return self.tp * self.cp * self.pp

    @property
    def segment_multiple(self) -> int:
        """Under context parallelism every segment of a chunk is padded to a multiple of this
        (2 x CP pieces, each a multiple of TP under sequence parallelism); 1 without CP."""
        return 2 * self.cp * self.pad_multiple if self.cp > 1 else 1

    @property
    def pad_multiple(self) -> int:
        """Micro-batches (chunks) are padded to a multiple of this many tokens: TP under sequence
        parallelism (each TP rank holds an equal slice of the tokens), else 1."""
        return self.tp if self.sequence_parallel else 1

    def with_world(self, world_size: int) -> ParallelConfig:
        """This layout in a job of `world_size` ranks, DP filled in; ValueError if TP x PP does not
        divide it (or a given DP does not match)."""
        cp = f" x {_named('cp')} {self.cp}" if self.cp > 1 else ""
        if world_size % self.model_parallel_size:
            raise ValueError(f"world size {world_size} is not a multiple of {_named('tp')} "
                             f"{self.tp}{cp} x {_named('pp')} {self.pp}")
        dp = world_size // self.model_parallel_size
        if self.dp is not None and self.dp != dp:
            raise ValueError(f"{_named('dp')} {self.dp} does not match world size {world_size} "
                             f"/ (TP {self.tp} x CP {self.cp} x PP {self.pp}) = {dp}")
        return dataclasses.replace(self, dp=dp)

    def check_model(self, shape) -> None:
        """Megatron's requirements on a model (core.models.ModelShape): TP divides the attention
        heads and K/V groups, PP divides the layers (even stages)."""
        if shape.num_attention_heads % self.tp or shape.num_query_groups % self.tp:
            raise ValueError(f"{_named('tp')} {self.tp} does not divide the model's "
                             f"{shape.num_attention_heads} attention heads and "
                             f"{shape.num_query_groups} query groups")
        if shape.num_layers % self.pp:
            raise ValueError(f"{_named('pp')} {self.pp} does not divide the model's "
                             f"{shape.num_layers} layers")


def _named(name: str) -> str:
    """A ParallelConfig field's flag and its short alias, as an error message names them."""
    f = next(f for f in dataclasses.fields(ParallelConfig) if f.name == name)
    return f"{f.metadata['flag']} ({'/'.join(f.metadata['aliases'])})"


@dataclass(frozen=True)
class Recompute:
    """One option of Megatron's activation recompute menu (TransformerConfig's recompute_*).

    - none: every layer keeps what its backward needs;
    - selective: the listed modules of every layer re-run in the backward instead of keeping
      their activations (core_attn: the attention core; mlp: the MLP; layernorm: the two norms,
      whose outputs are not kept);
    - full: every layer keeps only its input and re-runs whole in the backward (Megatron's
      uniform method, one layer per checkpoint);
    - block N: the first N layers of each pipeline stage do that, the others keep everything.

    The text form (`parse`, `str`) is what flags and reports use: none, selective (core_attn),
    selective:mlp+layernorm, full, block:2."""

    kind: Literal["none", "selective", "full", "block"] = "none"
    modules: tuple[RecomputeModule, ...] = ()  # selective only, in RECOMPUTE_MODULES order
    num_layers: int = 0  # block only: N

    def __post_init__(self):
        if self.kind == "selective":
            unknown = [m for m in self.modules if m not in RECOMPUTE_MODULES]
            if unknown or not self.modules:
                raise ValueError(f"selective recompute {self.modules!r}: modules must be a "
                                 f"non-empty subset of {', '.join(RECOMPUTE_MODULES)}")
            ordered = tuple(m for m in RECOMPUTE_MODULES if m in self.modules)
            object.__setattr__(self, "modules", ordered)
        elif self.modules:
            raise ValueError(f"recompute {self.kind!r} takes no modules, got {self.modules!r}")
        if self.kind == "block" and self.num_layers < 1:
            raise ValueError(f"block recompute needs N >= 1 layers (block:N), got "
                             f"{self.num_layers}")
        if self.kind != "block" and self.num_layers:
            raise ValueError(f"recompute {self.kind!r} takes no number of layers, got "
                             f"{self.num_layers}")

    @classmethod
    def parse(cls, text: str, flag: str = "--recompute") -> Recompute:
        """From its text form; ValueError naming `flag` and the accepted forms."""
        kind, _, rest = text.strip().partition(":")
        try:
            if kind in ("none", "full") and not rest:
                return cls(kind)
            if kind == "selective":
                return cls("selective", tuple((rest or "core_attn").split("+")))
            if kind == "block" and rest.isdigit():
                return cls("block", num_layers=int(rest))
        except ValueError as e:
            raise ValueError(f"{flag} {text!r}: {e}") from None
        raise ValueError(f"{flag} {text!r}: expected none, full, block:N, selective or "
                         f"selective:M1+M2 with modules from {', '.join(RECOMPUTE_MODULES)}")

    def __str__(self) -> str:
        if self.kind == "selective":
            return "selective" if self.modules == ("core_attn",) else \
                "selective:" + "+".join(self.modules)
        return f"block:{self.num_layers}" if self.kind == "block" else self.kind

    def megatron_kwargs(self) -> dict:
        """The TransformerConfig fields that select this option."""
        if self.kind == "selective":
            return dict(recompute_granularity="selective", recompute_modules=list(self.modules))
        if self.kind == "full":
            return dict(recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=1)
        if self.kind == "block":
            return dict(recompute_granularity="full", recompute_method="block",
                        recompute_num_layers=self.num_layers)
        return {}

    def check_layers(self, layers_per_stage: int, flag: str = "--recompute") -> None:
        """Block N needs N <= the layers of a pipeline stage."""
        if self.kind == "block" and self.num_layers > layers_per_stage:
            raise ValueError(f"{flag} {self}: a pipeline stage has only {layers_per_stage} "
                             "layers")

    @staticmethod
    def menu(layers_per_stage: int) -> list[Recompute]:
        """Every option for stages of `layers_per_stage` layers: none, the 7 selective module
        sets, block 1 .. layers_per_stage - 1, full (block with every layer is full)."""
        import itertools

        subsets = [c for n in range(1, len(RECOMPUTE_MODULES) + 1)
                   for c in itertools.combinations(RECOMPUTE_MODULES, n)]
        return ([Recompute()] + [Recompute("selective", s) for s in subsets]
                + [Recompute("block", num_layers=n) for n in range(1, layers_per_stage)]
                + [Recompute("full")])


# ---- command-line flags derived from the dataclasses ---------------------------------------------


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
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


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
        names = [flag, *(f.metadata.get("aliases", ()) if aliases else ())]
        shown = (default_help or {}).get(f.name, default)
        help_text = f"{docs[f.name]}" + (f" (default: {shown})" if kind is not bool else "")
        dest = dest_prefix + f.name
        if kind is bool:
            parser.add_argument(*names, dest=dest, action="store_true", default=default,
                                help=help_text)
        else:
            parser.add_argument(*names, dest=dest, type=kind, default=default, choices=choices,
                                metavar=None if choices else f.name.upper(), help=help_text)
        for old in f.metadata.get("deprecated", ()) if aliases else ():
            deprecated_alias(parser, old, flag, dest=dest, type=None if kind is bool else kind,
                             choices=choices, **({"nargs": 0} if kind is bool else {}))


def deprecated_alias(parser, old: str, canonical: str, **kwargs) -> None:
    """Register `old` as a hidden spelling of `canonical` that warns when used (argparse keyword
    arguments as for the canonical flag; dest defaults to the canonical flag's)."""
    kwargs.setdefault("dest", canonical.lstrip("-").replace("-", "_"))
    parser.add_argument(old, action=_Deprecated, canonical=canonical,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def config_from_args(cls: type, args: argparse.Namespace, dest_prefix: str = "", **overrides):
    """An instance of `cls` from parsed flags (its ValueErrors name the flags)."""
    values = {f.name: getattr(args, dest_prefix + f.name) for f in dataclasses.fields(cls)
              if hasattr(args, dest_prefix + f.name)}
    return cls(**{**values, **overrides})


def _kind(annotation) -> tuple[type, tuple | None]:
    """(argparse type, choices) of a field annotation: int, float, str, bool, Literal[...] or
    `X | None`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return type(args[0]), tuple(args)
    if args:  # X | None
        return _kind(args[0])
    return annotation, None


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
