"""How much more than its allocated peak a step needs from PyTorch's caching allocator: the margin
every fits verdict takes (perfmodel/hardware.py Hardware.fragmentation), from traced steps.

    python scripts/benchmarks/memory_margin.py                 # ~8 min on 2 cores
    python scripts/benchmarks/memory_margin.py --json > margin.json

Each configuration is traced as a run makes it (memtrace/: the build, a first step that makes
Adam's states, the second step), on Qwen2.5-1.5B at 32K with the global batch of the H200
measurements (docs/benchmarks-appendix.md, "Memory"), and its allocations replayed through the native
caching allocator (memtrace/allocator.py): `needed` is the least device memory in which no request
fails (segments released and retried, as the allocator does before an out-of-memory error), over
the allocated peak (torch.cuda.max_memory_allocated). The largest ratio over ChunkFlow's plans and
the stock baselines' is the margin.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (system, chunk size, K, recompute, loss piece)
CONFIGS = [
    ("chunkflow", 16384, 1, "none", 0),
    ("chunkflow", 16384, 1, "none", 2048),
    ("chunkflow", 8192, 2, "none", 0),
    ("chunkflow", 8192, 1, "selective:mlp", 0),
    ("chunkflow", 16384, 1, "full", 0),
    ("chunkflow", 32768, 1, "selective:mlp+layernorm", 2048),
    ("megatron-packed", 32768, 1, "none", 0),
    ("megatron-packed", 32768, 1, "selective:mlp", 0),
    ("megatron-packed", 32768, 1, "block:14", 0),
    ("megatron-packed", 32768, 1, "full", 0),
    ("megatron-packed", 32768, 1, "full", 2048),
    ("megatron-sft", 32768, 1, "full", 0),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--stack", default="torch-2.11", help="GPU software stack (memtrace/stack.py)")
    args = ap.parse_args(argv)
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.core.profiles import ensure_long, sample_lengths
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
    from megatron_chunkflow.memtrace.trace import trace_memory

    lengths = [min(n, 32768) for n in sample_lengths("B", 128, seed=0)]
    lengths = [min(max(n, 2), 32768) for n in ensure_long(lengths, "B", 16384, 1, 0)]
    load = os.getloadavg()[0]
    rows = []
    for system, c, k, recompute, piece in CONFIGS:
        settings = TrainSettings(
            shape=get_model_shape("qwen2.5-1.5b"), model_name="qwen2.5-1.5b", system=system,
            dtype="bfloat16", seq_length=32768, global_batch_size=len(lengths), train_iters=3,
            chunkflow=ChunkFlowConfig(c, k, "varlen", loss_piece=piece),
            optimizer=OptimizerConfig(lr_warmup_iters=0),
            parallel=ParallelConfig(recompute=recompute), device="cuda")
        start = time.perf_counter()
        t = trace_memory(settings, lengths, stack=args.stack)
        rows.append({"system": system, "chunk_size": c if system == "chunkflow" else None,
                     "k": k if system == "chunkflow" else None, "recompute": recompute,
                     "loss_piece": piece, "allocated_gib": t.peak_allocated / 2**30,
                     "needed_gib": t.needed / 2**30, "ratio": t.needed / t.peak_allocated,
                     "seconds": time.perf_counter() - start})
        r = rows[-1]
        print(f"{system:<16} C={str(r['chunk_size']):<6} K={str(r['k']):<4} {recompute:<24} "
              f"piece {piece:<5} allocated {r['allocated_gib']:6.1f} GiB  needed "
              f"{r['needed_gib']:6.1f} GiB  x{r['ratio']:.3f}",
              file=sys.stderr if args.json else sys.stdout, flush=True)
    worst = max(rows, key=lambda r: r["ratio"])
    summary = {"stack": args.stack, "load_avg_1m_at_start": load, "rows": rows,
               "margin": worst["ratio"] - 1, "worst": worst}
    text = (f"largest: x{worst['ratio']:.3f} ({worst['system']}, {worst['recompute']}); "
            f"load average {load:.2f} at the start")
    if args.json:
        print(text, file=sys.stderr)
        json.dump(summary, sys.stdout, indent=1)
        print()
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
