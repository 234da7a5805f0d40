# ChunkFlow, SFT at 32K context, on nodes of 8x H100 80GB (fits H200 141GB unchanged).
# CP = 1 (configs/README.md says why); sequences longer than the chunk size are cut into dependent chunks, the rest are
# packed into standalone chunks of CHUNK_SIZE tokens; K chunks of a long sequence keep activations
# (configs/README.md, "ChunkFlow at 32K").
#
#   source configs/runs/h100_32k_chunkflow.sh && run_config qwen2.5-7b

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RUN_NAME=h100_32k_chunkflow
SYSTEM=chunkflow
SEQ_LENGTH=32768        # the longest sequence accepted (longer ones follow --overlong)
GLOBAL_BATCH_SIZE=1024  # sequences (not rows): about 1.1M tokens per step on profile A
MOCK_PROFILE=A          # --mock-data lengths: profile A of docs/design.md (tail up to 32K)
RUN_TRAINING_ARGS=(
    --no-rope-fusion  # ChunkFlow applies RoPE by position ids (runtime/model.py)
)

#                      nodes  TP  PP  CP  recompute  chunk  K
declare -gA LAYOUT=(
    [qwen2.5-7b]="         2   2   1   1  none        8192  1"
    [qwen2.5-14b]="        2   4   1   1  none        8192  1"
    [qwen2.5-32b]="        4   8   1   1  none        8192  1"
    [qwen2.5-72b]="        8   8   4   1  none        8192  2"
)
