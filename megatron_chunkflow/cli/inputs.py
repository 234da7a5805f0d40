"""Sequence lengths for the CLI: a seeded profile or a lengths file."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_chunkflow.config import deprecated_alias
from megatron_chunkflow.core.profiles import PROFILES, sample_lengths


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
    lengths = []
    for lineno, raw in enumerate(p.read_text().splitlines(), start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: {text!r} is not an integer") from None
        if n <= 0:
            raise ValueError(f"{path}:{lineno}: length {n} must be positive")
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
    if not args.scale > 0:
        raise ValueError(f"--scale must be > 0, got {args.scale}")
    lengths = sample_lengths(args.profile, args.global_batch_size, args.seed, args.step,
                             args.scale)
    return lengths, (f"profile {args.profile}, seed {args.seed}, step {args.step}"
                     + (f", scale {args.scale:g}" if args.scale != 1 else ""))
