"""Sequence lengths for the CLI: a seeded profile or a lengths file."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from megatron_chunkflow.flags import deprecated_alias
from megatron_chunkflow.core.profiles import PROFILES, sample_lengths

MAX_LENGTH = 1 << 24  # tokens in one sequence: 16M, 64x a 256K context; planning stays bounded


def check_length(n: int, where: str) -> None:
    """ValueError naming `where` for a sequence longer than any command plans."""
    if n > MAX_LENGTH:
        raise ValueError(f"{where}: length {n:,} is more than the {MAX_LENGTH:,} tokens a "
                         "sequence may have here")


def add_length_arguments(parser: argparse.ArgumentParser, default_sequences: int,
                         default_scale: float = 1.0) -> None:
    g = parser.add_argument_group("sequence lengths")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--profile", choices=sorted(PROFILES), default="B",
                     help="seeded long-tailed length profile (docs/design.md; default: B)")
    src.add_argument("--lengths-file", metavar="PATH",
                     help="one positive integer per line ('#' starts a comment)")
    g.add_argument("--global-batch-size", type=int, default=default_sequences, metavar="N",
                   help=f"sequences in the global batch (default: {default_sequences})")
    deprecated_alias(g, "--num-sequences", "--global-batch-size", type=int)
    g.add_argument("--seed", type=int, default=0, help="profile seed (default: 0)")
    g.add_argument("--step", type=int, default=0, help="training step to draw (default: 0)")
    g.add_argument("--scale", type=float, default=default_scale, metavar="F",
                   help="multiply every length by F, e.g. 0.125 on CPU "
                        f"(default: {default_scale:g})")


def read_lengths_file(path: str) -> list[int]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--lengths-file {path}: no such file")
    try:
        text_all = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--lengths-file {path}: not UTF-8 text (byte {e.start})") from None
    lengths = []
    for lineno, raw in enumerate(text_all.splitlines(), start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: {text!r} is not an integer") from None
        if n <= 0:
            raise ValueError(f"{path}:{lineno}: length {n} must be positive")
        check_length(n, f"{path}:{lineno}")
        lengths.append(n)
    if not lengths:
        raise ValueError(f"{path}: no lengths (empty input)")
    return lengths


def lengths_from_args(args: argparse.Namespace) -> tuple[list[int], str]:
    """The lengths and a one-line description of where they came from."""
    if args.lengths_file:
        return read_lengths_file(args.lengths_file), args.lengths_file
    if args.global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {args.global_batch_size}")
    if not (args.scale > 0 and math.isfinite(args.scale)):
        raise ValueError(f"--scale must be a finite number > 0, got {args.scale}")
    if args.step < 0:
        raise ValueError(f"--step must be >= 0, got {args.step}")
    lengths = sample_lengths(args.profile, args.global_batch_size, args.seed, args.step,
                             args.scale)
    check_length(max(lengths), f"--scale {args.scale:g}")
    return lengths, (f"profile {args.profile}, seed {args.seed}, step {args.step}"
                     + (f", scale {args.scale:g}" if args.scale != 1 else ""))
