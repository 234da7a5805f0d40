"""`chunkflow`: the command line.

Conventions shared by every subcommand:
- `--json` prints exactly one JSON object on stdout; human text then goes to stderr.
- Exit 0 on success, 1 when a check failed, 2 on bad usage or bad input (the message names the
  flag, value, file and line).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line summary); each module has add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "plan": ("megatron_chunkflow.cli.plan",
             "cut, pack and schedule one global batch; compare with stock Megatron's 1F1B"),
    "train": ("megatron_chunkflow.cli.train",
              "fine-tune with ChunkFlow (or --no-chunkflow: stock Megatron); the main job"),
    "verify": ("megatron_chunkflow.cli.verify",
               "check chunked training against unchunked megatron-core: loss, gradients, memory"),
    "bench": ("megatron_chunkflow.cli.bench",
              "measure stock Megatron against ChunkFlow on this machine: same model, data, "
              "layout and memory budget"),
    "simulate": ("megatron_chunkflow.cli.simulate",
                 "predict step time, MFU and memory per GPU on a cluster: Megatron vs ChunkFlow"),
    "calibrate": ("megatron_chunkflow.cli.calibrate",
                  "measure this GPU's rates (GEMM, attention, memory-bound kernels, launches) "
                  "and write a device profile for simulate"),
    "memory": ("megatron_chunkflow.cli.memory",
               "trace one job's GPU memory per GPU on this machine, beside the model, and say "
               "whether it fits a named GPU"),
}
# the subcommands that run megatron-core: refused at start on a release outside compat.RANGE
RUN_MEGATRON = {"train", "verify", "bench", "calibrate", "memory"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chunkflow",
        description="ChunkFlow long-context fine-tuning for Megatron-LM / megatron-core.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                title="commands")
    for name, (module, summary) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in RUN_MEGATRON:
        from megatron_chunkflow import compat

        try:
            compat.check_release()
        except compat.UnsupportedRelease as e:
            print(f"chunkflow {args.command}: error: {e}", file=sys.stderr)
            return 2
    try:
        return importlib.import_module(args.module).run(args)
    except ValueError as e:  # user-facing errors (core raises ValueError only for bad input)
        print(f"chunkflow {args.command}: error: {e}", file=sys.stderr)
        return 2
