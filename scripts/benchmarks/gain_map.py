"""Where ChunkFlow helps: its predicted speedup against the strongest stock baseline that fits,
over model size (Qwen2.5 0.5B-72B) x context (32K-256K), on the calibrated H200 profile and the
H100 datasheet; a figure (PNG), a markdown table and one JSON line per cell.

    python scripts/benchmarks/gain_map.py --resume out/gain_map.jsonl \
        --png docs/gain_map.png --markdown docs/gain_map.md          # every cell, in parts
    python scripts/benchmarks/gain_map.py --models qwen2.5-0.5b --seq-lengths 32768 \
        --devices h100 --global-batch-size 64                         # one cell, seconds

Each cell is `chunkflow simulate`'s comparison with its defaults (perfmodel/comparison.py
compare: every stock baseline, megatron-sft, -packed, -unpacked and -hybrid-cp, on its fastest
layout and recompute that fits; ChunkFlow on its fastest layout, recompute, chunk size, K and
re-forward mode that fits) on the model's GPUs (GPUS below, as docs/benchmarks-appendix.md's
tables) and a profile-B global batch of --global-batch-size sequences (seed 0) truncated to the
context, at the device's CP overlap (not again at 0 and 1 as `simulate` prints). The cell is the
speedup against the fastest stock baseline that fits; "none fits" where no stock baseline does and ChunkFlow does;
"x" where nothing fits. tests/scripts/test_gain_map.py checks cells against `chunkflow simulate`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_chunkflow.cli.simulate import NAMES  # noqa: E402  every stock baseline
from megatron_chunkflow.core.lengths import LengthsConfig  # noqa: E402
from megatron_chunkflow.core.models import get_model_shape  # noqa: E402
from megatron_chunkflow.mcore.hybrid_cp import balanced_cp_groups  # noqa: E402
from megatron_chunkflow.perfmodel.comparison import compare, verdict  # noqa: E402
from megatron_chunkflow.perfmodel.gpu_profiles import describe, load_profile  # noqa: E402

MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b",
          "qwen2.5-32b", "qwen2.5-72b")
GPUS = {"qwen2.5-0.5b": 8, "qwen2.5-1.5b": 8, "qwen2.5-3b": 8, "qwen2.5-7b": 32,
        "qwen2.5-14b": 32, "qwen2.5-32b": 64, "qwen2.5-72b": 128}
SEQ_LENGTHS = (32768, 65536, 131072, 262144)
# the device profiles (`simulate --gpu-profile`): the calibrated H200, the H100 datasheet
DEVICES = {"h200": "h200-torch2.11-local", "h100": "h100"}
BATCH = 256  # profile-B sequences per global batch: a search of minutes per cell at 72B
SIMULATE = ("simulate", "--model", "{model}", "--seq-length", "{seq}", "--gpus", "{gpus}",
            "--gpu-profile", "{profile}", "--global-batch-size", "{batch}")


def simulate_argv(model: str, seq: int, device: str, batch: int) -> list[str]:
    """The `chunkflow simulate` command line whose comparison a cell is."""
    values = dict(model=model, seq=seq, gpus=GPUS[model], profile=DEVICES[device], batch=batch)
    return [a.format(**values) for a in SIMULATE]


def cell(model: str, seq: int, device: str, batch: int = BATCH) -> dict:
    """One cell: ChunkFlow's best fitting plan against each stock baseline's, and the verdict."""
    hw = load_profile(DEVICES[device])
    gpus = GPUS[model]
    raw, _ = LengthsConfig(profile="B", global_batch_size=batch).lengths(batch)
    lengths = [min(n, seq) for n in raw]
    start = time.perf_counter()
    result = compare(lengths, get_model_shape(model), hw, gpus, seq, NAMES, balanced_cp_groups,
                     auto_chunking=True, reforward=None, overlap_ends=False)
    judged = verdict(result, gpus)
    cf = result.chunkflow
    return {"model": model, "seq_length": seq, "device": device, "profile": hw.profile,
            "calibrated": hw.calibrated, "gpus": gpus, "sequences": batch,
            "speedup": judged["speedup"], "strongest": result.strongest,
            "helps": judged["helps"], "chunkflow_fits": cf.fits, "cause": judged["cause"],
            "verdict": judged["text"],
            "speedups": result.speedups,
            "chunkflow": cf.to_json(),
            "stock": ({n: p.to_json() for n, p in result.baselines.items()}),
            "command": "chunkflow " + " ".join(simulate_argv(model, seq, device, batch)),
            "search_s": round(time.perf_counter() - start, 1)}


def label(c: dict) -> str:
    if c["speedup"] is not None:
        return f"{c['speedup']:.2f}x"
    return "none fits" if c["chunkflow_fits"] else "x"


def short(model: str) -> str:
    return model.removeprefix("qwen2.5-").upper()


def markdown(cells: list[dict]) -> str:
    """One table per device: rows models, columns contexts, each cell labelled."""
    lines = []
    for device in dict.fromkeys(c["device"] for c in cells):
        mine = {(c["model"], c["seq_length"]): c for c in cells if c["device"] == device}
        seqs = sorted({s for _, s in mine})
        models = [m for m in MODELS if any((m, s) in mine for s in seqs)]
        hw = load_profile(DEVICES[device])
        first = next(iter(mine.values()))
        lines += [f"**{hw.name}**, {describe(hw)}; global batch {first['sequences']} profile-B "
                  "sequences; speedup against the strongest stock baseline that fits "
                  "(after the number):", "",
                  "| model (GPUs) | " + " | ".join(f"{s // 1024}K" for s in seqs) + " |",
                  "|---" * (len(seqs) + 1) + "|"]
        for m in models:
            row = [f"{short(m)} ({GPUS[m]})"]
            for s in seqs:
                c = mine.get((m, s))
                row.append("" if c is None else f"{label(c)} {(c['strongest'] or '')}"
                           .replace("megatron-", "").strip())
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def draw(cells: list[dict], path: str) -> None:
    """A heat map per device: green where ChunkFlow is faster, red where slower, each cell
    labelled with the speedup and the strongest stock baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    devices = list(dict.fromkeys(c["device"] for c in cells))
    fig, axes = plt.subplots(1, len(devices), figsize=(5.2 * len(devices), 4.6), squeeze=False)
    norm = TwoSlopeNorm(vmin=0.8, vcenter=1.0, vmax=1.6)
    for ax, device in zip(axes[0], devices):
        mine = {(c["model"], c["seq_length"]): c for c in cells if c["device"] == device}
        seqs = sorted({s for _, s in mine})
        models = [m for m in MODELS if any((m, s) in mine for s in seqs)]
        grid = [[(mine[m, s]["speedup"] if (m, s) in mine and mine[m, s]["speedup"] is not None
                  else float("nan")) for s in seqs] for m in models]
        ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
        for i, m in enumerate(models):
            for j, s in enumerate(seqs):
                c = mine.get((m, s))
                if c is not None:
                    base = (c["strongest"] or "").replace("megatron-", "")
                    ax.text(j, i, f"{label(c)}\n{base}", ha="center", va="center", fontsize=8)
        hw = load_profile(DEVICES[device])
        ax.set_xticks(range(len(seqs)), [f"{s // 1024}K" for s in seqs])
        ax.set_yticks(range(len(models)), [f"{short(m)} ({GPUS[m]} GPUs)" for m in models])
        ax.set_xlabel("context (--seq-length)")
        kind = "calibrated" if hw.calibrated else "datasheet, not calibrated"
        ax.set_title(f"{hw.name} ({kind})", fontsize=10)
    fig.suptitle("ChunkFlow's predicted speedup against the strongest stock Megatron baseline "
                 f"that fits\n(global batch {cells[0]['sequences']} profile-B sequences; "
                 "each system on its best fitting plan)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--seq-lengths", nargs="+", type=int, choices=SEQ_LENGTHS,
                    default=list(SEQ_LENGTHS))
    ap.add_argument("--devices", nargs="+", choices=sorted(DEVICES), default=list(DEVICES))
    ap.add_argument("--global-batch-size", type=int, default=BATCH, metavar="N",
                    help=f"profile-B sequences per global batch (default: {BATCH})")
    ap.add_argument("--resume", metavar="FILE",
                    help="keep each cell in FILE (JSON lines) as it is found, and skip the cells "
                         "FILE already has: the whole map takes hours on one core")
    ap.add_argument("--png", metavar="PATH", help="draw the map")
    ap.add_argument("--markdown", metavar="PATH", help="write the tables (default: stdout)")
    args = ap.parse_args(argv)
    if args.global_batch_size < 1:
        ap.error(f"--global-batch-size must be >= 1, got {args.global_batch_size}")
    done = {}
    if args.resume and Path(args.resume).is_file():
        for line in Path(args.resume).read_text().splitlines():
            c = json.loads(line)
            done[c["model"], c["seq_length"], c["device"], c["sequences"]] = c
    cells = []
    for device in args.devices:
        for model in args.models:
            for seq in args.seq_lengths:
                key = (model, seq, device, args.global_batch_size)
                if key not in done:
                    print(f"gain_map: {model} {seq // 1024}K on {GPUS[model]} x {device} ...",
                          file=sys.stderr, flush=True)
                    done[key] = cell(model, seq, device, args.global_batch_size)
                    print(f"gain_map:   {label(done[key])} against {done[key]['strongest']} "
                          f"({done[key]['search_s']:.0f} s)", file=sys.stderr, flush=True)
                    if args.resume:
                        with open(args.resume, "a") as f:
                            f.write(json.dumps(done[key]) + "\n")
                cells.append(done[key])
    text = markdown(cells)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    else:
        print(text)
    if args.png:
        draw(cells, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
