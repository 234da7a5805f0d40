"""Tiny random Hugging Face checkpoints of every supported family (Qwen2, Qwen3, Llama 3,
Mistral, Qwen3-MoE, Qwen2-MoE, Mixtral), built with transformers and saved with save_pretrained (nothing is downloaded); shared
by tests/mcore/test_hf_interop.py and tests/checks/test_hf_verify.py (each has a module-scoped
`checkpoints` fixture calling build_checkpoints)."""

import torch

SEQ = 37
# name -> (model_type, hidden, layers, heads, kv heads, tied, max shard size, extra config)
CASES = {
    "gqa2_tied": ("qwen2", 64, 2, 4, 2, True, None, {}),
    "gqa2_untied_sharded": ("qwen2", 64, 2, 4, 2, False, "100KB", {}),
    "gqa7_hidden56": ("qwen2", 56, 2, 7, 1, False, None, {}),
    "gqa4_kv1": ("qwen2", 64, 2, 4, 1, True, None, {}),  # TP=2 > KV heads: half a QKV group
    # Llama 3.2's factor (32): the scaling divides the low frequencies of head dim 16 by it
    "llama3_scaled": ("llama", 64, 2, 4, 2, False, None, {
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "rope_scaling": {
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072}),
    # QK norm, and a head dim (24) that is not hidden / heads (16)
    "qwen3_hd24": ("qwen3", 64, 2, 4, 2, True, None, {"head_dim": 24}),
    # 4 layers: PP 2 x 2 virtual stages, one layer per model chunk
    "qwen2_4layers_tied": ("qwen2", 64, 4, 4, 2, True, None, {}),
    # Mistral Nemo's shape: head dim 32 over hidden / heads 16, no sliding window
    "mistral_hd32": ("mistral", 64, 2, 4, 2, False, None, {"head_dim": 32,
                                                          "sliding_window": None}),
    # mixture of experts, 4 experts of width 32, top 2: Qwen3-MoE (QK norm, head dim 24, top-k
    # renormalised), Qwen2-MoE (Q/K/V bias, top-k of the full softmax, a gated shared expert),
    # Mixtral (renormalised, no bias)
    "qwen3_moe": ("qwen3_moe", 64, 2, 4, 2, True, None, {
        "head_dim": 24, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "qwen2_moe": ("qwen2_moe", 64, 2, 4, 2, False, None, {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False}),
    "mixtral": ("mixtral", 64, 2, 4, 2, False, None, {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
        "sliding_window": None, "rms_norm_eps": 1e-5}),
}
FAMILY_CASES = ["llama3_scaled", "qwen3_hd24", "mistral_hd32"]
MOE_CASES = ["qwen3_moe", "qwen2_moe", "mixtral"]


def hf_config(name, vocab_size=1000):
    from transformers import AutoConfig

    kind, hidden, layers, heads, kv, tied, _, extra = CASES[name]
    kw = dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=176,
              num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab_size,
              tie_word_embeddings=tied, rope_theta=1e6, rms_norm_eps=1e-6, attention_dropout=0.0,
              dtype=torch.float32)
    return AutoConfig.for_model(kind, **{**kw, **extra})


def hf_model(name):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(hf_config(name)).eval()
    with torch.no_grad():  # biases start at zero and norms at one: randomise so layouts matter
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.05 * torch.randn_like(p))
    return model


def build_checkpoints(tmp_path_factory, names=None):
    """name -> (directory, HF state dict, tokens [1, SEQ], HF logits [1, SEQ, 1000])."""
    out = {}
    for name in names or CASES:
        shard = CASES[name][6]
        model = hf_model(name)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
        tokens = torch.randint(0, 1000, (1, SEQ), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            logits = model(tokens).logits
        state = {k: v.clone() for k, v in model.state_dict().items()}
        out[name] = (path, state, tokens, logits)
    return out
