"""Tiny random Hugging Face Qwen2 checkpoints, built with transformers and saved with
save_pretrained (nothing is downloaded); shared by tests/mcore/test_hf_interop.py and
tests/checks/test_hf_verify.py (each has a module-scoped `checkpoints` fixture calling
build_checkpoints)."""

import torch

SEQ = 37
# name -> (hidden, layers, heads, kv heads, tied, max shard size for save_pretrained)
CASES = {
    "gqa2_tied": (64, 2, 4, 2, True, None),
    "gqa2_untied_sharded": (64, 2, 4, 2, False, "100KB"),
    "gqa7_hidden56": (56, 2, 7, 1, False, None),
    "gqa4_kv1": (64, 2, 4, 1, True, None),  # TP=2 > KV heads: a rank holds half a QKV group
}


def hf_model(name):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, tied, _ = CASES[name]
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=176,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=1000,
                         tie_word_embeddings=tied, rope_theta=1e6, rms_norm_eps=1e-6,
                         attention_dropout=0.0, dtype=torch.float32)
    torch.manual_seed(sum(map(ord, name)))
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases start at zero and norms at one: randomise so layouts matter
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.05 * torch.randn_like(p))
    return model


def build_checkpoints(tmp_path_factory):
    """name -> (directory, HF state dict, tokens [1, SEQ], HF logits [1, SEQ, 1000])."""
    out = {}
    for name, (*_, shard) in CASES.items():
        model = hf_model(name)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
        tokens = torch.randint(0, 1000, (1, SEQ), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            logits = model(tokens).logits
        state = {k: v.clone() for k, v in model.state_dict().items()}
        out[name] = (path, state, tokens, logits)
    return out
