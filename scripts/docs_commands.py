"""Every command in README.md and docs/*.md (configs/ and scripts/slurm/ READMEs too), run exactly
as written after the README's install (`make demo`; `chunkflow` from .venv/bin on PATH, as
`source .venv/bin/activate` gives; out/, which `make demo` makes), from the repository root.

    python scripts/docs_commands.py --list       # every command, where it is, its class
    python scripts/docs_commands.py              # the quick ones (seconds each; CI runs these)
    python scripts/docs_commands.py --all        # quick and slow (minutes each: about an hour)
    python scripts/docs_commands.py --all --doc docs/hf.md   # one document's

A command is quick, slow (it trains, benchmarks or searches for minutes) or not run here, with the
reason: it needs a GPU, a cluster, your own files (a path such as /models/..., a placeholder such
as <your Megatron args> or ...), or it is the README's own setup (`make demo`, `make test`). The
rules are CLASSES below, first match wins; a command no rule names is slow. Lines a code block
runs before a command (`export`, `source`, a file written with `printf`) are run before it in the
same shell. Exit 1 naming every command that failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
        "configs/README.md", "scripts/slurm/README.md"]
COMMAND = re.compile(r"^(chunkflow|make|python|\.venv/|export|source|torchrun|sbatch|bash|pip|"
                     r"printf|PYTHONPATH|cd |git )")
SETUP = re.compile(r"^(export|source|printf) ")  # run again before the block's later commands
# (pattern, class): "quick", "slow", or "skip: why"
CLASSES = [
    (r"<[^>]+>|\.\.\.|/models/|/opt/|/data/|/scratch|/ckpt/|\$OUT/logs|\$HOME/venvs",
     "skip: needs your own files or arguments (a placeholder or a path of yours)"),
    (r"^make (demo|test)\b", "skip: the README's setup itself (CI runs `make test`)"),
    (r"calibrate|device_check\.sh --out \"\$OUT\"|make gpu-wheels",
     "skip: needs a GPU node (or the network, for the wheels)"),
    (r"^(sbatch|export (OUT|DATA|TOKENIZER|CHECKPOINT|VENV|MEGATRON_LM_DIR)=)",
     "skip: a SLURM cluster's setting"),
    (r"^source configs/|torchrun \.\.\.", "skip: sets a SLURM run's arrays (scripts/slurm/)"),
    (r"^chunkflow plan\b", "quick"),
    (r"^chunkflow simulate --gpu-profile h200-torch2\.11-local --model qwen2\.5-1\.5b --gpus 1",
     "quick"),
    (r"^printf ", "quick"),
]


@dataclass
class Command:
    path: str
    line: int
    text: str
    setup: list[str]  # the block's earlier export/source/printf lines

    @property
    def kind(self) -> str:
        bare = self.text.split("  #")[0].strip()
        return next((k for pattern, k in CLASSES if re.search(pattern, bare)), "slow")


def commands() -> list[Command]:
    """Every command in a ``` block of DOCS, continuation lines joined."""
    out = []
    for path in DOCS:
        lines = (REPO / path).read_text().splitlines()
        in_block, current, start, setup = False, "", 0, []
        for i, line in enumerate(lines, 1):
            if line.startswith("```"):
                in_block, current, setup = not in_block, "", []
                continue
            if not in_block:
                continue
            if current:
                current += " " + line.strip()
            elif COMMAND.match(line):
                current, start = line, i
            else:
                continue
            if current.rstrip().endswith("\\"):
                current = current.rstrip()[:-1].rstrip()
                continue
            out.append(Command(path, start, current, list(setup)))
            if SETUP.match(current):
                setup.append(current)
            current = ""
    return out


def run(cmd: Command, timeout: float) -> tuple[int, float, str]:
    (REPO / "out").mkdir(exist_ok=True)  # as `make demo` leaves it
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    script = "\n".join(["set -e", *cmd.setup, cmd.text])
    start = time.perf_counter()
    try:
        p = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=timeout)
        rc, tail = p.returncode, (p.stderr or p.stdout).strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        rc, tail = 124, [f"did not finish in {timeout:.0f} s"]
    return rc, time.perf_counter() - start, tail[0] if tail else ""


def chunkflow_argv(text: str) -> list[str] | None:
    """The `chunkflow` argument list of a command that runs the CLI (`chunkflow ...`, `python
    -m megatron_chunkflow ...`, `torchrun ... -m megatron_chunkflow ...`), else None."""
    words = shlex.split(text.split("  #")[0], comments=True)
    if words[:1] == ["chunkflow"]:
        return words[1:]
    if "megatron_chunkflow" in words and words[words.index("megatron_chunkflow") - 1] == "-m":
        return words[words.index("megatron_chunkflow") + 1:]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="list the commands, run nothing")
    mode.add_argument("--all", action="store_true", help="run the slow commands too")
    ap.add_argument("--timeout", type=float, default=3600, metavar="S",
                    help="seconds a command may take (default: 3600)")
    ap.add_argument("--doc", action="append", choices=DOCS, metavar="PATH",
                    help="only the commands of this document (repeatable; default: all)")
    args = ap.parse_args(argv)
    failed, ran = [], {}  # a command written in several places runs once
    for cmd in commands():
        if args.doc and cmd.path not in args.doc:
            continue
        kind = cmd.kind
        where = f"{cmd.path}:{cmd.line}"
        if args.list or kind.startswith("skip") or (kind == "slow" and not args.all):
            print(f"{where:<28} {kind if not kind.startswith('skip') else 'not run'}: {cmd.text}"
                  + (f"\n{'':<28} ({kind[6:]})" if kind.startswith("skip") else ""))
            continue
        key = (cmd.text.split("  #")[0].strip(), tuple(cmd.setup))
        if key in ran:
            print(f"{where:<28} {kind} as at {ran[key]}: {cmd.text}")
            continue
        ran[key] = where
        rc, seconds, last = run(cmd, args.timeout)
        print(f"{where:<28} {kind} {'ok' if rc == 0 else f'FAILED (exit {rc})'} "
              f"{seconds:.0f} s: {cmd.text}" + (f"\n{'':<28} {last}" if rc else ""), flush=True)
        if rc:
            failed.append(f"{where}: {cmd.text}")
    if failed:
        print("\n".join(["", "failed:", *failed]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
