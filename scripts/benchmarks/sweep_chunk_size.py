"""Activation memory against ChunkFlow's chunk size at fixed lengths (CPU, PP=2, ~2 minutes).

    python scripts/benchmarks/sweep_chunk_size.py                 # out/bench/sweep_chunk_size.*
    python scripts/benchmarks/sweep_chunk_size.py --long 32768 --out /tmp/sweep

One batch (a long sequence + short profile-B ones), K = 1, C from 512 to the long sequence's
length, next to megatron-packed without recompute, with block:1 and with full recompute; every number measured with
`chunkflow bench`'s meters (bytes saved for backward + K/V state, worst stage). Writes a markdown
table, a CSV, the JSON rows and a PNG.
"""

from __future__ import annotations

import sys

import _sweep


def main(argv=None) -> int:
    args = _sweep.parse(__doc__.split("\n")[0], argv)
    sizes = [c for c in (512, 1024, 2048, 4096, 8192, 16384, 32768) if c <= args.long]
    configs = ([{"system": "chunkflow", "chunk_size": c, "k": 1} for c in sizes]
               + [{"system": "megatron-packed", "recompute": r} for r in ("none", "block:1", "full")])
    rows, out = _sweep.run(args, configs, "sweep_chunk_size",
                           "Activation memory vs chunk size (K = 1)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cf = [r for r in rows if r["system"] == "chunkflow"]
    fig, ax = plt.subplots(figsize=(7, 4))
    _sweep.stacked(ax, [str(r["chunk_size"]) for r in cf], cf)
    ax.plot([str(r["chunk_size"]) for r in cf], [r["modelled_peak_bytes"] / _sweep.MIB
                                                 for r in cf], "k.--", label="modelled peak")
    for r, style in zip([r for r in rows if r["system"] != "chunkflow"], ("-", "--", ":")):
        ax.axhline(r["peak_bytes"] / _sweep.MIB, color="gray", linestyle=style,
                   label=f"{r['system']}, recompute {r['recompute']}")
    ax.set_xlabel("chunk size C (K = 1)")
    ax.set_title(f"one {args.long}-token sequence + {args.num_short} short ones", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sweep_chunk_size.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
