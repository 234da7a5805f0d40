"""SFT data: sources (ShareGPT, JSONL/Parquet conversations or text, Megatron indexed datasets),
tokenizers, the ChatML template with assistant-only loss masks, and length policies."""

from megatron_chunkflow.data.chat import (
    DEFAULT_SYSTEM_MESSAGE,
    BadRecord,
    encode_conversation,
    encode_text,
    encode_tokens,
)
from megatron_chunkflow.data.dataset import (
    OVERLONG_POLICIES,
    SFTDataset,
    default_data_description,
    encode_record,
    open_sft_dataset,
    split_sequence,
)
from megatron_chunkflow.data.sequence import TokenSequence
from megatron_chunkflow.data.sources import iter_records
from megatron_chunkflow.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "BadRecord",
    "DEFAULT_SYSTEM_MESSAGE",
    "OVERLONG_POLICIES",
    "SFTDataset",
    "Tokenizer",
    "TokenSequence",
    "default_data_description",
    "encode_conversation",
    "encode_record",
    "encode_text",
    "encode_tokens",
    "iter_records",
    "load_tokenizer",
    "open_sft_dataset",
    "split_sequence",
]
