"""Checkpoints through megatron dist_checkpointing: model, optimizer, scheduler, RNG, data position.

Layout (Megatron-LM's): SAVE/iter_0000010/ with the sharded model and optimizer state, plus
`extra_rank{R}.pt` per rank (scheduler, RNG states, iteration, consumed sequences, run settings), and
SAVE/latest_checkpointed_iteration.txt naming the newest complete one.

Crash safety: a checkpoint is written to iter_N.tmp, renamed to iter_N once every rank has finished,
and only then is the tracker file replaced (write + os.replace, atomic on POSIX). A crash during a
save leaves the previous checkpoint and tracker untouched, so --load resumes from it.

The training loop only calls `Checkpointer.load()` once and `Checkpointer.save(step, consumed,
last_step=...)` after every step; the configuration decides what happens.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class CheckpointConfig:
    """Where a run saves and resumes (Megatron-LM's flags), and Hugging Face import and export."""

    save: str | None = None
    """Checkpoint directory (Megatron-LM's layout, dist_checkpointing)."""

    load: str | None = None
    """Resume from the newest complete checkpoint in this directory."""

    save_interval: int | None = None
    """Save every N steps (and at the end)."""

    load_hf: str | None = None
    """Start from a Hugging Face Qwen2/Qwen2.5 checkpoint directory (its config.json sets the
    model; overrides --model)."""

    save_hf: str | None = None
    """Write the trained model as a Hugging Face checkpoint (safetensors) here."""

    def __post_init__(self):
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"--save-interval must be >= 1, got {self.save_interval}")


class Checkpointer:
    """Loads and saves one run's model, optimizer, scheduler, RNG and data position."""

    def __init__(self, config: CheckpointConfig, model, optimizer, scheduler, settings: dict):
        self.config, self.settings = config, settings
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def load(self) -> tuple[int, int]:
        """(steps done, sequences consumed): from --load, or (0, 0)."""
        if not self.config.load:
            return 0, 0
        iteration, consumed, _ = load_checkpoint(self.config.load, self.model, self.optimizer,
                                                 self.scheduler)
        return iteration, consumed

    def save(self, iteration: int, consumed: int, last_step: bool = False) -> None:
        """After step `iteration`: save on --save-interval steps and after the run's last step."""
        interval = self.config.save_interval
        if self.config.save and (last_step or (interval and iteration % interval == 0)):
            save_checkpoint(self.config.save, iteration, self.model, self.optimizer,
                            self.scheduler, consumed, self.settings)


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sharded_state(model, optimizer, loading: bool) -> dict:
    sd = {"model": model.sharded_state_dict()}
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=loading)
    return sd


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, consumed: int,
                    settings: dict) -> Path:
    """Save everything needed to resume at `iteration` (steps done); returns the directory."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    root_path = Path(root)
    final, tmp = _iter_dir(root_path, iteration), root_path / f"iter_{iteration:07d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, loading=False), str(tmp),
                            sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1,
                                                                          thread_count=1))
    torch.save({"scheduler": scheduler.state_dict(), "rng": _rng_state(), "iteration": iteration,
                "consumed": consumed, "settings": settings},
               tmp / f"extra_rank{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tracker_tmp = root_path / (TRACKER + ".tmp")
        tracker_tmp.write_text(f"{iteration}\n")
        os.replace(tracker_tmp, root_path / TRACKER)
    dist.barrier()
    return final


def load_checkpoint(root: str, model, optimizer, scheduler) -> tuple[int, int, dict]:
    """Restore the newest complete checkpoint under `root`: (iteration, consumed, settings)."""
    from megatron.core import dist_checkpointing

    root_path = Path(root)
    tracker = root_path / TRACKER
    if not tracker.is_file():
        raise ValueError(f"--load {root}: no {TRACKER} (no complete checkpoint there)")
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"--load {tracker}: expected an iteration number, found {text!r}")
    iteration = int(text)
    directory = _iter_dir(root_path, iteration)
    extra_file = directory / f"extra_rank{dist.get_rank()}.pt"
    if not extra_file.is_file():
        raise ValueError(f"--load {directory}: {extra_file.name} is missing (saved with a "
                         "different number of processes?)")
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, loading=True), str(directory))
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    extra = torch.load(extra_file, weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    _set_rng_state(extra["rng"])
    return extra["iteration"], extra["consumed"], extra["settings"]
