# Mistral-Nemo-Base-2407 architecture for Megatron-LM core_v0.16.1 (pretrain_gpt.py flags).
#
#   source configs/models/mistral-nemo-12b.sh && torchrun ... pretrain_gpt.py "${MODEL_ARGS[@]}" ...
#
# Transcribed from https://huggingface.co/mistralai/Mistral-Nemo-Base-2407/blob/main/config.json
#   model_type mistral, num_hidden_layers 40, hidden_size 5120, intermediate_size 14336,
#   num_attention_heads 32, num_key_value_heads 8, head_dim 128, hidden_act silu,
#   rms_norm_eps 1e-05, rope_theta 1000000.0, max_position_embeddings 1024000,
#   vocab_size 131072, tie_word_embeddings false, attention_dropout 0.0, initializer_range 0.02.
# Mistral layers: no bias, SwiGLU MLP, RMSNorm, sliding_window null.
# TOKENIZER: a Hugging Face model directory or hub id (default mistralai/Mistral-Nemo-Base-2407).
# Its tokenizer has exactly the checkpoint's 131072 embedding rows; --padded-vocab-size keeps
# any TP size from padding it further (configs/README.md, "Vocabulary").

MODEL_ARGS=(
    --num-layers 40
    --hidden-size 5120
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --max-position-embeddings 1024000
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights  # tie_word_embeddings false
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --attention-softmax-in-fp32
    --init-method-std 0.02
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "${TOKENIZER:-mistralai/Mistral-Nemo-Base-2407}"
    --padded-vocab-size 131072
)
