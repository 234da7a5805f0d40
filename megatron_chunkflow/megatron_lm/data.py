"""ChunkFlow's data iterator for Megatron-LM's training loop (`--dataloader-type external`).

Megatron-LM's train() pulls from the iterator inside forward_backward_func; ChunkFlow's
forward_backward function pulls exactly one `ChunkedStep` per iteration: the global batch of
`--global-batch-size` *sequences* (a seeded shuffle, epoch after epoch, the same on every rank),
cut into chunks, packed, distributed over DP and planned for this pipeline. Every rank (all TP and
PP ranks) plans the same batch, so no plan or shape has to be broadcast; forward_backward_chunkflow
checks the plans' digests over the model-parallel group.

Sources: `--data-path` (one JSONL/JSON/Parquet file of conversations or text, a directory of them,
or a Megatron indexed dataset prefix, each document one sequence), or `--mock-data` (token ids
drawn uniformly, lengths from a named profile of core/profiles.py scaled so that the profile's
longest sequence is --seq-length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.costs import sequence_model_flops
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.data.sampler import BatchSampler
from megatron_chunkflow.data.store import batch_lengths, global_batch
from megatron_chunkflow.runtime.execute import plan_step
from megatron_chunkflow.runtime.ranks import Ranks


@dataclass
class StepStats:
    """What the last planned step holds, for FLOPs and throughput logging."""

    tokens: int = 0  # tokens of the global batch (all DP ranks)
    flops: float = 0.0  # model FLOPs of the global batch: per-sequence attention, no recompute
    chunks: int = 0  # data chunks of the global batch
    reforwarded: float = 0.0  # fraction of this DP rank's chunks re-forwarded in the backward


@dataclass
class ChunkFlowStepIterator:
    """Yields one ChunkedStep per training iteration for this rank's (DP rank, CP rank, pipeline)."""

    dataset: object
    global_batch_size: int
    seed: int
    chunkflow: ChunkFlowConfig
    parallel: ParallelConfig
    ranks: Ranks  # this process's DP rank (its chunks) and CP rank (its share of every chunk)
    shape: ModelShape
    consumed: int = 0  # sequences consumed so far (Megatron-LM's consumed_train_samples)
    last: StepStats = field(default_factory=StepStats)

    def __post_init__(self):
        self._sampler = BatchSampler(len(self.dataset), self.global_batch_size, self.seed)

    def __iter__(self):
        return self

    def __next__(self):
        sequences = global_batch(self.dataset, self._sampler.batch_at(self.consumed))
        self.consumed += self.global_batch_size
        step = plan_step(sequences, self.chunkflow, self.parallel, self.shape, self.ranks)
        lengths = batch_lengths(sequences)
        self.last = StepStats(
            tokens=sum(lengths), flops=sequence_model_flops(lengths, self.shape),
            chunks=len(step.batch.chunks),
            reforwarded=len(step.plan.recomputed) / max(1, len(step.metas)))
        return step
