"""Where a data set's token ids live, and a global batch that reads only what a rank uses.

Every rank plans the whole global batch, but planning needs only lengths: `LazyBatch` gives the
planner the batch's lengths (`batch_lengths`) and reads a sequence's ids only when this rank
builds a chunk of it. The ids themselves live in one of two stores:

- `PackedSamples`: sequences that had to be tokenized (conversations, text), kept as one int32
  array of ids, one byte per loss-mask entry and an offset per sequence (5 bytes per token,
  instead of a pair of tensors per sequence at 12 bytes per token);
- `IndexedSamples`: a Megatron indexed dataset (PREFIX.bin/.idx), memory-mapped: nothing is
  read at open but the index, and a vectorised pass over the mapped ids that checks their range
  (pages the kernel may drop at once), so a rank holds only the ids of its current chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron_chunkflow.data.sequence import TokenSequence
from megatron_chunkflow.data.sources import check_indexed


class PackedSamples:
    """Tokenized sequences appended one by one, stored compactly (see the module docstring)."""

    def __init__(self):
        self._tokens: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._lengths: list[int] = []
        self._offsets = self._flat_tokens = self._flat_masks = None

    def append(self, seq: TokenSequence) -> None:
        self._tokens.append(seq.tokens.numpy().astype(np.int32))
        self._masks.append(seq.loss_mask.numpy().astype(np.uint8))
        self._lengths.append(len(seq))

    def finish(self) -> "PackedSamples":
        """Concatenate what was appended; the per-sequence arrays are released."""
        lengths = np.asarray(self._lengths, dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)])
        self._flat_tokens = np.concatenate(self._tokens) if self._tokens else np.zeros(0, np.int32)
        self._flat_masks = np.concatenate(self._masks) if self._masks else np.zeros(0, np.uint8)
        self._tokens, self._masks = [], []
        self.lengths = self._lengths = lengths
        return self

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, index: int) -> TokenSequence:
        a, b = int(self._offsets[index]), int(self._offsets[index + 1])
        return TokenSequence(torch.from_numpy(self._flat_tokens[a:b].astype(np.int64)),
                             torch.from_numpy(self._flat_masks[a:b].astype(np.float32)))

    @property
    def max_token_id(self) -> int:
        return int(self._flat_tokens.max()) if self._flat_tokens.size else -1


class IndexedSamples:
    """Pieces (document, first token, length) of a memory-mapped Megatron indexed dataset; every
    target counts but a piece's last (its target is not in the piece)."""

    def __init__(self, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 max_token_id: int):
        self._ids = ids  # the whole .bin, memory-mapped
        self._starts = starts
        self.lengths = lengths
        self.max_token_id = max_token_id  # found by the range check at open

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> TokenSequence:
        a = int(self._starts[index])
        n = int(self.lengths[index])
        tokens = torch.from_numpy(np.array(self._ids[a:a + n], dtype=np.int64))
        mask = torch.ones(n, dtype=torch.float32)
        mask[-1] = 0
        return TokenSequence(tokens, mask)


def map_indexed(prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, first token of each document, document lengths) of PREFIX.bin/.idx, ids
    memory-mapped. A document is its sequences' tokens, which the builder writes one after
    another; ValueError if this file's are not."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    check_indexed(prefix)
    index = IndexedDataset(prefix, mmap=True).index
    seq_lengths = np.asarray(index.sequence_lengths, dtype=np.int64)
    pointers = np.asarray(index.sequence_pointers, dtype=np.int64)
    itemsize = np.dtype(index.dtype).itemsize
    ends = np.concatenate([[0], np.cumsum(seq_lengths)])
    if not np.array_equal(pointers, ends[:-1] * itemsize):
        raise ValueError(f"--data-path {prefix}: the sequences in {prefix}.bin are not stored "
                         "one after another, as Megatron's IndexedDatasetBuilder writes them")
    bounds = np.asarray(index.document_indices, dtype=np.int64)
    ids = np.memmap(f"{prefix}.bin", dtype=index.dtype, mode="r", shape=(int(ends[-1]),))
    return ids, ends[bounds[:-1]], ends[bounds[1:]] - ends[bounds[:-1]]


def document_id_ranges(ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(lowest, highest) id of every document (0, -1 for an empty one), in one vectorised pass
    over the mapped ids."""
    low = np.zeros(len(lengths), dtype=np.int64)
    top = np.full(len(lengths), -1, dtype=np.int64)
    full = np.flatnonzero(lengths > 0)
    if full.size:  # empty documents hold no ids, so each slice is exactly one document's
        low[full] = np.minimum.reduceat(ids, starts[full])
        top[full] = np.maximum.reduceat(ids, starts[full])
    return low, top


class LazyBatch(Sequence):
    """The global batch `indices` of `samples`: lengths at once, a sequence's ids when first
    indexed (kept for the step)."""

    def __init__(self, samples, indices):
        self._samples, self._indices = samples, list(indices)
        self.lengths = [int(samples.lengths[i]) for i in self._indices]
        self._read: dict[int, TokenSequence] = {}

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, j: int) -> TokenSequence:
        if j not in self._read:
            self._read[j] = self._samples[self._indices[j]]
        return self._read[j]

    @property
    def num_read(self) -> int:
        """Sequences whose ids were read so far."""
        return len(self._read)


def global_batch(dataset, indices):
    """The samples `indices` of `dataset`: a LazyBatch where the dataset can give one (an
    SFTDataset), else the sequences themselves (a list of TokenSequence, synthetic data)."""
    batch = getattr(dataset, "batch", None)
    return batch(indices) if batch is not None else [dataset[i] for i in indices]


def batch_lengths(sequences) -> list[int]:
    """Lengths of a global batch without reading its ids where it is a LazyBatch."""
    lengths = getattr(sequences, "lengths", None)
    return list(lengths) if lengths is not None else [len(s) for s in sequences]
