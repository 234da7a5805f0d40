# Stock Megatron-LM, SFT at 32K context, on nodes of 8x H100 80GB (fits H200 141GB unchanged).
# Every micro-batch is one row of 32,768 packed tokens; TP + sequence parallelism, CP and partial
# recompute sized so a row fits (configs/README.md, "Stock at 32K").
#
#   source configs/runs/h100_32k_stock.sh && run_config qwen2.5-7b

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RUN_NAME=h100_32k_stock
SYSTEM=stock
SEQ_LENGTH=32768
GLOBAL_BATCH_SIZE=32  # rows of 32K tokens: 1.05M tokens per step
RUN_TRAINING_ARGS=()

# The same node count as h100_32k_chunkflow.sh, so that the two compare on equal hardware.
#                      nodes  TP  PP  CP  recompute
declare -gA LAYOUT=(
    [qwen2.5-7b]="         2   4   1   1  block:4"
    [qwen2.5-14b]="        2   8   1   1  none"
    [qwen2.5-32b]="        4   8   2   2  none"
    [qwen2.5-72b]="        8   8   4   2  block:10"
)
