"""BenchSettings: what one `chunkflow bench` comparison runs, and where its lengths come from.

    lengths, source = bench_lengths(LengthsConfig(scale=1 / 8, min_long=1), sharegpt=False,
                                    seq_length=32768, default_batch=256)
    s = BenchSettings(shape=..., model_name="tiny-bench", lengths=lengths, seq_length=32768,
                      budget_bytes=2**30, parallel=ParallelConfig(pp=2, dp=1))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig, Recompute
from megatron_chunkflow.core.lengths import LengthsConfig
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.step import BASELINES, baseline_microbatches

MIB = 2.0**20


@dataclass
class BenchSettings:
    """What one comparison runs: model, batch, layout, budgets, baselines, repeats. Every rule that
    ties two of its flags together is checked here (ValueError naming them)."""

    shape: ModelShape
    model_name: str
    lengths: list[int]
    seq_length: int
    budget_bytes: float
    chunkflow_budget_bytes: float | None = None  # ChunkFlow's own budget (None: budget_bytes)
    chunk_size: int | None = None  # None: chosen by the budget
    num_kept: int | None = None  # None: chosen by the budget
    attention_backend: str = "auto"  # every system's kernel
    baselines: tuple[str, ...] = BASELINES  # the stock systems compared with ChunkFlow
    megatron_recompute: str = "auto"  # auto (by the budget) or a Recompute text form
    chunkflow_recompute: str = "auto"  # the same, inside ChunkFlow's chunks
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(pp=2))
    warmup: int = 1
    repeats: int = 2
    seed: int = 0
    threads: int = 1
    caching_malloc: bool = True  # instrument.cache_freed_memory in every rank

    def __post_init__(self):
        for flag, value, low in (("--seq-length", self.seq_length, 2),
                                 ("--warmup", self.warmup, 0), ("--repeats", self.repeats, 1),
                                 ("--threads", self.threads, 1)):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}, got {value}")
        # --chunk-size and --chunkflow-k may be left to the budget (None): check the given ones
        ChunkFlowConfig(1 if self.chunk_size is None else self.chunk_size,
                        1 if self.num_kept is None else self.num_kept, self.attention_backend)
        for flag, value in (("--budget-mib", self.budget_bytes),
                            ("--chunkflow-budget-mib", self.chunkflow_budget_bytes)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value / MIB:g}")
        if self.chunk_size is not None and self.chunk_size > self.seq_length:
            raise ValueError(f"--chunk-size {self.chunk_size} is larger than --seq-length "
                             f"{self.seq_length}")
        self.parallel.check_model(self.shape)
        for flag in ("--megatron-recompute", "--chunkflow-recompute"):
            value = getattr(self, flag[2:].replace("-", "_"))
            if value != "auto":
                Recompute.parse(value, flag).check_layers(
                    self.shape.num_layers // self.parallel.pp, flag)
        if self.parallel.dp is not None:
            self._check_every_rank_has_work(self.parallel.dp)

    def _check_every_rank_has_work(self, dp: int) -> None:
        for name in self.baselines:
            if len(baseline_microbatches(self.lengths, self.seq_length, dp, name)) < dp:
                raise ValueError(f"the batch ({len(self.lengths)} sequences, "
                                 f"--global-batch-size) packs into fewer {name} micro-batches "
                                 f"of --seq-length {self.seq_length} than the {dp} "
                                 "data-parallel ranks: stock Megatron would leave a rank idle")

    @property
    def chunkflow_budget(self) -> float:
        return self.budget_bytes if self.chunkflow_budget_bytes is None \
            else self.chunkflow_budget_bytes


def bench_lengths(lengths: LengthsConfig, sharegpt: bool, seq_length: int,
                  default_batch: int) -> tuple[list[int], str]:
    """The comparison's batch: the first --global-batch-size ShareGPT conversations (--sharegpt)
    or --profile / --lengths-file; --min-long of them longer than --seq-length / 8; every length
    cut to --seq-length (the run's context), the description saying how many were."""
    if sharegpt:
        if lengths.lengths_file:
            raise ValueError("--sharegpt and --lengths-file are two sources of lengths; give one")
        out, source = sharegpt_lengths(lengths.global_batch_size or default_batch, lengths.scale)
        if lengths.min_long:
            from megatron_chunkflow.core.profiles import ensure_long

            out = ensure_long(out, lengths.profile_name, seq_length // 8, lengths.min_long,
                              lengths.seed, lengths.scale)
    else:
        out, source = lengths.lengths(default_batch, long_above=seq_length // 8)
    truncated = sum(n > seq_length for n in out)
    return ([min(n, seq_length) for n in out],
            source + (f"; {truncated} truncated to --seq-length" if truncated else ""))


def sharegpt_lengths(num_sequences: int, scale: float) -> tuple[list[int], str]:
    """Token counts of the first ShareGPT conversations (the train command's default data)."""
    from megatron_chunkflow.data import load_tokenizer, open_sft_dataset

    data = open_sft_dataset(None, load_tokenizer(None), seq_length=1 << 30,
                            max_samples=num_sequences)
    lengths = [max(2, round(n * scale)) for n in data.lengths]
    return lengths, f"ShareGPT, first {len(lengths)} conversations, scale {scale:g}"
