"""The golden comparison for a refactor: `verify`, `train`, `plan` and `simulate` on their embedded
defaults, their JSON at two commits byte-identical except the wall-clock fields.

    python scripts/golden_json.py HEAD~3            # that commit against the working tree
    python scripts/golden_json.py main HEAD --keep out/golden   # two commits; keep the JSON
    python scripts/golden_json.py HEAD~3 --layouts  # also verify at TP 2, PP 2, PP 2 x VPP 2, CP 2

The older tree runs from a temporary `git worktree` with this checkout's Python; each command
runs in a fresh process, its stdout (one JSON object) parsed, the fields a clock or the host's
memory sets (WALL_CLOCK) dropped wherever they appear, and the rest compared as canonical JSON.
Exit 0 when every command agrees, 1 with the first differing path of each that does not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "verify": ["verify"],
    "train": ["train", "--train-iters", "3"],
    "plan": ["plan"],
    "simulate": ["simulate", "--global-batch-size", "256", "--gpus", "8"],
}
# `verify` in a job of 2 processes (torchrun) for each parallel layout (--layouts)
LAYOUTS = {
    "verify_tp2": ["verify", "--tp", "2"],
    "verify_pp2": ["verify", "--pp", "2"],
    "verify_pp2_vpp2": ["verify", "--pp", "2", "--vpp", "2"],
    "verify_cp2": ["verify", "--cp", "2"],
}
# fields a clock or the process's memory sets: never compared
WALL_CLOCK = {"step_s", "tokens_per_s", "model_tflops", "peak_mem_bytes", "wall_s", "elapsed_s",
              "seconds", "started", "date",
              "measured"}  # verify's bubble_ratio.measured: from the ops' timings


def strip(value):
    """`value` without WALL_CLOCK keys, at any depth."""
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in WALL_CLOCK}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def first_difference(a, b, path: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{path or '.'}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key}: only in {'the new' if key in b else 'the old'}"
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def run_all(tree: Path, commands: dict) -> dict:
    """{command: its stripped JSON} with the package of `tree` (the LAYOUTS ones under torchrun,
    2 processes: rank 0 prints the JSON)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = {}
    for name, argv in commands.items():
        launcher = [sys.executable, "-m", "megatron_chunkflow"]
        if name in LAYOUTS:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "-m", "megatron_chunkflow"]
        with tempfile.TemporaryDirectory() as cwd:
            run = subprocess.run([*launcher, *argv, "--json"],
                                 cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
        if run.returncode != 0:
            raise SystemExit(f"{tree}: chunkflow {' '.join(argv)} exited {run.returncode}:\n"
                             f"{run.stderr[-2000:]}")
        out[name] = strip(json.loads(run.stdout))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", help="the commit to compare against")
    ap.add_argument("new", nargs="?", default=None, help="a commit (default: the working tree)")
    ap.add_argument("--keep", metavar="DIR", help="write each side's JSON here")
    ap.add_argument("--layouts", action="store_true",
                    help="also `verify` at TP 2, PP 2, PP 2 x VPP 2 and CP 2 (2 processes each)")
    args = ap.parse_args()
    commands = {**COMMANDS, **(LAYOUTS if args.layouts else {})}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for side, rev in (("old", args.old), ("new", args.new)):
            if rev is None:
                trees[side] = ROOT
                continue
            path = Path(tmp) / side
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path),
                            rev], check=True, capture_output=True)
            trees[side] = path
        try:
            results = {side: run_all(tree, commands) for side, tree in trees.items()}
        finally:
            for side, rev in (("old", args.old), ("new", args.new)):
                if rev is not None:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                    str(trees[side])], capture_output=True)
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        for side, result in results.items():
            (Path(args.keep) / f"{side}.json").write_text(json.dumps(result, indent=1,
                                                                     sort_keys=True))
    failed = 0
    for name in commands:
        found = first_difference(results["old"][name], results["new"][name])
        print(f"{name}: " + ("identical" if found is None else f"differs at {found}"))
        failed += found is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
