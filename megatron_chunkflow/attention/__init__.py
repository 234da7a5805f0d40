"""Varlen, bottom-right causal attention for data chunks: one function, several backends.

Pure torch at import time; flash-attn and Transformer Engine are imported only when their backend
is called.
"""

from megatron_chunkflow.attention.backends import BACKENDS, available_backends, resolve_backend
from megatron_chunkflow.attention.chunk_attention import chunk_attention

__all__ = ["BACKENDS", "available_backends", "chunk_attention", "resolve_backend"]
