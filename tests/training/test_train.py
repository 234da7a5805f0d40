"""`chunkflow train`'s loop: ChunkFlow and the stock-Megatron baseline train identically; resume."""

import os

import pytest

from megatron_chunkflow.config import ChunkFlowConfig
from tests.models import tiny

pytestmark = pytest.mark.slow

LENGTHS = [70, 5, 33, 100, 12, 64, 1, 16, 48, 9, 130, 21, 7, 90, 3, 40, 55, 11]


def _settings(**kw):
    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings

    layout = kw.get("parallel")  # the tiny model, a layer per model chunk (tests/models.py)
    stages = layout.pp * layout.vpp if layout is not None else 1
    base = dict(shape=tiny("tiny", stages), model_name="tiny", train_iters=8,
                global_batch_size=6, seq_length=160, chunkflow=ChunkFlowConfig(16, 1),
                optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2),
                dtype="float64", seed=5)
    return TrainSettings(**{**base, **kw})


def _dataset():
    from megatron_chunkflow.data.synthetic import make_sequences

    return make_sequences([max(n, 2) for n in LENGTHS], 1000, seed=3)


def _losses(runs):
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.training.loop import train

    out = []
    for kw in runs:
        s = _settings(**kw)
        job = init_distributed(s.parallel, s.seed)
        out.append([m["loss"] for m in train(s, job, _dataset())])
    shutdown()
    return out


SYSTEMS = ["chunkflow", "megatron-sft", "megatron-packed", "megatron-unpacked"]
_WHOLE: list = []


def _whole(gloo) -> list[float]:
    """The losses of 8 uninterrupted steps with the default settings (ChunkFlow, one process):
    the reference of several tests below, run once per test process."""
    if not _WHOLE:
        (losses,) = gloo.run(_losses, 1, [dict()], timeout=900)[0]
        _WHOLE.append(losses)
    return _WHOLE[0]


@pytest.mark.parametrize("pp", [pytest.param(1, marks=pytest.mark.medium), 2])
def test_chunkflow_trains_like_stock_megatron(gloo, pp):
    """8 steps, float64, same data order and seed: ChunkFlow and the three stock baselines give
    the same loss at every step to 1e-8 (megatron-sft computes its lines' padding, fixed shapes
    through the pipeline, and still trains on exactly the same tokens)."""
    from megatron_chunkflow.config import ParallelConfig

    layout = ParallelConfig(pp=pp)
    systems = SYSTEMS[1:] if pp == 1 else SYSTEMS  # ChunkFlow at PP 1: the shared reference
    runs = gloo.run(_losses, pp, [dict(parallel=layout, system=s) for s in systems],
                    timeout=900)[-1]
    if pp == 1:
        runs = [_whole(gloo), *runs]
    chunkflow = runs[0]
    assert chunkflow[-1] < chunkflow[0]
    for name, baseline in zip(SYSTEMS[1:], runs[1:]):
        assert len(chunkflow) == len(baseline) == 8
        for step, (a, b) in enumerate(zip(chunkflow, baseline), start=1):
            assert a == pytest.approx(b, rel=1e-8), f"{name} step {step}: {a} vs {b}"


def test_virtual_stages_train_like_stock_megatron(gloo):
    """PP 2 x V 2: ChunkFlow's interleaved plan (K = 1 and 2) against stock megatron-sft through
    Megatron's interleaved 1F1B, 8 steps, float64, the same loss at every step (9 sequences per
    step into lines of 260 tokens: 2 stock micro-batches, a count Megatron's interleaved schedule
    accepts). Same layout, so the same initial weights (the model chunks' initialisation
    differs from PP 2's)."""
    from megatron_chunkflow.config import ParallelConfig

    common = dict(global_batch_size=9, seq_length=260, train_iters=8,
                  parallel=ParallelConfig(pp=2, vpp=2))
    runs = gloo.run(_losses, 2, [
        dict(system="megatron-sft", **common), dict(**common),
        dict(chunkflow=ChunkFlowConfig(16, 2), **common)], timeout=900)[-1]
    plain = runs[0]
    assert plain[-1] < plain[0]
    for name, other in zip(["chunkflow", "chunkflow K2"], runs[1:]):
        assert len(other) == 8
        for step, (a, b) in enumerate(zip(plain, other), start=1):
            assert a == pytest.approx(b, rel=1e-8), f"{name} step {step}: {a} vs {b}"


def _losses_with_crashed_save(ckpt):
    """Run 4 steps saving at 4; leave what a crash in the middle of the next save leaves (a
    half-written iter_*.tmp, tracker untouched); then resume."""
    from pathlib import Path

    from megatron_chunkflow.mcore.settings import CheckpointConfig

    first = _losses([dict(checkpoint=CheckpointConfig(save=ckpt, save_interval=4),
                          exit_interval=4)])[0]
    partial = Path(ckpt) / "iter_0000006.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    return first, _losses([dict(checkpoint=CheckpointConfig(load=ckpt))])[0]


def test_resume_gives_the_same_losses(gloo, tmp_path):
    """Save at step 4, crash during a later save, resume: steps 5-8 match an uninterrupted run."""
    ckpt = str(tmp_path / "ckpt")
    whole = _whole(gloo)
    first, resumed = gloo.run(_losses_with_crashed_save, 1, ckpt, timeout=900)[0]
    assert len(first) == 4 and len(resumed) == 4
    assert first == pytest.approx(whole[:4], rel=1e-12)
    assert resumed == pytest.approx(whole[4:], rel=1e-10)


def _resume_after_crashed_resave(ckpt):
    """Save at 2 and 4; leave what a crash inside a second save of iteration 4 leaves (the
    complete copy renamed to iter_0000004.old, the tracker naming 4) and resume; then lose that
    copy too and resume again: from iteration 2."""
    import shutil
    from pathlib import Path

    from megatron_chunkflow.mcore.settings import CheckpointConfig

    _losses([dict(checkpoint=CheckpointConfig(save=ckpt, save_interval=2), exit_interval=4)])
    root = Path(ckpt)
    tracker = root / "latest_checkpointed_iteration.txt"
    tracker.write_text("2\n")  # a crash after iter_0000004 was complete, before the tracker
    from_lagging = _losses([dict(checkpoint=CheckpointConfig(load=ckpt))])[0]
    tracker.write_text("4\n")
    (root / "iter_0000004").rename(root / "iter_0000004.old")
    from_old = _losses([dict(checkpoint=CheckpointConfig(load=ckpt))])[0]
    shutil.rmtree(root / "iter_0000004.old")
    from_2 = _losses([dict(checkpoint=CheckpointConfig(load=ckpt))])[0]
    return from_lagging, from_old, from_2


def test_resume_falls_back_to_the_newest_complete_checkpoint(gloo, tmp_path, capfd):
    ckpt = str(tmp_path / "ckpt")
    whole = _whole(gloo)
    lagging, from_old, from_2 = gloo.run(_resume_after_crashed_resave, 1, ckpt, timeout=900)[0]
    assert lagging == pytest.approx(whole[4:], rel=1e-10)  # the newest complete, not the tracker's
    assert from_old == pytest.approx(whole[4:], rel=1e-10)
    assert from_2 == pytest.approx(whole[2:], rel=1e-10)
    err = capfd.readouterr().err
    assert "names iteration 2, but iter_0000004 is newer and complete; resuming from it" in err
    assert "resuming from the newest complete checkpoint, iter_0000004.old" in err
    assert "resuming from the newest complete checkpoint, iter_0000002" in err
    assert "resumed from iteration 2 (12 sequences consumed)" in err
    # a line for every checkpoint saved, as Megatron-LM prints one
    assert f"saved checkpoint from iteration 2 to {ckpt}/iter_0000002 (" in err
    assert f"saved checkpoint from iteration 4 to {ckpt}/iter_0000004 (" in err


def _load(ckpt):
    from megatron_chunkflow.mcore.settings import CheckpointConfig

    return _losses([dict(checkpoint=CheckpointConfig(load=ckpt))])


def test_truncated_shard_is_named(gloo, tmp_path, capfd):
    """A damaged file is named, and only then is removing the directory advised; torch's loader
    prints nothing of its own on the way (its "Global metadata is not found" and the unpickling
    traceback of a truncated .metadata)."""
    import shutil
    from pathlib import Path

    from megatron_chunkflow.mcore.settings import CheckpointConfig

    ckpt = str(tmp_path / "ckpt")
    gloo.run(_losses, 1, [dict(checkpoint=CheckpointConfig(save=ckpt), train_iters=3)],
                  timeout=600)
    pristine = tmp_path / "pristine"
    shutil.copytree(Path(ckpt) / "iter_0000003", pristine)
    (shard,) = (Path(ckpt) / "iter_0000003").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"--load .*iter_0000003: the sharded checkpoint cannot "
                                         r"be read .*the files are damaged: remove this "):
        gloo.run(_load, 1, ckpt, timeout=600)
    shutil.rmtree(Path(ckpt) / "iter_0000003")
    shutil.copytree(pristine, Path(ckpt) / "iter_0000003")
    metadata = Path(ckpt) / "iter_0000003" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:50])
    capfd.readouterr()
    with pytest.raises(ValueError, match=r"cannot be read .*the files are damaged"):
        gloo.run(_load, 1, ckpt, timeout=600)
    out, err = capfd.readouterr()
    assert "Global metadata is not found" not in out + err
    assert "Traceback" not in out + err and "UnpicklingError" not in out + err


def _resume_with_other_adapters(root):
    """A checkpoint without LoRA resumed with --lora-rank 4, one with rank 4 without LoRA and with
    rank 8: each refused before loading, naming the flag and the value saved."""
    from megatron_chunkflow.mcore.lora import LoRAConfig
    from megatron_chunkflow.mcore.settings import CheckpointConfig

    messages = []
    for saved, given in ((None, LoRAConfig(4)), (LoRAConfig(4), None), (LoRAConfig(4),
                                                                          LoRAConfig(8))):
        ckpt = f"{root}/{saved is not None}_{given is not None}"
        _losses([dict(checkpoint=CheckpointConfig(save=ckpt), train_iters=3, lora=saved)])
        try:
            _losses([dict(checkpoint=CheckpointConfig(load=ckpt), train_iters=4, lora=given)])
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_resume_with_other_lora_settings_names_them_and_keeps_the_checkpoint(gloo, tmp_path):
    """The adapters decide the checkpoint's parameters and optimizer states: a mismatch is named
    before anything is loaded, never as a damaged checkpoint to remove."""
    without, with_rank4, rank8 = gloo.run(_resume_with_other_adapters, 1, str(tmp_path),
                                          timeout=900)[0]
    assert "was saved without LoRA (full fine-tuning); this run has --lora-rank 4" in without
    assert "was saved with LoRA adapters (--lora-rank 4 --lora-alpha 16 --lora-targets " \
           "qkv,proj,fc1,fc2); this run has none" in with_rank4
    assert "was saved with other LoRA adapters: --lora-rank 8 (saved 4)" in rank8
    assert not any("remove" in m for m in (without, with_rank4, rank8))


def test_resume_on_more_processes_than_saved_is_refused(gloo, tmp_path):
    from megatron_chunkflow.mcore.settings import CheckpointConfig

    ckpt = str(tmp_path / "ckpt")
    gloo.run(_losses, 1, [dict(checkpoint=CheckpointConfig(save=ckpt), train_iters=3)],
                  timeout=600)
    with pytest.raises(ValueError, match="saved by 1 processes, this run has 2; resume with 1"):
        gloo.run(_load, 2, ckpt, timeout=600)


def test_stock_runs_steps_with_fewer_microbatches_than_dp_ranks(gloo):
    """DP=2, global batches of 2 sequences: most pack into one --seq-length micro-batch, so one
    rank has nothing to run. It idles (zero gradients, no tokens, the same reduction) instead of
    dying, and the losses equal ChunkFlow's at every step."""
    runs = gloo.run(_losses, 2, [dict(system=s, global_batch_size=2, train_iters=8)
                                      for s in ("chunkflow", "megatron-packed", "megatron-sft")],
                         timeout=600)
    for chunkflow, packed, sft in runs:  # every rank reports the same losses
        assert len(chunkflow) == 8 and chunkflow == pytest.approx(packed, rel=1e-8)
        assert sft == pytest.approx(chunkflow, rel=1e-8)
    assert runs[0] == runs[1]


def _lrs(ckpt):
    """Learning rates applied: an unbroken run of the new schedule, and runs saved at step 5 of
    the old one and resumed with the new one, without and with --override-lr-schedule."""
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.settings import CheckpointConfig, OptimizerConfig
    from megatron_chunkflow.training.loop import train

    new = dict(optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-5, lr_warmup_iters=2), train_iters=8)

    def run(**kw):
        s = _settings(**kw)
        job = init_distributed(s.parallel, s.seed)
        return [m["lr"] for m in train(s, job, _dataset())]

    old = run(train_iters=8)
    run(train_iters=8, checkpoint=CheckpointConfig(save=ckpt), exit_interval=5)
    kept = run(**new, checkpoint=CheckpointConfig(load=ckpt))
    overridden = run(**new, checkpoint=CheckpointConfig(load=ckpt, override_lr_schedule=True))
    whole = run(**new)
    shutdown()
    return old, kept, overridden, whole


def test_override_lr_schedule_takes_this_runs_schedule(gloo, tmp_path, capfd):
    old, kept, overridden, whole = gloo.run(_lrs, 1, str(tmp_path / "ckpt"),
                                                 timeout=900)[0]
    assert kept == pytest.approx(old[5:], rel=1e-12)  # the checkpoint's schedule continues
    assert overridden == pytest.approx(whole[5:], rel=1e-12)
    assert overridden != pytest.approx(kept, rel=1e-3)
    err = capfd.readouterr().err
    assert "--override-lr-schedule takes this run's" in err
    assert "--override-lr-schedule: this run's learning-rate schedule, continued from step 5" \
        in err


def _cp_records(placements):
    from megatron_chunkflow.config import ParallelConfig
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.training.loop import train

    out = []
    for placement in placements:
        s = _settings(parallel=ParallelConfig(cp=2), train_iters=3, global_batch_size=18,
                      chunkflow=ChunkFlowConfig(128, 1, cp_placement=placement))
        job = init_distributed(s.parallel, s.seed)
        out.append(train(s, job, _dataset()))
    shutdown()
    return out


def test_cp_placements_train_alike_and_report_their_traffic(gloo):
    """CP 2, the whole dataset per step at C = 128, where the hybrid placement keeps packed
    sequences whole on one rank (core/cp_place.py): the same losses as splitting every segment
    (float64), and each record says what the rank received in the CP attention, less with the
    hybrid placement."""
    for hybrid, split in gloo.run(_cp_records, 2, ["hybrid", "split"], timeout=900):
        assert len(hybrid) == len(split) == 3
        for h, p in zip(hybrid, split):
            assert h["loss"] == pytest.approx(p["loss"], rel=1e-10)
            assert 0 < h["cp_kv_received_bytes"] < p["cp_kv_received_bytes"]
            assert 0 < h["cp_grad_received_bytes"] < p["cp_grad_received_bytes"]


def _diverged(ckpt):
    from pathlib import Path

    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.settings import CheckpointConfig, OptimizerConfig
    from megatron_chunkflow.training.loop import Diverged, train

    s = _settings(train_iters=8, optimizer=OptimizerConfig(lr=1e6, min_lr=1e5, lr_warmup_iters=0,
                                                           clip_grad=0.0),
                  checkpoint=CheckpointConfig(save=ckpt, save_interval=1))
    job = init_distributed(s.parallel, s.seed)
    steps = []
    try:
        train(s, job, _dataset(), on_step=lambda m: steps.append(m["loss"]))
        error = None
    except Diverged as e:
        error = str(e)
    shutdown()
    tracker = Path(ckpt) / "latest_checkpointed_iteration.txt"
    return error, steps, int(tracker.read_text()) if tracker.exists() else 0


def test_a_diverged_run_stops_at_that_step_and_keeps_the_last_good_checkpoint(gloo, tmp_path):
    """--lr 1e6 with clipping off: the first step whose loss or gradient norm is inf or nan ends
    the run (Diverged naming the step and --lr), and that step is never saved."""
    error, steps, saved = gloo.run(_diverged, 1, str(tmp_path / "ckpt"), timeout=600)[0]
    assert error is not None, f"8 steps at --lr 1e6 stayed finite: {steps}"
    bad = len(steps)  # the step that diverged is the last one reported
    assert f"step {bad}: the " in error and "--lr 1e+06" in error and "--clip-grad 0" in error
    assert saved == bad - 1, (saved, bad, error)


def _save_into_a_blocked_path(ckpt):
    from pathlib import Path

    from megatron_chunkflow.mcore.settings import CheckpointConfig
    from megatron_chunkflow.training.checkpoint import SaveFailed

    Path(ckpt).mkdir()
    (Path(ckpt) / "iter_0000002.tmp").write_text("a file where the save writes its directory")
    try:
        _losses([dict(checkpoint=CheckpointConfig(save=ckpt, save_interval=1), train_iters=3)])
    except SaveFailed as e:
        return str(e), (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text().strip()
    return None, None


def test_a_failed_save_stops_the_run_naming_the_cause_and_keeps_the_last_checkpoint(gloo,
                                                                                    tmp_path):
    error, saved = gloo.run(_save_into_a_blocked_path, 1, str(tmp_path / "ckpt"),
                            timeout=600)[0]
    assert error is not None and "saving iteration 2 failed: " in error, error
    assert "File exists" in error and "every complete checkpoint there is kept" in error
    assert saved == "1"  # step 1's checkpoint is the last one, untouched


def _save_on_a_full_disk(ckpt):
    """Every shard write fails as a full disk fails (ENOSPC inside torch's writer, which
    dist_checkpointing reports as a CheckpointException, a BaseException)."""
    import errno
    from pathlib import Path

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_chunkflow.mcore.settings import CheckpointConfig
    from megatron_chunkflow.training.checkpoint import SaveFailed

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    original, filesystem_async._write_item = filesystem_async._write_item, full
    try:
        _losses([dict(checkpoint=CheckpointConfig(save=ckpt, save_interval=2), train_iters=3)])
    except SaveFailed as e:
        return str(e), sorted(p.name for p in Path(ckpt).iterdir())
    finally:
        filesystem_async._write_item = original
    return None, None


def test_a_full_disk_ends_the_run_in_one_line_and_removes_the_partial_save(gloo, tmp_path):
    error, left = gloo.run(_save_on_a_full_disk, 1, str(tmp_path / "ckpt"), timeout=600)[0]
    assert error is not None and "saving iteration 2 failed: no space left on device" in error
    assert left == []  # iter_0000002.tmp removed; nothing complete was there



OVERLAY = "CHUNKFLOW_MCORE_OVERLAY"  # `make test-release`: the other megatron-core release's dir


@pytest.mark.release
@pytest.mark.skipif(not os.environ.get(OVERLAY), reason="needs two megatron-core releases: "
                    "`make test-release MCORE=0.19.2` runs it over the installed one")
def test_a_checkpoint_of_the_installed_release_resumes_on_the_other(tmp_path):
    """Users upgrade in the middle of a project: `chunkflow train` saves at step 2 on the
    virtualenv's megatron-core (0.16.1 in CI), then resumes on the other release (the overlay,
    0.19.2); steps 3 and 4 are bit-identical to the uninterrupted run's (float64, the GPTModel
    the checkpoint holds, which --model-class auto keeps on a release that recommends
    HybridModel)."""
    import json
    import subprocess
    import sys

    overlay = os.environ[OVERLAY]
    base_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and os.path.abspath(p) != os.path.abspath(overlay))}
    base_env.pop(OVERLAY)
    other_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [overlay, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])}
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "corpus.bin"), dtype=np.int32)
    g = torch.Generator().manual_seed(0)
    for n in LENGTHS:  # the tiny model's vocabulary: 1000 ids
        builder.add_item(torch.randint(0, 1000, (max(n, 2),), generator=g))
        builder.end_document()
    builder.finalize(str(tmp_path / "corpus.idx"))
    args = ["--model", "tiny", "--dtype", "float64", "--data-path", str(tmp_path / "corpus"),
            "--train-iters", "4", "--global-batch-size", "4", "--seq-length", "160",
            "--chunk-size", "32", "--lr-warmup-iters", "1", "--save", str(tmp_path / "ckpt"),
            "--save-interval", "2"]

    def train(env, *extra, log):
        run = subprocess.run([sys.executable, "-m", "megatron_chunkflow", "train", *args, *extra,
                              "--log-json", str(tmp_path / log)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        steps = [json.loads(line) for line in (tmp_path / log).open()]
        return run, {s["step"]: s["loss"] for s in steps}

    probe = "from megatron_chunkflow import compat; print(compat.version_text())"
    versions = [subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                               text=True).stdout.split()[-1] for env in (base_env, other_env)]
    assert versions[0] != versions[1], versions
    _, whole = train(base_env, log="whole.jsonl")  # saves at 2 and 4
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2\n")
    (tmp_path / "ckpt" / "iter_0000004").rename(tmp_path / "iter_0000004.aside")
    run, resumed = train(other_env, "--load", str(tmp_path / "ckpt"), log="resumed.jsonl")
    assert f"GPTModel of megatron-core {versions[1]}" in run.stdout
    assert "resumed from iteration 2" in run.stderr
    assert sorted(resumed) == [3, 4]
    assert [resumed[3], resumed[4]] == [whole[3], whole[4]]  # bit for bit
