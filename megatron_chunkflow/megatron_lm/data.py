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
longest sequence is --seq-length). Validation (--eval-iters) runs another iterator of the same
kind, forward only, on the --split share of --data-path that Megatron-LM would hold out
(SequenceRange), or on mock sequences of another seed.
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


class SequenceRange:
    """Sequences start .. stop - 1 of a dataset (Megatron-LM's --split: contiguous ranges)."""

    def __init__(self, dataset, start: int, stop: int):
        self.dataset, self.start, self.stop = dataset, start, stop
        self.description = getattr(dataset, "description", "")

    @classmethod
    def of(cls, dataset, bounds: tuple[float, float] | None) -> SequenceRange | None:
        """The range of `dataset` that a split matrix entry (fractions, or None) covers, rounded
        as Megatron's dataset builder rounds them."""
        if bounds is None:
            return None
        n = len(dataset)
        return cls(dataset, int(round(bounds[0] * n)), int(round(bounds[1] * n)))

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.dataset[self.start + index]

    def batch(self, indices):
        return global_batch(self.dataset, [self.start + i for i in indices])


@dataclass
class StepStats:
    """What the last planned step holds, for FLOPs and throughput logging."""

    tokens: int = 0  # tokens of the global batch (all DP ranks)
    flops: float = 0.0  # model FLOPs of the global batch: per-sequence attention, no recompute
    chunks: int = 0  # data chunks of the global batch
    reforwarded: float = 0.0  # fraction of this DP rank's chunks re-forwarded in the backward


@dataclass
class ChunkFlowStepIterator:
    """Yields one ChunkedStep per iteration (training, or validation) for this rank's DP rank, CP
    rank and pipeline."""

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

    def next_lengths(self) -> list[int]:
        """The lengths of the global batch the next step takes (without taking it)."""
        return batch_lengths(global_batch(self.dataset, self._sampler.batch_at(self.consumed)))

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


def open_datasets(a):
    """(training, validation or None, how they were split, for the data line): --mock-data draws
    the validation sequences with another seed; --data-path is split into contiguous ranges of
    its sequences by --split, as Megatron-LM splits documents (the test share is not used)."""
    if a.mock_data:
        from megatron_chunkflow.data.synthetic import MockSFTDataset

        vocab = true_vocab_size(a)
        train, valid = (MockSFTDataset(a.chunkflow_mock_profile, a.global_batch_size * max(n, 1),
                                       a.seq_length, vocab, seed)
                        for n, seed in ((a.train_iters, a.seed), (a.eval_iters, a.seed + 1)))
        return train, valid, ""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from megatron_chunkflow.data.dataset import open_sft_dataset
    from megatron_chunkflow.megatron_lm.args import LaunchError
    from megatron_chunkflow.megatron_lm.tokenizers import data_tokenizer

    try:
        tokenizer = data_tokenizer(a, true_vocab_size(a), _megatron_tokenizer())
        dataset = open_sft_dataset(a.data_path[0], tokenizer, seq_length=a.seq_length,
                                   overlong=a.overlong, skip_bad_records=a.skip_bad_records)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(a.split))
    train, valid = (SequenceRange.of(dataset, bounds) for bounds in matrix[:2])
    if train is None or not len(train):
        raise LaunchError(f"--split {a.split} leaves no training sequences of the "
                          f"{len(dataset)} in --data-path {a.data_path[0]}")
    return train, valid, f" (--split {a.split} of {len(dataset)})"


def _megatron_tokenizer():
    """The tokenizer Megatron built from --tokenizer-type (its chat template, if it has one, is
    what --data-path conversations go through); None where it built none."""
    from megatron.training import get_tokenizer

    try:
        return get_tokenizer()
    except Exception:  # noqa: BLE001  Megatron asserts the global was initialized
        return None


def true_vocab_size(a) -> int:
    """Ids the data may use: the tokenizer's vocabulary (Megatron pads the model's beyond it)."""
    from megatron.training import get_tokenizer

    try:
        return int(get_tokenizer().vocab_size)
    except Exception:  # noqa: BLE001  tokenizers without vocab_size: the model's rows
        return int(a.padded_vocab_size)


def loss_vocab_size(a) -> int:
    """The vocabulary ChunkFlow's loss is taken over: --chunkflow-load-hf's config.json vocabulary
    (the Hugging Face model's softmax), else the tokenizer's; the rows Megatron pads beyond it are
    masked (stock Megatron-LM keeps them in its softmax)."""
    if a.chunkflow_load_hf:
        from megatron_chunkflow.mcore.hf import shape_from_hf_dir

        return shape_from_hf_dir(a.chunkflow_load_hf).vocab_size
    return true_vocab_size(a)
