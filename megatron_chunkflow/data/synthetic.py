"""Synthetic sequences: random token ids with an SFT-like loss mask (checks, tests, benchmarks), and
`MockSFTDataset`, a dataset of them with lengths from a named profile (`--mock-data`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron_chunkflow.core.profiles import PROFILES, sample_lengths
from megatron_chunkflow.data.sequence import TokenSequence


def make_sequences(lengths: Sequence[int], vocab_size: int, seed: int,
                   prompt_fraction: float = 0.3,
                   fully_masked: Sequence[int] = ()) -> list[TokenSequence]:
    """Random tokens; an SFT-like loss mask: the first `prompt_fraction` of targets masked, and
    every target of the sequences in `fully_masked` (prompt-only samples)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        tokens = torch.randint(0, vocab_size, (n,), generator=g)
        mask = torch.ones(n)
        mask[: int(n * prompt_fraction)] = 0
        mask[-1] = 0  # the last token has no target
        if i in fully_masked:
            mask.zero_()
        out.append(TokenSequence(tokens, mask))
    return out


class MockSFTDataset(torch.utils.data.Dataset):
    """`--mock-data`: `num_samples` sequences of random token ids, every target counted; lengths
    from `profile` scaled so that its longest possible sequence is `seq_length`."""

    def __init__(self, profile: str, num_samples: int, seq_length: int, vocab_size: int,
                 seed: int):
        pr = PROFILES[profile]
        longest = pr.tail_hi if pr.tail_p > 0 else pr.body_hi
        self.scale = seq_length / longest
        lengths = sample_lengths(profile, num_samples, seed, scale=self.scale)
        self._lengths = [min(seq_length, max(2, n)) for n in lengths]
        self.vocab_size, self.seed = vocab_size, seed
        self.description = (f"mock data: profile {profile} lengths x {self.scale:.4g} "
                            f"(longest {seq_length}), random token ids < {vocab_size}")

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, index: int) -> TokenSequence:
        rng = np.random.default_rng([self.seed, index])
        n = self._lengths[index]
        tokens = torch.from_numpy(rng.integers(0, self.vocab_size, n, dtype=np.int64))
        mask = torch.ones(n, dtype=torch.float32)
        mask[-1] = 0
        return TokenSequence(tokens, mask)

    @property
    def lengths(self) -> list[int]:
        return list(self._lengths)
