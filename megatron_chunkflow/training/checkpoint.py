"""Checkpoints through megatron dist_checkpointing: model, optimizer, scheduler, RNG, data position.

Layout (Megatron-LM's): SAVE/iter_0000010/ with the sharded model and optimizer state, plus
`extra_rank{R}.pt` per rank (scheduler, RNG states, iteration, consumed sequences, run settings), and
SAVE/latest_checkpointed_iteration.txt naming the newest complete one.

Crash safety: a checkpoint is written to iter_N.tmp, renamed to iter_N once every rank has finished,
and only then is the tracker file replaced (write + os.replace, atomic on POSIX). Saving over an
existing iter_N first renames it to iter_N.old and removes that only after the tracker is written,
so no complete checkpoint is removed before its replacement is in place. --load resumes from the
tracker's iteration when it is complete (every rank's extra state and the sharded metadata), else
from the newest complete iter_N (or iter_N.old), saying so; a checkpoint saved by a different
number of processes is refused, naming both counts.

The training loop only calls `Checkpointer.load()` once and `Checkpointer.save(step, consumed,
last_step=...)` after every step; the configuration decides what happens.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_chunkflow.mcore.settings import CheckpointConfig
from megatron_chunkflow.training.resume import compare_settings, resumed_model_class

TRACKER = "latest_checkpointed_iteration.txt"
OLD = ".old"  # a complete checkpoint being replaced by a new save of the same iteration


def model_class_to_resume(model_class: str, root: str | None) -> str:
    """--model-class for a run resuming from --load `root`: "auto" is the newest checkpoint's
    class (training/resume.py resumed_model_class); without one, find_checkpoint names what is
    missing after the build."""
    newest = sorted(Path(root).glob("iter_*/extra_rank0.pt")) if root else []
    saved = read_extra_state(newest[-1])["settings"] if newest and model_class == "auto" else None
    return resumed_model_class(model_class, saved)


class Checkpointer:
    """Loads and saves one run's model, optimizer, scheduler, RNG and data position."""

    def __init__(self, config: CheckpointConfig, model, optimizer, scheduler, settings: dict):
        self.config, self.settings = config, settings
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def load(self) -> tuple[int, int]:
        """(steps done, sequences consumed): from --load, or (0, 0)."""
        if not self.config.load:
            return 0, 0
        iteration, directory, _ = find_checkpoint(self.config.load)
        saved = read_extra_state(directory / f"extra_rank{dist.get_rank()}.pt")["settings"]
        for note in compare_settings(saved, self.settings, iteration, self.config.load,
                                     override_schedule=self.config.override_lr_schedule):
            if dist.get_rank() == 0:
                print(f"chunkflow train: {note}", file=sys.stderr, flush=True)
        iteration, consumed, _ = load_checkpoint(
            self.config.load, self.model, self.optimizer, self.scheduler,
            override_schedule=self.config.override_lr_schedule)
        if dist.get_rank() == 0:
            print(f"chunkflow train: resumed from iteration {iteration} ({consumed} sequences "
                  f"consumed) in {self.config.load}", file=sys.stderr, flush=True)
        return iteration, consumed

    def save(self, iteration: int, consumed: int, last_step: bool = False) -> None:
        """After step `iteration`: save on --save-interval steps and after the run's last step."""
        interval = self.config.save_interval
        if self.config.save and (last_step or (interval and iteration % interval == 0)):
            from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

            start = time.perf_counter()
            try:
                directory = save_checkpoint(self.config.save, iteration, self.model,
                                            self.optimizer, self.scheduler, consumed,
                                            self.settings)
            except (Exception, CheckpointException) as e:  # noqa: BLE001  named, no traceback
                shutil.rmtree(_tmp_dir(Path(self.config.save), iteration),
                              ignore_errors=True)  # the half-written copy, never a complete one
                raise SaveFailed(f"--save {self.config.save}: saving iteration {iteration} "
                                 f"failed: {save_failure_cause(e, self.config.save)}; every "
                                 "complete checkpoint there is kept") from e
            if dist.get_rank() == 0:  # as Megatron-LM says it
                print(f"chunkflow train: saved checkpoint from iteration {iteration} to "
                      f"{directory} ({time.perf_counter() - start:.1f} s)", file=sys.stderr,
                      flush=True)


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (disk full, read-only, ...): the run stops, the
    complete checkpoints on disk untouched."""


ERRNO_CAUSES = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only file system",
                errno.EACCES: "permission denied", errno.EDQUOT: "disk quota exceeded"}


def save_failure_cause(error: BaseException, root: str) -> str:
    """What stopped a save, in words: the OS error anywhere in the exception's chain (torch's
    writers wrap it, re-raise it as text ("Worker failure: [Errno 28] ..."), or report a full
    disk only as a short write; its CheckpointException holds each rank's), else the exception
    itself."""
    failures = getattr(error, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        error = first[0] if isinstance(first, tuple) else first
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in ERRNO_CAUSES:
            return f"{ERRNO_CAUSES[e.errno]} ({e.strerror})"
        code = re.search(r"\[Errno (\d+)\] ([^\n:]+)", str(e))
        if code and int(code.group(1)) in ERRNO_CAUSES:
            return f"{ERRNO_CAUSES[int(code.group(1))]} ({code.group(2).strip()})"
        e = e.__cause__ or e.__context__
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if free is not None and free < 64 * 2**20:
        return f"no space left on device ({free:,} bytes free; the writer said: {text})"
    return text


EXTRA_KEYS = ("scheduler", "rng", "iteration", "consumed", "settings")


def _numpy_globals() -> list:
    """What a numpy array in a checkpoint's pickle refers to (numpy's RNG state, saved by
    checkpoints of earlier versions): allowed by name, nothing else."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype,
            type(np.dtype(np.uint32)), type(np.dtype(np.float64))]


def read_extra_state(path: Path) -> dict:
    """A rank's extra_rank{R}.pt, unpickled without running code (torch.load weights_only: tensors,
    numbers, strings and containers; numpy arrays by name); ValueError naming --load and the file
    when it is empty, truncated, garbled, not this project's, or holds other objects."""
    import pickle

    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            extra = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "Unsupported global" in text:
            name = text.split("GLOBAL ", 1)[-1].split(" ", 1)[0] if "GLOBAL " in text else "?"
            raise ValueError(f"--load {path}: holds a Python object ({name}) that loading would "
                             "have to run code to rebuild; a chunkflow train checkpoint holds "
                             "tensors, numbers and strings only, so this file is not one (or was "
                             "altered): it is not loaded") from None
        raise ValueError(f"--load {path}: cannot be read ({type(e).__name__}: "
                         f"{text.splitlines()[0][:200] if text else 'empty'}); the file is "
                         f"damaged: remove {path.parent.name} to resume from an older "
                         "checkpoint") from None
    except Exception as e:  # noqa: BLE001  unpickling fails in many ways, all the same to a user
        raise ValueError(f"--load {path}: cannot be read ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else 'empty'}); the file is "
                         f"damaged: remove {path.parent.name} to resume from an older "
                         "checkpoint") from None
    missing = [k for k in EXTRA_KEYS if not isinstance(extra, dict) or k not in extra]
    if missing:
        raise ValueError(f"--load {path}: not a chunkflow train checkpoint's extra state "
                         f"(no {', '.join(missing)})")
    return extra


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _tmp_dir(root: Path, iteration: int) -> Path:
    """Where iteration's checkpoint is written before it is complete."""
    return _iter_dir(root, iteration).with_suffix(".tmp")


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]  # a tensor (numpy array in earlier checkpoints)
    np.random.set_state((kind, np.asarray(keys).astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sharded_state(model, optimizer, loading: bool) -> dict:
    if isinstance(model, list):  # virtual stages: one entry per model chunk, as Megatron-LM
        sd = {f"model{v}": chunk.sharded_state_dict() for v, chunk in enumerate(model)}
    else:
        sd = {"model": model.sharded_state_dict()}
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=loading)
    return sd


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, consumed: int,
                    settings: dict) -> Path:
    """Save everything needed to resume at `iteration` (steps done); returns the directory."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    root_path = Path(root)
    final, tmp = _iter_dir(root_path, iteration), _tmp_dir(root_path, iteration)
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
        # never remove a complete checkpoint before its replacement is in place: a crash between
        # any two of these renames leaves one complete copy that load_checkpoint finds
        old = final.with_name(final.name + OLD)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        tracker_tmp = root_path / (TRACKER + ".tmp")
        tracker_tmp.write_text(f"{iteration}\n")
        os.replace(tracker_tmp, root_path / TRACKER)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _saved_ranks(directory: Path) -> int:
    return len(list(directory.glob("extra_rank*.pt")))


def _is_complete(directory: Path, world: int) -> bool:
    """Every rank's extra state and the distributed checkpoint's metadata are there."""
    return (directory.is_dir() and (directory / ".metadata").is_file()
            and all((directory / f"extra_rank{r}.pt").is_file() for r in range(world)))


def _newest_complete(root: Path, world: int) -> tuple[int, Path] | None:
    """The highest iteration with a complete directory (iter_N, else iter_N.old)."""
    found = {}
    for d in root.glob("iter_*"):
        name = d.name.removesuffix(OLD)
        digits = name.removeprefix("iter_")
        if digits.isdigit() and len(digits) == 7 and _is_complete(d, world):
            it = int(digits)
            if it not in found or d.name == name:  # iter_N wins over iter_N.old
                found[it] = d
    if not found:
        return None
    newest = max(found)
    return newest, found[newest]


def find_checkpoint(root: str) -> tuple[int, Path, str | None]:
    """(iteration, directory, a note when it is not the one the tracker names) of the checkpoint
    --load resumes from; ValueError naming --load when there is none to resume from."""
    root_path = Path(root)
    world = dist.get_world_size()
    tracker = root_path / TRACKER
    if not root_path.is_dir():
        raise ValueError(f"--load {root}: no such directory")
    named = None
    if tracker.is_file():
        text = tracker.read_text().strip()
        if not text.isdigit():
            raise ValueError(f"--load {tracker}: expected an iteration number, found {text!r}")
        named = int(text)
        directory = _iter_dir(root_path, named)
        if _is_complete(directory, world):
            newest = _newest_complete(root_path, world)
            if newest is None or newest[0] <= named:
                return named, directory, None
            return (*newest, f"--load {root}: {TRACKER} names iteration {named}, but "
                             f"{newest[1].name} is newer and complete; resuming from it")
        for d in (directory, directory.with_name(directory.name + OLD)):
            saved = _saved_ranks(d) if d.is_dir() else 0
            if saved and saved != world and (d / ".metadata").is_file():
                raise ValueError(f"--load {d}: saved by {saved} processes, this run has {world}; "
                                 f"resume with {saved} processes")
    newest = _newest_complete(root_path, world)
    if newest is None:
        what = (f"{TRACKER} names iteration {named}, which is missing or incomplete"
                if named is not None else f"no {TRACKER}")
        raise ValueError(f"--load {root}: {what}, and no other complete checkpoint is there")
    iteration, directory = newest
    note = (f"--load {root}: " + (f"iteration {named} (named by {TRACKER}) is missing or "
                                  "incomplete" if named is not None else f"no {TRACKER}")
            + f"; resuming from the newest complete checkpoint, {directory.name}")
    return iteration, directory, note


def load_checkpoint(root: str, model, optimizer, scheduler,
                    override_schedule: bool = False) -> tuple[int, int, dict]:
    """Restore the newest complete checkpoint under `root`: (iteration, consumed, settings).
    `override_schedule`: keep this run's peak and minimum rates, which Megatron's optimizer keeps
    per parameter group (and its state dict would restore) beside the scheduler's own."""
    from megatron.core import dist_checkpointing

    iteration, directory, note = find_checkpoint(root)
    if note and dist.get_rank() == 0:
        print(f"chunkflow train: {note}", file=sys.stderr, flush=True)
    extra_file = directory / f"extra_rank{dist.get_rank()}.pt"
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        with _quiet_loading():
            loaded = dist_checkpointing.load(_sharded_state(model, optimizer, loading=True),
                                             str(directory))
    except (Exception, CheckpointException) as e:  # a damaged shard is the user's file: name it
        cause = _cause(e)
        if any(m in cause for m in MISMATCH):  # intact files, another model or optimizer
            raise ValueError(f"--load {directory}: the checkpoint does not match this run's model "
                             f"or optimizer ({cause}); its files are intact: resume with the "
                             "settings it was saved with") from None
        raise ValueError(f"--load {directory}: the sharded checkpoint cannot be read "
                         f"({cause}); the files are damaged: remove this directory to resume "
                         "from an older one") from None
    if isinstance(model, list):
        for v, chunk in enumerate(model):
            chunk.load_state_dict(loaded[f"model{v}"])
    else:
        model.load_state_dict(loaded["model"])
    rates = [{k: g[k] for k in ("max_lr", "min_lr") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(loaded["optimizer"])
    if override_schedule:
        for group, kept in zip(optimizer.param_groups, rates):
            group.update(kept)
    extra = read_extra_state(extra_file)
    scheduler.load_state_dict(extra["scheduler"])
    _set_rng_state(extra["rng"])
    return extra["iteration"], extra["consumed"], extra["settings"]


# what dist_checkpointing says when intact files hold another layout than the run's
MISMATCH = ("shape mismatch", "Cannot merge", "Missing key", "Unexpected key", "not found in the "
            "checkpoint", "size mismatch", "does not match", "not in state dict")


@contextlib.contextmanager
def _quiet_loading():
    """What torch's distributed checkpoint loader prints and logs on its way to raising (its
    "Global metadata is not found", each rank's traceback) held back: the run's one-line message
    says it."""
    import io
    import logging

    names = ("torch.distributed.checkpoint", "megatron.core.dist_checkpointing")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _cause(e: BaseException) -> str:
    """One line for what went wrong reading a checkpoint: torch's CheckpointException carries
    each rank's exception with its whole traceback; the first rank's exception alone, its first
    line, at most 200 characters."""
    failures = getattr(e, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text[:200]}"
