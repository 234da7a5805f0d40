"""A Hugging Face config.json -> ModelShape, for the families the package builds, refusing what it
cannot build exactly (pure: no torch, no transformers).

    shape = shape_from_hf_config(json.load(open("config.json")), "config.json")

| model_type | what differs                                   | refused                            |
|------------|------------------------------------------------|------------------------------------|
| qwen2      | bias on Q/K/V (always)                         | use_sliding_window true            |
| qwen3      | QK RMSNorm per head, head_dim (128) != h / nh  | attention_bias, sliding window     |
| llama      | rope_type "llama3" frequency scaling           | attention_bias, mlp_bias           |
| mistral    | head_dim may differ from h / nh (Nemo)         | a sliding_window that is not null  |
| qwen3_moe  | qwen3's attention; every MLP a routed MoE      | decoder_sparse_step != 1, dense    |
|            | (num_experts, num_experts_per_tok,             | mlp_only_layers, sliding window    |
|            | moe_intermediate_size, norm_topk_prob)         |                                    |
| qwen2_moe  | qwen2's attention; MoE plus a shared expert    | the same, qkv_bias false           |
|            | gated by a sigmoid                             |                                    |
| mixtral    | mistral's attention; num_local_experts of      | router_jitter_noise, a sliding     |
|            | intermediate_size, top-k renormalised          | window                             |

Every family: hidden_act silu, attention_dropout 0, plain or "llama3" RoPE (YaRN, linear and
dynamic scaling are refused). The MoE families' router_aux_loss_coef becomes the coefficient of the
per-sequence balancing loss ChunkFlow keeps exact (runtime/moe.py); other MoE architectures
(DeepSeek, Llama 4) are refused by model_type.
"""

from __future__ import annotations

import dataclasses

from megatron_chunkflow.core.models import (
    HF_CARDS,
    HF_MODELS,
    LLAMA3_ROPE_FIXED,
    ModelShape,
    check_shape,
    field_problem,
    get_model_shape,
)

FAMILIES = {"qwen2": "Qwen2 / Qwen2.5", "qwen3": "Qwen3 (dense)", "llama": "Llama 3.x",
            "mistral": "Mistral / Mistral Nemo", "qwen3_moe": "Qwen3-MoE",
            "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral"}
OTHER_MOE = {"deepseek_v2", "deepseek_v3", "llama4", "glm4_moe", "gpt_oss"}
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}

# config.json keys -> ModelShape fields
HF_SHAPE_KEYS = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups",
    "vocab_size": "vocab_size",
    "tie_word_embeddings": "tie_embeddings",
    "rms_norm_eps": "norm_eps",
}


def rope_parameters(d: dict) -> dict:
    """RoPE settings wherever the transformers version put them: rope_parameters (5.x, theta
    inside) or rope_scaling (4.x, theta at the top level)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return {"rope_type": repr(rope)}
    return rope


def shape_from_hf_config(d: dict, source: str) -> ModelShape:
    """The ModelShape of a config.json dict; ValueError naming `source` and the key otherwise."""
    kind = d.get("model_type")
    if kind in OTHER_MOE:
        raise ValueError(f"{source}: model_type {kind!r} is a mixture-of-experts architecture "
                         "that is not supported (the MoE families supported: qwen3_moe, "
                         "qwen2_moe, mixtral)")
    if kind not in FAMILIES:
        raise ValueError(f"{source}: model_type {kind!r} is not supported (supported: "
                         + ", ".join(f"{k!r} ({v})" for k, v in FAMILIES.items()) + ")")
    _refuse(source, d.get("hidden_act", "silu") != "silu", "hidden_act", d.get("hidden_act"),
            "the MLP must be SwiGLU (silu)")
    dropout = d.get("attention_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or dropout != 0:
        raise ValueError(f"{source}: attention_dropout {dropout!r}: training here runs without "
                         "dropout (a re-forwarded chunk would draw a new mask, so its gradients "
                         "would not be exact), and the model would train unlike its config says; "
                         "set it to 0.0 in config.json (the released checkpoints have 0.0)")
    if kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        _refuse(source, d.get("use_sliding_window", False), "use_sliding_window", True,
                "Megatron's GPT model has no sliding-window attention")
    if kind in ("mistral", "mixtral"):
        _refuse(source, d.get("sliding_window") is not None, "sliding_window",
                d.get("sliding_window"), "Megatron's GPT model has no sliding-window attention "
                "(Mistral-7B-v0.1's 4096; v0.3, Nemo and Mixtral have null)")
    if kind == "qwen2_moe":
        _refuse(source, d.get("qkv_bias", True) is not True, "qkv_bias", d.get("qkv_bias"),
                "Qwen2-MoE is built with its bias on Q/K/V")
    if kind not in ("qwen2", "qwen2_moe"):
        for key in ("attention_bias", "mlp_bias"):
            _refuse(source, d.get(key, False), key, d.get(key),
                    "only Qwen2's bias on Q/K/V is built (no bias on the output or MLP)")
    rope = rope_parameters(d)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    factor = None
    if rope_type == "llama3":
        fixed = {k: rope.get(k) for k in LLAMA3_ROPE_FIXED}
        if fixed != LLAMA3_ROPE_FIXED:
            raise ValueError(f"{source}: llama3 RoPE scaling with {fixed}: megatron-core 0.16.1 "
                             f"fixes these at {LLAMA3_ROPE_FIXED} (only the factor is a setting)")
        factor = rope.get("factor")
        _refuse(source, not isinstance(factor, (int, float)) or factor <= 0,
                "rope_scaling.factor", factor, "it must be a positive number")
    elif rope_type != "default":
        raise ValueError(f"{source}: RoPE scaling {rope!r} is not supported (plain RoPE, or "
                         "Llama 3's rope_type 'llama3')")
    kw = {field: d[key] for key, field in HF_SHAPE_KEYS.items() if key in d}
    kw.setdefault("num_query_groups", d.get("num_attention_heads"))  # no GQA: one per head
    kw["rotary_base"] = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    kw.update(qkv_bias=kind in ("qwen2", "qwen2_moe"), qk_norm=kind in ("qwen3", "qwen3_moe"),
              rope_scaling_factor=None if factor is None else float(factor))
    if kind in ("qwen3_moe", "qwen2_moe", "mixtral"):
        kw.update(_moe_fields(d, kind, source))
    missing = sorted(k for k, f in HF_SHAPE_KEYS.items() if f not in kw and
                     k not in ("tie_word_embeddings", "rms_norm_eps"))
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}")
    for field, value in kw.items():
        problem = field_problem(field, value)
        _refuse(source, problem, _hf_key(field), value, f"it must be {problem}")
    head_dim = d.get("head_dim")
    if head_dim is None and kind == "qwen3":
        head_dim = 128  # transformers' Qwen3Config default, whatever hidden / heads
    if head_dim is not None:
        problem = field_problem("kv_channels", head_dim)
        _refuse(source, problem, "head_dim", head_dim, f"it must be {problem}")
        if head_dim * kw["num_attention_heads"] != kw["hidden_size"]:
            kw["kv_channels"] = head_dim
    return check_shape(ModelShape(**kw), source)


def _moe_fields(d: dict, kind: str, source: str) -> dict:
    """The ModelShape MoE fields of a qwen3_moe, qwen2_moe or mixtral config.json; ValueError
    naming the key of what is not built (dense layers between MoE layers, router noise)."""
    mixtral = kind == "mixtral"
    # the released configs name the expert count num_experts (Qwen) or num_local_experts
    # (Mixtral); transformers 5 writes num_local_experts for all three
    experts = "num_local_experts" if mixtral or ("num_experts" not in d and
                                                 "num_local_experts" in d) else "num_experts"
    keys = {"num_experts": experts, "moe_topk": "num_experts_per_tok",
            "moe_ffn_hidden_size": "intermediate_size" if mixtral else "moe_intermediate_size"}
    if kind == "qwen2_moe":
        keys["moe_shared_expert_size"] = "shared_expert_intermediate_size"
    missing = sorted(k for k in keys.values() if k not in d)
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)} (a {kind} config.json has them)")
    kw = {field: d[key] for field, key in keys.items()}
    if mixtral:
        noise = d.get("router_jitter_noise") or 0
        _refuse(source, noise != 0, "router_jitter_noise", noise, "training multiplies the "
                "router's input by random noise, which a re-forwarded chunk would draw again; "
                "set it to 0.0 (Mixtral's released configs have 0.0)")
    else:
        step, dense = d.get("decoder_sparse_step", 1), d.get("mlp_only_layers") or []
        _refuse(source, step != 1, "decoder_sparse_step", step, "every layer's MLP is built as "
                "an MoE layer (dense layers between them are not)")
        _refuse(source, dense, "mlp_only_layers", dense, "every layer's MLP is built as an MoE "
                "layer")
    norm = True if mixtral else d.get("norm_topk_prob", False)
    _refuse(source, not isinstance(norm, bool), "norm_topk_prob", norm, "it must be true or false")
    coeff = d.get("router_aux_loss_coef", 0.001)
    _refuse(source, isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0,
            "router_aux_loss_coef", coeff, "it must be a number >= 0")
    kw.update(moe_norm_topk=norm, moe_aux_loss_coeff=float(coeff) or None)
    for field, value in kw.items():
        problem = field_problem(field, value)
        _refuse(source, problem, keys.get(field, field), value, f"it must be {problem}")
    _refuse(source, kw["moe_topk"] > kw["num_experts"], "num_experts_per_tok", kw["moe_topk"],
            f"it must be at most the {kw['num_experts']} experts")
    return kw


def _hf_key(field: str) -> str:
    return next((k for k, f in HF_SHAPE_KEYS.items() if f == field), field)


def _refuse(source: str, bad, key: str, value, why: str) -> None:
    if bad:
        raise ValueError(f"{source}: {key} {value!r} is not supported: {why}")


def hf_config_dict(shape: ModelShape, dtype: str = "float32") -> dict:
    """A config.json transformers loads as the model `shape` describes (its family's class);
    max_position_embeddings is the preset's where `shape` is one (else what its RoPE was made
    for: 131,072 with Llama 3's scaling, 32,768 without). Token ids (bos, eos) are the
    tokenizer's business and are left out."""
    preset = next((HF_CARDS[k] for k, v in HF_MODELS.items() if v == shape), None)
    positions = preset.max_position_embeddings if preset else (
        131072 if shape.rope_scaling_factor is not None else 32768)
    arch = ARCHITECTURES[shape.family]
    rope = {"rope_type": "default"}
    if shape.rope_scaling_factor is not None:
        rope = {"rope_type": "llama3", "factor": shape.rope_scaling_factor, **LLAMA3_ROPE_FIXED}
    out = {
        "architectures": [arch], "model_type": shape.family, "hidden_act": "silu",
        "hidden_size": shape.hidden_size, "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size, "tie_word_embeddings": shape.tie_embeddings,
        "rope_theta": shape.rotary_base, "rope_scaling": None if rope["rope_type"] == "default"
        else rope, "rms_norm_eps": shape.norm_eps, "attention_dropout": 0.0,
        "max_position_embeddings": positions, "torch_dtype": dtype,
    }
    if shape.family in ("qwen2", "qwen2_moe"):
        out["use_sliding_window"] = False
    else:
        out.update(attention_bias=False, mlp_bias=False)
    if shape.is_moe:
        out.update(_moe_config(shape))
    return out


def _moe_config(shape: ModelShape) -> dict:
    """config.json's MoE keys of `shape`'s family; ValueError where the family's transformers
    class cannot hold the shape (a Mixtral without renormalised top-k, a Qwen2-MoE without its
    shared expert, a Qwen3-MoE with one)."""
    family, shared = shape.family, shape.moe_shared_expert_size
    problem = ("Mixtral renormalises the top-k probabilities" if family == "mixtral" and
               not shape.moe_norm_topk else "Qwen2-MoE has a shared expert" if
               family == "qwen2_moe" and not shared else "Qwen3-MoE has no shared expert" if
               family == "qwen3_moe" and shared else None)
    if problem:
        raise ValueError(f"this MoE shape has no Hugging Face family: {problem}")
    common = {"num_experts_per_tok": shape.moe_topk, "output_router_logits": False,
              "router_aux_loss_coef": shape.moe_aux_loss_coeff or 0.0}
    if family == "mixtral":
        return {**common, "num_local_experts": shape.num_experts, "router_jitter_noise": 0.0,
                "intermediate_size": shape.moe_ffn_hidden_size, "sliding_window": None}
    out = {**common, "num_experts": shape.num_experts, "norm_topk_prob": shape.moe_norm_topk,
           "moe_intermediate_size": shape.moe_ffn_hidden_size, "decoder_sparse_step": 1,
           "mlp_only_layers": []}
    if shared:
        out["shared_expert_intermediate_size"] = shared
    return out


def model_shape_from_dict(d: dict, source: str = "model config") -> ModelShape:
    """Our field names, or a Hugging Face config.json (it has a model_type: read and checked
    here); unknown keys of our format are ignored."""
    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected a JSON object with the model's fields, got "
                         f"{type(d).__name__}")
    if "model_type" in d:
        return shape_from_hf_config(d, source)
    fields = {f.name: f for f in dataclasses.fields(ModelShape)}
    hf_only = set(d) & (set(HF_SHAPE_KEYS) - set(fields))
    if hf_only:
        raise ValueError(f"{source}: has Hugging Face config.json keys "
                         f"({', '.join(sorted(hf_only))}) but no model_type; "
                         "give the checkpoint's whole config.json, or ModelShape's field names")
    kw = {k: v for k, v in d.items() if k in fields}
    missing = [f.name for f in fields.values()
               if f.default is dataclasses.MISSING and f.name not in kw]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}")
    for name, value in kw.items():
        problem = field_problem(name, value)
        if problem:
            raise ValueError(f"{source}: {name} must be {problem}, got {value!r}")
    return check_shape(ModelShape(**kw), source)


def load_model_shape(name: str, config_path: str | None = None) -> ModelShape:
    """The shape --model-config FILE describes (our field names or a Hugging Face config.json),
    else the --model preset `name`; ValueErrors name the flag and file."""
    if not config_path:
        return get_model_shape(name)
    from megatron_chunkflow.flags import read_json_file

    data = read_json_file(config_path, f"--model-config {config_path}")
    return model_shape_from_dict(data, f"--model-config {config_path}")
