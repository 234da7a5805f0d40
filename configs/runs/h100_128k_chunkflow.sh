# ChunkFlow, SFT at 128K context, on nodes of 8x H100 80GB (fits H200 141GB unchanged).
# A 128K sequence becomes dependent chunks whose K/V state stays on the GPU. LAYOUT is generated
# by scripts/slurm/layouts.py: the simulator's fastest layout, chunk size and K that fit on the
# run's nodes (the same nodes as h100_128k_stock.sh).
#
#   source configs/runs/h100_128k_chunkflow.sh && run_config llama3.1-8b

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RUN_NAME=h100_128k_chunkflow
SYSTEM=chunkflow
SEQ_LENGTH=131072       # the longest sequence accepted (longer ones follow --overlong)
GLOBAL_BATCH_SIZE=2048  # sequences: about 2.1M tokens per step on profile C
MOCK_PROFILE=C          # --mock-data lengths: profile C of docs/design.md (tail 16K-96K)
RUN_TRAINING_ARGS=(
    --no-rope-fusion  # ChunkFlow applies RoPE by position ids (runtime/model.py)
)

#                      nodes  TP  PP  CP  recompute              chunk   K  piece
declare -gA LAYOUT=(
    [llama3.1-8b]="        2   2   1   4  none                   32768   2      0"
    [mistral-nemo-12b]="   4   4   1   2  none                   32768   2      0"
    [llama3.1-70b]="      16   4 4x2   2  selective:layernorm     8192   1      0"
)
