#!/bin/bash
# Submit SFT runs of scripts/slurm/train.sbatch, with --nodes taken from the run config.
#
#   scripts/slurm/submit.sh MODEL CONTEXT SYSTEM [sbatch options...]
#   scripts/slurm/submit.sh qwen2.5-7b 32k chunkflow
#   scripts/slurm/submit.sh qwen2.5-72b 256k both --time 06:00:00   # stock and ChunkFlow
#   scripts/slurm/submit.sh all all both                             # every run config's rows
#   DRY_RUN=1 scripts/slurm/submit.sh all all both                   # check, print the sbatch lines
#
# MODEL: a configs/models name (qwen2.5-7b, llama3.1-8b, ...) or all (every model with a row in
# the context's run config); CONTEXT: 32k|128k|256k|all;
# SYSTEM: chunkflow|stock|both. The environment (MEGATRON_LM_DIR, OUT, DATA, CHECKPOINT,
# TOKENIZER, ...) is passed to the job; scripts/slurm/README.md lists it. Every input is checked
# before anything is submitted: a bad one stops with a message naming it and exit status 2.

set -euo pipefail

die() { echo "submit.sh: $*" >&2; exit 2; }

if (( $# < 3 )); then
    sed -n '2,13p' "$0" >&2
    exit 2
fi
models=$1 contexts=$2 systems=$3
shift 3
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export REPO_DIR
HW=${HW:-h100}

# ---- arguments ----------------------------------------------------------------------------------
[[ -n $models ]] || die "MODEL is empty: give a configs/models name or all"
known_contexts=$(cd "$REPO_DIR/configs/runs" && { ls -- "${HW}"_*_chunkflow.sh 2>/dev/null || :; } |
                 sed "s/^${HW}_//; s/_chunkflow\.sh$//" | sort -n | xargs)
[[ -n $contexts ]] || die "CONTEXT is empty: give ${known_contexts// /, } or all"
[[ $contexts == all ]] && contexts=$known_contexts
case $systems in
    both) systems="stock chunkflow" ;;
    stock|chunkflow) ;;
    *) die "SYSTEM '$systems': give chunkflow, stock or both" ;;
esac
known_models=$(cd "$REPO_DIR/configs/models" && ls -- *.sh | sed 's/\.sh$//' | xargs)
for model in $models; do
    [[ $model == all || -f $REPO_DIR/configs/models/$model.sh ]] ||
        die "MODEL '$model': no configs/models/$model.sh (known: $known_models, all)"
done
for context in $contexts; do
    for system in $systems; do
        [[ -f $REPO_DIR/configs/runs/${HW}_${context}_${system}.sh ]] ||
            die "CONTEXT '$context': no run config configs/runs/${HW}_${context}_${system}.sh" \
                "(HW=$HW; contexts: ${known_contexts// /, }, all)"
    done
done

# ---- environment --------------------------------------------------------------------------------
positive_int() {  # positive_int NAME: $NAME unset, or a whole number >= 1
    local value=${!1:-}
    [[ -z $value || ( $value =~ ^[0-9]+$ && $value =~ [1-9] ) ]] ||
        die "$1=$value: not a whole number >= 1"
}
has() { [[ " $systems " == *" $1 "* ]]; }

[[ -n ${MEGATRON_LM_DIR:-} ]] ||
    die "MEGATRON_LM_DIR is not set: a Megatron-LM checkout at tag core_v0.16.1"
[[ -f $MEGATRON_LM_DIR/pretrain_gpt.py ]] ||
    die "MEGATRON_LM_DIR=$MEGATRON_LM_DIR has no pretrain_gpt.py"
[[ -n ${OUT:-} ]] || die "OUT is not set: a directory for logs, TensorBoard and checkpoints"
[[ ! -e $OUT || -d $OUT ]] || die "OUT=$OUT exists and is not a directory"
MOCK=${MOCK:-0}
[[ $MOCK == 0 || $MOCK == 1 ]] || die "MOCK=$MOCK: give 1 (mock data) or 0"
if [[ $MOCK == 0 ]]; then
    [[ -n ${DATA:-} ]] || die "DATA is not set: an indexed-dataset prefix (PREFIX.bin + .idx)," \
        "a ChunkFlow .jsonl/.json/.parquet file or directory, or MOCK=1"
    if [[ -f $DATA.bin && -f $DATA.idx ]]; then
        text_data=0
    elif [[ ( $DATA == *.bin || $DATA == *.idx ) &&
            -f ${DATA%.*}.bin && -f ${DATA%.*}.idx ]]; then
        die "DATA=$DATA: give the indexed-dataset prefix without .bin/.idx (${DATA%.*})"
    elif [[ -d $DATA || -f $DATA ]]; then
        text_data=1
    else
        die "DATA=$DATA: no such file or directory, and no $DATA.bin + $DATA.idx"
    fi
    if (( text_data )) && has stock; then
        die "DATA=$DATA: stock Megatron-LM reads only an indexed-dataset prefix (PREFIX.bin +" \
            ".idx); see scripts/slurm/README.md, 'Data'"
    fi
    if (( text_data )) && [[ -f $DATA && $DATA != *.jsonl && $DATA != *.json &&
                             $DATA != *.parquet ]]; then
        die "DATA=$DATA: ChunkFlow reads .jsonl, .json or .parquet files, a directory of them," \
            "or an indexed-dataset prefix"
    fi
    if (( text_data )) && [[ ! -f ${TOKENIZER:-}/tokenizer.json ]]; then
        die "TOKENIZER='${TOKENIZER:-}': ChunkFlow on DATA=$DATA needs a local Hugging Face" \
            "model directory with tokenizer.json"
    fi
fi
if [[ ${TOKENIZER:-} == [/.~]* && ! -d $TOKENIZER ]]; then
    die "TOKENIZER=$TOKENIZER: no such directory (give a model directory or a hub id)"
fi
if [[ -n ${CHECKPOINT:-} && ! -d $CHECKPOINT ]]; then
    die "CHECKPOINT=$CHECKPOINT: no such directory"
fi
if [[ -n ${VENV:-} && ! -f $VENV/bin/activate ]]; then
    die "VENV=$VENV: no bin/activate there"
fi
positive_int TRAIN_ITERS
positive_int SAVE_INTERVAL
positive_int MASTER_PORT
if [[ -n ${MASTER_PORT:-} ]] && (( 10#$MASTER_PORT > 65535 )); then
    die "MASTER_PORT=$MASTER_PORT: not a port number (1-65535)"
fi
case ${OVERLONG:-error} in
    error|drop|split) ;;
    *) die "OVERLONG=$OVERLONG: give error, drop or split" ;;
esac
case ${CHUNKFLOW_ATTENTION_BACKEND:-auto} in
    auto|torch|cpu_flash|sdpa|flex|varlen|flash|te) ;;
    *) die "CHUNKFLOW_ATTENTION_BACKEND=$CHUNKFLOW_ATTENTION_BACKEND: give auto, torch, sdpa," \
           "flex, varlen, flash or te" ;;
esac
if [[ -n ${EXTRA_ARGS:-} ]] && has chunkflow; then  # the plugin's flags among them, as it checks
    python=${PYTHON:-${VENV:+$VENV/bin/}python3}
    read -r -a extra_args <<< "$EXTRA_ARGS"
    if ! why=$(cd "$REPO_DIR" && "$python" -m megatron_chunkflow.megatron_lm.preflight \
               "${extra_args[@]}" 2>&1); then
        [[ $why == *"EXTRA_ARGS"* ]] || die "EXTRA_ARGS not checked: $python cannot run" \
            "megatron_chunkflow here (${why##*$'\n'}); set VENV to the job's environment"
        die "${why##*$'\n'}"
    fi
fi
if [[ -z ${DRY_RUN:-} ]] && ! command -v sbatch > /dev/null; then
    die "sbatch not found on PATH (DRY_RUN=1 checks and prints the commands without it)"
fi

# ---- one sbatch command per run, each checked by the job script's own dry run -------------------
commands=()
layout_models() {  # the models with a row in a context's ChunkFlow run config, in its order
    sed -n 's/^[[:space:]]*\[\([^]]*\)\]=".*/\1/p' "$REPO_DIR/configs/runs/${HW}_$1_chunkflow.sh"
}
for context in $contexts; do
    context_models=$models
    [[ $models == all ]] && context_models=$(layout_models "$context" | xargs)
    for model in $context_models; do
        for system in $systems; do
            run_file=$REPO_DIR/configs/runs/${HW}_${context}_${system}.sh
            if ! nodes=$(
                # shellcheck source=/dev/null
                source "$run_file" 2>&1 && run_config "$model" 2>&1 && echo "$NODES"
            ) || [[ ! $nodes =~ ^[0-9]+$ ]]; then
                die "MODEL '$model': ${nodes##*$'\n'}"
            fi
            if ! check=$(MODEL=$model CONTEXT=$context SYSTEM=$system HW=$HW MOCK=$MOCK \
                         DRY_RUN=1 bash "$REPO_DIR/scripts/slurm/train.sbatch" 2>&1 > /dev/null)
            then
                die "${model} ${context} ${system}: ${check##*$'\n'}"
            fi
            cmd=(sbatch --nodes "$nodes" --job-name "${model}_${context}_${system}"
                 --export "ALL,MODEL=$model,CONTEXT=$context,SYSTEM=$system,HW=$HW"
                 "$@" "$REPO_DIR/scripts/slurm/train.sbatch")
            commands+=("$(printf '%q ' "${cmd[@]}")")
        done
    done
done

queued=()
for line in "${commands[@]}"; do
    if [[ -n ${DRY_RUN:-} ]]; then
        echo "$line"
    elif eval "$line"; then
        queued+=("${line##*--job-name }")
    else
        echo "submit.sh: sbatch failed: $line" >&2
        if (( ${#queued[@]} )); then
            echo "submit.sh: already queued (${#queued[@]}): ${queued[*]%% *}" >&2
        fi
        exit 1
    fi
done
