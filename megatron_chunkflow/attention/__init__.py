"""Varlen, bottom-right causal attention for data chunks: one function, several backends.

Pure torch at import time; flash-attn and Transformer Engine are imported only when their backend
is called.
"""

from megatron_chunkflow.attention.backends import BACKENDS, available_backends, resolve_backend
from megatron_chunkflow.attention.chunk_attention import chunk_attention
from megatron_chunkflow.attention.lse import (
    attention_backward,
    attention_with_lse,
    lse_by_token,
    lse_pair,
    merge_lse,
)

__all__ = ["BACKENDS", "attention_backward", "attention_with_lse", "available_backends",
           "chunk_attention", "lse_by_token", "lse_pair", "merge_lse", "resolve_backend"]
