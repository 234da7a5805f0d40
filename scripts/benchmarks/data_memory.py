"""Memory and time one rank spends opening a Megatron indexed dataset: memory-mapped (what
`chunkflow train` and the launcher do) against reading every document into memory (how every
other source is read), in fresh processes, on a synthetic corpus written here.

    python scripts/benchmarks/data_memory.py [--tokens 5000000] [--json]

Each figure is the growth of the process's peak resident set (ru_maxrss: it includes the
mapped file's pages the range check touched, which the kernel shares between ranks and may drop)
and of its private memory (RssAnon) while open_sft_dataset runs, its wall time, then the time to
plan and read one global batch of 256 sequences for DP rank 0 of 8.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import megatron_chunkflow.data.dataset as d
from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.data import load_tokenizer
from megatron_chunkflow.data.sampler import BatchSampler
from megatron_chunkflow.data.store import global_batch
from megatron_chunkflow.runtime.execute import plan_step
from megatron_chunkflow.runtime.ranks import Ranks

import megatron.core.datasets.indexed_dataset  # imported by both: not part of the figures
prefix, mode = sys.argv[1], sys.argv[2]
tok = load_tokenizer(None)
if mode == "in-memory":
    d.is_indexed_prefix = lambda path: False
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def anon():  # private memory (no file-backed pages, which the kernel shares and may drop)
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
before, anon_before, t0 = rss(), anon(), time.perf_counter()
ds = d.open_sft_dataset(prefix, tok, seq_length=1 << 20)
opened, anon_opened, t1 = rss(), anon(), time.perf_counter()
batch = global_batch(ds, BatchSampler(len(ds), 256, 0).batch_at(0))
plan_step(batch, ChunkFlowConfig(4096, 1), ParallelConfig(dp=8), get_model_shape("tiny"),
          Ranks(dp=8))
t2 = time.perf_counter()
print(json.dumps({"open_mib": (opened - before) / 2**20,
                  "open_private_mib": (anon_opened - anon_before) / 2**20, "open_s": t1 - t0, "step_s": t2 - t1,
                  "sequences": len(ds)}))
"""


def write_corpus(prefix: str, tokens: int) -> None:
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    g = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    written = 0
    while written < tokens:
        n = int(min(tokens - written, max(2, g.lognormal(6.5, 1.2))))  # long-tailed, ~1.3K mean
        builder.add_item(torch.from_numpy(g.integers(0, 150_000, n, dtype=np.int32)))
        builder.end_document()
        written += n
    builder.finalize(prefix + ".idx")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=5_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "corpus")
        write_corpus(prefix, args.tokens)
        out = {"tokens": args.tokens, "load_avg_1m": load}
        for mode in ("memory-mapped", "in-memory"):
            run = subprocess.run([sys.executable, "-c", CHILD, prefix, mode], capture_output=True,
                                 text=True, check=True)
            out[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    mm, mem = out["memory-mapped"], out["in-memory"]
    out["memory_ratio"] = mm["open_mib"] / mem["open_mib"] if mem["open_mib"] else None
    out["private_memory_ratio"] = (mm["open_private_mib"] / mem["open_private_mib"]
                                   if mem["open_private_mib"] else None)
    out["open_time_ratio"] = mm["open_s"] / mem["open_s"]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.tokens:,} tokens, {mm['sequences']:,} sequences (load {load:.2f})")
    for mode in ("memory-mapped", "in-memory"):
        r = out[mode]
        print(f"  {mode:14s} open: peak RSS +{r['open_mib']:6.1f} MiB, private "
              f"+{r['open_private_mib']:6.1f} MiB, {r['open_s']:5.2f} s; one step's plan and "
              f"reads {r['step_s']:.3f} s")
    print(f"  memory-mapped / in-memory: peak RSS {out['memory_ratio']:.3f}x, private "
          f"{out['private_memory_ratio']:.3f}x, open time {out['open_time_ratio']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
