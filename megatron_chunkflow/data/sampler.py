"""BatchSampler: which dataset samples form each global batch, the same on every rank."""

from __future__ import annotations

import numpy as np


class BatchSampler:
    """Global batches of dataset indices: a fresh seeded permutation each epoch; the position is
    the number of sequences consumed, which is what a checkpoint stores."""

    def __init__(self, num_samples: int, batch_size: int, seed: int):
        self.n, self.batch, self.seed = num_samples, batch_size, seed
        self._epoch, self._order = -1, None

    def _permutation(self, epoch: int):
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._order

    def batch_at(self, consumed: int) -> list[int]:
        """The indices of the global batch that starts after `consumed` sequences."""
        out = []
        for pos in range(consumed, consumed + self.batch):
            epoch, offset = divmod(pos, self.n)
            out.append(int(self._permutation(epoch)[offset]))
        return out
