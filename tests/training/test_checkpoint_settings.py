"""Resuming compares the checkpoint's settings with the run's before loading anything
(training/resume.py compare_settings): contradictions refused naming the flag, changes that
can be honoured said with which value wins."""

import dataclasses
import re

import pytest

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.mcore.lora import LoRAConfig
from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
from megatron_chunkflow.training.resume import compare_settings


def _settings(**kw) -> dict:
    base = dict(shape=get_model_shape("tiny"), model_name="tiny", train_iters=20,
                optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2), seed=5)
    return dataclasses.asdict(TrainSettings(**{**base, **kw}))


SAVED = _settings()


def test_same_settings_resume_silently():
    assert compare_settings(SAVED, _settings(), 10, "ckpt") == []


@pytest.mark.parametrize("given,message", [
    (_settings(shape=get_model_shape("tiny-bench")), "holds another model: hidden_size 64 there, "
                                                     "128 here"),
    (_settings(parallel=ParallelConfig(pp=2)), "saved with --pipeline-model-parallel-size 1; "
                                               "this run has 2"),
    (_settings(seed=6), "saved with --seed 5; --seed 6 would reshuffle the data"),
    (_settings(dtype="float64"), "was saved in float32; this run trains in float64 (--dtype): "
                                 "resume in float32"),
    (_settings(train_iters=10), "--train-iters 10: --load ckpt (iteration 10) has already trained"),
])
def test_contradictions_are_refused(given, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compare_settings(SAVED, given, 10, "ckpt")


def test_schedule_changes_say_the_checkpoint_wins():
    notes = compare_settings(
        SAVED, _settings(optimizer=OptimizerConfig(lr=1e-3, min_lr=3e-4, lr_warmup_iters=2),
                         train_iters=40, global_batch_size=8), 10, "ckpt")
    assert len(notes) == 2
    assert "--lr 0.001 (saved 0.003), --train-iters 40 (saved 20): the checkpoint's " \
           "learning-rate schedule continues" in notes[0]
    assert "--global-batch-size 8" in notes[1]


def test_override_says_this_runs_schedule_wins():
    notes = compare_settings(SAVED, _settings(train_iters=40), 10, "ckpt",
                             override_schedule=True)
    assert notes == ["--load ckpt (iteration 10): --train-iters 40 (saved 20): "
                     "--override-lr-schedule: this run's learning-rate schedule, continued from "
                     "step 10"]


def test_a_failed_save_names_the_os_cause(tmp_path):
    """torch's writers wrap the OS error (or report a full disk only as a short write): the
    cause is found in the chain and said in words."""
    import errno

    from megatron_chunkflow.training.checkpoint import save_failure_cause

    def chained(err):
        try:
            try:
                raise err
            except OSError as inner:
                raise RuntimeError("unexpected pos 704 vs 598") from inner
        except RuntimeError as outer:
            return outer

    full = chained(OSError(errno.ENOSPC, "No space left on device"))
    assert save_failure_cause(full, str(tmp_path)) == \
        "no space left on device (No space left on device)"
    read_only = chained(OSError(errno.EROFS, "Read-only file system"))
    assert save_failure_cause(read_only, str(tmp_path)).startswith("read-only file system")
    assert save_failure_cause(RuntimeError("writer broke\nmore"), str(tmp_path)) == "writer broke"


def test_a_damaged_extra_state_is_named(tmp_path):
    """extra_rank0.pt truncated, garbled, empty or someone else's: ValueError naming --load and
    the file (the launcher and `train` print it as one line, exit 2), never torch's traceback."""
    import torch

    from megatron_chunkflow.training.checkpoint import EXTRA_KEYS, read_extra_state

    good = tmp_path / "iter_0000002" / "extra_rank0.pt"
    good.parent.mkdir()
    torch.save({k: 1 for k in EXTRA_KEYS}, good)
    assert read_extra_state(good)["iteration"] == 1
    data = good.read_bytes()
    for name, content, message in (("truncated", data[:len(data) // 2], "cannot be read"),
                                   ("garbled", b"\x00garbage" * 50, "cannot be read"),
                                   ("empty", b"", "cannot be read"),
                                   ("foreign", None, "not a chunkflow train checkpoint's extra "
                                                     "state (no scheduler, rng")):
        path = tmp_path / "iter_0000002" / f"{name}.pt"
        if content is None:
            torch.save({"iteration": 2}, path)
        else:
            path.write_bytes(content)
        with pytest.raises(ValueError, match=r"--load .*" + name + r"\.pt: " + re.escape(message)):
            read_extra_state(path)


def test_a_damaged_shard_is_named_in_one_line():
    """torch's CheckpointException carries every rank's traceback in its text: the message keeps
    the first rank's exception, one line."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_chunkflow.training.checkpoint import _cause

    try:
        raise RuntimeError("PytorchStreamReader failed reading zip archive\nmore detail")
    except RuntimeError as inner:
        import traceback

        e = CheckpointException("load failed", {0: (inner, traceback.extract_tb(
            inner.__traceback__))})
    assert "Traceback" in str(e)
    assert _cause(e) == "RuntimeError: PytorchStreamReader failed reading zip archive"
    assert _cause(ValueError("x" * 500)) == "ValueError: " + "x" * 200


def test_a_stock_interleaved_run_is_checked_at_every_step_before_the_first():
    """--no-chunkflow --pp 2 --vpp 2: a step Megatron's interleaved schedule would refuse (too
    few micro-batches) is found before step 0 from the lengths alone, naming the step."""
    from megatron_chunkflow.config import ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.data.sampler import BatchSampler
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings
    from megatron_chunkflow.training.loop import check_stock_interleaving

    def settings(batch):
        return TrainSettings(shape=get_model_shape("tiny"), model_name="tiny",
                             system="megatron-sft", seq_length=64, global_batch_size=batch,
                             train_iters=6, parallel=ParallelConfig(pp=2, vpp=2),
                             optimizer=OptimizerConfig(lr_warmup_iters=0), device="cpu")

    data = [[0] * 40] * 64  # 40 tokens each: one per 64-token line, one line per micro-batch
    few = settings(1)  # 1 micro-batch, fewer than PP
    with pytest.raises(ValueError, match=r"step 0: 1 micro-batches per pipeline: Megatron's "
                                         r"interleaved schedule needs at least 2 .*checked "
                                         r"before step 0"):
        check_stock_interleaving(few, data, BatchSampler(64, 1, 0), 0, 6, 0, 1)
    check_stock_interleaving(settings(8), data, BatchSampler(64, 8, 0), 0, 6, 0, 1)


@pytest.mark.parametrize("given,message", [
    (_settings(lora=LoRAConfig(4)), "was saved without LoRA (full fine-tuning); this run has "
                                    "--lora-rank 4: resume without --lora-*"),
    (_settings(parallel=ParallelConfig(pp=2, vpp=2)), "saved with --pipeline-model-parallel-size "
                                                      "1; this run has 2"),
    (_settings(model_class="gpt"), None),
])
def test_what_decides_the_checkpoints_layout_is_compared(given, message):
    if message is None:  # the class this release builds by default is the saved one's
        assert compare_settings(SAVED, given, 10, "ckpt") == []
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        compare_settings(SAVED, given, 10, "ckpt")


def test_lora_settings_are_named_with_the_saved_values():
    saved = _settings(lora=LoRAConfig(4, 8.0, "qkv,proj"))
    assert compare_settings(saved, saved, 10, "ckpt") == []
    for given, message in (
            (_settings(), "was saved with LoRA adapters (--lora-rank 4 --lora-alpha 8 "
                          "--lora-targets qkv,proj); this run has none: give --lora-rank 4"),
            (_settings(lora=LoRAConfig(8, 8.0, "qkv,proj")), "other LoRA adapters: --lora-rank 8 "
                                                             "(saved 4)"),
            (_settings(lora=LoRAConfig(4, 16.0, "qkv")), "--lora-alpha 16.0 (saved 8.0), "
                                                         "--lora-targets qkv (saved qkv,proj)")):
        with pytest.raises(ValueError, match=re.escape(message)):
            compare_settings(saved, given, 10, "ckpt")


def test_a_checkpoint_never_runs_code_when_loaded(tmp_path):
    """extra_rank*.pt is read with torch.load(weights_only=True): a file whose pickle would call a
    function is refused by name, and the function is not called; an earlier checkpoint's numpy
    RNG state still loads."""
    import numpy as np
    import torch

    from megatron_chunkflow.training.checkpoint import read_extra_state

    called = tmp_path / "called"

    class Payload:
        def __reduce__(self):
            return (open, (str(called), "w"))

    path = tmp_path / "extra_rank0.pt"
    torch.save({"scheduler": Payload(), "rng": {}, "iteration": 1, "consumed": 0,
                "settings": {}}, path)
    with pytest.raises(ValueError, match=r"holds a Python object \(.*open\) that loading would "
                                         r"have to run code to rebuild.*it is not loaded"):
        read_extra_state(path)
    assert not called.exists()
    torch.save({"scheduler": {}, "rng": {"numpy": np.random.get_state()}, "iteration": 1,
                "consumed": 0, "settings": {}}, path)
    assert read_extra_state(path)["rng"]["numpy"][0] == "MT19937"


def test_another_expert_layout_is_refused_before_loading():
    """Expert-parallel shards are laid out per EP rank: another EP is named, not attempted (an
    older checkpoint without the field reads as EP 1)."""
    moe = dict(shape=get_model_shape("tiny-qwen3-moe"), model_name="tiny-qwen3-moe")
    saved = _settings(**moe)
    del saved["parallel"]["ep"], saved["parallel"]["etp"]
    assert compare_settings(saved, _settings(**moe), 10, "ckpt") == []
    with pytest.raises(ValueError, match=re.escape(
            "saved with --expert-model-parallel-size 1; this run has 2")):
        compare_settings(saved, _settings(**moe, parallel=ParallelConfig(ep=2)), 10, "ckpt")
