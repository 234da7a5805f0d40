"""Transformer shapes the cost model needs (no weights, no megatron imports).

Qwen2.5 shapes are transcribed from each model's Hugging Face config.json
(https://huggingface.co/Qwen/Qwen2.5-<size>/blob/main/config.json): hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size,
tie_word_embeddings. The tiny shapes are ours, for CPU runs.

HF_CARDS holds, per Qwen2.5 size, the config.json values that ModelShape does not (maximum
positions, activation, initializer, dropout, sliding window) and the hub id. With QWEN25 they
generate configs/models/qwen2.5-*.sh (scripts/gen_model_configs.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder-only transformer with GQA and a SwiGLU MLP (Qwen2.5 family)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = True  # Qwen2/2.5 have a bias on Q, K and V only
    rotary_base: float = 1_000_000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V) per token per layer: num_query_groups * head_dim."""
        return self.num_query_groups * self.head_dim


QWEN25 = {
    "qwen2.5-0.5b": ModelShape(24, 896, 4864, 14, 2, 151936, tie_embeddings=True),
    "qwen2.5-1.5b": ModelShape(28, 1536, 8960, 12, 2, 151936, tie_embeddings=True),
    "qwen2.5-3b": ModelShape(36, 2048, 11008, 16, 2, 151936, tie_embeddings=True),
    "qwen2.5-7b": ModelShape(28, 3584, 18944, 28, 4, 152064),
    "qwen2.5-14b": ModelShape(48, 5120, 13824, 40, 8, 152064, norm_eps=1e-5),
    "qwen2.5-32b": ModelShape(64, 5120, 27648, 40, 8, 152064, norm_eps=1e-5),
    "qwen2.5-72b": ModelShape(80, 8192, 29568, 64, 8, 152064, norm_eps=1e-5),
}

TINY = {
    # 4 layers so that PP=2 and PP=4 both split evenly; GQA 4:2 like the real family; a vocabulary
    # that is not a multiple of 128 (like the Qwen2.5 tokenizer's 151,665 ids before padding).
    "tiny": ModelShape(4, 64, 176, 4, 2, 1000, tie_embeddings=True),
    "tiny-untied": ModelShape(4, 64, 176, 4, 2, 1000),
    # `chunkflow train`'s CPU default: the real Qwen2.5 vocabulary (151,936 padded ids), tiny body
    "qwen2.5-tiny": ModelShape(4, 64, 176, 4, 2, 151936, tie_embeddings=True),
    # `chunkflow bench`'s CPU default: head dim 64 (Qwen2.5's is 64-128) and GQA 2:1, an MLP of
    # 5.25 h (Qwen2.5-7B's ratio); wide enough that a step's time is kernels, not Python
    "tiny-bench": ModelShape(4, 128, 672, 2, 1, 1000, tie_embeddings=True),
}


@dataclass(frozen=True)
class HFCard:
    """What configs/models/ transcribes from a Hugging Face config.json beyond its ModelShape.

    Family-wide Qwen2.5 values are the defaults; `hub_id` names the checkpoint, its config.json and
    the default tokenizer.
    """

    hub_id: str  # "Qwen/Qwen2.5-7B"
    max_position_embeddings: int
    hidden_act: str = "silu"  # the SwiGLU gate's activation
    initializer_range: float = 0.02
    attention_dropout: float = 0.0
    use_sliding_window: bool = False
    # len(tokenizer): 151,643 BPE tokens + 22 specials, fewer than any checkpoint's embedding rows
    tokenizer_size: int = 151_665

    @property
    def name(self) -> str:
        """The model's display name, "Qwen2.5-7B"."""
        return self.hub_id.split("/")[-1]

    @property
    def config_url(self) -> str:
        return f"https://huggingface.co/{self.hub_id}/blob/main/config.json"


HF_CARDS = {  # keyed like QWEN25
    "qwen2.5-0.5b": HFCard("Qwen/Qwen2.5-0.5B", max_position_embeddings=32768),
    "qwen2.5-1.5b": HFCard("Qwen/Qwen2.5-1.5B", max_position_embeddings=131072),
    "qwen2.5-3b": HFCard("Qwen/Qwen2.5-3B", max_position_embeddings=32768),
    "qwen2.5-7b": HFCard("Qwen/Qwen2.5-7B", max_position_embeddings=131072),
    "qwen2.5-14b": HFCard("Qwen/Qwen2.5-14B", max_position_embeddings=131072),
    "qwen2.5-32b": HFCard("Qwen/Qwen2.5-32B", max_position_embeddings=131072),
    "qwen2.5-72b": HFCard("Qwen/Qwen2.5-72B", max_position_embeddings=131072),
}

MODEL_SHAPES = {**QWEN25, **TINY}


def get_model_shape(name: str) -> ModelShape:
    """Look up a named shape; the error lists the known names."""
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; known: {', '.join(sorted(MODEL_SHAPES))}"
        ) from None


# Hugging Face config.json keys -> ModelShape fields (Qwen2 / Qwen2.5)
HF_KEYS = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups",
    "vocab_size": "vocab_size",
    "tie_word_embeddings": "tie_embeddings",
    "rope_theta": "rotary_base",
    "rms_norm_eps": "norm_eps",
}


def model_shape_from_dict(d: dict, source: str = "model config") -> ModelShape:
    """Our field names or a Hugging Face Qwen2 config.json; unknown keys are ignored."""
    import dataclasses

    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected a JSON object with the model's fields, got "
                         f"{type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(ModelShape)}
    kw = {HF_KEYS.get(k, k): v for k, v in d.items() if HF_KEYS.get(k, k) in fields}
    missing = [f.name for f in fields.values()
               if f.default is dataclasses.MISSING and f.name not in kw]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}")
    for name, value in kw.items():
        kind = fields[name].type
        if kind == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{source}: {name} must be a positive integer, got {value!r}")
        if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                or not value > 0):
            raise ValueError(f"{source}: {name} must be a positive number, got {value!r}")
        if kind == "bool" and not isinstance(value, bool):
            raise ValueError(f"{source}: {name} must be true or false, got {value!r}")
    shape = ModelShape(**kw)
    if shape.hidden_size % shape.num_attention_heads:
        raise ValueError(f"{source}: hidden_size {shape.hidden_size} is not a multiple of "
                         f"num_attention_heads {shape.num_attention_heads}")
    if shape.num_attention_heads % shape.num_query_groups:
        raise ValueError(f"{source}: num_attention_heads {shape.num_attention_heads} is not a "
                         f"multiple of num_query_groups {shape.num_query_groups}")
    return shape


def load_model_shape(name: str, config_path: str | None = None) -> ModelShape:
    """The shape --model-config FILE describes (our field names or a Hugging Face Qwen2
    config.json), else the --model preset `name`; ValueErrors name the flag and file."""
    if not config_path:
        return get_model_shape(name)
    from megatron_chunkflow.flags import read_json_file

    data = read_json_file(config_path, f"--model-config {config_path}")
    return model_shape_from_dict(data, f"--model-config {config_path}")
