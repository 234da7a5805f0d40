"""config.json -> ModelShape for each supported family (core/hf_config.py), and what is refused.

    .venv/bin/python -m pytest tests/core/test_hf_config.py -q

The dicts are the released checkpoints' config.json values (transformers 4 layout: rope_theta and
rope_scaling at the top level), so each must give the preset of core/models.py exactly.
"""

import pytest

from megatron_chunkflow.core.hf_config import (
    hf_config_dict,
    model_shape_from_dict,
    shape_from_hf_config,
)
from megatron_chunkflow.core.models import HF_MODELS, get_model_shape

LLAMA31_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
              "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
              "max_position_embeddings": 131072, "head_dim": 128,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192,
                               "rope_type": "llama3"}}
QWEN3_8B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu",
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
            "max_position_embeddings": 40960, "rope_scaling": None, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": 36}
NEMO = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_act": "silu",
        "hidden_size": 5120, "intermediate_size": 14336, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False, "sliding_window": None, "attention_dropout": 0.0,
        "max_position_embeddings": 1024000}


LLAMA32_1B = {**LLAMA31_8B, "hidden_size": 2048, "intermediate_size": 8192,
              "num_hidden_layers": 16, "num_attention_heads": 32, "head_dim": 64,
              "tie_word_embeddings": True, "rope_scaling": {**LLAMA31_8B["rope_scaling"],
                                                            "factor": 32.0}}
QWEN3_06B = {**QWEN3_8B, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "tie_word_embeddings": True, "max_window_layers": 28}
MISTRAL_7B = {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
              "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
              "tie_word_embeddings": False, "sliding_window": None, "attention_dropout": 0.0,
              "max_position_embeddings": 32768}


@pytest.mark.parametrize("config,preset", [
    (LLAMA31_8B, "llama3.1-8b"), (LLAMA32_1B, "llama3.2-1b"), (QWEN3_8B, "qwen3-8b"),
    (QWEN3_06B, "qwen3-0.6b"), (NEMO, "mistral-nemo-12b"), (MISTRAL_7B, "mistral-7b-v0.3")])
def test_released_configs_give_the_presets(config, preset):
    shape = shape_from_hf_config(config, "config.json")
    assert shape == get_model_shape(preset)
    assert model_shape_from_dict(config, "f") == shape  # --model-config reads it the same way


def test_transformers5_layout_is_read_the_same():
    v5 = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    assert shape_from_hf_config(v5, "c") == get_model_shape("llama3.1-8b")


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_every_preset_round_trips_through_its_config(name):
    shape = HF_MODELS[name]
    assert shape_from_hf_config(hf_config_dict(shape), name) == shape


@pytest.mark.parametrize("change,message", [
    ({"model_type": "deepseek_v3"}, "mixture-of-experts architecture that is not supported "
     "(the MoE families supported: qwen3_moe, qwen2_moe, mixtral)"),
    ({"model_type": "qwen3_moe"}, "missing moe_intermediate_size, num_experts, "
     "num_experts_per_tok (a qwen3_moe config.json has them)"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported (supported: 'qwen2'"),
    ({"attention_bias": True}, "attention_bias True is not supported: only Qwen2's bias"),
    ({"mlp_bias": True}, "mlp_bias True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"attention_dropout": 0.1}, "attention_dropout 0.1: training here runs without dropout"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling {'rope_type': 'yarn'"),
    ({"rope_scaling": {**LLAMA31_8B["rope_scaling"], "low_freq_factor": 2.0}},
     "megatron-core 0.16.1 fixes these"),
    ({"head_dim": 0}, "head_dim 0 is not supported: it must be a positive integer"),
    ({"num_key_value_heads": 5}, "num_attention_heads 32 is not a multiple of num_query_groups 5"),
    ({"vocab_size": -1}, "vocab_size -1 is not supported: it must be a positive integer"),
])
def test_llama_config_refusals_name_the_key(change, message):
    with pytest.raises(ValueError, match="^config.json: ") as e:
        shape_from_hf_config({**LLAMA31_8B, **change}, "config.json")
    assert message in str(e.value)


def test_sliding_windows_are_refused():
    with pytest.raises(ValueError, match="sliding_window 4096 is not supported"):
        shape_from_hf_config({**NEMO, "sliding_window": 4096}, "config.json")
    with pytest.raises(ValueError, match="use_sliding_window True is not supported"):
        shape_from_hf_config({**QWEN3_8B, "use_sliding_window": True}, "config.json")


def test_hf_keys_without_model_type_are_named():
    with pytest.raises(ValueError, match="has Hugging Face config.json keys .* but no model_type"):
        model_shape_from_dict({"hidden_size": 64, "num_hidden_layers": 2}, "--model-config f")


def test_our_field_names_refuse_a_shape_no_family_has():
    fields = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
              "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 100}
    assert model_shape_from_dict({**fields, "qk_norm": True, "qkv_bias": False}, "f").qk_norm
    with pytest.raises(ValueError, match="^f: qk_norm with qkv_bias: no supported family"):
        model_shape_from_dict({**fields, "qk_norm": True}, "f")  # qkv_bias defaults to true


def test_qwen3_head_dim_defaults_to_transformers_128():
    """Qwen3Config's head_dim defaults to 128, not hidden / heads (64 for Qwen3-0.6B)."""
    no_head_dim = {k: v for k, v in QWEN3_06B.items() if k != "head_dim"}
    assert shape_from_hf_config(no_head_dim, "c").head_dim == 128


def test_exported_config_keeps_the_presets_positions():
    assert hf_config_dict(get_model_shape("llama3.1-8b"))["max_position_embeddings"] == 131072
    assert hf_config_dict(get_model_shape("qwen3-8b"))["max_position_embeddings"] == 40960
    assert hf_config_dict(get_model_shape("tiny-llama3"))["max_position_embeddings"] == 131072


# the released MoE checkpoints' config.json (Qwen/Qwen3-30B-A3B, Qwen/Qwen2-57B-A14B,
# mistralai/Mixtral-8x7B-v0.1)
QWEN3_30B_A3B = {**QWEN3_8B, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                 "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "max_window_layers": 48,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
                 "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8,
                 "output_router_logits": False, "router_aux_loss_coef": 0.001}
QWEN2_57B_A14B = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
                  "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
                  "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                  "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                  "tie_word_embeddings": False, "use_sliding_window": False,
                  "attention_dropout": 0.0, "max_position_embeddings": 65536,
                  "decoder_sparse_step": 1, "moe_intermediate_size": 2560,
                  "shared_expert_intermediate_size": 20480, "num_experts": 64,
                  "num_experts_per_tok": 8, "norm_topk_prob": False,
                  "router_aux_loss_coef": 0.001}
MIXTRAL_8X7B = {**MISTRAL_7B, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0,
                "output_router_logits": False}


QWEN3_235B_A22B = {**QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288,
                   "num_hidden_layers": 94, "num_attention_heads": 64, "max_window_layers": 94,
                   "moe_intermediate_size": 1536}


@pytest.mark.parametrize("config,preset", [
    (QWEN3_30B_A3B, "qwen3-30b-a3b"), (QWEN3_235B_A22B, "qwen3-235b-a22b"),
    (QWEN2_57B_A14B, "qwen2-57b-a14b"), (MIXTRAL_8X7B, "mixtral-8x7b")])
def test_released_moe_configs_give_the_presets(config, preset):
    assert shape_from_hf_config(config, "config.json") == get_model_shape(preset)


@pytest.mark.parametrize("config,family,dims", [
    (QWEN3_30B_A3B, "qwen3_moe", (48, 2048, 128, 128, 768, 8, True, None, 0.001)),
    (QWEN2_57B_A14B, "qwen2_moe", (28, 3584, 128, 64, 2560, 8, False, 20480, 0.001)),
    (MIXTRAL_8X7B, "mixtral", (32, 4096, 128, 8, 14336, 2, True, None, 0.02))])
def test_released_moe_configs(config, family, dims):
    """Each MoE family's released config.json: its layers, width, head dim, experts, expert width,
    top-k, renormalisation, shared expert and balancing coefficient; the config written back for
    the shape reads as the same shape (transformers 5 writes num_local_experts for all three)."""
    shape = shape_from_hf_config(config, "config.json")
    assert shape.family == family
    assert (shape.num_layers, shape.hidden_size, shape.head_dim, shape.num_experts,
            shape.moe_ffn_hidden_size, shape.moe_topk, shape.moe_norm_topk,
            shape.moe_shared_expert_size, shape.moe_aux_loss_coeff) == dims
    written = hf_config_dict(shape)
    assert written["architectures"] == config["architectures"]
    assert shape_from_hf_config(written, "c") == shape
    v5 = {("num_local_experts" if k == "num_experts" else k): v for k, v in config.items()}
    assert shape_from_hf_config(v5, "c") == shape


@pytest.mark.parametrize("config,change,message", [
    (QWEN3_30B_A3B, {"decoder_sparse_step": 2}, "decoder_sparse_step 2 is not supported: every "
     "layer's MLP is built as an MoE layer"),
    (QWEN2_57B_A14B, {"mlp_only_layers": [0]}, "mlp_only_layers [0] is not supported"),
    (MIXTRAL_8X7B, {"router_jitter_noise": 0.01}, "router_jitter_noise 0.01 is not supported: "
     "training multiplies the router's input by random noise"),
    (QWEN3_30B_A3B, {"num_experts_per_tok": 200}, "num_experts_per_tok 200 is not supported: it "
     "must be at most the 128 experts"),
    (QWEN2_57B_A14B, {"qkv_bias": False}, "qkv_bias False is not supported"),
    (MIXTRAL_8X7B, {"sliding_window": 4096}, "sliding_window 4096 is not supported")])
def test_moe_config_refusals_name_the_key(config, change, message):
    with pytest.raises(ValueError, match="^config.json: ") as e:
        shape_from_hf_config({**config, **change}, "config.json")
    assert message in str(e.value)
