"""Parameter names across pipeline stages and model classes: what a stage's parameter is called in
the PP = 1 GPTModel of the same architecture (mcore/build.py's named parameters, Hugging Face
import and export in mcore/hf.py, LoRA's adapters in mcore/lora.py, verify's reference weights,
SpaCO's check). A HybridModel's (mcore/hybrid.py) map to the same names."""

from __future__ import annotations


def full_model_name(stage_name: str, model) -> str:
    """The name parameter `stage_name` of the built stage `model` (a GPTModel or HybridModel
    stage, or one model chunk of it) has in the PP = 1 GPTModel of the same architecture.

    Stage layers are numbered from 0 locally; the global index adds the stage's layer offset (a
    HybridModel's layer j is GPT layer j // 2). With tied embeddings and PP > 1 the last stage's
    output_layer.weight is its copy of the embedding.
    """
    from megatron_chunkflow.mcore.hybrid import gpt_layer_name, is_hybrid

    parts = stage_name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset(model))
        if parts[4:6] == ["experts", "local_experts"]:  # SequentialMLP's expert i of this rank
            parts[6] = str(int(parts[6]) + expert_offset(model))
        elif parts[4] == "experts" and parts[-1].startswith("weight") and parts[-1][6:].isdigit():
            # Transformer Engine's grouped experts: expert i of this rank is `weight{i}`
            parts[-1] = f"weight{int(parts[-1][6:]) + expert_offset(model)}"
        stage_name = ".".join(parts)
    elif model.share_embeddings_and_output_weights and stage_name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return gpt_layer_name(stage_name) if is_hybrid(model) else stage_name


def expert_offset(model) -> int:
    """The global index of this rank's first expert under expert parallelism (EP rank x the
    experts per rank; 0 without EP)."""
    config = model.config
    ep = config.expert_model_parallel_size
    if ep == 1:
        return 0
    group = getattr(getattr(model, "pg_collection", None), "ep", None)
    if group is None:
        raise ValueError(f"{type(model).__name__} has no expert-parallel group: build it on the "
                         "job's process groups (mcore/build.py build_gpt_model)")
    return group.rank() * (config.num_moe_experts // ep)


def layer_offset(model) -> int:
    """The global index of the stage's first layer (in its own model class's layers)."""
    from megatron_chunkflow.mcore.hybrid import is_hybrid

    if is_hybrid(model):
        layers = model.decoder.layers
        return layers[0].layer_number - 1 if len(layers) else 0
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config, getattr(model, "vp_stage", None))
