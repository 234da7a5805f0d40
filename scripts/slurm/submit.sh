#!/bin/bash
# Submit Qwen2.5 SFT runs of scripts/slurm/train.sbatch, with --nodes taken from the run config.
#
#   scripts/slurm/submit.sh MODEL CONTEXT SYSTEM [sbatch options...]
#   scripts/slurm/submit.sh qwen2.5-7b 32k chunkflow
#   scripts/slurm/submit.sh qwen2.5-72b 256k both --time 06:00:00   # stock and ChunkFlow
#   scripts/slurm/submit.sh all all both                             # the 16 runs of the README
#   DRY_RUN=1 scripts/slurm/submit.sh all all both                   # print the sbatch lines
#
# MODEL: qwen2.5-7b|qwen2.5-14b|qwen2.5-32b|qwen2.5-72b or all; CONTEXT: 32k|256k|all;
# SYSTEM: chunkflow|stock|both. The environment (MEGATRON_LM_DIR, OUT, DATA, CHECKPOINT,
# TOKENIZER, ...) is passed to the job; scripts/slurm/README.md lists it.

set -euo pipefail

if (( $# < 3 )); then
    sed -n '2,13p' "$0" >&2
    exit 2
fi
models=$1 contexts=$2 systems=$3
shift 3
[[ $models == all ]] && models="qwen2.5-7b qwen2.5-14b qwen2.5-32b qwen2.5-72b"
[[ $contexts == all ]] && contexts="32k 256k"
[[ $systems == both ]] && systems="stock chunkflow"
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export REPO_DIR
HW=${HW:-h100}

for model in $models; do
    for context in $contexts; do
        for system in $systems; do
            run_file=$REPO_DIR/configs/runs/${HW}_${context}_${system}.sh
            if [[ ! -f $run_file ]]; then
                echo "submit.sh: no run config $run_file" >&2
                exit 2
            fi
            nodes=$(
                # shellcheck source=/dev/null
                source "$run_file" && run_config "$model" && echo "$NODES"
            ) || exit 2
            cmd=(sbatch --nodes "$nodes" --job-name "${model}_${context}_${system}"
                 --export "ALL,MODEL=$model,CONTEXT=$context,SYSTEM=$system,HW=$HW"
                 "$@" "$REPO_DIR/scripts/slurm/train.sbatch")
            if [[ -n ${DRY_RUN:-} ]]; then
                printf '%q ' "${cmd[@]}"
                echo
            else
                "${cmd[@]}"
            fi
        done
    done
done
