"""Seeded long-tailed length profiles (docs/design.md, "Length profiles").

Body: lognormal with median 800 tokens and sigma 0.7, clipped to [16, 8192]. Tail: each sequence is,
with probability p, drawn log-uniformly on [tail_lo, tail_hi] instead.

  A    p = 0.5%,  tail on [8K, 32K]
  B    p = 0.2%,  tail on [8K, 256K]
  C    p = 0.11%, tail on [16K, 96K]   (Llama-3-like: 99.89% short, long ones ~37K on average)
  dcp  Megatron's dynamic-CP benchmark: lognormal with mean 1024 and sigma 1.5 (so mu =
       ln(1024) - sigma^2 / 2), clipped to [128, 8192]; no tail.

`scale` multiplies every length (for CPU runs, e.g. 1/8), rounding and keeping at least 1 token.
Draws depend only on (profile, seed, step), so every rank can regenerate a step's lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

K = 1024


@dataclass(frozen=True)
class Profile:
    name: str
    body_median: float
    body_sigma: float
    body_lo: int
    body_hi: int
    tail_p: float = 0.0
    tail_lo: int = 0
    tail_hi: int = 0


PROFILES = {
    "A": Profile("A", 800, 0.7, 16, 8 * K, 0.005, 8 * K, 32 * K),
    "B": Profile("B", 800, 0.7, 16, 8 * K, 0.002, 8 * K, 256 * K),
    "C": Profile("C", 800, 0.7, 16, 8 * K, 0.0011, 16 * K, 96 * K),
    "dcp": Profile("dcp", 1024 * math.exp(-1.5**2 / 2), 1.5, 128, 8 * K),
}


def sample_lengths(profile: str, num_sequences: int, seed: int, step: int = 0,
                   scale: float = 1.0) -> list[int]:
    """Draw `num_sequences` lengths of a named profile for (seed, step)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose from {', '.join(PROFILES)}")
    if num_sequences < 1:
        raise ValueError(f"number of sequences must be >= 1, got {num_sequences}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    pr = PROFILES[profile]
    rng = np.random.default_rng([seed, step])
    body = rng.lognormal(math.log(pr.body_median), pr.body_sigma, num_sequences)
    lengths = np.clip(body, pr.body_lo, pr.body_hi)
    if pr.tail_p > 0:
        is_tail = rng.random(num_sequences) < pr.tail_p
        tail = np.exp(rng.uniform(math.log(pr.tail_lo), math.log(pr.tail_hi), num_sequences))
        lengths = np.where(is_tail, tail, lengths)
    return [max(1, int(round(x * scale))) for x in lengths]


def ensure_long(lengths: list[int], profile: str, chunk_size: int, min_long: int, seed: int,
                scale: float = 1.0) -> list[int]:
    """Redraw the last sequences so that at least `min_long` are longer than `chunk_size`.

    Small batches of a 0.2% tail rarely contain a long sequence; checks of chunked training need
    one. Redrawn lengths are log-uniform on [max(C + 1, scaled tail start), max(scaled tail end,
    4C)], seeded, so the batch stays reproducible.
    """
    have = sum(1 for n in lengths if n > chunk_size)
    if have >= min_long:
        return list(lengths)
    pr = PROFILES[profile]
    lo = max(chunk_size + 1, int(pr.tail_lo * scale))
    hi = max(int(pr.tail_hi * scale), 4 * chunk_size)
    rng = np.random.default_rng([seed, 1 << 20])
    out = list(lengths)
    replace = [i for i in range(len(out) - 1, -1, -1) if out[i] <= chunk_size][: min_long - have]
    for i in replace:
        out[i] = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    return out
