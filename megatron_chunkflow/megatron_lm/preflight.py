"""The launch checks that need no --chunkflow: what Megatron-LM's validate_args would assert (a
traceback, exit 1) or find only at the first save, named by flag before Megatron builds
anything (megatron_lm/plugin.py calls it first in validate_args).
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_chunkflow.flags import check_output_dir
from megatron_chunkflow.megatron_lm.args import (
    LaunchError,
    add_chunkflow_arguments,
    chunkflow_config,
)


def check_launch_layout(args) -> None:
    """What Megatron-LM's validate_args would assert (a traceback) or find only at the first save,
    checked first and named by flag, with or without --chunkflow: the batch, the processes the
    layout needs, virtual stages without a pipeline, an unwritable --save."""
    world = int(os.environ.get("WORLD_SIZE", getattr(args, "world_size", None) or 1))
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    problems = [f"{flag} must be >= 1, got {value}" for flag, value in (
        ("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
        ("--context-parallel-size", cp), ("--global-batch-size", args.global_batch_size),
        ("--micro-batch-size", args.micro_batch_size)) if value is not None and value < 1]
    if problems:
        raise LaunchError("; ".join(problems))
    model = tp * pp * cp
    if world % model:
        raise LaunchError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size "
                          f"{pp} x --context-parallel-size {cp} = {model} processes per model "
                          f"replica, and this job has {world} (WORLD_SIZE): start a multiple of "
                          f"{model}")
    dp = world // model
    gbs, mbs = args.global_batch_size, args.micro_batch_size
    if mbs is None:
        raise LaunchError("--micro-batch-size is required (Megatron-LM has no default; ChunkFlow "
                          "runs 1)")
    if gbs is not None and gbs % (mbs * dp):
        raise LaunchError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size "
                          f"{mbs} x {dp} data-parallel ranks = {mbs * dp}, as Megatron-LM "
                          "requires")
    virtual = [flag for flag, dest in (
        ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage"),
        ("--num-virtual-stages-per-pipeline-rank", "num_virtual_stages_per_pipeline_rank"))
        if getattr(args, dest, None)]
    if virtual and pp < 2:
        raise LaunchError(f"{virtual[0]} needs --pipeline-model-parallel-size >= 2 (virtual "
                          f"stages interleave a pipeline), got {pp}")
    try:
        check_output_dir("--save", getattr(args, "save", None))
    except ValueError as e:
        raise LaunchError(str(e)) from None


def check_chunkflow_flags(argv: list[str]) -> None:
    """The plugin's own flags among `argv` (others ignored), parsed and checked as the launcher
    does: argparse's error or a LaunchError naming the flag (scripts/slurm/submit.sh, on the
    login node, for EXTRA_ARGS)."""
    parser = add_chunkflow_arguments(argparse.ArgumentParser(
        prog="EXTRA_ARGS", usage="EXTRA_ARGS: the plugin's flags checked here", add_help=False))
    args, _ = parser.parse_known_args(argv)
    try:
        chunkflow_config(args)
    except ValueError as e:
        raise LaunchError(str(e)) from None


if __name__ == "__main__":  # python -m megatron_chunkflow.megatron_lm.preflight ARGS...
    try:
        check_chunkflow_flags(sys.argv[1:])
    except LaunchError as e:
        print(f"EXTRA_ARGS: {e}", file=sys.stderr)
        sys.exit(2)

