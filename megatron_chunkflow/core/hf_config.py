"""A Hugging Face config.json -> ModelShape, for the four families the package builds, refusing
what it cannot build exactly (pure: no torch, no transformers).

    shape = shape_from_hf_config(json.load(open("config.json")), "config.json")

| model_type | what differs                                   | refused                            |
|------------|------------------------------------------------|------------------------------------|
| qwen2      | bias on Q/K/V (always)                         | use_sliding_window true            |
| qwen3      | QK RMSNorm per head, head_dim (128) != h / nh  | attention_bias, sliding window     |
| llama      | rope_type "llama3" frequency scaling           | attention_bias, mlp_bias           |
| mistral    | head_dim may differ from h / nh (Nemo)         | a sliding_window that is not null  |

Every family: hidden_act silu, attention_dropout 0, plain or "llama3" RoPE (YaRN, linear and
dynamic scaling are refused), no MoE (Qwen2-MoE, Qwen3-MoE and Mixtral are named as unsupported:
ChunkFlow would compute the router's load-balancing loss per data chunk, not per sequence).
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
            "mistral": "Mistral / Mistral Nemo"}
MOE = {"qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "llama4"}

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
    if kind in MOE:
        raise ValueError(f"{source}: model_type {kind!r} is a mixture-of-experts model, whose "
                         "Hugging Face import (experts, router, shared expert) is not supported "
                         "yet; the built-in MoE shapes (--model tiny-qwen3-moe, qwen3-moe-tiny, "
                         "...) train and verify with ChunkFlow")
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
    if kind in ("qwen2", "qwen3"):
        _refuse(source, d.get("use_sliding_window", False), "use_sliding_window", True,
                "Megatron's GPT model has no sliding-window attention")
    if kind == "mistral":
        _refuse(source, d.get("sliding_window") is not None, "sliding_window",
                d.get("sliding_window"), "Megatron's GPT model has no sliding-window attention "
                "(Mistral-7B-v0.1's 4096; v0.3 and Nemo have null)")
    if kind != "qwen2":
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
    kw.update(qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
              rope_scaling_factor=None if factor is None else float(factor))
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
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "llama": "LlamaForCausalLM"}[shape.family]
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
    if shape.family != "qwen2":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out["use_sliding_window"] = False
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
