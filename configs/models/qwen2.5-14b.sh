# Qwen2.5-14B architecture for Megatron-LM core_v0.16.1 (pretrain_gpt.py flags).
#
#   source configs/models/qwen2.5-14b.sh && torchrun ... pretrain_gpt.py "${MODEL_ARGS[@]}" ...
#
# Transcribed from https://huggingface.co/Qwen/Qwen2.5-14B/blob/main/config.json
#   model_type qwen2, num_hidden_layers 48, hidden_size 5120, intermediate_size 13824,
#   num_attention_heads 40, num_key_value_heads 8, head_dim 128, hidden_act silu,
#   rms_norm_eps 1e-05, rope_theta 1000000.0, max_position_embeddings 131072,
#   vocab_size 152064, tie_word_embeddings false, attention_dropout 0.0, initializer_range 0.02.
# Qwen2 layers: bias on Q/K/V only, SwiGLU MLP, RMSNorm; use_sliding_window false.
# TOKENIZER: a Hugging Face model directory or hub id (default Qwen/Qwen2.5-14B).
# Its tokenizer has fewer ids (151665) than the checkpoint's 152064 embedding rows, so the
# padded vocabulary is given explicitly (configs/README.md, "Vocabulary").

MODEL_ARGS=(
    --num-layers 48
    --hidden-size 5120
    --ffn-hidden-size 13824
    --num-attention-heads 40
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --max-position-embeddings 131072
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --add-qkv-bias
    --untie-embeddings-and-output-weights  # tie_word_embeddings false
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --attention-softmax-in-fp32
    --init-method-std 0.02
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "${TOKENIZER:-Qwen/Qwen2.5-14B}"
    --padded-vocab-size 152064
)
