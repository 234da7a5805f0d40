"""The megatron-core layer shared by `chunkflow train`, verify, bench and the Megatron-LM plugin."""
