"""ChunkFlow's chunk size x K at a fixed product: memory and step time (CPU, PP=2, ~2 minutes).

    python scripts/benchmarks/sweep_chunk_k.py                    # C x K = 8192
    python scripts/benchmarks/sweep_chunk_k.py --product 4096 --out /tmp/sweep

With C x K fixed, the last K chunks of the long sequence hold the same number of tokens and the
same tokens are re-forwarded (L - C K), so activations and recompute FLOPs stay about equal; what
changes is the number of chunks (per-op overhead, pipeline fill) and the kernels' efficiency at
size C (the held chunks' attention reads views of the one K/V buffer, whatever K). Same batch and meters as sweep_chunk_size.py.
"""

from __future__ import annotations

import sys

import _sweep


def main(argv=None) -> int:
    import argparse

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--product", type=int, default=8192, help="C x K (default: 8192)")
    known, rest = extra.parse_known_args(argv)
    args = _sweep.parse(__doc__.split("\n")[0], rest)
    pairs = [(c, known.product // c) for c in (512, 1024, 2048, 4096, 8192, 16384)
             if known.product % c == 0 and c <= known.product]
    configs = [{"system": "chunkflow", "chunk_size": c, "k": k} for c, k in pairs]
    rows, out = _sweep.run(args, configs, "sweep_chunk_k",
                           f"Chunk size x K at C x K = {known.product}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['chunk_size']} x {r['k']}" for r in rows]
    fig, (ax, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    _sweep.stacked(ax, labels, rows)
    ax.set_xlabel("C x K")
    ax.legend(fontsize=7)
    ax_t.bar(labels, [r["step_s"] for r in rows], color="#54a24b")
    ax_t.set_ylabel("step time (s)")
    ax_t.set_xlabel("C x K")
    fig.suptitle(f"C x K = {known.product}: one {args.long}-token sequence + "
                 f"{args.num_short} short ones", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "sweep_chunk_k.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
