"""`chunkflow`: the command line.

Conventions shared by every subcommand:
- `--json` prints exactly one JSON object on stdout; human text then goes to stderr.
- Exit 0 on success, 1 when a check failed, 2 on bad usage or bad input (the message names the
  flag, value, file and line).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
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


def first_rank() -> bool:
    """Whether this process speaks for a torchrun job: rank 0 (or no job). Every rank refuses the
    same bad input; one says so, or the ranks' lines run together."""
    return os.environ.get("RANK", "0") == "0"


class _Parser(argparse.ArgumentParser):
    """argparse's usage, help and errors printed by the first rank only; a usage error in one
    line with the closest spelling of a mistyped choice or flag, not the usage screen."""

    def _print_message(self, message, file=None):
        if first_rank():
            super()._print_message(message, file)

    def error(self, message: str):
        tail = (f" (`{self.prog} --help` lists the flags)"
                if message.startswith("unrecognized arguments") else "")
        self.exit(2, f"{self.prog}: error: {message}{self._did_you_mean(message)}{tail}\n")

    def _did_you_mean(self, message: str) -> str:
        choice = re.search(r"argument (\S+?)(?:/\S+)?: invalid choice: '([^']*)' \(choose from "
                           r"(.*)\)", message)
        if choice:
            flag, word = choice.group(1), choice.group(2)
            options = [c for a in self._actions if flag in a.option_strings or a.dest == flag
                       for c in (a.choices or ())]
            return _closest(word, [str(c) for c in options])
        unknown = re.search(r"unrecognized arguments: (.*)", message)
        if unknown:
            flags = [o for a in self._actions for o in a.option_strings]
            return "".join(_closest(w.split("=")[0], flags)
                           for w in unknown.group(1).split() if w.startswith("-"))
        return ""


def _closest(word: str, options: list[str]) -> str:
    """"; did you mean X?" for the option closest to `word` (case ignored), or ""."""
    lower = {o.lower(): o for o in options}
    match = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.6)
    return f"; did you mean {lower[match[0]]}?" if match else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="chunkflow",
        description="ChunkFlow long-context fine-tuning for Megatron-LM / megatron-core.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                title="commands", parser_class=_Parser)
    for name, (module, summary) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(module=module)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line; a flag the subcommand does not know is refused by the
    subcommand's parser, with the closest flag it has (SystemExit, as argparse)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from megatron_chunkflow.flags import flag_errors

    try:
        args = parse(argv)
    except SystemExit as e:  # argparse's usage error (exit 2), --help (exit 0)
        return e.code
    errors = flag_errors(args)
    if errors:  # every size flag out of bounds, in one line, before any work
        _refuse(args.command, "; ".join(errors))
        return 2
    if args.command in RUN_MEGATRON:
        from megatron_chunkflow import compat

        try:
            compat.check_release()
        except compat.UnsupportedRelease as e:
            _refuse(args.command, e)
            return 2
    try:
        return importlib.import_module(args.module).run(args)
    except ValueError as e:  # user-facing errors (core raises ValueError only for bad input)
        _refuse(args.command, e)
        return 2
    except BrokenPipeError:  # `chunkflow ... --json | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # and no flush error
        return 1


def _refuse(command: str, error: Exception) -> None:
    """One line for bad input, from the first rank."""
    if first_rank():
        print(f"chunkflow {command}: error: {error}", file=sys.stderr, flush=True)
