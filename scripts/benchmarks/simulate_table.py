"""The simulator's prediction table in docs/benchmarks.md: every Qwen2.5 size at 32K and 256K.

    python scripts/benchmarks/simulate_table.py                 # markdown on stdout
    python scripts/benchmarks/simulate_table.py --gpu h200 --json

Per row: stock Megatron on its fastest layout that fits, ChunkFlow on its fastest layout and
(chunk size, K) that fit (`chunkflow simulate --auto`, layouts searched), then the pinned command
that reproduces the row, which is run once through the CLI and checked to give the same numbers.
GPUs per model and the global batch (64 sequences per GPU, at least 2048; profile B, seed 0)
are fixed below.
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
from megatron_chunkflow.perfmodel.hardware import GPUS, get_gpu  # noqa: E402
from megatron_chunkflow.core.models import get_model_shape  # noqa: E402
from megatron_chunkflow.perfmodel.predict import GIB  # noqa: E402
from megatron_chunkflow.core.profiles import sample_lengths  # noqa: E402
from megatron_chunkflow.perfmodel.search import best_chunkflow, best_megatron  # noqa: E402

GPUS_PER_MODEL = {"qwen2.5-0.5b": 8, "qwen2.5-1.5b": 8, "qwen2.5-3b": 8, "qwen2.5-7b": 32,
                  "qwen2.5-14b": 32, "qwen2.5-32b": 64, "qwen2.5-72b": 128}
SEQ_LENGTHS = (32768, 262144)


def batch_size(gpus: int) -> int:
    return max(2048, 64 * gpus)


def command(model: str, seq: int, gpus: int, gpu: str, mg, cf) -> list[str]:
    return ["--model", model, "--seq-length", str(seq), "--gpus", str(gpus), "--gpu", gpu,
            "--global-batch-size", str(batch_size(gpus)),
            "--megatron-parallel", mg.layout.to_flag(), "--chunkflow-parallel", cf.layout.to_flag(),
            "--chunk-size", str(cf.chunk_size), "--chunkflow-k", str(cf.k)]


def reproduce(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = cli_main(["simulate", *argv, "--json"])
    assert rc == 0, argv
    return json.loads(out.getvalue())


def layout_cell(p) -> str:
    lay = p.layout
    return f"{lay.tp},{lay.cp},{lay.pp},{lay.dp} {lay.recompute}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    ap.add_argument("--json", action="store_true", help="rows as JSON instead of markdown")
    args = ap.parse_args()
    hw = get_gpu(args.gpu)
    rows = []
    for model, gpus in GPUS_PER_MODEL.items():
        shape = get_model_shape(model)
        raw = sample_lengths("B", batch_size(gpus), seed=0)
        for seq in SEQ_LENGTHS:
            t = time.process_time()
            lengths = [min(n, seq) for n in raw]
            mg = best_megatron(lengths, shape, hw, gpus, seq)
            cf = best_chunkflow(lengths, shape, hw, gpus, seq, auto_chunking=True)
            argv = command(model, seq, gpus, args.gpu, mg, cf)
            again = reproduce(argv)
            for name, p in (("megatron", mg), ("chunkflow", cf)):
                assert abs(again[name]["step_s"] - p.step_s) <= 1e-9 * p.step_s, (argv, name)
            rows.append({"model": model, "seq_length": seq, "gpus": gpus,
                         "sequences": len(lengths), "tokens": sum(lengths),
                         "longest": max(lengths), "megatron": mg.to_json(),
                         "chunkflow": cf.to_json(), "speedup": again["speedup"],
                         "command": "chunkflow simulate " + " ".join(argv)})
            print(f"{model} {seq}: {time.process_time() - t:.1f}s", file=sys.stderr)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print(f"| # | model | context | GPUs ({args.gpu}) | tokens (longest) | Megatron TP,CP,PP,DP "
          "recompute | step s | MFU | GiB | ChunkFlow TP,CP,PP,DP recompute, C, K | step s | "
          "MFU | GiB | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        mg, cf = r["megatron"], r["chunkflow"]
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "n/a (does not fit)"
        cells = [str(i), r["model"].removeprefix("qwen2.5-").upper(), f"{r['seq_length'] // 1024}K",
                 str(r["gpus"]), f"{r['tokens'] / 1e6:.2f}M ({r['longest'] // 1024}K)"]
        for p, extra in ((mg, ""), (cf, f", {cf['chunk_size'] // 1024}K, {cf['k']}")):
            lay = p["layout"]
            fits = "" if p["fits"] else " (does not fit)"
            cells += [f"{lay['tp']},{lay['cp']},{lay['pp']},{lay['dp']} {lay['recompute']}{extra}",
                      f"{p['step_s']:.2f}", f"{p['mfu']:.1%}", f"{p['peak_mem_gib']:.1f}{fits}"]
        cells.append(sp)
        print("| " + " | ".join(cells) + " |")
    print("\nCommands (row number: command):\n\n```")
    for i, r in enumerate(rows, 1):
        print(f"{i:>2}: {r['command']}")
    print("```")
    usable = hw.usable_bytes / GIB
    print(f"\nMemory budget: {usable:.1f} GiB usable of {hw.hbm_gb:g} GB per GPU "
          f"(reserve {hw.reserve_fraction:.0%}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
