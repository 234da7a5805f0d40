"""The device check's step 5 (scripts/gpu/device_check.py): Megatron-LM's own pretrain_gpt.py
with --chunkflow through `python -m megatron_chunkflow.launch`, Qwen2.5-0.5B in bf16 with the
distributed optimizer on mock data for LAUNCHER_ITERS steps (a tiny model on CPU for the dry run):
its losses and iteration times. The checkout is MEGATRON_LM_DIR or third_party/Megatron-LM-TAG of
the installed megatron-core (`make megatron-lm`; on a GPU machine: `make megatron-lm-slim` here, carry third_party/megatron-lm-slim, MEGATRON_LM_DIR
pointing at it); without one the step says so and is skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_ITERS = 4
TIMEOUT_S = 60  # on a GPU; three times this on the dry run


def step_launcher(out: Path, dry_run: bool) -> dict:
    """pretrain_gpt.py --chunkflow through the launcher (module docstring)."""
    import torch

    from megatron_chunkflow import compat

    megatron = Path(os.environ.get(
        "MEGATRON_LM_DIR", ROOT / "third_party" / f"Megatron-LM-{compat.megatron_lm_tag()}"))
    megatron = megatron.resolve()
    script = megatron / "pretrain_gpt.py"
    if not script.is_file():
        return {"skipped": f"no Megatron-LM checkout at {megatron} (MEGATRON_LM_DIR, or "
                           "`make megatron-lm-slim` and carry third_party/megatron-lm-slim)"}
    if dry_run:
        model = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "176",
                 "--num-attention-heads", "4", "--group-query-attention",
                 "--num-query-groups", "2", "--max-position-embeddings", "1024",
                 "--position-embedding-type", "rope", "--rotary-base", "1000000",
                 "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
                 "--disable-bias-linear", "--add-qkv-bias",
                 "--vocab-size", compat.null_tokenizer_vocab_flag(1000),
                 "--distributed-backend", "gloo", "--use-cpu-initialization"]
        seq, chunk, gbs = 512, 128, 4
    else:
        from megatron_chunkflow.core.models import get_model_shape

        shape = get_model_shape("qwen2.5-0.5b")
        model = ["--num-layers", shape.num_layers, "--hidden-size", shape.hidden_size,
                 "--ffn-hidden-size", shape.ffn_hidden_size, "--num-attention-heads",
                 shape.num_attention_heads, "--group-query-attention", "--num-query-groups",
                 shape.num_query_groups, "--kv-channels", shape.head_dim,
                 "--max-position-embeddings", 32768, "--position-embedding-type", "rope",
                 "--rotary-base", "1000000", "--normalization", "RMSNorm", "--norm-epsilon",
                 "1e-6", "--swiglu", "--disable-bias-linear", "--add-qkv-bias",
                 "--vocab-size", compat.null_tokenizer_vocab_flag(shape.vocab_size), "--bf16",
                 "--use-distributed-optimizer"]
        seq, chunk, gbs = 8192, 4096, 16
    args = [*map(str, model), "--tokenizer-type", "NullTokenizer", "--mock-data",
            "--transformer-impl", "local", "--no-persist-layer-norm",
            "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
            "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--seq-length", str(seq),
            "--micro-batch-size", "1", "--global-batch-size", str(gbs), "--train-iters",
            str(LAUNCHER_ITERS), "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "1",
            "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
            "--chunkflow", "--chunk-size", str(chunk), "--chunkflow-k", "1"]
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "megatron_chunkflow.launch", str(script), *args],
                         cwd=out, capture_output=True, text=True,
                         timeout=TIMEOUT_S * (3 if dry_run else 1) - 5)
    log = run.stdout + run.stderr
    (out / "launcher.log").write_text(log[-200_000:])
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", log)]
    times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", log)]
    return {"passed": run.returncode == 0 and len(losses) == LAUNCHER_ITERS
            and all(x == x and abs(x) != float("inf") for x in losses),
            "returncode": run.returncode, "losses": losses, "iteration_ms": times,
            "wall_s": time.perf_counter() - t0, "model": "tiny" if dry_run else "qwen2.5-0.5b",
            "seq_length": seq, "chunk_size": chunk, "global_batch_size": gbs,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            **({} if run.returncode == 0 else {"log_tail": log[-3000:]})}
