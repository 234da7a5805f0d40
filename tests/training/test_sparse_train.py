"""SpaCO in `chunkflow train`'s loop (runtime/sparse.py through training/loop.py), float64, CPU,
gloo: every token counts, each step's draw is seeded, resume draws the same chunks.

    python -m pytest tests/training/test_sparse_train.py -q

SpaCO's gradients themselves are checked in tests/checks/test_sparse.py.
"""

import pytest

from tests.models import tiny

pytestmark = pytest.mark.slow

C = 16


def _train(ckpt):
    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.settings import CheckpointConfig, OptimizerConfig, TrainSettings
    from megatron_chunkflow.runtime.sparse import SparseConfig
    from megatron_chunkflow.training.loop import train

    dataset = make_sequences([70, 5, 33, 100, 12, 64, 2, 16, 48, 9, 130, 21], 1000, seed=3)
    base = dict(shape=tiny("tiny"), model_name="tiny", train_iters=4,
                global_batch_size=6, seq_length=160, chunkflow=ChunkFlowConfig(C),
                optimizer=OptimizerConfig(lr=1e-2, min_lr=1e-3, lr_warmup_iters=0),
                dtype="float64", seed=5, sparse=SparseConfig(2))
    runs = {"exact": dict(sparse=SparseConfig(), train_iters=1), "whole": {},
            "first": dict(checkpoint=CheckpointConfig(save=ckpt, save_interval=2),
                          exit_interval=2),
            "resumed": dict(checkpoint=CheckpointConfig(load=ckpt))}
    out = {}
    for name, kw in runs.items():
        job = init_distributed(seed=5)
        out[name] = train(TrainSettings(**{**base, **kw}), job, dataset)
    shutdown()
    return out


def test_sparse_training_is_seeded_and_counts_every_token(gloo, tmp_path):
    """Step 1's loss (same weights) equals exact training's: every chunk runs forward and counts;
    each step's draw depends on (seed, step) only, so a resumed run draws the same chunks."""
    out = gloo.run(_train, 1, str(tmp_path / "ckpt"), timeout=900)[0]
    (exact,), whole = out["exact"], out["whole"]
    assert whole[0]["loss"] == pytest.approx(exact["loss"], rel=1e-12)
    assert whole[0]["loss_tokens"] == exact["loss_tokens"]
    assert all(m["approximate"] and m["sparse_backward"] == 2 for m in whole)
    assert any(m["backward_chunks"] < m["dependent_chunks"] for m in whole)
    assert whole[-1]["loss"] < whole[0]["loss"]
    resumed = out["first"] + out["resumed"]
    assert [m["backward_chunks"] for m in resumed] == [m["backward_chunks"] for m in whole]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in whole], rel=1e-10)
