"""Parameter names across pipeline stages: what a stage's parameter is called in the PP = 1 model
of the same architecture (mcore/build.py's named parameters, Hugging Face import and export in
mcore/hf.py, LoRA's adapters in mcore/lora.py, SpaCO's check)."""

from __future__ import annotations


def full_model_name(stage_name: str, config, tie_embeddings: bool,
                    vp_stage: int | None = None) -> str:
    """The name a pipeline stage's parameter (of model chunk `vp_stage`) has in the PP = 1 model
    of the same architecture.

    Stage layers are numbered from 0 locally; the global index adds the stage's layer offset. With
    tied embeddings and PP > 1 the last stage's output_layer.weight is its copy of the embedding.
    """
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    parts = stage_name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + get_transformer_layer_offset(config, vp_stage))
        return ".".join(parts)
    if tie_embeddings and stage_name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return stage_name
