"""The simulator's prediction tables in docs/benchmarks-appendix.md: every Qwen2.5 size at 32K and 256K,
and the other families (Qwen3, Llama 3.1, Mistral Nemo) at 32K and, where the model's positions
reach it, 128K, against each stock baseline (megatron-sft, -packed, -unpacked, -hybrid-cp).

    python scripts/benchmarks/simulate_table.py                 # markdown on stdout
    python scripts/benchmarks/simulate_table.py --families      # the other families' table
    python scripts/benchmarks/simulate_table.py --gpu-profile h200 --json
    python scripts/benchmarks/simulate_table.py --models qwen2.5-7b --seq-lengths 32768
    python scripts/benchmarks/simulate_table.py --resume out/qwen.jsonl   # in parts: run again

Per (model, context): `chunkflow simulate --baseline all --auto` (every layout, virtual stages
per pipeline rank V included, and recompute option searched for each stock baseline, ChunkFlow's
layout, V, recompute, (chunk size, K), --chunkflow-reforward-attention and its loss whole or in
pieces searched too, each stock prediction again at CP overlap 0 and 1, and, where ChunkFlow
pieces its loss, with the same loss), run in-process through the CLI;
then, per baseline, the pinned command that reproduces its row, run once more and checked to
give the same numbers. GPUs per model and the global batch (64 sequences per GPU, at least 2048;
profile B, seed 0) are fixed below.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_chunkflow.cli import main as cli_main  # noqa: E402
from megatron_chunkflow.cli.simulate import NAMES  # noqa: E402
from megatron_chunkflow.core.hybrid_cp import FLAG as MAX_SEQLEN_FLAG  # noqa: E402
from megatron_chunkflow.perfmodel.gpu_profiles import (  # noqa: E402
    describe,
    load_profile,
    profile_names,
)
from megatron_chunkflow.perfmodel.predict import GIB  # noqa: E402

GPUS_PER_MODEL = {"qwen2.5-0.5b": 8, "qwen2.5-1.5b": 8, "qwen2.5-3b": 8, "qwen2.5-7b": 32,
                  "qwen2.5-14b": 32, "qwen2.5-32b": 64, "qwen2.5-72b": 128,
                  "qwen3-8b": 32, "qwen3-14b": 32, "qwen3-32b": 64, "llama3.1-8b": 32,
                  "mistral-nemo-12b": 32, "llama3.1-70b": 128}
SEQ_LENGTHS = (32768, 262144)
# (model, context): Qwen3's positions stop at 40K (YaRN is not supported); Llama 3.1's and
# Mistral Nemo's reach 128K
FAMILY_ROWS = [("qwen3-8b", 32768), ("qwen3-14b", 32768), ("qwen3-32b", 32768),
               ("llama3.1-8b", 32768), ("llama3.1-8b", 131072), ("mistral-nemo-12b", 32768),
               ("mistral-nemo-12b", 131072), ("llama3.1-70b", 32768), ("llama3.1-70b", 131072)]


def batch_size(gpus: int) -> int:
    return max(2048, 64 * gpus)


def setup_args(model: str, seq: int, gpus: int, gpu: str) -> list[str]:
    return ["--model", model, "--seq-length", str(seq), "--gpus", str(gpus), "--gpu-profile", gpu,
            "--global-batch-size", str(batch_size(gpus))]


def pp_text(layout: dict) -> str:
    """PP, or PPxV with virtual stages (the form --megatron-parallel takes)."""
    return f"{layout['pp']}x{layout['vpp']}" if layout.get("vpp", 1) > 1 else str(layout["pp"])


def flag(layout: dict) -> str:
    return f"{layout['tp']},{layout['cp']},{pp_text(layout)},{layout['recompute']}"


def simulate(argv: list[str]) -> dict:
    """`chunkflow simulate ARGV --json`, in-process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = cli_main(["simulate", *argv, "--json"])
    assert rc == 0, argv
    return json.loads(out.getvalue())


def layout_cell(p: dict, chunkflow: bool = False) -> str:
    lay = p["layout"]
    m = p.get("max_seqlen_per_dp_cp_rank")
    cp = "h" if m else lay["cp"]  # megatron-hybrid-cp: a CP size per sequence
    cell = f"{lay['tp']},{cp},{pp_text(lay)},{lay['dp']} {lay['recompute']}"
    if m:
        cell += f", M {m // 1024}K"
    if chunkflow:
        cell += f", {p['chunk_size'] // 1024}K, {p['k']}"
        if p.get("cp_kv") == "replicated":
            cell += ", K/V replicated"
        if p.get("reforward_attention", "recompute") != "recompute":
            cell += f", attention {p['reforward_attention']}"
        if p.get("loss_piece"):
            cell += f", loss in {p['loss_piece']}-token pieces"
    return cell


def speedup_cell(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else "n/a"


def rows_for(model: str, seq: int, gpus: int, gpu: str) -> list[dict]:
    """One row per baseline: the searched predictions and the pinned command, checked."""
    setup = setup_args(model, seq, gpus, gpu)
    found = simulate([*setup, "--baseline", "all", "--auto",
                      "--chunkflow-reforward-attention", "auto", "--chunkflow-loss-piece", "auto"])
    cf = found["chunkflow"]
    rows = []
    for name in NAMES:
        mg = found["baselines"][name]
        argv = [*setup, "--baseline", name, "--megatron-parallel", flag(mg["layout"]),
                "--chunkflow-parallel", flag(cf["layout"]), "--chunk-size", str(cf["chunk_size"]),
                "--chunkflow-k", str(cf["k"])]
        if "max_seqlen_per_dp_cp_rank" in mg:
            argv += [MAX_SEQLEN_FLAG, str(mg["max_seqlen_per_dp_cp_rank"])]
        if "cp_kv" in cf:
            argv += ["--chunkflow-cp-kv", cf["cp_kv"]]
        if cf["reforward_attention"] != "recompute":
            argv += ["--chunkflow-reforward-attention", cf["reforward_attention"]]
        if cf.get("loss_piece"):
            argv += ["--chunkflow-loss-piece", str(cf["loss_piece"])]
        again = simulate(argv)
        for got, want in ((again["baselines"][name], found["baselines"][name]),
                          (again["chunkflow"], cf)):
            assert abs(got["step_s"] - want["step_s"]) <= 1e-9 * want["step_s"], (argv, name)
        rng = found["cp_overlap"]["range"]
        rows.append({"model": model, "seq_length": seq, "gpus": gpus, "baseline": name,
                     "sequences": found["setup"]["global_batch_size"],
                     "tokens": found["setup"]["tokens"], "longest": found["setup"]["longest"],
                     "megatron": found["baselines"][name], "chunkflow": cf,
                     "speedup": found["speedups"][name], "strongest": found["strongest"],
                     "speedup_same_loss": found["speedups_same_loss"].get(name),
                     "speedup_cp_overlap": {e: rng[e][name]["speedup"] for e in rng},
                     "cp_overlap": found["cp_overlap"]["value"],
                     "command": "chunkflow simulate " + " ".join(argv)})
    return rows


def markdown(rows: list[dict], gpu: str) -> None:
    hw = load_profile(gpu)
    print(f"Every row: {describe(hw)}.\n")
    print(f"| # | model | context | GPUs ({hw.name}) | tokens (longest) | baseline | "
          "Megatron TP,CP,PP[xV],DP recompute | "
          "step s | MFU | GiB | pad | ChunkFlow TP,CP,PP[xV],DP recompute, C, K | step s | MFU | "
          f"GiB | speedup (CP overlap {rows[0]['cp_overlap']:g}; 0 / 1) |")
    print("|---" * 16 + "|")
    for i, r in enumerate(rows, 1):
        mg, cf = r["megatron"], r["chunkflow"]
        first = i == 1 or (rows[i - 2]["model"], rows[i - 2]["seq_length"]) != \
            (r["model"], r["seq_length"])
        fits = "" if mg["fits"] else " (does not fit)"
        name = r["model"]
        name = name.removeprefix("qwen2.5-").upper() if name.startswith("qwen2.5-") else name
        cells = [str(i), name if first else "",
                 f"{r['seq_length'] // 1024}K" if first else "", str(r["gpus"]) if first else "",
                 f"{r['tokens'] / 1e6:.2f}M ({r['longest'] // 1024}K)" if first else "",
                 r["baseline"].removeprefix("megatron-"), layout_cell(mg), f"{mg['step_s']:.2f}",
                 f"{mg['mfu']:.1%}", f"{mg['peak_mem_gib']:.1f}{fits}",
                 f"{mg['padding_fraction']:.1%}"]
        if first:
            cf_fits = "" if cf["fits"] else " (does not fit)"
            cells += [layout_cell(cf, chunkflow=True), f"{cf['step_s']:.2f}", f"{cf['mfu']:.1%}",
                      f"{cf['peak_mem_gib']:.1f}{cf_fits}"]
        else:
            cells += ["", "", "", ""]
        ends = r["speedup_cp_overlap"]
        same = (f"; {speedup_cell(r['speedup_same_loss'])} given the same loss"
                if r.get("speedup_same_loss") is not None else "")
        cells.append(f"{speedup_cell(r['speedup'])} ({speedup_cell(ends['0'])} / "
                     f"{speedup_cell(ends['1'])}){same}")
        print("| " + " | ".join(cells) + " |")
    print("\nChunkFlow against the strongest stock baseline (the fastest that fits):\n")
    for r in rows:
        if r["baseline"] == r["strongest"]:
            print(f"- {r['model']} {r['seq_length'] // 1024}K: {r['strongest']}, "
                  f"{speedup_cell(r['speedup'])}")
    print("\nCommands (row number: command):\n\n```")
    for i, r in enumerate(rows, 1):
        print(f"{i:>2}: {r['command']}")
    print("```")
    print(f"\nMemory budget: {hw.usable_bytes / GIB:.1f} GiB allocated at most of "
          f"{hw.memory_gib:g} GiB per GPU ({hw.reserve_gib:g} GiB outside PyTorch, "
          f"{hw.fragmentation:.0%} for the allocator's fragmentation).")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu-profile", dest="gpu", choices=profile_names(), default="h100",
                    help="the device profile (perfmodel/gpu_profiles.py; default: the h100 "
                         "datasheet, not calibrated)")
    ap.add_argument("--models", nargs="+", choices=sorted(GPUS_PER_MODEL),
                    default=[m for m in GPUS_PER_MODEL if m.startswith("qwen2.5-")])
    ap.add_argument("--seq-lengths", nargs="+", type=int, default=list(SEQ_LENGTHS))
    ap.add_argument("--families", action="store_true",
                    help="the other families' (model, context) pairs instead of --models")
    ap.add_argument("--json", action="store_true", help="rows as JSON instead of markdown")
    ap.add_argument("--resume", metavar="FILE", help="keep each (model, context)'s rows in FILE "
                    "(JSON lines) as they are found, and skip the pairs FILE already has: a long "
                    "regeneration in parts")
    args = ap.parse_args()
    rows = []
    pairs = FAMILY_ROWS if args.families else [(m, s) for m in args.models
                                                 for s in args.seq_lengths]
    done = {}
    if args.resume and Path(args.resume).is_file():
        for line in Path(args.resume).read_text().splitlines():
            entry = json.loads(line)
            done[(entry["model"], entry["seq_length"], entry["gpu"])] = entry["rows"]
    for model, seq in pairs:
        if (model, seq, args.gpu) in done:
            rows += done[(model, seq, args.gpu)]
            continue
        t = time.perf_counter()
        found = rows_for(model, seq, GPUS_PER_MODEL[model], args.gpu)
        rows += found
        if args.resume:
            with open(args.resume, "a") as f:
                f.write(json.dumps({"model": model, "seq_length": seq, "gpu": args.gpu,
                                    "rows": found}) + "\n")
        print(f"{model} {seq}: {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        markdown(rows, args.gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
