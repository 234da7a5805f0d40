"""The plugin's checks of Megatron-LM's own flags under --chunkflow, on parsed-argument objects
(no Megatron-LM checkout needed; the launcher tests run the same checks end to end)."""

import enum
import sys
from types import SimpleNamespace

import pytest

from megatron_chunkflow.megatron_lm import args as plugin_args
from megatron_chunkflow.megatron_lm.args import LaunchError


class AttnBackend(enum.Enum):  # the members of megatron.core.transformer.enums.AttnBackend
    flash, fused, unfused, local, auto = 1, 2, 3, 4, 5


def _args(**given):
    defaults = dict(attention_backend=AttnBackend.auto, use_flash_attn=False,
                    chunkflow_attention_backend="auto", bf16=True, fp16=False,
                    num_attention_heads=28, tensor_model_parallel_size=4, context_parallel_size=1,
                    chunkflow_chunk_size=16384, seq_length=262144)
    return SimpleNamespace(**{**defaults, **given})


@pytest.mark.parametrize(("argv", "given", "backend"), [
    (["--attention-backend", "flash"], {"attention_backend": AttnBackend.flash}, "flash"),
    (["--attention-backend", "fused"], {"attention_backend": AttnBackend.fused}, "te"),
    (["--attention-backend=unfused"], {"attention_backend": AttnBackend.unfused}, "torch"),
    (["--use-flash-attn"], {"use_flash_attn": True}, "flash"),
])
def test_megatron_attention_flags_carry_over(monkeypatch, argv, given, backend):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    args = _args(**given)
    assert plugin_args._megatron_attention_backend(args) == " ".join(argv).replace("=", " ")
    assert args.chunkflow_attention_backend == backend


def test_no_megatron_attention_flag_changes_nothing(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--chunkflow"])
    args = _args()
    assert plugin_args._megatron_attention_backend(args) is None
    assert args.chunkflow_attention_backend == "auto"


@pytest.mark.parametrize(("argv", "given", "needle"), [
    (["--attention-backend", "flash", "--chunkflow-attention-backend", "torch"],
     {"attention_backend": AttnBackend.flash, "chunkflow_attention_backend": "torch"},
     "--attention-backend flash and --chunkflow-attention-backend torch ask for different"),
    (["--attention-backend", "fused", "--use-flash-attn"],
     {"attention_backend": AttnBackend.fused, "use_flash_attn": True},
     "--attention-backend fused and --use-flash-attn ask for different"),
])
def test_disagreeing_attention_flags_are_refused(monkeypatch, argv, given, needle):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    with pytest.raises(LaunchError, match=needle):
        plugin_args._megatron_attention_backend(_args(**given))


def test_a_materialising_backend_that_cannot_fit_is_refused(monkeypatch):
    """sdpa at the 7B/256K layout (7 heads per rank at TP 4, 16K chunks): the flag, the size."""
    monkeypatch.setattr("megatron_chunkflow.attention.trainable.device_memory_bytes",
                        lambda device: 80 * 2**30)
    with pytest.raises(LaunchError, match=r"--chunkflow-attention-backend sdpa materialises .* "
                                          r"7 heads x 16384 x 262144 keys = 116.0 GiB"):
        plugin_args._check_attention_backend(_args(chunkflow_attention_backend="sdpa"))
    plugin_args._check_attention_backend(_args())  # auto: a fused or tiled kernel
