"""Where a command's output goes: human text, and with --json exactly one JSON object on stdout
(human text then goes to stderr). Every `chunkflow` subcommand writes through Output.
"""

from __future__ import annotations

import json
import sys


class Output:
    """`say` writes human text (stdout, or stderr under --json); `result` writes the JSON object."""

    def __init__(self, as_json: bool, quiet: bool = False):
        self.as_json = as_json
        self.quiet = quiet  # e.g. every rank but the first of a torchrun job

    def say(self, text: str = "") -> None:
        if not self.quiet:
            print(text, file=sys.stderr if self.as_json else sys.stdout)

    def progress(self, text: str) -> None:
        """A line on stderr while something long runs (a search, a trace); none under --json."""
        if not self.as_json and not self.quiet:
            print(text, file=sys.stderr, flush=True)

    def result(self, obj: dict) -> None:
        if self.as_json and not self.quiet:
            json.dump(obj, sys.stdout, separators=(",", ":"))
            sys.stdout.write("\n")
