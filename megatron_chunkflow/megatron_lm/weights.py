"""The model pretrain_gpt.py builds, made the checkpoint's: --chunkflow-load-hf checked against
the model flags and loaded, and Llama 3's RoPE scaling factor honoured. Both systems (with and
without --chunkflow) get the same, so that they start from the same model.
"""

from __future__ import annotations

import torch

from megatron_chunkflow.megatron_lm.args import SHAPE_FLAGS, LaunchError, shape_from_args


def check_load_hf(args) -> None:
    """--chunkflow-load-hf names a readable config.json of a supported family whose architecture
    the model flags build, checked before any model is built: every ModelShape field but the
    (padded) vocabulary, each wrong one named by its flag."""
    if not args.chunkflow_load_hf:
        return
    from megatron_chunkflow.mcore.hf import shape_from_hf_dir

    try:
        hf = shape_from_hf_dir(args.chunkflow_load_hf)
    except ValueError as e:
        raise LaunchError(f"--chunkflow-load-hf {args.chunkflow_load_hf}: {e}") from None
    mine = shape_from_args(args)
    wrong = [f"{flag} {_shown(getattr(mine, field))} (config.json: {_shown(getattr(hf, field))})"
             for field, flag in SHAPE_FLAGS.items() if getattr(mine, field) != getattr(hf, field)]
    # what every supported family is, whatever its config.json says
    wrong += [f"{flag} (every supported family: {need})" for flag, bad, need in (
        (f"--normalization {args.normalization}", args.normalization != "RMSNorm", "RMSNorm"),
        (f"--position-embedding-type {args.position_embedding_type}",
         args.position_embedding_type != "rope", "rope"),
        (f"--rotary-percent {args.rotary_percent}", args.rotary_percent != 1.0,
         "1.0, RoPE on the whole head"),
        ("--rotary-interleaved", args.rotary_interleaved, "the rotate-half layout"),
        ("--layernorm-zero-centered-gamma",
         getattr(args, "layernorm_zero_centered_gamma", False), "plain RMSNorm weights"),
        ("no --swiglu", not args.swiglu, "a SwiGLU MLP"),
        ("no --disable-bias-linear", args.add_bias_linear, "no bias on the output or MLP"),
    ) if bad]
    if wrong:
        raise LaunchError(f"--chunkflow-load-hf {args.chunkflow_load_hf}: the model flags do not "
                          "build this checkpoint's model: " + "; ".join(wrong))


def _shown(value) -> str:
    if value is None or isinstance(value, bool):
        return {None: "unset", True: "on", False: "off"}[value]
    return str(value)


def load_hf(model: list, hf_dir: str) -> None:
    """The checkpoint's weights into each model chunk (this rank's TP / PP slice)."""
    from megatron.core.utils import get_model_config

    from megatron_chunkflow.mcore.hf import import_hf_weights, shape_from_hf_dir

    hf_shape = shape_from_hf_dir(hf_dir)
    try:
        for chunk in model:
            import_hf_weights(chunk, hf_dir, get_model_config(chunk), hf_shape)
    except ValueError as e:  # a tensor missing or of another shape than the flags build
        raise LaunchError(f"--chunkflow-load-hf {hf_dir}: {e}") from None


def rope_factor_provider(provider, args, *a, **kw):
    """pretrain_gpt.py's model provider, then --rope-scaling-factor applied. Megatron-LM
    core_v0.16.1's gpt_builder passes --use-rope-scaling to GPTModel but not the factor, so every
    model gets megatron-core's default 8 (Llama 3.1's); Llama 3.2's 32 would be silently wrong."""
    model = provider(*a, **kw)
    rope = getattr(model, "rotary_pos_emb", None)
    if args.use_rope_scaling and args.rope_scaling_factor != 8.0 and rope is not None:
        dim = rope.inv_freq.numel() * 2
        exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=rope.inv_freq.device) / dim
        rope.inv_freq = rope._apply_scaling(1.0 / (args.rotary_base ** exponent),
                                            factor=args.rope_scaling_factor)
    return model
