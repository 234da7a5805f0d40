"""Hugging Face import/export under Transformer Engine's layer spec (Megatron-LM's GPU default):
the fused norm weights map to the local spec's names, as megatron-core's own TE state-dict hook
renames them (post_training/modelopt/gpt/state_dict_hooks.py)."""

import inspect

from megatron_chunkflow.mcore.hf import TE_NAMES, local_spec_name


def test_te_fused_norm_names_map_to_local_names():
    assert (local_spec_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight")
            == "decoder.layers.3.input_layernorm.weight")
    assert (local_spec_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
            == "decoder.layers.0.pre_mlp_layernorm.weight")
    for name in ("decoder.layers.0.self_attention.linear_qkv.weight",
                 "decoder.layers.0.input_layernorm.weight", "decoder.final_layernorm.weight",
                 "embedding.word_embeddings.weight"):
        assert local_spec_name(name) == name


def test_mapping_agrees_with_megatron_core():
    from megatron.core.post_training.modelopt.gpt import state_dict_hooks

    source = inspect.getsource(state_dict_hooks)
    for te, local in TE_NAMES.items():
        assert f'("{te}", "{local}")' in source
