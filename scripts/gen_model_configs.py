"""Generate configs/models/*.sh (Qwen2.5, Qwen3, Llama 3.x, Mistral) from
megatron_chunkflow/core/models.py.

    python scripts/gen_model_configs.py            # rewrite every model file (`make configs`)
    python scripts/gen_model_configs.py --check    # exit 1 naming each stale file, with a diff

Each file is MODEL_ARGS for Megatron-LM's pretrain_gpt.py, rendered from two tables of
core/models.py: HF_MODELS (the ModelShape: layers, sizes, heads, KV groups, head dim, vocabulary
rows, tied embeddings, Q/K/V bias, QK norm, RoPE base and scaling, RMSNorm epsilon) and HF_CARDS
(what else its header transcribes from the Hugging Face config.json: model_type, maximum
positions, activation, initializer, dropout, the tokenizer's size, the hub id that is also the
default tokenizer). To change a model file, change those tables and run
this script; tests/scripts/test_configs.py (test_model_configs_are_generated) fails while any
file differs from what this script writes.

Needs neither torch nor megatron (core/ is pure), so the system python is enough.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_chunkflow.core.models import (  # noqa: E402
    HF_CARDS,
    HF_MODELS,
    LLAMA3_ROPE_FIXED,
    HFCard,
    ModelShape,
)

MODELS_DIR = REPO / "configs" / "models"
MEGATRON_LM_TAG = "core_v0.16.1"  # the Megatron-LM the flags were checked against


def _flag_number(x: float) -> str:
    """A number as the files write flag values: 1000000 for 1e6, 1e-6 (not 1e-06) for epsilons."""
    if float(x).is_integer():
        return str(int(x))
    return repr(float(x)).replace("e-0", "e-").replace("e+0", "e+")


# what each family's layers are, for the header (core/hf_config.py: what is read and refused)
LAYERS = {
    "qwen2": "Qwen2 layers: bias on Q/K/V only, SwiGLU MLP, RMSNorm; use_sliding_window false.",
    "qwen3": "Qwen3 layers: RMSNorm on each head's query and key (q_norm, k_norm), no bias, "
             "SwiGLU MLP.",
    "llama": "Llama layers: no bias, SwiGLU MLP, RMSNorm, RoPE scaled by the llama3 rule.",
    "mistral": "Mistral layers: no bias, SwiGLU MLP, RMSNorm, sliding_window null.",
}


def _check_representable(name: str, shape: ModelShape, card: HFCard) -> None:
    """Refuse a model the template cannot express, rather than write wrong flags."""
    problems = []
    if card.hidden_act != "silu":
        problems.append(f"hidden_act {card.hidden_act!r} (the template writes --swiglu)")
    if card.model_type not in LAYERS:
        problems.append(f"model_type {card.model_type!r} (known: {', '.join(LAYERS)})")
    elif shape.family != {"mistral": "llama"}.get(card.model_type, card.model_type):
        problems.append(f"model_type {card.model_type!r} but the shape's switches are "
                        f"{shape.family!r}'s")
    if card.tokenizer_size > shape.vocab_size:
        problems.append(f"tokenizer_size {card.tokenizer_size} > vocab_size {shape.vocab_size}")
    if problems:
        raise ValueError(f"{name}: cannot render: {'; '.join(problems)}")


def _family_flags(shape: ModelShape) -> list[str]:
    flags = ["--add-qkv-bias"] if shape.qkv_bias else []
    if shape.qk_norm:
        flags.append("--qk-layernorm")
    if shape.rope_scaling_factor is not None:
        flags += ["--use-rope-scaling",
                  f"--rope-scaling-factor {_flag_number(shape.rope_scaling_factor)}"]
    return flags


def model_flags(shape: ModelShape, card: HFCard) -> list[str]:
    """MODEL_ARGS: one flag per line, in the order Megatron-LM's arguments.py groups them."""
    tie_flag = ("--untie-embeddings-and-output-weights  # tie_word_embeddings false"
                if not shape.tie_embeddings else
                "# tie_word_embeddings true: Megatron ties by default (no --untie-... flag)")
    return [
        f"--num-layers {shape.num_layers}",
        f"--hidden-size {shape.hidden_size}",
        f"--ffn-hidden-size {shape.ffn_hidden_size}",
        f"--num-attention-heads {shape.num_attention_heads}",
        "--group-query-attention",
        f"--num-query-groups {shape.num_query_groups}",
        f"--kv-channels {shape.head_dim}",
        "--position-embedding-type rope",
        f"--rotary-base {_flag_number(shape.rotary_base)}",
        "--rotary-percent 1.0",
        f"--max-position-embeddings {card.max_position_embeddings}",
        "--normalization RMSNorm",
        f"--norm-epsilon {_flag_number(shape.norm_eps)}",
        "--swiglu",
        "--disable-bias-linear",
        *_family_flags(shape),
        tie_flag,
        f"--attention-dropout {card.attention_dropout!r}",
        "--hidden-dropout 0.0",  # HF has no hidden dropout; Megatron's default is 0.1
        "--attention-softmax-in-fp32",
        f"--init-method-std {card.initializer_range!r}",
        "--tokenizer-type HuggingFaceTokenizer",
        f'--tokenizer-model "${{TOKENIZER:-{card.hub_id}}}"',
        f"--padded-vocab-size {shape.vocab_size}",
    ]


def render(name: str) -> str:
    """The text of configs/models/{name}.sh for one key of HF_MODELS / HF_CARDS."""
    shape, card = HF_MODELS[name], HF_CARDS[name]
    _check_representable(name, shape, card)
    tied = str(shape.tie_embeddings).lower()
    shape_lines = [f"rms_norm_eps {shape.norm_eps!r}, rope_theta {float(shape.rotary_base)!r}, "
                   f"max_position_embeddings {card.max_position_embeddings},"]
    if shape.rope_scaling_factor is not None:
        low, high, original = LLAMA3_ROPE_FIXED.values()
        factor = shape.rope_scaling_factor
        shape_lines += [f"rope_scaling llama3: factor {factor!r}, low_freq_factor {low!r}, "
                        f"high_freq_factor {high!r},",
                        f"original_max_position_embeddings {original},"]
    vocab = [f"# TOKENIZER: a Hugging Face model directory or hub id (default {card.hub_id})."]
    if card.tokenizer_size < shape.vocab_size:
        vocab += [f"# Its tokenizer has fewer ids ({card.tokenizer_size}) than the checkpoint's "
                  f"{shape.vocab_size} embedding rows, so the",
                  '# padded vocabulary is given explicitly (configs/README.md, "Vocabulary").']
    else:
        vocab += [f"# Its tokenizer has exactly the checkpoint's {shape.vocab_size} embedding "
                  "rows; --padded-vocab-size keeps",
                  '# any TP size from padding it further (configs/README.md, "Vocabulary").']
    header = [
        f"# {card.name} architecture for Megatron-LM {MEGATRON_LM_TAG} (pretrain_gpt.py flags).",
        "#",
        f"#   source configs/models/{name}.sh && torchrun ... pretrain_gpt.py "
        '"${MODEL_ARGS[@]}" ...',
        "#",
        f"# Transcribed from {card.config_url}",
        f"#   model_type {card.model_type}, num_hidden_layers {shape.num_layers}, hidden_size "
        f"{shape.hidden_size}, intermediate_size {shape.ffn_hidden_size},",
        f"#   num_attention_heads {shape.num_attention_heads}, num_key_value_heads "
        f"{shape.num_query_groups}, head_dim {shape.head_dim}, hidden_act {card.hidden_act},",
        *(f"#   {line}" for line in shape_lines),
        f"#   vocab_size {shape.vocab_size}, tie_word_embeddings {tied}, attention_dropout "
        f"{card.attention_dropout!r}, initializer_range {card.initializer_range!r}.",
        f"# {LAYERS[card.model_type]}",
        *vocab,
    ]
    body = ["", "MODEL_ARGS=(", *(f"    {f}" for f in model_flags(shape, card)), ")"]
    return "\n".join(header + body) + "\n"


def expected(models_dir: Path = MODELS_DIR) -> dict[Path, str]:
    """Every generated file's path and text."""
    if sorted(HF_MODELS) != sorted(HF_CARDS):
        raise ValueError(f"core/models.py: HF_MODELS and HF_CARDS have different keys: "
                         f"{sorted(set(HF_MODELS) ^ set(HF_CARDS))}")
    return {models_dir / f"{name}.sh": render(name) for name in HF_MODELS}


def stale(models_dir: Path = MODELS_DIR) -> list[tuple[Path, str]]:
    """(path, unified diff) for each file that differs from what `expected` writes, is missing, or
    is in the folder without being generated (the diff then removes it)."""
    want = expected(models_dir)
    out = []
    for path in sorted(set(want) | set(models_dir.glob("*.sh"))):
        have = path.read_text() if path.exists() else ""
        text = want.get(path, "")
        if have != text:
            rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            diff = "".join(difflib.unified_diff(
                have.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{rel} ({'on disk' if path.exists() else 'missing'})",
                tofile=f"{rel} ({'generated' if path in want else 'not generated: remove'})"))
            out.append((path, diff))
    return out


def write(models_dir: Path = MODELS_DIR) -> list[Path]:
    """Rewrite the files that differ; return them. Files not generated are left, and named."""
    want = expected(models_dir)
    changed = []
    for path, _ in stale(models_dir):
        if path in want:
            path.write_text(want[path])
            changed.append(path)
        else:
            print(f"{path}: not generated from core/models.py (no such key); remove it",
                  file=sys.stderr)
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each stale file and printing its diff")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for path, diff in problems:
            print(f"stale: {path.relative_to(REPO)}")
            sys.stdout.write(diff)
        if problems:
            print("run: python scripts/gen_model_configs.py", file=sys.stderr)
        return 1 if problems else 0
    for path in write():
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
