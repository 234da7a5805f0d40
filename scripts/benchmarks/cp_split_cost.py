"""What ChunkFlow's CP ring costs the standalone chunks of a searched plan, and what a CP group
sized to each split segment (fewer ranks than the whole CP group) could gain or lose (simulator).

    python scripts/benchmarks/cp_split_cost.py --model qwen2.5-72b --seq-length 262144 \\
        --gpus 128 --global-batch-size 256          # ~3 minutes: the search of simulate --auto

Runs ChunkFlow's search as `chunkflow simulate --auto --chunkflow-reforward-attention auto` does
(profile B, seed 0, the same batch), rebuilds the chosen plan's chunks and, per GPU of the busiest
DP rank, over the layers it holds:

- ring: what the ring adds to the attention of the standalone chunks whose hybrid placement
  (core/cp_place.py) splits segments: the simulator's attention seconds with the ring, minus the
  same pairs computed with no traffic and no merges. No placement of those segments over fewer
  ranks can save more than this.
- per split segment longer than a rank's share of its chunk (the others are split only to keep
  the ranks' tokens within the padding bound): the smallest power-of-two group of ranks that
  could hold it within the share, and the attention seconds its busiest member would then add
  (the segment's pairs over that group instead of over all CP ranks), or "all" where it needs
  every rank.

Model outputs under the simulator's assumptions (docs/benchmarks-appendix.md), not measurements.
"""

from __future__ import annotations

import argparse
import sys

from megatron_chunkflow.core.cp_place import SPLIT, place_segments
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.perfmodel.hardware import get_gpu
from megatron_chunkflow.perfmodel.layer import (
    ATTN_BWD_FLOPS,
    attention_flops_per_pair_per_layer,
    layer_model,
)
from megatron_chunkflow.perfmodel.pairs import zigzag_split_pairs
from megatron_chunkflow.perfmodel.predict import cp_padded_lengths, runtime_layout, with_padding
from megatron_chunkflow.perfmodel.search import best_chunkflow
from megatron_chunkflow.perfmodel.work import chunk_work


def compute_seconds(pairs: float, shape, layout, hw) -> float:
    """Forward and backward seconds of `pairs` attention pairs in one layer, no traffic."""
    flops = pairs * attention_flops_per_pair_per_layer(shape, layout.tp)
    return (flops / (hw.peak_flops * hw.attn_fwd_eff)
            + ATTN_BWD_FLOPS * flops / (hw.peak_flops * hw.attn_bwd_eff))


def busiest_pairs(tokens: int, block: int, size: int) -> float:
    """The pairs of a standalone segment of `tokens` on the busiest of `size` ranks (ring)."""
    return max(own + others for own, others in zigzag_split_pairs(0, tokens, block, size))


def split_costs(pred, lengths, shape, hw) -> dict:
    """The ring's cost and each long split segment's smallest group, for Prediction `pred`."""
    layout = runtime_layout(pred.layout)
    if layout.cp == 1:
        raise ValueError(f"the plan chosen has no CP ({layout.to_json()}): nothing is split")
    m = layout.segment_multiple
    batch = build_chunks(cp_padded_lengths(lengths, m), pred.chunk_size, layout.dp,
                         pred.num_kept, shape, m, layout.chunk_padding)
    lm, block, cp = layer_model(shape, layout.degrees, hw), hw.attn_block, layout.cp
    layers = shape.num_layers / layout.pp  # per GPU
    ranks = []
    for r in range(layout.dp):
        ring, segments = 0.0, []
        for c in with_padding(list(batch.chunks_for_rank(r)), lengths):
            if c.is_dependent:
                continue
            w = chunk_work(c, block, cp, pred.cp_kv, layout.pad_multiple, pred.cp_placement)
            if not w.gathered:
                continue
            fwd, bwd = lm.attention(w.tokens, w.pairs, w.gathered, w.replicated, w.ring,
                                    w.whole, w.whole_pairs)
            ring += (fwd + bwd - compute_seconds(w.pairs, shape, layout, hw)) * layers
            n_all = [s.computed_tokens for s in c.segments]
            placed = (place_segments(n_all, cp, layout.pad_multiple)
                      if pred.cp_placement == "hybrid" else None)
            share = (placed.local_tokens if placed else c.computed_tokens // cp)
            for i, n in enumerate(n_all):
                if (placed and placed.owners[i] != SPLIT) or n <= share:
                    continue
                g = next((g for g in (2 ** k for k in range(1, cp.bit_length()))
                          if g < cp and n <= g * share), None)
                extra = None if g is None else compute_seconds(
                    busiest_pairs(n, block, g) - busiest_pairs(n, block, cp), shape, layout,
                    hw) * layers
                segments.append({"chunk": c.id, "tokens": n, "share": share, "group": g,
                                 "added_s": extra})
        ranks.append({"dp_rank": r, "ring_s": ring, "segments": segments})
    lay = pred.layout
    pp = f"{lay.pp} x {lay.vpp}" if lay.vpp > 1 else str(lay.pp)
    text = f"TP {lay.tp}, CP {lay.cp}, PP {pp}, DP {lay.dp}, {lay.recompute}"
    return {"layout": text, "chunk_size": pred.chunk_size, "k": pred.num_kept,
            "step_s": pred.step_s, "ranks": ranks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-72b")
    ap.add_argument("--seq-length", type=int, default=262144)
    ap.add_argument("--gpus", type=int, default=128)
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--global-batch-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape, hw = get_model_shape(args.model), get_gpu(args.gpu)
    lengths = [min(n, args.seq_length)
               for n in sample_lengths("B", args.global_batch_size, args.seed)]
    pred = best_chunkflow(lengths, shape, hw, args.gpus, args.seq_length, auto_chunking=True,
                          cp_kv=None, reforward=None)
    out = split_costs(pred, lengths, shape, hw)
    print(f"{args.model}, {args.gpus} x {args.gpu}, global batch {args.global_batch_size} "
          f"(profile B, seed {args.seed}): ChunkFlow {out['layout']}, C = {out['chunk_size']}, "
          f"K = {out['k']}, step {out['step_s']:.3f} s")
    worst = max(out["ranks"], key=lambda r: r["ring_s"])
    print(f"ring on standalone chunks (busiest DP rank {worst['dp_rank']}, per GPU): "
          f"{worst['ring_s']:.3f} s, {worst['ring_s'] / out['step_s']:.1%} of the step: the "
          "most any placement over fewer ranks could save")
    for s in worst["segments"]:
        what = ("needs every CP rank" if s["group"] is None else
                f"fits {s['group']} ranks, whose busiest would add {s['added_s']:.3f} s of "
                "attention")
        print(f"  chunk {s['chunk']}: a segment of {s['tokens']:,} tokens over a share of "
              f"{s['share']:,}: {what}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        sys.exit(f"cp_split_cost.py: {e}")
