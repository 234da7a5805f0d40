# Shared by every configs/runs/h100_*.sh file: Megatron-LM core_v0.16.1 flags for Qwen2.5 SFT and
# run_config, which reads a run file's LAYOUT table for one model.
#
#   source configs/models/qwen2.5-7b.sh
#   source configs/runs/h100_32k_chunkflow.sh   # sources this file
#   run_config qwen2.5-7b                       # sets the variables below, or fails naming MODEL
#   torchrun ... "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" \
#       "${CHUNKFLOW_ARGS[@]}"
#
# run_config sets NODES (8-GPU nodes), TP, PP, VPP (a row's PP column may read PPxV: V virtual
# stages per pipeline rank), CP, DP, RECOMPUTE, CHUNK_SIZE, CHUNKFLOW_K and LOSS_PIECE (the loss
# in pieces of that many tokens, 0 or absent: whole) ("" for stock runs), and the arrays
# PARALLEL_ARGS, TRAINING_ARGS and CHUNKFLOW_ARGS (empty for stock runs). configs/README.md explains every choice. Data flags are added by the launcher
# (scripts/slurm/train.sbatch).

GPUS_PER_NODE=8

# Optimizer and schedule: full-parameter SFT of a pretrained Qwen2.5 (AdamW, cosine to 10% of peak,
# 3% warmup), bf16 weights with fp32 main grads, distributed optimizer with overlapped grad
# reduce-scatter / param all-gather. Per-token loss: every target token weighs the same however the
# sequences are packed or chunked (the gradient ChunkFlow reproduces exactly).
COMMON_TRAINING_ARGS=(
    --micro-batch-size 1
    --train-iters "${TRAIN_ITERS:-1000}"
    --lr 1e-5
    --min-lr 1e-6
    --lr-decay-style cosine
    --lr-warmup-fraction 0.03
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --calculate-per-token-loss
    --log-interval 1
    --log-throughput
    --log-memory-interval 10
    --eval-iters 0
    --distributed-timeout-minutes 30
)

# run_config MODEL: fill the variables above from the sourced run file's LAYOUT[MODEL] row.
run_config() {
    local model=$1 row recompute_args=()
    if [[ -z ${LAYOUT[$model]+set} ]]; then
        echo "configs/runs/${RUN_NAME}.sh: no layout for model '$model'" \
             "(known: $(printf '%s ' "${!LAYOUT[@]}" | tr ' ' '\n' | sort | xargs))" >&2
        return 1
    fi
    row=${LAYOUT[$model]}
    read -r NODES TP PP CP RECOMPUTE CHUNK_SIZE CHUNKFLOW_K LOSS_PIECE <<< "$row"
    VPP=1  # PP written PPxV: V virtual stages per pipeline rank (interleaved 1F1B)
    if [[ $PP == *x* ]]; then
        VPP=${PP#*x} PP=${PP%x*}
    fi
    DP=$(( NODES * GPUS_PER_NODE / (TP * PP * CP) ))
    case $RECOMPUTE in
        none) ;;
        full) recompute_args=(--recompute-granularity full --recompute-method uniform
                              --recompute-num-layers 1) ;;
        block:*) recompute_args=(--recompute-granularity full --recompute-method block
                                 --recompute-num-layers "${RECOMPUTE#block:}") ;;
        selective) recompute_args=(--recompute-granularity selective) ;;  # core_attn
        selective:*) local modules=${RECOMPUTE#selective:}
                     # shellcheck disable=SC2206  # M1+M2 -> two words
                     recompute_args=(--recompute-granularity selective
                                     --recompute-modules ${modules//+/ }) ;;
        *) echo "configs/runs/${RUN_NAME}.sh: bad recompute '$RECOMPUTE' for $model" >&2
           return 1 ;;
    esac
    PARALLEL_ARGS=(
        --tensor-model-parallel-size "$TP"
        --pipeline-model-parallel-size "$PP"
        --context-parallel-size "$CP"
        "${recompute_args[@]}"
    )
    if (( TP > 1 )); then
        PARALLEL_ARGS+=(--sequence-parallel)
    fi
    if (( VPP > 1 )); then
        PARALLEL_ARGS+=(--num-virtual-stages-per-pipeline-rank "$VPP")
    fi
    TRAINING_ARGS=(
        "${COMMON_TRAINING_ARGS[@]}"
        --seq-length "$SEQ_LENGTH"
        --global-batch-size "$GLOBAL_BATCH_SIZE"
        "${RUN_TRAINING_ARGS[@]}"
    )
    CHUNKFLOW_ARGS=()
    if [[ $SYSTEM == chunkflow ]]; then
        CHUNKFLOW_ARGS=(
            --chunkflow
            --chunk-size "$CHUNK_SIZE"
            --chunkflow-k "$CHUNKFLOW_K"
            # auto: the fastest backend that has been tested on this device type
            # (see docs/megatron-lm.md)
            --chunkflow-attention-backend "${CHUNKFLOW_ATTENTION_BACKEND:-auto}"
            --overlong "${OVERLONG:-error}"
        )
        if (( ${LOSS_PIECE:-0} > 0 )); then
            CHUNKFLOW_ARGS+=(--chunkflow-loss-piece "$LOSS_PIECE")
        fi
    else
        CHUNK_SIZE="" CHUNKFLOW_K="" LOSS_PIECE=""
    fi
}
