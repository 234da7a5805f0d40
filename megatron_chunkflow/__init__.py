"""megatron_chunkflow: ChunkFlow (ICML 2025) long-context fine-tuning for Megatron-LM / megatron-core."""

__version__ = "0.1.0"
