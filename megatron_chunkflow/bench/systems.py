"""The two systems `chunkflow bench` compares, built and stepped the same way, and its probes.

- BenchSettings: what one comparison runs (model, batch, layout, budget, repeats, kernel).
- build_system / step_system: training/loop.py's build_training and run_step (stock Megatron's
  own schedule, or ChunkFlow's forward_backward_chunkflow) with a meter and a timeline attached.
- timed_step: one step measured on every rank (wall time, per-op intervals, metered bytes, RSS).
- probe_rates: activation bytes per token per stage, measured on a probe micro-batch.
- probe_step_times: a stage's forward + backward of two probe micro-batches, timed, from which
  bench/calibrate.py fits the CPU device's host time per op and dense-work efficiency.
Run in every process of a job.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from megatron_chunkflow.perfmodel.budget import ActivationRates
from megatron_chunkflow.core.costs import layers_per_stage
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.bench.instrument import (
    BenchMeter,
    instrument_megatron,
    peak_rss,
    reset_peak_rss,
)
from megatron_chunkflow.runtime.pipeline import StageTimeline

PROBE_TOKENS = 1024


@dataclass
class BenchSettings:
    shape: ModelShape
    model_name: str
    lengths: list[int]
    seq_length: int
    budget_bytes: float
    chunk_size: int | None = None  # None: chosen by the budget
    k: int | None = None
    megatron_recompute: str = "auto"  # auto (by the budget), none, full
    tp: int = 1
    pp: int = 2
    warmup: int = 1
    repeats: int = 2
    backend: str = "cpu_flash"
    seed: int = 0
    threads: int = 1
    caching_malloc: bool = True  # instrument.cache_freed_memory in every rank




@dataclass
class System:
    """One trained system: its settings and Megatron's model, DDP, optimizer and scheduler."""

    name: str  # "megatron" or "chunkflow"
    settings: object  # training.loop.TrainSettings
    model: object
    store: object
    ddp: object
    optimizer: object
    scheduler: object


def build_system(name: str, ts) -> System:
    from megatron_chunkflow.training.loop import build_training

    torch.manual_seed(ts.seed)
    return System(name, ts, *build_training(ts))


def train_settings(s: BenchSettings, **kw):
    from megatron_chunkflow.training.loop import TrainSettings

    steps = s.warmup + s.repeats
    return TrainSettings(shape=s.shape, model_name=s.model_name, train_iters=steps + 1,
                         global_batch_size=len(s.lengths), seq_length=s.seq_length, lr=1e-4,
                         min_lr=1e-5, lr_warmup_iters=0, seed=s.seed, tp=s.tp, pp=s.pp,
                         backend=s.backend, **kw)


def step_system(system: System, sequences, meter: BenchMeter, timeline: StageTimeline) -> int:
    """One training step (forward, backward, optimizer); returns micro-batches or chunks."""
    from megatron.core import parallel_state

    from megatron_chunkflow.runtime.inputs import plan_step
    from megatron_chunkflow.runtime.schedules import forward_backward_chunkflow
    from megatron_chunkflow.training.loop import run_step
    from megatron_chunkflow.checks.verify import forward_step

    ts = system.settings
    system.ddp.zero_grad_buffer()
    system.optimizer.zero_grad()
    if ts.chunkflow:  # training/loop.py's run_step, with the meter and timeline passed in
        dp, dp_rank = (parallel_state.get_data_parallel_world_size(),
                       parallel_state.get_data_parallel_rank())
        step, batch, _ = plan_step(sequences, ts.chunk_size, ts.k, ts.pp, dp, dp_rank, ts.shape)
        step_fn = partial(forward_step, tp_group=parallel_state.get_tensor_model_parallel_group(),
                          exact_loss=False)
        forward_backward_chunkflow(
            forward_step_func=step_fn, data_iterator=iter([step]), model=system.ddp,
            num_microbatches=len(step.metas), seq_length=ts.chunk_size, micro_batch_size=1,
            meter=meter, timeline=timeline)
        count = len(batch.chunks)
    else:
        with instrument_megatron(meter, timeline):
            _, count, _ = run_step(ts, sequences, system.ddp, system.model.config)
    system.optimizer.step()
    system.scheduler.step(increment=1)
    return count


def gather(row: dict) -> list[dict]:
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def timed_step(system: System, sequences, trim: bool = True) -> list[dict]:
    """One step of `system`, measured on every rank; every rank's record. `trim`: return freed
    heap to the OS first, so the step's peak RSS is its own (and its pages fault in again)."""
    from megatron.core import parallel_state

    meter, timeline = BenchMeter(system.model, system.store), StageTimeline()
    gc.collect()
    reset_peak_rss(trim)
    dist.barrier()
    t0 = time.perf_counter()
    count = step_system(system, sequences, meter, timeline)
    elapsed = time.perf_counter() - t0
    return gather({
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "elapsed": elapsed, "ops": timeline.ops, "span": timeline.step_time,
        "peak_total": meter.peak_total, "peak_state": meter.peak_state,
        "peak_activation": meter.peak_activation, "peak_recompute": meter.peak_recompute,
        "rss": peak_rss(), "count": count})


def probe_rates(system: System, s: BenchSettings) -> ActivationRates:
    """Bytes per token per stage, measured: one micro-batch of PROBE_TOKENS tokens (4 packed
    sequences) per DP rank through `system`'s model (no recompute) on Megatron's schedule,
    metered, the largest over ranks of a stage; K/V, accumulator and hidden bytes from the
    tensors' shapes and dtypes."""
    from megatron.core import parallel_state

    from megatron_chunkflow.training.loop import run_step
    from megatron_chunkflow.checks.verify import make_sequences

    dp = parallel_state.get_data_parallel_world_size()
    probe = make_sequences([PROBE_TOKENS // 4] * 4 * dp, s.shape.vocab_size, s.seed)
    ts = dataclasses.replace(system.settings, chunkflow=False, seq_length=PROBE_TOKENS,
                             recompute_granularity=None)
    meter = BenchMeter(system.model, system.store)
    with instrument_megatron(meter, StageTimeline()):
        run_step(ts, probe, system.ddp, system.model.config)
    system.ddp.zero_grad_buffer()
    rows = gather({"stage": parallel_state.get_pipeline_model_parallel_rank(),
                    "per_token": meter.max_chunk_activation / PROBE_TOKENS})
    per_token = [0.0] * s.pp
    for r in rows:
        per_token[r["stage"]] = max(per_token[r["stage"]], r["per_token"])
    elem = torch.finfo(system.model.config.params_dtype).bits // 8
    kv = 2 * (s.shape.num_query_groups // s.tp) * s.shape.head_dim
    layers = layers_per_stage(s.shape.num_layers, s.pp)
    return ActivationRates(tuple(per_token), tuple(kv * n * elem for n in layers),
                           tuple(kv * n * 4 for n in layers), s.shape.hidden_size * elem)


PROBE_SIZES = (512, 4096)  # tokens of the two timing probes
PROBE_SEGMENT = 256  # tokens per packed sequence in them (short SFT samples)


def probe_step_times(system: System, s: BenchSettings, repeats: int = 3) -> dict[int, float]:
    """Seconds of one micro-batch's forward + backward on a pipeline stage (the mean over all
    ranks, so every rank gets the same numbers) for micro-batches of PROBE_SIZES tokens packed
    from PROBE_SEGMENT-token sequences, one per DP rank, on Megatron's schedule without
    recompute: the median of `repeats` runs after one unrecorded."""
    from megatron.core import parallel_state

    from megatron_chunkflow.training.loop import run_step
    from megatron_chunkflow.checks.verify import make_sequences

    out = {}
    for tokens in PROBE_SIZES:
        dp = parallel_state.get_data_parallel_world_size()
        batch = make_sequences([PROBE_SEGMENT] * (tokens // PROBE_SEGMENT) * dp,
                               s.shape.vocab_size, s.seed)
        ts = dataclasses.replace(system.settings, chunkflow=False, seq_length=tokens,
                                 recompute_granularity=None)
        times = []
        for _ in range(repeats + 1):
            timeline = StageTimeline()
            with instrument_megatron(BenchMeter(system.model, system.store), timeline):
                run_step(ts, batch, system.ddp, system.model.config)
            times.append(sum(end - start for _, _, start, end in timeline.ops))
        mine = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
        dist.all_reduce(mine)
        out[tokens] = float(mine) / dist.get_world_size()
    system.ddp.zero_grad_buffer()
    return out
