"""TokenSequence: one tokenized training sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenSequence:
    """Token ids and a loss mask aligned with the *targets*: loss_mask[t] = 1 when predicting token
    t+1 from tokens[:t+1] counts (an assistant token in SFT). The last position has no target and is
    always 0."""

    tokens: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] float32, target-aligned; loss_mask[L-1] == 0

    def __len__(self) -> int:
        return self.tokens.numel()
