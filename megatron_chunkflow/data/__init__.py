"""SFT data: sources (ShareGPT, JSONL/Parquet conversations or text, Megatron indexed datasets),
tokenizers, the ChatML template with assistant-only loss masks, and length policies."""
