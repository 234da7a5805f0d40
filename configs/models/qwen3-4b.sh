# Qwen3-4B architecture for Megatron-LM core_v0.16.1 (pretrain_gpt.py flags).
#
#   source configs/models/qwen3-4b.sh && torchrun ... pretrain_gpt.py "${MODEL_ARGS[@]}" ...
#
# Transcribed from https://huggingface.co/Qwen/Qwen3-4B/blob/main/config.json
#   model_type qwen3, num_hidden_layers 36, hidden_size 2560, intermediate_size 9728,
#   num_attention_heads 32, num_key_value_heads 8, head_dim 128, hidden_act silu,
#   rms_norm_eps 1e-06, rope_theta 1000000.0, max_position_embeddings 40960,
#   vocab_size 151936, tie_word_embeddings true, attention_dropout 0.0, initializer_range 0.02.
# Qwen3 layers: RMSNorm on each head's query and key (q_norm, k_norm), no bias, SwiGLU MLP.
# TOKENIZER: a Hugging Face model directory or hub id (default Qwen/Qwen3-4B).
# Its tokenizer has fewer ids (151669) than the checkpoint's 151936 embedding rows, so the
# padded vocabulary is given explicitly (configs/README.md, "Vocabulary").

MODEL_ARGS=(
    --num-layers 36
    --hidden-size 2560
    --ffn-hidden-size 9728
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --max-position-embeddings 40960
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --qk-layernorm
    # tie_word_embeddings true: Megatron ties by default (no --untie-... flag)
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --attention-softmax-in-fp32
    --init-method-std 0.02
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "${TOKENIZER:-Qwen/Qwen3-4B}"
    --padded-vocab-size 151936
)
