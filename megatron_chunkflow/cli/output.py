"""Where a subcommand's output goes: human text, and with --json one JSON object on stdout."""

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

    def result(self, obj: dict) -> None:
        if self.as_json and not self.quiet:
            json.dump(obj, sys.stdout, separators=(",", ":"))
            sys.stdout.write("\n")


def check_output_file(flag: str, path: str | None) -> None:
    """A file this command will write, checked before any work: ValueError naming `flag` when it
    is a directory or its directory is missing or not writable."""
    import os

    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: directory {parent} is not writable")


def check_output_dir(flag: str, path: str | None) -> None:
    """A directory this command will create or write into: ValueError naming `flag` when it is an
    existing file, or when it is missing and so is its nearest existing ancestor's write access."""
    import os

    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a file, not a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"{flag} {path}: {existing} is not writable")
