# Stock Megatron-LM, SFT at 256K context, on nodes of 8x H100 80GB (fits H200 141GB unchanged).
# Every micro-batch is one row of 262,144 packed tokens: context parallelism splits the row and
# full recompute keeps one layer's activations (configs/README.md, "Stock at 256K").
#
#   source configs/runs/h100_256k_stock.sh && run_config qwen2.5-7b

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RUN_NAME=h100_256k_stock
SYSTEM=stock
SEQ_LENGTH=262144
GLOBAL_BATCH_SIZE=8  # rows of 256K tokens: 2.1M tokens per step
RUN_TRAINING_ARGS=(
    # Megatron asserts max_position_embeddings >= seq_length; RoPE has no position table, so this
    # raises a limit and adds no weights. The checkpoints were trained to 32K (128K with YaRN).
    --max-position-embeddings "$SEQ_LENGTH"
)

# The same node count as h100_256k_chunkflow.sh.
#                      nodes  TP  PP  CP  recompute
declare -gA LAYOUT=(
    [qwen2.5-7b]="         2   4   1   4  full"
    [qwen2.5-14b]="        4   8   1   2  full"
    [qwen2.5-32b]="        8   8   2   4  full"
    [qwen2.5-72b]="       16   8   4   4  full"
)
