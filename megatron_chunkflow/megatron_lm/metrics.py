"""The plugin's logging seams: FLOPs of the step's actual sequence lengths (attention per
sequence) for Megatron-LM's throughput, and one `[chunkflow]` line (tokens, tokens/s/GPU, model
TFLOP/s/GPU, chunks, re-forwarded fraction, peak memory) after each of its log lines, written to its
TensorBoard and W&B writers too.
"""

from __future__ import annotations

import time

from megatron_chunkflow.megatron_lm.hooks import HOOKS, megatron_args, print_last


def num_flops(original, args, batch_size, *rest, **kwargs):
    # core_v0.19.0 also passes the batch's packed-sequence statistics, which ChunkFlow's own count
    # (the step's actual sequence lengths) already covers
    if not args.chunkflow or HOOKS.iterator is None:
        return original(args, batch_size, *rest, **kwargs)
    if HOOKS.in_log and HOOKS.interval_steps:
        return HOOKS.interval_flops / HOOKS.interval_steps  # mean over the log interval
    return HOOKS.iterator.last.flops


def train_step(original, *args, **kwargs):
    a = megatron_args()
    if not a.chunkflow:
        return original(*args, **kwargs)
    if not HOOKS.memory_checked:
        HOOKS.memory_checked = True
        from megatron_chunkflow.mcore.cpu import has_real_cuda

        if not a.chunkflow_skip_memory_check and has_real_cuda():
            from megatron_chunkflow.megatron_lm.args import trace_settings
            from megatron_chunkflow.memtrace.guard import check_memory

            check_memory(trace_settings(a), HOOKS.iterator.next_lengths())
    start = time.perf_counter()
    out = original(*args, **kwargs)
    last = HOOKS.iterator.last
    HOOKS.interval_time += time.perf_counter() - start
    HOOKS.interval_flops += last.flops
    HOOKS.interval_tokens += last.tokens
    HOOKS.interval_steps += 1
    return out


def training_log(original, *args, **kwargs):
    a = megatron_args()
    if not a.chunkflow or HOOKS.iterator is None:
        return original(*args, **kwargs)
    HOOKS.in_log = True
    try:
        out = original(*args, **kwargs)
    finally:
        HOOKS.in_log = False
    iteration = args[3] if len(args) > 3 else kwargs["iteration"]
    first = kwargs.get("is_first_iteration", False)
    if (iteration % a.log_interval == 0 or first) and HOOKS.interval_steps:
        metrics = _interval_metrics(a)
        print_last(_log_line(iteration, metrics))
        from megatron.training import get_tensorboard_writer, get_wandb_writer

        write_metrics(get_tensorboard_writer(), get_wandb_writer(), metrics, iteration)
        if not first:
            HOOKS.interval_flops = HOOKS.interval_tokens = HOOKS.interval_time = 0.0
            HOOKS.interval_steps = 0
    return out


def _interval_metrics(a) -> dict[str, float]:
    """The log interval's ChunkFlow metrics, keyed as TensorBoard and W&B get them."""
    from megatron_chunkflow.mcore.step import peak_memory_bytes

    h, last = HOOKS, HOOKS.iterator.last
    per_step = h.interval_time / h.interval_steps
    tokens = h.interval_tokens / h.interval_steps
    return {"chunkflow/tokens": tokens,
            "chunkflow/tokens_per_sec_per_gpu": tokens / per_step / a.world_size,
            "chunkflow/model_tflops_per_gpu":
                h.interval_flops / h.interval_steps / per_step / a.world_size / 1e12,
            "chunkflow/chunks": float(last.chunks),
            "chunkflow/reforwarded_fraction": float(last.reforwarded),
            "chunkflow/peak_memory_gib": peak_memory_bytes() / 2**30}


def _log_line(iteration: int, m: dict[str, float]) -> str:
    from megatron_chunkflow.mcore.cpu import has_real_cuda

    memory = "peak allocated GiB" if has_real_cuda() else "peak RSS GiB"
    return (f"[chunkflow] iteration {iteration} | tokens {int(m['chunkflow/tokens'])} | "
            f"tokens/s/GPU {m['chunkflow/tokens_per_sec_per_gpu']:.1f} | model TFLOP/s/GPU "
            f"{m['chunkflow/model_tflops_per_gpu']:.3f} | chunks {int(m['chunkflow/chunks'])} | "
            f"recompute {m['chunkflow/reforwarded_fraction']:.2f} | {memory} "
            f"{m['chunkflow/peak_memory_gib']:.2f}")


def write_metrics(tensorboard, wandb, metrics: dict[str, float], iteration: int) -> None:
    """The [chunkflow] line's metrics to Megatron-LM's TensorBoard and W&B writers (each exists
    on the last rank when --tensorboard-dir / --wandb-project was given; None elsewhere)."""
    if tensorboard is not None:
        for key, value in metrics.items():
            tensorboard.add_scalar(key, value, iteration)
    if wandb is not None:
        wandb.log(metrics, iteration)
