"""Transformer shapes the cost model needs (no weights, no megatron imports).

Four families of dense decoder-only transformers, all GQA + SwiGLU + RMSNorm + RoPE, that differ in
four switches: a bias on Q/K/V (Qwen2/2.5), an RMSNorm on each head's query and key before RoPE
(Qwen3), a head dim that is not hidden / heads (Qwen3, Mistral Nemo), and Llama 3's RoPE frequency
scaling. Each shape is transcribed from its Hugging Face config.json (HFCard.config_url):
hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
head_dim, vocab_size, tie_word_embeddings, rope_theta, rope_scaling, rms_norm_eps. The tiny shapes
are ours, for CPU runs.

HF_CARDS holds, per model, the config.json values that ModelShape does not (maximum positions,
model_type, tokenizer size) and the hub id. With HF_MODELS they generate configs/models/*.sh
(scripts/gen_model_configs.py). core/hf_config.py reads a config.json, or --model-config's file,
into a ModelShape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Llama 3's RoPE scaling ("rope_type": "llama3") as megatron-core 0.16.1 applies it: only the factor
# is a parameter; these three are fixed (RotaryEmbedding._apply_scaling's defaults).
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder-only transformer with GQA, a SwiGLU MLP, RMSNorm and RoPE."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = True  # Qwen2/2.5 have a bias on Q, K and V only; the others have none
    rotary_base: float = 1_000_000.0
    norm_eps: float = 1e-6
    kv_channels: int | None = None  # the head dim where it is not hidden / heads
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's query and key, before RoPE
    rope_scaling_factor: float | None = None  # Llama 3's RoPE scaling (LLAMA3_ROPE_FIXED)
    # mixture of experts (every layer's MLP; None: a dense model): routed experts per layer, each
    # expert's FFN width, experts per token; the top-k probabilities renormalised (Qwen3-MoE,
    # Mixtral) or taken from the softmax over all experts (Qwen2-MoE); Qwen2-MoE's shared expert
    # (its FFN width; gated by a sigmoid); the balancing loss's coefficient (config.json
    # router_aux_loss_coef), applied per sequence (runtime/moe.py)
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_topk: int | None = None
    moe_norm_topk: bool = True
    moe_shared_expert_size: int | None = None
    moe_aux_loss_coeff: float | None = None

    def __post_init__(self):
        # one spelling per shape: a head dim of hidden / heads is no override (shapes compare equal)
        if self.kv_channels and self.kv_channels * self.num_attention_heads == self.hidden_size:
            object.__setattr__(self, "kv_channels", None)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V) per token per layer: num_query_groups * head_dim."""
        return self.num_query_groups * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def require_dense(self, name: str, command: str) -> None:
        """ValueError where `command` models costs or memory and this is a mixture-of-experts
        model (`name`: how the user named it): its numbers would be a dense model's."""
        if self.is_moe:
            raise ValueError(
                f"--model {name}: a mixture-of-experts model; `chunkflow {command}` does not "
                "model experts yet (their weights per rank, the router, the token all-to-all, "
                "expert imbalance), so its numbers would be a dense model's. `chunkflow verify` "
                "and `chunkflow train` run it")

    @property
    def family(self) -> str:
        """The Hugging Face architecture that has these switches: its config.json model_type."""
        if self.is_moe:
            return "qwen3_moe" if self.qk_norm else "qwen2_moe" if self.qkv_bias else "mixtral"
        if self.qk_norm:
            return "qwen3"
        return "qwen2" if self.qkv_bias else "llama"


def _qwen25(*dims, tied=False, eps=1e-6):
    return ModelShape(*dims, tie_embeddings=tied, norm_eps=eps)


def _qwen3(layers, hidden, ffn, heads, tied=False):
    return ModelShape(layers, hidden, ffn, heads, 8, 151936, tie_embeddings=tied, qkv_bias=False,
                      kv_channels=128, qk_norm=True)


def _llama3(layers, hidden, ffn, heads, tied=False, factor=8.0):
    return ModelShape(layers, hidden, ffn, heads, 8, 128256, tie_embeddings=tied, qkv_bias=False,
                      rotary_base=500_000.0, norm_eps=1e-5, rope_scaling_factor=factor)


QWEN25 = {
    "qwen2.5-0.5b": _qwen25(24, 896, 4864, 14, 2, 151936, tied=True),
    "qwen2.5-1.5b": _qwen25(28, 1536, 8960, 12, 2, 151936, tied=True),
    "qwen2.5-3b": _qwen25(36, 2048, 11008, 16, 2, 151936, tied=True),
    "qwen2.5-7b": _qwen25(28, 3584, 18944, 28, 4, 152064),
    "qwen2.5-14b": _qwen25(48, 5120, 13824, 40, 8, 152064, eps=1e-5),
    "qwen2.5-32b": _qwen25(64, 5120, 27648, 40, 8, 152064, eps=1e-5),
    "qwen2.5-72b": _qwen25(80, 8192, 29568, 64, 8, 152064, eps=1e-5),
}

QWEN3 = {  # dense Qwen3: head dim 128 whatever the width, 8 K/V heads, QK norm, no bias
    "qwen3-0.6b": _qwen3(28, 1024, 3072, 16, tied=True),
    "qwen3-1.7b": _qwen3(28, 2048, 6144, 16, tied=True),
    "qwen3-4b": _qwen3(36, 2560, 9728, 32, tied=True),
    "qwen3-8b": _qwen3(36, 4096, 12288, 32),
    "qwen3-14b": _qwen3(40, 5120, 17408, 40),
    "qwen3-32b": _qwen3(64, 5120, 25600, 64),
}

LLAMA3 = {  # Llama 3.x: 128,256 ids, RoPE base 500,000 scaled by the "llama3" rule
    "llama3.2-1b": _llama3(16, 2048, 8192, 32, tied=True, factor=32.0),
    "llama3.2-3b": _llama3(28, 3072, 8192, 24, tied=True, factor=32.0),
    "llama3.1-8b": _llama3(32, 4096, 14336, 32),
    "llama3.1-70b": _llama3(80, 8192, 28672, 64),
    "llama3.3-70b": _llama3(80, 8192, 28672, 64),
}

MISTRAL = {  # plain RoPE with base 1e6, no bias, no sliding window (null in config.json)
    "mistral-7b-v0.3": ModelShape(32, 4096, 14336, 32, 8, 32768, qkv_bias=False, norm_eps=1e-5),
    "mistral-nemo-12b": ModelShape(40, 5120, 14336, 32, 8, 131072, qkv_bias=False,
                                   norm_eps=1e-5, kv_channels=128),
}

HF_MODELS = {**QWEN25, **QWEN3, **LLAMA3, **MISTRAL}

# mixture of experts, each transcribed from its config.json (Qwen/Qwen3-30B-A3B,
# Qwen/Qwen3-235B-A22B, Qwen/Qwen2-57B-A14B, mistralai/Mixtral-8x7B-v0.1): `train` and `verify`
# build them; the cost and memory models do not model experts yet (require_dense)
MOE = {
    "qwen3-30b-a3b": ModelShape(48, 2048, 6144, 32, 4, 151936, qkv_bias=False, kv_channels=128,
                                qk_norm=True, num_experts=128, moe_ffn_hidden_size=768,
                                moe_topk=8, moe_aux_loss_coeff=0.001),
    "qwen3-235b-a22b": ModelShape(94, 4096, 12288, 64, 4, 151936, qkv_bias=False,
                                  kv_channels=128, qk_norm=True, num_experts=128,
                                  moe_ffn_hidden_size=1536, moe_topk=8, moe_aux_loss_coeff=0.001),
    "qwen2-57b-a14b": ModelShape(28, 3584, 18944, 28, 4, 151936, num_experts=64,
                                 moe_ffn_hidden_size=2560, moe_topk=8, moe_norm_topk=False,
                                 moe_shared_expert_size=20480, moe_aux_loss_coeff=0.001),
    "mixtral-8x7b": ModelShape(32, 4096, 14336, 32, 8, 32000, qkv_bias=False, norm_eps=1e-5,
                               num_experts=8, moe_ffn_hidden_size=14336, moe_topk=2,
                               moe_aux_loss_coeff=0.02),
}

TINY = {
    # 4 layers so that PP=2 and PP=4 both split evenly; GQA 4:2 like the real family; a vocabulary
    # that is not a multiple of 128 (like the Qwen2.5 tokenizer's 151,665 ids before padding).
    "tiny": ModelShape(4, 64, 176, 4, 2, 1000, tie_embeddings=True),
    "tiny-untied": ModelShape(4, 64, 176, 4, 2, 1000),
    # the other families' switches at the same size: Qwen3's QK norm with a head dim (24) that is
    # not hidden / heads (16), Llama 3's scaled RoPE without biases
    "tiny-qwen3": ModelShape(4, 64, 176, 4, 2, 1000, tie_embeddings=True, qkv_bias=False,
                             kv_channels=24, qk_norm=True),
    "tiny-llama3": ModelShape(4, 64, 176, 4, 2, 1000, qkv_bias=False, rotary_base=500_000.0,
                              norm_eps=1e-5, rope_scaling_factor=8.0),
    # mixture of experts, 4 experts of width 32, top 2: Qwen3-MoE's switches (QK norm, head dim 24,
    # renormalised top-k), Qwen2-MoE's (QKV bias, top-k from the full softmax, a gated shared
    # expert), Mixtral's (neither); a balancing-loss coefficient large enough to show in float64
    "tiny-qwen3-moe": ModelShape(4, 64, 176, 4, 2, 1000, tie_embeddings=True, qkv_bias=False,
                                 kv_channels=24, qk_norm=True, num_experts=4,
                                 moe_ffn_hidden_size=32, moe_topk=2, moe_aux_loss_coeff=0.01),
    "tiny-qwen2-moe": ModelShape(4, 64, 176, 4, 2, 1000, num_experts=4, moe_ffn_hidden_size=32,
                                 moe_topk=2, moe_norm_topk=False, moe_shared_expert_size=48,
                                 moe_aux_loss_coeff=0.01),
    "tiny-mixtral": ModelShape(4, 64, 176, 4, 2, 1000, qkv_bias=False, norm_eps=1e-5,
                               num_experts=4, moe_ffn_hidden_size=32, moe_topk=2,
                               moe_aux_loss_coeff=0.01),
    # `chunkflow train --model qwen3-moe-tiny`: tiny-qwen3-moe with the real Qwen vocabulary
    "qwen3-moe-tiny": ModelShape(4, 64, 176, 4, 2, 151936, tie_embeddings=True, qkv_bias=False,
                                 kv_channels=24, qk_norm=True, num_experts=4,
                                 moe_ffn_hidden_size=32, moe_topk=2, moe_aux_loss_coeff=0.01),
    # `chunkflow train`'s CPU default: the real Qwen2.5 vocabulary (151,936 padded ids), tiny body
    "qwen2.5-tiny": ModelShape(4, 64, 176, 4, 2, 151936, tie_embeddings=True),
    # `chunkflow bench`'s CPU default: head dim 64 (Qwen2.5's is 64-128) and GQA 2:1, an MLP of
    # 5.25 h (Qwen2.5-7B's ratio); wide enough that a step's time is kernels, not Python
    "tiny-bench": ModelShape(4, 128, 672, 2, 1, 1000, tie_embeddings=True),
}


@dataclass(frozen=True)
class HFCard:
    """What configs/models/ transcribes from a Hugging Face config.json beyond its ModelShape.

    `hub_id` names the checkpoint, its config.json and the default tokenizer; `tokenizer_size` is
    len(tokenizer), which for Qwen is fewer than the checkpoint's embedding rows."""

    hub_id: str  # "Qwen/Qwen2.5-7B"
    max_position_embeddings: int
    model_type: str = "qwen2"
    tokenizer_size: int = 151_665  # Qwen2.5: 151,643 BPE tokens + 22 specials
    hidden_act: str = "silu"  # the SwiGLU gate's activation
    initializer_range: float = 0.02
    attention_dropout: float = 0.0

    @property
    def name(self) -> str:
        """The model's display name, "Qwen2.5-7B"."""
        return self.hub_id.split("/")[-1]

    @property
    def config_url(self) -> str:
        return f"https://huggingface.co/{self.hub_id}/blob/main/config.json"


def _cards(org: str, names: dict[str, str], **kw) -> dict[str, HFCard]:
    return {key: HFCard(f"{org}/{name}", **kw) for key, name in names.items()}


HF_CARDS = {  # keyed like HF_MODELS
    **{k: HFCard(f"Qwen/Qwen2.5-{k.split('-')[1].upper()}", max_position_embeddings=m)
       for k, m in [("qwen2.5-0.5b", 32768), ("qwen2.5-1.5b", 131072), ("qwen2.5-3b", 32768),
                    ("qwen2.5-7b", 131072), ("qwen2.5-14b", 131072), ("qwen2.5-32b", 131072),
                    ("qwen2.5-72b", 131072)]},
    # Qwen3: 32K native positions (+8K for generation); longer needs YaRN, which is not supported
    **{k: HFCard(f"Qwen/Qwen3-{k.split('-')[1].upper()}", max_position_embeddings=40960,
                 model_type="qwen3", tokenizer_size=151_669) for k in QWEN3},
    **_cards("meta-llama", {"llama3.2-1b": "Llama-3.2-1B", "llama3.2-3b": "Llama-3.2-3B",
                            "llama3.1-8b": "Llama-3.1-8B", "llama3.1-70b": "Llama-3.1-70B",
                            "llama3.3-70b": "Llama-3.3-70B-Instruct"},
             max_position_embeddings=131072, model_type="llama", tokenizer_size=128256),
    "mistral-7b-v0.3": HFCard("mistralai/Mistral-7B-v0.3", max_position_embeddings=32768,
                              model_type="mistral", tokenizer_size=32768),
    "mistral-nemo-12b": HFCard("mistralai/Mistral-Nemo-Base-2407",
                               max_position_embeddings=1024000, model_type="mistral",
                               tokenizer_size=131072),
}

MODEL_SHAPES = {**HF_MODELS, **MOE, **TINY}


def get_model_shape(name: str) -> ModelShape:
    """Look up a named shape; the error lists the known names."""
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; known: {', '.join(sorted(MODEL_SHAPES))}"
        ) from None


def field_problem(name: str, value) -> str | None:
    """What ModelShape field `name` needs that `value` is not ("a positive integer", "a positive
    number", "true or false"), or None when it is fine; None passes where the field allows it."""
    kind = next(f.type for f in dataclasses.fields(ModelShape) if f.name == name)
    if value is None and kind.endswith("| None"):
        return None
    kind = kind.removesuffix(" | None")
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        return "a positive integer"
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))
                            or not 0 < value < float("inf")):
        return "a finite positive number"
    if kind == "bool" and not isinstance(value, bool):
        return "true or false"
    return None


def check_shape(shape: ModelShape, source: str) -> ModelShape:
    """The divisibility every family has; ValueError naming `source` and the fields."""
    if shape.kv_channels is None and shape.hidden_size % shape.num_attention_heads:
        raise ValueError(f"{source}: hidden_size {shape.hidden_size} is not a multiple of "
                         f"num_attention_heads {shape.num_attention_heads} (give the head dim)")
    if shape.num_attention_heads % shape.num_query_groups:
        raise ValueError(f"{source}: num_attention_heads {shape.num_attention_heads} is not a "
                         f"multiple of num_query_groups {shape.num_query_groups}")
    if shape.qk_norm and shape.qkv_bias:
        raise ValueError(f"{source}: qk_norm with qkv_bias: no supported family has both (Qwen3's "
                         "QK norm comes without a Q/K/V bias); set qkv_bias false")
    if shape.head_dim % 2:
        raise ValueError(f"{source}: the head dim {shape.head_dim} is odd (RoPE rotates pairs)")
    return shape
