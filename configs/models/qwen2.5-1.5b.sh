# Qwen2.5-1.5B architecture for Megatron-LM core_v0.16.1 (pretrain_gpt.py flags).
#
#   source configs/models/qwen2.5-1.5b.sh && torchrun ... pretrain_gpt.py "${MODEL_ARGS[@]}" ...
#
# Transcribed from https://huggingface.co/Qwen/Qwen2.5-1.5B/blob/main/config.json
#   model_type qwen2, num_hidden_layers 28, hidden_size 1536, intermediate_size 8960,
#   num_attention_heads 12, num_key_value_heads 2, head_dim 128, hidden_act silu,
#   rms_norm_eps 1e-06, rope_theta 1000000.0, max_position_embeddings 131072,
#   vocab_size 151936, tie_word_embeddings true, attention_dropout 0.0, initializer_range 0.02.
# Qwen2 layers: bias on Q/K/V only, SwiGLU MLP, RMSNorm; use_sliding_window false.
# TOKENIZER: a Hugging Face model directory or hub id (default Qwen/Qwen2.5-1.5B).
# Its tokenizer has fewer ids (151665) than the checkpoint's 151936 embedding rows, so the
# padded vocabulary is given explicitly (configs/README.md, "Vocabulary").

MODEL_ARGS=(
    --num-layers 28
    --hidden-size 1536
    --ffn-hidden-size 8960
    --num-attention-heads 12
    --group-query-attention
    --num-query-groups 2
    --kv-channels 128
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --max-position-embeddings 131072
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --add-qkv-bias
    # tie_word_embeddings true: Megatron ties by default (no --untie-... flag)
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --attention-softmax-in-fp32
    --init-method-std 0.02
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "${TOKENIZER:-Qwen/Qwen2.5-1.5B}"
    --padded-vocab-size 151936
)
