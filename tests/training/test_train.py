"""`chunkflow train`'s loop: ChunkFlow and the stock-Megatron baseline train identically; resume."""

import pytest

from megatron_chunkflow.training.dist import run_processes

pytestmark = pytest.mark.slow

LENGTHS = [70, 5, 33, 100, 12, 64, 1, 16, 48, 9, 130, 21, 7, 90, 3, 40, 55, 11]


def _settings(**kw):
    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.training.settings import OptimizerConfig, TrainSettings

    base = dict(shape=get_model_shape("tiny"), model_name="tiny", train_iters=20,
                global_batch_size=6, seq_length=160, chunkflow=ChunkFlowConfig(16, 1),
                optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2),
                dtype="float64", seed=5)
    return TrainSettings(**{**base, **kw})


def _dataset():
    from megatron_chunkflow.data.synthetic import make_sequences

    return make_sequences([max(n, 2) for n in LENGTHS], 1000, seed=3)


def _losses(runs):
    from megatron_chunkflow.training.dist import init_distributed, shutdown
    from megatron_chunkflow.training.loop import train

    out = []
    for kw in runs:
        s = _settings(**kw)
        init_distributed(tp=s.parallel.tp, pp=s.parallel.pp, seed=s.seed)
        out.append([m["loss"] for m in train(s, _dataset())])
    shutdown()
    return out


SYSTEMS = ["chunkflow", "megatron-sft", "megatron-packed", "megatron-unpacked"]


@pytest.mark.parametrize("pp", [1, 2])
def test_chunkflow_trains_like_stock_megatron(pp):
    """20 steps, float64, same data order and seed: ChunkFlow and the three stock baselines give
    the same loss at every step to 1e-8 (megatron-sft computes its lines' padding, fixed shapes
    through the pipeline, and still trains on exactly the same tokens)."""
    from megatron_chunkflow.config import ParallelConfig

    layout = ParallelConfig(pp=pp)
    runs = run_processes(_losses, pp, [dict(parallel=layout, system=s) for s in SYSTEMS],
                         timeout=900)[-1]
    chunkflow = runs[0]
    assert chunkflow[-1] < chunkflow[0]
    for name, baseline in zip(SYSTEMS[1:], runs[1:]):
        assert len(chunkflow) == len(baseline) == 20
        for step, (a, b) in enumerate(zip(chunkflow, baseline), start=1):
            assert a == pytest.approx(b, rel=1e-8), f"{name} step {step}: {a} vs {b}"


def _losses_with_crashed_save(ckpt):
    """Run 10 steps saving at 10; leave what a crash in the middle of the next save leaves (a
    half-written iter_*.tmp, tracker untouched); then resume."""
    from pathlib import Path

    from megatron_chunkflow.training.checkpoint import CheckpointConfig

    first = _losses([dict(checkpoint=CheckpointConfig(save=ckpt, save_interval=10),
                                exit_interval=10)])[0]
    partial = Path(ckpt) / "iter_0000015.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    return first, _losses([dict(checkpoint=CheckpointConfig(load=ckpt))])[0]


def test_resume_gives_the_same_losses(tmp_path):
    """Save at step 10, crash during a later save, resume: steps 11-20 match an uninterrupted run."""
    ckpt = str(tmp_path / "ckpt")
    (whole,) = run_processes(_losses, 1, [dict()], timeout=900)[0]
    first, resumed = run_processes(_losses_with_crashed_save, 1, ckpt, timeout=900)[0]
    assert len(first) == 10 and len(resumed) == 10
    assert first == pytest.approx(whole[:10], rel=1e-12)
    assert resumed == pytest.approx(whole[10:], rel=1e-10)
