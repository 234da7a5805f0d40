"""Where a command's sequence lengths come from: a seeded long-tailed profile (core/profiles.py) or
a lengths file. `chunkflow plan`, `simulate`, `verify` and `bench` derive their length flags from
LengthsConfig, each with its own default batch (cli/: SCENARIO), and `--seed` means the same in
every command: the seed of everything it draws at random.

    lengths, source = LengthsConfig(profile="A", global_batch_size=300).lengths(default_batch=2000)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_chunkflow.core.profiles import PROFILES, ensure_long, sample_lengths
from megatron_chunkflow.flags import MAX_COUNT, MAX_SEED

ProfileName = Literal["A", "B", "C", "dcp"]  # core/profiles.py PROFILES
MAX_LENGTH = 1 << 24  # tokens in one sequence: 16M, 64x a 256K context; planning stays bounded
# sequences in one global batch that plan, simulate and the searches take: 64K, 32x the 2,048 of
# a large SFT step; the plans and searches grow with it, so past it they are refused, not slow
MAX_SEQUENCES = 1 << 16
DEFAULT_PROFILE = "B"
# the flags of a command that takes lengths as drawn (plan, simulate): all but --min-long
AS_DRAWN = ("profile", "lengths_file", "global_batch_size", "seed", "step", "scale")


@dataclass(frozen=True)
class LengthsConfig:
    """The sequence lengths of a command's global batch."""

    profile: ProfileName | None = None
    """Seeded long-tailed length profile (docs/design.md, "Length profiles")."""

    lengths_file: str | None = None
    """The global batch itself: one positive integer per line ('#' starts a comment)."""

    global_batch_size: int | None = field(default=None, metadata={
        "deprecated": ("--num-sequences",), "bounds": (1, MAX_COUNT)})
    """Sequences in the global batch, drawn from --profile."""

    seed: int = field(default=0, metadata={"bounds": (0, MAX_SEED)})
    """Seed of everything the command draws at random: lengths from --profile, token ids, initial
    weights, the data order."""

    step: int = field(default=0, metadata={"bounds": (0, MAX_COUNT)})
    """Training step to draw from --profile (each step draws a new batch)."""

    scale: float = 1.0
    """Multiply every length drawn from --profile by F, e.g. 0.125 on CPU."""

    min_long: int = field(default=0, metadata={"bounds": (0, MAX_COUNT)})
    """Make sure at least N sequences drawn from --profile are long (longer than the command's
    threshold: the chunk size in verify, --seq-length / 8 in bench) by redrawing the last ones
    from the profile's tail."""

    def __post_init__(self):
        if self.lengths_file is not None:
            for flag, given in (("--profile", self.profile is not None),
                                ("--global-batch-size", self.global_batch_size is not None)):
                if given:
                    raise ValueError(f"{flag} draws the lengths; with --lengths-file the file is "
                                     "the global batch: give one of the two")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.global_batch_size is not None and self.global_batch_size > MAX_SEQUENCES:
            raise ValueError(f"--global-batch-size {self.global_batch_size:,}: at most "
                             f"{MAX_SEQUENCES:,} sequences (plans and searches grow with them)")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"--scale must be a finite number > 0, got {self.scale}")
        if self.step < 0:
            raise ValueError(f"--step must be >= 0, got {self.step}")
        if self.min_long < 0:
            raise ValueError(f"--min-long must be >= 0, got {self.min_long}")
        if self.profile is not None and self.profile not in PROFILES:
            raise ValueError(f"--profile {self.profile!r}: choose from {', '.join(PROFILES)}")

    def check_given(self, given: set[str]) -> None:
        """With --lengths-file, the flags that only shape drawn lengths are refused when given
        (not ignored)."""
        if self.lengths_file is None:
            return
        for name in ("scale", "step", "min_long"):
            if name in given:
                raise ValueError(f"--{name.replace('_', '-')} shapes the lengths drawn from "
                                 "--profile; with --lengths-file the file's lengths are used as "
                                 "they are: give one of the two")

    def lengths(self, default_batch: int, long_above: int | None = None,
                step_offset: int = 0) -> tuple[list[int], str]:
        """The lengths, and a one-line description of where they came from; a profile draws
        --global-batch-size sequences (`default_batch` when it is not given) at --step plus
        `step_offset`, --min-long of them longer than `long_above`."""
        if self.lengths_file is not None:
            return read_lengths_file(self.lengths_file), self.lengths_file
        profile = self.profile or DEFAULT_PROFILE
        step = self.step + step_offset
        size = self.global_batch_size or default_batch
        if self.min_long > size and long_above is not None:
            raise ValueError(f"--min-long {self.min_long} is more than the global batch's {size} "
                             "sequences (--global-batch-size)")
        lengths = sample_lengths(profile, size, self.seed, step, self.scale)
        check_length(max(lengths), f"--scale {self.scale:g}")
        if self.min_long and long_above is not None:
            lengths = ensure_long(lengths, profile, long_above, self.min_long,
                                  self.seed + step_offset, self.scale)
        return lengths, (f"profile {profile}, seed {self.seed}, step {step}"
                         + (f", scale {self.scale:g}" if self.scale != 1 else ""))

    @property
    def profile_name(self) -> str:
        return self.profile or DEFAULT_PROFILE


def check_length(n: int, where: str) -> None:
    """ValueError naming `where` for a sequence longer than any command plans."""
    if n > MAX_LENGTH:
        raise ValueError(f"{where}: length {n:,} is more than the {MAX_LENGTH:,} tokens a "
                         "sequence may have here")


def read_lengths_file(path: str) -> list[int]:
    """The lengths in `path`, one per line; ValueError naming the file and line."""
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
        if len(lengths) > MAX_SEQUENCES:
            raise ValueError(f"{path}:{lineno}: more than {MAX_SEQUENCES:,} lengths, the most one "
                             "global batch may have here (plans and searches grow with it)")
    if not lengths:
        raise ValueError(f"{path}: no lengths (empty input)")
    return lengths

