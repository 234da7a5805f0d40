"""checks/settings.py: what one `chunkflow verify` run checks, and the rules between its flags
(before any process group starts; the command line's messages are tests/cli/test_verify.py's).

    python -m pytest tests/checks/test_settings.py -q
"""

import pytest

from megatron_chunkflow.checks.settings import VerifySettings
from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.lengths import LengthsConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.mcore.lora import LoRAConfig
from megatron_chunkflow.runtime.sparse import SparseConfig

TINY = get_model_shape("tiny")
CPU_BATCH = LengthsConfig(scale=1 / 32, min_long=1)


def settings(**kw):
    return VerifySettings(**{"shape": TINY, "lengths": CPU_BATCH,
                             "chunkflow": ChunkFlowConfig(256), **kw})


@pytest.mark.parametrize("kw,mode", [
    ({}, "exact"), ({"memory": "512"}, "memory"),
    ({"memory": "512", "parallel": ParallelConfig(cp=2)}, "memory_cp"),
    ({"hf_reference": "/ckpt"}, "hf"), ({"sparse": SparseConfig(1)}, "sparse"),
])
def test_one_mode_per_run(kw, mode, tmp_path):
    if "hf_reference" in kw:  # a checkpoint directory: its config.json
        kw = {"hf_reference": _checkpoint_config(tmp_path, TINY)}
    assert settings(**kw).mode == mode


def _checkpoint_config(directory, shape) -> str:
    import json

    from megatron_chunkflow.core.hf_config import hf_config_dict

    (directory / "config.json").write_text(json.dumps(hf_config_dict(shape)))
    return str(directory)


def test_the_hf_reference_is_the_model(tmp_path):
    """--hf-reference DIR: the checkpoint's config.json is the model whatever --model says, so its
    layout flags are checked against it (--ep 2 for an MoE checkpoint)."""
    moe = get_model_shape("tiny-qwen3-moe")
    s = settings(hf_reference=_checkpoint_config(tmp_path, moe), parallel=ParallelConfig(ep=2))
    assert s.shape == moe and s.parallel.ep == 2
    with pytest.raises(ValueError, match="for a mixture-of-experts model; this one is dense"):
        settings(hf_reference=_checkpoint_config(tmp_path, TINY), parallel=ParallelConfig(ep=2))


def test_steps_draw_new_batches_each_with_a_long_sequence():
    s = settings(steps=3)
    steps, source = s.step_lengths()
    assert len(steps) == 3 and steps[0] != steps[1]
    assert all(max(lengths) > 256 for lengths in steps)  # --min-long 1 over the chunk size
    assert source.endswith("step 0, scale 0.03125, 3 steps")


def test_spaco_draws_default_and_its_rules():
    assert settings(sparse=SparseConfig(1)).draws == 16
    with pytest.raises(ValueError, match="--draws needs --chunkflow-sparse-backward"):
        settings(draws=4)
    with pytest.raises(ValueError, match="--chunkflow-sparse-backward checks one batch"):
        settings(sparse=SparseConfig(1), steps=2)
    with pytest.raises(ValueError, match="cannot be combined with --memory"):
        settings(sparse=SparseConfig(1), memory="512")


@pytest.mark.parametrize("kw,message", [
    ({"memory": "12,x"}, "--lengths '12,x': expected comma-separated integers"),
    ({"memory": "0"}, "--lengths '0': lengths must be positive"),
    ({"memory": "512", "parallel": ParallelConfig(pp=2)}, "--memory measures at TP = PP = 1"),
    ({"parallel": ParallelConfig(cp=2), "lora": LoRAConfig(4)},
     "--lora-rank is not checked with --context-parallel-size 2"),
    ({"lora": LoRAConfig(4), "hf_reference": "/ckpt"},
     "--lora-rank cannot be combined with --hf-reference"),
    ({"steps": 0}, "--steps must be >= 1"),
])
def test_rules_between_flags_name_them(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings(**kw)
