# ChunkFlow, SFT at 256K context, on nodes of 8x H100 80GB (fits H200 141GB unchanged).
# A 256K sequence becomes dependent chunks whose K/V state stays on the GPU. LAYOUT is generated
# by scripts/slurm/layouts.py: the simulator's fastest layout, chunk size and K that fit on the
# run's nodes (the same nodes as h100_256k_stock.sh).
#
#   source configs/runs/h100_256k_chunkflow.sh && run_config qwen2.5-7b

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RUN_NAME=h100_256k_chunkflow
SYSTEM=chunkflow
SEQ_LENGTH=262144       # the longest sequence accepted (longer ones follow --overlong)
GLOBAL_BATCH_SIZE=2048  # sequences: about 2.4M tokens per step on profile B
MOCK_PROFILE=B          # --mock-data lengths: profile B of docs/design.md (tail up to 256K)
RUN_TRAINING_ARGS=(
    --no-rope-fusion  # ChunkFlow applies RoPE by position ids (runtime/model.py)
    --max-position-embeddings "$SEQ_LENGTH"  # see h100_256k_stock.sh
)

#                      nodes  TP  PP  CP  recompute              chunk   K  piece
declare -gA LAYOUT=(
    [qwen2.5-7b]="         2   2   1   8  none                   65536   2      0"
    [qwen2.5-14b]="        4   4   1   8  none                  131072   1      0"
    [qwen2.5-32b]="        8   4 4x2   2  none                    8192   8      0"
    [qwen2.5-72b]="       16   4 8x2   2  none                    8192   8      0"
)
