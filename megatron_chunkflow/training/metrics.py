"""What `chunkflow train` reports per step: a progress line on stderr, --log-json lines,
TensorBoard scalars.

    log = StepLog(LogConfig(log_json="metrics.jsonl"), total_steps=100)
    train(settings, job, dataset, on_step=log); log.close()

Each record holds the loss, tokens/s, model TFLOP/s (attention counted per sequence, recompute not
counted), peak memory, chunks per step, the learning rate the step applied and the gradient norm;
under context parallelism the K/V and dK/dV bytes this rank received in ChunkFlow's CP attention;
SpaCO runs label every record approximate. MoE models add the balancing loss (per MoE layer and
sequence, over the coefficient, as Megatron-LM logs `seq_load_balancing_loss`) and, for ChunkFlow,
each expert's share of the routed tokens. TensorBoard's tags are Megatron-LM's where a record
means the same (`lm loss`, `learning-rate`, `grad-norm`, `iteration-time`, `throughput`,
`mem-max-allocated-bytes`), ChunkFlow's own under `chunkflow/`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_chunkflow.flags import check_output_dir, check_output_file

FIELDS = ("step", "loss", "loss_tokens", "tokens", "tokens_per_s", "model_tflops",
          "peak_mem_bytes", "num_chunks", "lr", "grad_norm", "step_s", "approximate",
          "sparse_backward", "backward_chunks", "dependent_chunks", "cp_kv_received_bytes",
          "cp_grad_received_bytes", "balancing_loss", "expert_load")

# TensorBoard tags Megatron-LM's training_log writes, for the records that mean the same (a
# Megatron-LM run and a `chunkflow train` run then share their curves); every other record is
# ChunkFlow's own, under chunkflow/
MEGATRON_TAGS = {"loss": "lm loss", "lr": "learning-rate", "grad_norm": "grad-norm",
                 "step_s": "iteration-time", "model_tflops": "throughput",
                 "peak_mem_bytes": "mem-max-allocated-bytes",
                 "balancing_loss": "seq_load_balancing_loss"}


def tensorboard_tag(key: str) -> str:
    return MEGATRON_TAGS.get(key, f"chunkflow/{key}")


@dataclass(frozen=True)
class LogConfig:
    """Where a run's per-step metrics go besides the progress line."""

    log_json: str | None = None
    """One JSON line of metrics per step (appended)."""

    tensorboard_dir: str | None = None
    """TensorBoard event files (needs the tensorboard package)."""

    def __post_init__(self):
        check_output_file("--log-json", self.log_json)
        check_output_dir("--tensorboard-dir", self.tensorboard_dir)


class StepLog:
    """Called with each step's metrics (training/loop.py train's on_step); `quiet` ranks write
    nothing. `unit`: what a step runs, "chunk" (ChunkFlow) or "micro-batch" (stock Megatron)."""

    def __init__(self, config: LogConfig, total_steps: int, quiet: bool = False,
                 unit: str = "chunk"):
        self.total, self.quiet, self.unit = total_steps, quiet, unit
        self.json_file = open(config.log_json, "a") if config.log_json and not quiet else None
        self.tb = None
        if config.tensorboard_dir and not quiet:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("--tensorboard-dir needs the tensorboard package: "
                                 "pip install tensorboard") from None
            Path(config.tensorboard_dir).mkdir(parents=True, exist_ok=True)
            self.tb = SummaryWriter(config.tensorboard_dir)

    def __call__(self, m: dict) -> None:
        done = int(20 * m["step"] / self.total)
        units = self.unit if m["num_chunks"] == 1 else \
            self.unit + ("es" if self.unit.endswith("h") else "s")  # micro-batches, chunks
        if not self.quiet:
            print(f"step {m['step']:>4}/{self.total} [{'#' * done}{'.' * (20 - done)}] "
                  f"loss {m['loss']:.4f} | {m['tokens_per_s']:,.0f} tok/s | "
                  f"{m['model_tflops']:.3f} TFLOP/s | peak {m['peak_mem_bytes'] / 2**30:.2f} GiB | "
                  f"{m['num_chunks']} {units} | "
                  f"lr {m['lr']:.2e}{_moe_note(m)}{_cp_note(m)}{_sparse_note(m)}",
                  file=sys.stderr, flush=True)
        row = {k: m[k] for k in FIELDS if k in m}
        if self.json_file:
            self.json_file.write(json.dumps(row) + "\n")
            self.json_file.flush()
        if self.tb:
            for k, v in row.items():
                if k == "expert_load":  # one scalar per expert
                    for e, share in enumerate(v):
                        self.tb.add_scalar(f"chunkflow/expert_load/{e}", share, m["step"])
                elif k not in ("step", "approximate"):
                    self.tb.add_scalar(tensorboard_tag(k), v, m["step"])

    def close(self) -> None:
        if self.json_file:
            self.json_file.close()
        if self.tb:
            self.tb.close()


def _moe_note(m: dict) -> str:
    if "balancing_loss" not in m:
        return ""
    load = m.get("expert_load")
    spread = (f" | expert load max {max(load) * len(load):.2f}x the mean, min "
              f"{min(load) * len(load):.2f}x" if load else "")
    return f" | balancing loss {m['balancing_loss']:.4f}{spread}"


def _cp_note(m: dict) -> str:
    if "cp_kv_received_bytes" not in m:
        return ""
    moved = m["cp_kv_received_bytes"] + m["cp_grad_received_bytes"]
    return f" | CP received {moved / 2**20:.1f} MiB"


def _sparse_note(m: dict) -> str:
    if not m.get("approximate"):
        return ""
    return (f" | APPROXIMATE (SpaCO T={m['sparse_backward']}): {m['backward_chunks']}/"
            f"{m['dependent_chunks']} dependent chunks back-propagated")
