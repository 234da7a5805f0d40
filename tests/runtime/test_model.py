"""apply_chunkflow's checks of the Megatron model config (runtime/model.py)."""

import pytest


def test_unsupported_megatron_settings_are_refused():
    """Fused RoPE and dropout would give wrong results: apply_chunkflow refuses them (context
    parallelism it runs: runtime/cp.py)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_chunkflow.runtime.model import _check_config

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, apply_rope_fusion=False,
                hidden_dropout=0.0, attention_dropout=0.0)
    _check_config(TransformerConfig(**{**base, "context_parallel_size": 2}))
    fused = TransformerConfig(**base)
    fused.apply_rope_fusion = True  # as Megatron-LM sets it by default on GPU machines
    with pytest.raises(ValueError, match="--no-rope-fusion"):
        _check_config(fused)
    with pytest.raises(ValueError, match="--hidden-dropout 0.1 --attention-dropout 0: ChunkFlow "
                                         "re-forwards chunks"):
        _check_config(TransformerConfig(**{**base, "hidden_dropout": 0.1}))
    _check_config(TransformerConfig(**base))
