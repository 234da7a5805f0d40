"""megatron-core's HybridModel (0.18 on; GPTModel's replacement from 0.19) as the same transformer:
each GPT layer becomes an attention layer and an MLP layer, the pattern "*-" per layer.

    model = build_hybrid_model(shape, hybrid_config(config), job)   # like build_gpt_model
    gpt_layer_name("decoder.layers.5.mlp.linear_fc1.weight")       # "decoder.layers.2.mlp..."

The layers are megatron-core's own (TransformerLayer with only self-attention, MLPLayer with only
the MLP) built from the local GPT layer spec's modules (mcore/build.py), so the model computes what
GPTModel computes and its weights map one to one: hybrid layer 2 i holds GPT layer i's input norm
and attention, layer 2 i + 1 its pre-MLP norm and MLP, and decoder.final_norm is
decoder.final_layernorm (gpt_layer_name). HybridStack builds its final norm with Transformer
Engine unconditionally; here it is the spec's local RMSNorm. Pipeline stages (and virtual
stages) are "|"-separated segments of the pattern, segment v x PP + r on pipeline rank r, model
chunk v: GPTModel's assignment of layers.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.mcore.job import Job

ATTENTION, MLP = "*", "-"
GPT_PATTERN = ATTENTION + MLP  # one GPT layer
# Megatron-LM's pretrain_hybrid.py symbols for layers whose state crosses tokens other than through
# attention (Mamba, gated delta net) or that ChunkFlow's attention does not replace (DSA, MLA)
OTHER_LAYERS = {"M": "Mamba", "G": "gated delta net (GDN)", "D": "DeepSeek sparse attention (DSA)",
                "E": "mixture of experts", "L": "multi-latent attention (MLA)"}


def hybrid_pattern(num_layers: int, segments: int) -> str:
    """The pattern of `num_layers` GPT layers cut into `segments` (PP x VPP) equal stages."""
    if num_layers % segments:
        raise ValueError(f"{num_layers} layers do not split into {segments} pipeline segments "
                         "(pipeline stages x virtual stages)")
    per = GPT_PATTERN * (num_layers // segments)
    return "|".join([per] * segments)


def check_pattern(pattern: str, flag: str = "--hybrid-layer-pattern") -> int:
    """The transformer layers of a hybrid layer pattern ChunkFlow runs: only attention ("*") and
    MLP ("-") layers (the state of Mamba, GDN or DSA layers across a sequence's chunks is not
    attention's keys and values), each attention layer followed by one MLP layer (the planner's
    layer), "|" stage boundaries allowed. ValueError naming `flag` otherwise."""
    main = pattern.split("/")[0]
    other = sorted({c for c in main if c not in (ATTENTION, MLP, "|")})
    if other:
        kinds = ", ".join(f"{c!r} ({OTHER_LAYERS.get(c, 'unknown')})" for c in other)
        raise ValueError(f"{flag} {pattern}: ChunkFlow runs attention ('*') and MLP ('-') layers "
                         f"only, not {kinds}: their state across a sequence's chunks is not "
                         "attention's keys and values")
    if "/" in pattern:
        raise ValueError(f"{flag} {pattern}: multi-token prediction layers ('/...') are not "
                         "supported with ChunkFlow")
    for segment in main.split("|"):
        if not segment or segment != GPT_PATTERN * (len(segment) // 2):
            raise ValueError(f"{flag} {pattern}: ChunkFlow plans each layer as an attention "
                             f"layer followed by an MLP layer ('*-'); the stage {segment!r} is "
                             "not such layers")
    return main.count(ATTENTION)


def hybrid_config(config):
    """The TransformerConfig of the HybridModel of `config`'s GPT: twice the layers (one attention,
    one MLP each), block recompute counted in them."""
    num = config.recompute_num_layers
    return dataclasses.replace(
        config, num_layers=2 * config.num_layers,
        recompute_num_layers=2 * num if num is not None else None)


@functools.lru_cache(maxsize=None)
def _stack_class():
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    class LocalNormHybridStack(HybridStack):
        """HybridStack whose final norm is the layers' own norm class (`final_norm` in the spec's
        params), not Transformer Engine's."""

        def __init__(self, config, submodules, *args, final_norm=None, post_layer_norm=True,
                     **kwargs):
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = final_norm(config=config, hidden_size=config.hidden_size,
                                             eps=config.layernorm_epsilon)

    return LocalNormHybridStack


def local_hybrid_spec(qk_norm: bool = False):
    """The hybrid stack spec of megatron-core's local modules (no Transformer Engine): an
    attention layer (input norm, self-attention) and an MLP layer (pre-MLP norm, MLP), the GPT
    local layer's modules, every norm torch's RMSNorm (under sequence parallelism too, its
    gradient summed over TP: mcore/build.py TorchRMSNorm), with Qwen3's per-head Q/K norms if
    `qk_norm`. Checkpoint keys as Transformer Engine's spec names them (its norms fused into the
    linear layers). Megatron-LM's pretrain_hybrid.py takes it by name (megatron_lm/specs.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from megatron_chunkflow.mcore.build import TorchRMSNorm

    layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True).submodules
    self_attention = dataclasses.replace(layer.self_attention, submodules=dataclasses.replace(
        layer.self_attention.submodules, q_layernorm=TorchRMSNorm if qk_norm else IdentityOp,
        k_layernorm=TorchRMSNorm if qk_norm else IdentityOp))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=TorchRMSNorm, self_attention=self_attention,
        self_attn_bda=layer.self_attn_bda,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=TorchRMSNorm, mlp=layer.mlp, mlp_bda=layer.mlp_bda,
        sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}))
    return ModuleSpec(module=_stack_class(), params={"final_norm": TorchRMSNorm},
                      submodules=HybridStackSubmodules(attention_layer=attention, mlp_layer=mlp))


def build_hybrid_model(shape: ModelShape, config, job: Job, max_seq_length: int = 1 << 20,
                       vp_stage: int | None = None):
    """A HybridModel for this rank's pipeline stage of `job` (model chunk `vp_stage`), `config`
    from hybrid_config: what build_gpt_model builds, as attention and MLP layers."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    segments = job.parallel.pp * job.parallel.vpp
    model = HybridModel(
        config=config, hybrid_stack_spec=local_hybrid_spec(config.qk_layernorm),
        vocab_size=shape.vocab_size, max_sequence_length=max_seq_length,
        hybrid_layer_pattern=hybrid_pattern(config.num_layers // 2, segments),
        pre_process=job.is_first_stage(vp_stage), post_process=job.is_last_stage(vp_stage),
        share_embeddings_and_output_weights=shape.tie_embeddings,
        position_embedding_type="rope", rotary_base=int(shape.rotary_base),
        pg_collection=job.groups, vp_stage=vp_stage)
    rope_scaled(model, shape)
    return model


def is_hybrid(model) -> bool:
    """Whether a built model stage (unwrapped) is a HybridModel."""
    return hasattr(model, "decoder") and hasattr(model.decoder, "layer_type_list")


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def gpt_layer_name(name: str) -> str:
    """A HybridModel parameter's name in the GPTModel of the same transformer (global layer
    numbers, "*-" pattern): hybrid layer j is GPT layer j // 2."""
    if name.startswith("decoder.final_norm."):
        return "decoder.final_layernorm." + name[len("decoder.final_norm."):]
    m = _LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) // 2}.{m.group(2)}" if m else name


def rope_scaled(model, shape: ModelShape) -> None:
    """Llama 3's RoPE scaling, which HybridModel's constructor does not take: the frequencies
    GPTModel's rope_scaling computes, set after the build (no-op for other families)."""
    if shape.rope_scaling_factor is None or not hasattr(model, "rotary_pos_emb"):
        return
    rope = model.rotary_pos_emb
    dim = rope.inv_freq.numel() * 2
    exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=rope.inv_freq.device) / dim
    rope.inv_freq = rope._apply_scaling(1.0 / (int(shape.rotary_base) ** exponent),
                                        factor=shape.rope_scaling_factor)
