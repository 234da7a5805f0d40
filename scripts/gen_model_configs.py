"""Generate configs/models/qwen2.5-*.sh from megatron_chunkflow/core/models.py.

    python scripts/gen_model_configs.py            # rewrite every model file (`make configs`)
    python scripts/gen_model_configs.py --check    # exit 1 naming each stale file, with a diff

Each file is MODEL_ARGS for Megatron-LM's pretrain_gpt.py, rendered from two tables of
core/models.py: QWEN25 (the ModelShape: layers, sizes, heads, KV groups, vocabulary rows, tied
embeddings, RoPE base, RMSNorm epsilon) and HF_CARDS (what else its header transcribes from the
Hugging Face config.json: maximum positions, activation, initializer, dropout, sliding window, the
hub id that is also the default tokenizer). To change a model file, change those tables and run
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

from megatron_chunkflow.core.models import HF_CARDS, QWEN25, HFCard, ModelShape  # noqa: E402

MODELS_DIR = REPO / "configs" / "models"
MEGATRON_LM_TAG = "core_v0.16.1"  # the Megatron-LM the flags were checked against


def _flag_number(x: float) -> str:
    """A number as the files write flag values: 1000000 for 1e6, 1e-6 (not 1e-06) for epsilons."""
    if float(x).is_integer():
        return str(int(x))
    return repr(float(x)).replace("e-0", "e-").replace("e+0", "e+")


def _check_representable(name: str, shape: ModelShape, card: HFCard) -> None:
    """Refuse a model the template cannot express, rather than write wrong flags."""
    problems = []
    if card.hidden_act != "silu":
        problems.append(f"hidden_act {card.hidden_act!r} (the template writes --swiglu)")
    if card.use_sliding_window:
        problems.append("use_sliding_window true (Megatron-LM's GPT has no sliding window)")
    if not shape.qkv_bias:
        problems.append("no QKV bias (the template writes --add-qkv-bias)")
    if card.tokenizer_size >= shape.vocab_size:
        problems.append(f"tokenizer_size {card.tokenizer_size} >= vocab_size {shape.vocab_size} "
                        "(the header says the tokenizer has fewer ids)")
    if problems:
        raise ValueError(f"{name}: cannot render: {'; '.join(problems)}")


def render(name: str) -> str:
    """The text of configs/models/{name}.sh for one key of QWEN25 / HF_CARDS."""
    shape, card = QWEN25[name], HF_CARDS[name]
    _check_representable(name, shape, card)
    tied = str(shape.tie_embeddings).lower()
    if shape.tie_embeddings:
        tie_flag = "# tie_word_embeddings true: Megatron ties by default (no --untie-... flag)"
    else:
        tie_flag = "--untie-embeddings-and-output-weights  # tie_word_embeddings false"
    header = [
        f"# {card.name} architecture for Megatron-LM {MEGATRON_LM_TAG} (pretrain_gpt.py flags).",
        "#",
        f"#   source configs/models/{name}.sh && torchrun ... pretrain_gpt.py "
        '"${MODEL_ARGS[@]}" ...',
        "#",
        f"# Transcribed from {card.config_url}",
        f"#   num_hidden_layers {shape.num_layers}, hidden_size {shape.hidden_size}, "
        f"intermediate_size {shape.ffn_hidden_size}, num_attention_heads "
        f"{shape.num_attention_heads},",
        f"#   num_key_value_heads {shape.num_query_groups} (head_dim {shape.head_dim}), "
        f"hidden_act {card.hidden_act}, rms_norm_eps {shape.norm_eps!r},",
        f"#   rope_theta {float(shape.rotary_base)!r}, max_position_embeddings "
        f"{card.max_position_embeddings}, vocab_size {shape.vocab_size},",
        f"#   tie_word_embeddings {tied}, attention_dropout {card.attention_dropout!r}, "
        f"initializer_range {card.initializer_range!r},",
        f"#   use_sliding_window {str(card.use_sliding_window).lower()}. "
        "Qwen2 layers: bias on Q/K/V only, SwiGLU MLP, RMSNorm.",
        f"# TOKENIZER: a Hugging Face model directory or hub id (default {card.hub_id}). "
        "Its tokenizer has",
        f"# fewer ids than the checkpoint's {shape.vocab_size} embedding rows, so the padded "
        "vocabulary is given",
        '# explicitly (configs/README.md, "Vocabulary").',
    ]
    # One flag per line, in the order Megatron-LM's arguments.py groups them.
    flags = [
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
        "--add-qkv-bias",
        tie_flag,
        f"--attention-dropout {card.attention_dropout!r}",
        "--hidden-dropout 0.0",  # HF Qwen2 has no hidden dropout; Megatron's default is 0.1
        "--attention-softmax-in-fp32",
        f"--init-method-std {card.initializer_range!r}",
        "--tokenizer-type HuggingFaceTokenizer",
        f'--tokenizer-model "${{TOKENIZER:-{card.hub_id}}}"',
        f"--padded-vocab-size {shape.vocab_size}",
    ]
    body = ["", "MODEL_ARGS=(", *(f"    {f}" for f in flags), ")"]
    return "\n".join(header + body) + "\n"


def expected(models_dir: Path = MODELS_DIR) -> dict[Path, str]:
    """Every generated file's path and text."""
    if sorted(QWEN25) != sorted(HF_CARDS):
        raise ValueError(f"core/models.py: QWEN25 and HF_CARDS have different keys: "
                         f"{sorted(set(QWEN25) ^ set(HF_CARDS))}")
    return {models_dir / f"{name}.sh": render(name) for name in QWEN25}


def stale(models_dir: Path = MODELS_DIR) -> list[tuple[Path, str]]:
    """(path, unified diff) for each file that differs from what `expected` writes, is missing, or
    matches qwen2.5-*.sh without being generated (the diff then removes it)."""
    want = expected(models_dir)
    out = []
    for path in sorted(set(want) | set(models_dir.glob("qwen2.5-*.sh"))):
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
