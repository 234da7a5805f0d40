"""The systems `chunkflow bench` compares, built and stepped the same way, and its probes.

- build_system / step_system: mcore/step.py's build_training and training_step (a stock baseline on
  Megatron's own schedule, or ChunkFlow's execute_step) with a meter and a timeline attached.
- timed_step: one step measured on every rank (wall time, per-op intervals, metered bytes, RSS).
- probe_rates: activation bytes per token per stage under every recompute option, measured on a
  probe micro-batch with the exact meter.
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

import torch
import torch.distributed as dist

from megatron_chunkflow.bench.instrument import peak_rss, reset_peak_rss
from megatron_chunkflow.bench.settings import BenchSettings
from megatron_chunkflow.config import ChunkFlowConfig, Recompute
from megatron_chunkflow.core.costs import layers_per_stage
from megatron_chunkflow.data.synthetic import make_sequences
from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
from megatron_chunkflow.mcore.step import (
    Training,
    batch_forward_backward,
    build_training,
    training_step,
)
from megatron_chunkflow.perfmodel.budget import ActivationRates, OptionRates
from megatron_chunkflow.perfmodel.kvstate import kv_state_bytes_per_token
from megatron_chunkflow.runtime.meter import ActivationMeter
from megatron_chunkflow.runtime.observe import StageTimeline

PROBE_TOKENS = 1024


@dataclass
class System:
    """One trained system: its name and settings, and what mcore/step.py's build_training made
    of them (model, DDP, optimizer, scheduler)."""

    name: str  # "chunkflow" or a baseline's name
    settings: TrainSettings
    training: Training


def build_system(name: str, ts: TrainSettings, job) -> System:
    """`name` built on `job` (mcore/job.py) from the seed: every system starts from the same
    weights."""
    torch.manual_seed(ts.seed)
    return System(name, ts, build_training(ts, job))


def train_settings(s: BenchSettings, system: str, chunk_size: int | None = None,
                   num_kept: int | None = None,
                   recompute: Recompute = Recompute()) -> TrainSettings:
    """`chunkflow train`'s settings for one of the two systems on this comparison's batch; the
    chunking defaults to the given one (or C = --seq-length, K = 1 until one is chosen)."""
    chunkflow = ChunkFlowConfig(chunk_size or s.chunk_size or s.seq_length,
                                num_kept or s.num_kept or 1,
                                s.attention_backend)
    return TrainSettings(
        shape=s.shape, model_name=s.model_name, system=system, chunkflow=chunkflow,
        parallel=dataclasses.replace(s.parallel, recompute=recompute),
        optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-5, lr_warmup_iters=0),
        train_iters=s.warmup + s.repeats + 1, global_batch_size=len(s.lengths),
        seq_length=s.seq_length, seed=s.seed)


def step_system(system: System, sequences, observers) -> int:
    """One training step (forward, backward, optimizer: mcore/step.py's training_step, as
    `chunkflow train` runs it), measured by `observers`; returns micro-batches or chunks."""
    return training_step(system.settings, system.training, sequences,
                         observers=observers).num_chunks


def gather(row: dict) -> list[dict]:
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def timed_step(system: System, sequences, trim: bool = True) -> list[dict]:
    """One step of `system`, measured on every rank; every rank's record. `trim`: return freed
    heap to the OS first, so the step's peak RSS is its own (and its pages fault in again)."""
    tr = system.training
    ranks = tr.job.ranks
    meter, timeline = ActivationMeter(tr.model, tr.store), StageTimeline()
    gc.collect()
    reset_peak_rss(trim)
    dist.barrier()
    t0 = time.perf_counter()
    count = step_system(system, sequences, [timeline, meter])
    elapsed = time.perf_counter() - t0
    return gather({
        "stage": ranks.pp_rank, "dp_rank": ranks.dp_rank, "tp_rank": ranks.tp_rank,
        "elapsed": elapsed, "ops": timeline.ops, "span": timeline.step_time,
        "peak_total": meter.peak_total, "peak_state": meter.peak_state,
        "peak_activation": meter.peak_activation, "peak_recompute": meter.peak_recompute,
        "rss": peak_rss(), "count": count})


def probe_rates(system: System, s: BenchSettings,
                options: list[Recompute] = (Recompute(),)) -> ActivationRates:
    """Bytes per token per stage, measured with the exact meter on one probe micro-batch of
    PROBE_TOKENS tokens (4 packed sequences) per DP rank on Megatron's schedule, the largest over
    ranks of a stage: for every recompute option in `options`, what the micro-batch holds
    between its forward and its backward and the most live while it runs (a model per option,
    since Megatron's layers read the recompute setting when they are built); K/V, accumulator
    and hidden bytes from the tensors' shapes and dtypes."""
    ranks = system.training.job.ranks
    probe = make_sequences([PROBE_TOKENS // 4] * 4 * ranks.dp, s.shape.vocab_size, s.seed)
    pp, tp = s.parallel.pp, s.parallel.tp
    measured = {}
    for option in options:
        ts = dataclasses.replace(system.settings, system="megatron-packed",
                                 seq_length=PROBE_TOKENS,
                                 parallel=dataclasses.replace(s.parallel, recompute=option))
        torch.manual_seed(s.seed)
        tr = system.training if option.kind == "none" else build_training(ts, system.training.job)
        meter = ActivationMeter(tr.model, tr.store)
        batch_forward_backward(ts, tr, probe, observers=[meter])
        rows = gather({"stage": ranks.pp_rank,
                       "held": meter.max_chunk_activation / PROBE_TOKENS,
                       "peak": meter.peak_total / PROBE_TOKENS})
        held, peak = [0.0] * pp, [0.0] * pp
        for r in rows:
            held[r["stage"]] = max(held[r["stage"]], r["held"])
            peak[r["stage"]] = max(peak[r["stage"]], r["peak"])
        measured[str(option)] = OptionRates(tuple(held), tuple(peak))
        del tr
    elem = torch.finfo(system.training.model.config.params_dtype).bits // 8
    layers = layers_per_stage(s.shape.num_layers, pp)

    def kv(n, nbytes):  # K and V of n layers, `nbytes` per element, this TP rank's heads
        return kv_state_bytes_per_token(s.shape, n, nbytes, tp, with_grad=False)

    none = measured.get("none")
    return ActivationRates(none.held if none else (0.0,) * pp, tuple(kv(n, elem) for n in layers),
                           tuple(kv(n, 4) for n in layers), s.shape.hidden_size * elem,
                           measured)


PROBE_SIZES = (512, 4096)  # tokens of the two timing probes
PROBE_SEGMENT = 256  # tokens per packed sequence in them (short SFT samples)


def probe_step_times(system: System, s: BenchSettings, repeats: int = 3) -> dict[int, float]:
    """Seconds of one micro-batch's forward + backward on a pipeline stage (the mean over all
    ranks, so every rank gets the same numbers) for micro-batches of PROBE_SIZES tokens packed
    from PROBE_SEGMENT-token sequences, one per DP rank, on Megatron's schedule without
    recompute: the median of `repeats` runs after one unrecorded."""
    out = {}
    for tokens in PROBE_SIZES:
        batch = make_sequences(
            [PROBE_SEGMENT] * (tokens // PROBE_SEGMENT) * system.training.job.ranks.dp,
            s.shape.vocab_size, s.seed)
        ts = dataclasses.replace(system.settings, system="megatron-packed", seq_length=tokens,
                                 parallel=dataclasses.replace(s.parallel, recompute=Recompute()))
        times = []
        for _ in range(repeats + 1):
            timeline = StageTimeline()
            tr = system.training
            batch_forward_backward(ts, tr, batch, observers=[ActivationMeter(tr.model, tr.store),
                                                             timeline])
            times.append(sum(end - start for _, _, start, end in timeline.ops))
        mine = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
        dist.all_reduce(mine)
        out[tokens] = float(mine) / dist.get_world_size()
    return out
