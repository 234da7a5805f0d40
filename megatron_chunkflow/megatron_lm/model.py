"""The plugin's model seam: the model Megatron-LM builds, with chunk attention swapped in before
it is wrapped (DDP registers its hooks per module), --rope-scaling-factor honoured and
--chunkflow-load-hf loaded. Megatron-LM builds through training.get_model from a model provider
(pretrain_gpt.py at core_v0.16.1) or through a model builder's build_distributed_models (core_v0.19.0's
pretrain_gpt.py and pretrain_hybrid.py; compat.model_builders): both take the same path here.
"""

from __future__ import annotations

from functools import partial

from megatron_chunkflow import compat
from megatron_chunkflow.megatron_lm.args import LaunchError, chunkflow_config, resolve_backend
from megatron_chunkflow.megatron_lm.hooks import HOOKS, megatron_args
from megatron_chunkflow.megatron_lm.weights import load_hf, rope_factor_provider


def get_model(original, model_provider_func, *args, **kwargs):
    """training.get_model: the model built from a model provider (pretrain_gpt.py's at
    core_v0.16.1; later tags build through a model builder, _build_distributed_models)."""
    return _built_models(lambda wrap: original(wrap(model_provider_func), *args, **kwargs))


def patch_builder(cls) -> None:
    original = cls.build_distributed_models

    def build_distributed_models(self, *args, **kwargs):
        return _build_distributed_models(original, self, *args, **kwargs)

    cls.build_distributed_models = build_distributed_models


def _build_distributed_models(original, builder, *args, **kwargs):
    """A model builder's build_distributed_models (megatron/training/models, core_v0.18 on: the
    config container's path): the same as _get_model, its build_model being the provider."""
    def build(wrap):
        builder.build_model = wrap(builder.build_model)  # shadows the method for this build
        try:
            return original(builder, *args, **kwargs)
        finally:
            del builder.build_model

    return _built_models(build)


def _built_models(build):
    """`build(wrap)` builds the model list with `wrap(provider)` as its per-stage provider: the
    provider gets --rope-scaling-factor and, with --chunkflow, chunk attention swapped in before
    Megatron wraps the model (DDP registers hooks per module); --chunkflow-load-hf after."""
    from megatron_chunkflow.runtime.model import building_core_attention_without_cp

    a = megatron_args()
    if (a.chunkflow or a.chunkflow_load_hf) and not getattr(a, "chunkflow_checked", False):
        raise LaunchError("this Megatron-LM did not run the plugin's argument checks (they are "
                          "installed on its validate_args); megatron_chunkflow supports "
                          f"{compat.MEGATRON_LM_TAGS}")

    def wrap(provider):
        # both systems: the RoPE frequencies --rope-scaling-factor asks for (weights.py)
        provider = partial(rope_factor_provider, provider, a)
        if a.chunkflow:
            provider = partial(_chunkflow_provider, provider, resolve_backend(a),
                               chunkflow_config(a).loss_piece)
        return provider

    HOOKS.store = None  # a new model: its model chunks get one new store
    with building_core_attention_without_cp(a.context_parallel_size if a.chunkflow else 1):
        model = build(wrap)
    if a.chunkflow_load_hf:
        load_hf(model, a.chunkflow_load_hf)
    import torch.distributed as dist

    from megatron_chunkflow.attention.lse import ring_fallback

    note = ring_fallback(chunkflow_config(a), a.context_parallel_size, resolve_backend(a)) \
        if a.chunkflow else None
    if note and dist.get_rank() == 0:  # a substitution said, as train says it
        print(f"chunkflow: {note}", flush=True)
    return model


def _chunkflow_provider(provider, backend: str, loss_piece: int, *args, **kwargs):
    """pretrain_gpt.py's model provider, then chunk attention swapped in: before get_model wraps
    the model in Float16Module and DDP, whose forward pre-hooks (--overlap-param-gather) and
    gradient hooks are registered per module and parameter of the finished model. With virtual
    stages get_model calls it once per model chunk; the chunks share one K/V state store.
    `loss_piece` (--chunkflow-loss-piece): the last stage's loss in token pieces; Megatron-LM's
    padded vocabulary rows stay in its softmax, as its own cross entropy keeps them."""
    from megatron_chunkflow.runtime.model import apply_chunkflow

    model = provider(*args, **kwargs)
    HOOKS.store = apply_chunkflow(model, backend=backend, store=HOOKS.store,
                                   loss_piece=loss_piece)
    return model
