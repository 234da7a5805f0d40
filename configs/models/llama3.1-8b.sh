# Llama-3.1-8B architecture for Megatron-LM core_v0.16.1 (pretrain_gpt.py flags).
#
#   source configs/models/llama3.1-8b.sh && torchrun ... pretrain_gpt.py "${MODEL_ARGS[@]}" ...
#
# Transcribed from https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
#   model_type llama, num_hidden_layers 32, hidden_size 4096, intermediate_size 14336,
#   num_attention_heads 32, num_key_value_heads 8, head_dim 128, hidden_act silu,
#   rms_norm_eps 1e-05, rope_theta 500000.0, max_position_embeddings 131072,
#   rope_scaling llama3: factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0,
#   original_max_position_embeddings 8192,
#   vocab_size 128256, tie_word_embeddings false, attention_dropout 0.0, initializer_range 0.02.
# Llama layers: no bias, SwiGLU MLP, RMSNorm, RoPE scaled by the llama3 rule.
# TOKENIZER: a Hugging Face model directory or hub id (default meta-llama/Llama-3.1-8B).
# Its tokenizer has exactly the checkpoint's 128256 embedding rows; --padded-vocab-size keeps
# any TP size from padding it further (configs/README.md, "Vocabulary").

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --position-embedding-type rope
    --rotary-base 500000
    --rotary-percent 1.0
    --max-position-embeddings 131072
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --use-rope-scaling
    --rope-scaling-factor 8
    --untie-embeddings-and-output-weights  # tie_word_embeddings false
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --attention-softmax-in-fp32
    --init-method-std 0.02
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "${TOKENIZER:-meta-llama/Llama-3.1-8B}"
    --padded-vocab-size 128256
)
