"""ChunkFlow's data iterator for Megatron-LM's training loop (`--dataloader-type external`).

Megatron-LM's train() pulls from the iterator inside forward_backward_func; ChunkFlow's
forward_backward function pulls exactly one `ChunkedStep` per iteration: the global batch of
`--global-batch-size` *sequences* (a seeded shuffle, epoch after epoch, the same on every rank),
cut into chunks, packed, distributed over DP and planned for this pipeline. Every rank (all TP and
PP ranks) plans the same batch, so no plan or shape has to be broadcast; forward_backward_chunkflow
checks the plans' digests over the model-parallel group.

Sources: `--data-path` (one JSONL/JSON/Parquet file of conversations or text, a directory of them,
or a Megatron indexed dataset prefix, each document one sequence), or `--mock-data` (token ids
drawn uniformly, lengths from a named profile of DESIGN.md section 5 scaled so that the profile's
longest sequence is --seq-length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_chunkflow.core.costs import sequence_model_flops
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.profiles import PROFILES, sample_lengths
from megatron_chunkflow.data.sequence import TokenSequence
from megatron_chunkflow.runtime.inputs import plan_step
from megatron_chunkflow.training.loop import BatchSampler


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


@dataclass
class StepStats:
    """What the last planned step holds, for FLOPs and throughput logging."""

    tokens: int = 0  # tokens of the global batch (all DP ranks)
    flops: float = 0.0  # model FLOPs of the global batch: per-sequence attention, no recompute
    chunks: int = 0  # data chunks of the global batch
    reforwarded: float = 0.0  # fraction of this DP rank's chunks re-forwarded in the backward


@dataclass
class ChunkFlowStepIterator:
    """Yields one ChunkedStep per training iteration for this rank's (DP rank, pipeline)."""

    dataset: object
    global_batch_size: int
    seed: int
    chunk_size: int
    k: int
    num_stages: int
    dp_size: int
    dp_rank: int
    shape: ModelShape
    pad_multiple: int = 1
    consumed: int = 0  # sequences consumed so far (Megatron-LM's consumed_train_samples)
    last: StepStats = field(default_factory=StepStats)

    def __post_init__(self):
        self._sampler = BatchSampler(len(self.dataset), self.global_batch_size, self.seed)

    def __iter__(self):
        return self

    def __next__(self):
        sequences = [self.dataset[i] for i in self._sampler.batch_at(self.consumed)]
        self.consumed += self.global_batch_size
        step, batch, _ = plan_step(sequences, self.chunk_size, self.k, self.num_stages,
                                   self.dp_size, self.dp_rank, self.shape, self.pad_multiple)
        lengths = [len(s) for s in sequences]
        self.last = StepStats(
            tokens=sum(lengths), flops=sequence_model_flops(lengths, self.shape),
            chunks=len(batch.chunks),
            reforwarded=len(step.plan.recomputed) / max(1, len(step.metas)))
        return step
