"""Hugging Face checkpoints (Qwen2/2.5, Qwen3, Llama 3.x, Mistral; Qwen3-MoE, Qwen2-MoE, Mixtral
with mcore/hf_moe.py) <-> the megatron-core GPTModel of mcore/build.py.

    shape = shape_from_hf_dir(hf_dir)                          # the checkpoint's vocabulary
    padded = dataclasses.replace(shape, vocab_size=padded_vocab_size(shape.vocab_size, tp))
    config = transformer_config(padded, job); model = build_gpt_model(padded, config, job)
    import_hf_weights(model, hf_dir, config, shape)            # this rank's TP / PP slice
    save_hf_checkpoint(model, config, shape, out_dir, hf_dir / "config.json")  # every rank calls

Legend: h hidden, nh attention heads, ng query groups (KV heads), hd head dim, f ffn size, V vocab.
Megatron layouts, read off megatron-core 0.16.1 (transformer/attention.py
SelfAttention.get_query_key_value_tensors, transformer/mlp.py glu):

- linear_qkv [ng * (nh/ng + 2) * hd, h]: for each group j, its nh/ng query heads, then k_j, then
  v_j. ColumnParallelLinear keeps a contiguous 1/tp of the rows: whole groups when ng >= tp, a part
  of one group when ng < tp (Megatron then all-gathers and re-slices), so a plain row split is right
  in both cases.
- linear_fc1 [2f, h] is cat(gate, up) at TP = 1; TP rank r holds cat(gate_r, up_r), because glu
  chunks the rank's local output into act(first half) * second half.
- Qwen3's q_norm / k_norm [hd] are self_attention.q_layernorm / k_layernorm, whole on every TP
  rank (each rank normalises its own heads; finalize_model_grads sums their gradients over TP).
- The four families name their tensors alike (Llama's HF checkpoints are already in the
  rotate-half RoPE layout Megatron uses, rotary_interleaved=False); Qwen2 adds Q/K/V biases, Qwen3
  the QK norms.
- Vocabulary rows are padded to a multiple of 128 * tp (Megatron-LM's rule); padding rows are zero
  on import and dropped on export. `shape` is always the checkpoint's (unpadded) shape.

mbridge 0.15.1 (its Qwen2Bridge has the same QKV and fc1 merges) is not used: it maps Transformer
Engine spec names (linear_qkv.layer_norm_weight, linear_fc1.layer_norm_weight) and builds the model
itself with use_transformer_engine=True on CUDA, while this package builds the local spec (separate
input_layernorm / pre_mlp_layernorm) and runs on CPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_chunkflow.core.hf_config import hf_config_dict, shape_from_hf_config
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.mcore.hf_moe import moe_hf_shapes, moe_layer_names
from megatron_chunkflow.mcore.hf_source import HFSource
from megatron_chunkflow.mcore.job import tensor_parallel_of
from megatron_chunkflow.mcore.names import full_model_name


def shape_from_hf_dir(path) -> ModelShape:
    """The ModelShape of a checkpoint directory, from its config.json (core/hf_config.py: the
    families supported and what is refused)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{file}: no such file (expected a Hugging Face checkpoint directory)")
    from megatron_chunkflow.flags import read_json_file

    d = read_json_file(file, str(file))
    if not isinstance(d, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(d).__name__}")
    return shape_from_hf_config(d, str(file))


def hf_max_positions(path) -> int | None:
    """A checkpoint directory's max_position_embeddings (config.json), None when it has none."""
    from megatron_chunkflow.flags import read_json_file

    file = Path(path) / "config.json"
    d = read_json_file(file, str(file)) if file.is_file() else {}
    n = d.get("max_position_embeddings") if isinstance(d, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padded vocabulary: the next multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


# One name map, both directions. Outside the layers: megatron -> Hugging Face
OUTER_NAMES = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
               "output_layer.weight": "lm_head.weight",
               "decoder.final_layernorm.weight": "model.norm.weight"}
# a layer's tensors kept whole (megatron name after decoder.layers.N. -> after model.layers.N.)
LAYER_NAMES = {"input_layernorm.weight": "input_layernorm.weight",
               "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
               "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
               "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
               "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
               "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
# and the two fused ones: Q, K, V interleaved by group into linear_qkv; gate and up into fc1
QKV, FC1 = "self_attention.linear_qkv", ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight",
                                                                  "mlp.up_proj.weight"))


def hf_tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face checkpoint of `shape`'s family, with its shape."""
    h, f, v, q, kv = (shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size,
                      shape.num_attention_heads * shape.head_dim, shape.kv_dim)
    outer = {"embedding.word_embeddings.weight": (v, h), "decoder.final_layernorm.weight": (h,)}
    if not shape.tie_embeddings:
        outer["output_layer.weight"] = (v, h)
    out = {OUTER_NAMES[k]: s for k, s in outer.items()}
    whole = {"input_layernorm.weight": (h,), "self_attention.linear_proj.weight": (h, q),
             "pre_mlp_layernorm.weight": (h,)}
    mlp = moe_hf_shapes(shape) if shape.is_moe else \
        {LAYER_NAMES["mlp.linear_fc2.weight"]: (h, f), **{name: (f, h) for name in FC1[1]}}
    if shape.qk_norm:  # one weight per head dim, shared by every head
        whole.update({"self_attention.q_layernorm.weight": (shape.head_dim,),
                      "self_attention.k_layernorm.weight": (shape.head_dim,)})
    for g in range(shape.num_layers):
        p = f"model.layers.{g}."
        out.update({p + LAYER_NAMES[k]: s for k, s in whole.items()})
        out.update({p + name: s for name, s in mlp.items()})
        for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
            tail = (h,) if suffix == "weight" else ()
            out.update({f"{p}self_attn.{x}_proj.{suffix}": (n, *tail)
                        for x, n in (("q", q), ("k", kv), ("v", kv))})
    return out


def check_hf_checkpoint(directory, shape: ModelShape) -> None:
    """Its safetensors headers readable and every tensor `shape` needs there with its shape
    (ValueError naming the file or tensor), before any model is built or data tokenized."""
    HFSource(directory, shape.family).check(shape, hf_tensor_shapes(shape))


# Transformer Engine's layer spec (Megatron-LM's GPU default) fuses the norms into the next linear
# layer: the same tensors under other names.
TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
# and its grouped-GEMM experts (TEGroupedMLP) hold expert i's linear as `weight{i}` of one module
_TE_GROUPED = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def local_spec_name(name: str) -> str:
    """A parameter's name in the local layer spec, for TE-spec and local-spec models alike."""
    for te, local in TE_NAMES.items():
        if name.endswith("." + te):
            return name[: -len(te)] + local
    m = _TE_GROUPED.search(name)
    if m:
        return f"{name[:m.start()]}.mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight"
    return name


def _megatron_from_hf(name: str, src: HFSource, shape: ModelShape) -> torch.Tensor:
    """The TP = 1 megatron tensor `name` (a PP = 1 name), unpadded vocabulary; ValueError for a
    parameter no Hugging Face tensor of the family maps to (a model built otherwise)."""
    try:
        return _megatron_tensor(name, src, shape)
    except KeyError:
        raise ValueError(f"model parameter {name} has no Hugging Face tensor in a "
                         f"{shape.family} checkpoint (the model was built with something the "
                         "family does not have: a bias, a LayerNorm, ...)") from None


def _megatron_tensor(name: str, src: HFSource, shape: ModelShape) -> torch.Tensor:
    if name in OUTER_NAMES:
        return src.get(OUTER_NAMES[name])
    if not name.startswith("decoder.layers."):
        raise KeyError(name)
    _, _, g, rest = name.split(".", 3)
    p = f"model.layers.{g}."
    if shape.is_moe and rest.startswith("mlp."):
        return torch.cat([src.get(p + n) for n in moe_layer_names(shape)[rest]])
    if rest.startswith(QKV + "."):
        suffix = rest.rsplit(".", 1)[1]  # weight [.., h] or bias [..]
        ng = shape.num_query_groups
        q, k, v = (src.get(f"{p}self_attn.{x}_proj.{suffix}") for x in "qkv")
        # [ng, nh/ng * hd | hd | hd, (h)] -> [ng * (nh/ng + 2) * hd, (h)]
        qkv = torch.cat([t.reshape(ng, -1, *t.shape[1:]) for t in (q, k, v)], dim=1)
        return qkv.reshape(-1, *q.shape[1:])
    if rest == FC1[0]:
        return torch.cat([src.get(p + n) for n in FC1[1]])
    return src.get(p + LAYER_NAMES[rest])


def _hf_from_megatron(full: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """HF tensors from the TP = 1, PP = 1 megatron state (padded vocabulary rows dropped)."""
    v, ng, hd = shape.vocab_size, shape.num_query_groups, shape.head_dim
    outer = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    outer += [] if shape.tie_embeddings else ["output_layer.weight"]
    out = {OUTER_NAMES[k]: full[k][:v] if "norm" not in k else full[k] for k in outer}
    for g in range(shape.num_layers):
        m, p = f"decoder.layers.{g}.", f"model.layers.{g}."
        for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
            qkv = full[f"{m}{QKV}.{suffix}"]
            qkv = qkv.reshape(ng, -1, hd, *qkv.shape[1:])  # [ng, nh/ng + 2, hd, (h)]
            tail = qkv.shape[3:]
            out[f"{p}self_attn.q_proj.{suffix}"] = qkv[:, :-2].reshape(-1, *tail)
            out[f"{p}self_attn.k_proj.{suffix}"] = qkv[:, -2].reshape(-1, *tail)
            out[f"{p}self_attn.v_proj.{suffix}"] = qkv[:, -1].reshape(-1, *tail)
        if shape.is_moe:
            for mg, parts in moe_layer_names(shape).items():
                out.update(zip((p + n for n in parts), full[m + mg].chunk(len(parts))))
        else:
            out.update(zip((p + n for n in FC1[1]), full[m + FC1[0]].chunk(2)))
        out.update({p + hf: full[m + mg] for mg, hf in LAYER_NAMES.items()
                    if m + mg in full})  # the Q/K norms where the family has them
    return {k: t.contiguous() for k, t in out.items()}


def _unwrap(model):
    while hasattr(model, "module"):  # DDP, Float16Module
        model = model.module
    return model


def import_hf_weights(model, hf_dir_or_state_dict, config, shape: ModelShape) -> None:
    """Copy a HF checkpoint into this rank's TP / PP slice of a built GPTModel.

    `shape` is the checkpoint's (unpadded vocabulary); the model may have more vocabulary rows
    (padded_vocab_size), which are zero-filled. Every rank checks the whole checkpoint, so a
    missing, unexpected or wrongly shaped HF tensor raises the same ValueError everywhere. With
    tied embeddings an lm_head.weight (HF's state_dict() has the tied copy) is ignored, as in HF.
    """
    src = HFSource(hf_dir_or_state_dict, shape.family)
    src.check(shape, hf_tensor_shapes(shape))
    for name, param in _unwrap(model).named_parameters():
        tp, rank, _ = _tensor_parallel_of(name, _unwrap(model))
        full_name = local_spec_name(full_model_name(name, _unwrap(model)))
        full = _megatron_from_hf(full_name, src, shape)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            rows = param.shape[0] * tp
            if rows > full.shape[0]:
                full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
        local = full
        if getattr(param, "tensor_model_parallel", False):
            if _is_glu(full_name):
                local = torch.cat([t.chunk(tp)[rank] for t in full.chunk(2)])
            else:
                local = full.chunk(tp, dim=param.partition_dim)[rank]
        if local.shape != param.shape:
            raise ValueError(f"model parameter {name} has shape {list(param.shape)}, the HF "
                             f"tensors give {list(local.shape)} on TP rank {rank} of {tp} (build "
                             "the model with padded_vocab_size and the checkpoint's shape)")
        with torch.no_grad():
            param.copy_(local)


def _is_glu(name: str) -> bool:
    """A SwiGLU linear_fc1 (a dense layer's, an expert's, the shared expert's): cat(gate, up)."""
    return name.endswith("linear_fc1.weight")


def _tensor_parallel_of(name: str, model) -> tuple[int, int, object]:
    """(size, rank, group) of the tensor-parallel group parameter `name` of `model` is split
    over: an expert's is the expert TP group (--expert-tensor-parallel-size), every other the
    TP group."""
    if ".experts." in name:
        group = model.pg_collection.expt_tp
        return group.size(), group.rank(), group
    return tensor_parallel_of(model)


def gather_tensor_parallel(t: torch.Tensor, param, glu: bool, tp: int, group) -> torch.Tensor:
    """The whole tensor of `t`, this TP rank's shard of `param` (its weight, or its gradient),
    all-gathered over the TP `group` along the partition dim; a SwiGLU linear_fc1 (`glu`) holds
    cat(gate_r, up_r) on rank r and becomes cat(gate, up). Unsharded parameters are returned as
    they are. Collective over the TP group."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(shards, t.contiguous(), group=group)
    if glu:
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=param.partition_dim)


def export_hf_weights(model, config, shape: ModelShape) -> dict[str, torch.Tensor]:
    """The full HF state dict (CPU tensors) on every rank: TP shards and PP stages (every model
    chunk of a rank, with virtual stages: `model` a list) gathered.

    Collective: every rank of the model-parallel group must call it.
    """
    chunks = [_unwrap(m) for m in (model if isinstance(model, list) else [model])]
    if any(".lora_" in name for chunk in chunks for name, _ in chunk.named_parameters()):
        raise ValueError("the model has LoRA adapters: merge them into the base weights first "
                         "(mcore/lora.py merge_lora), or they would be left out")
    mine, experts = {}, {}
    for chunk in reversed(chunks):  # tied embeddings: the first model chunk's copy wins
        for name, param in chunk.named_parameters():
            full_name = local_spec_name(full_model_name(name, chunk))
            tp, _, group = _tensor_parallel_of(name, chunk)
            t = gather_tensor_parallel(param.detach(), param, _is_glu(full_name), tp, group)
            # a copy even on CPU: the export must not alias live weights
            (experts if ".experts." in name else mine)[full_name] = t.to("cpu", copy=True)
    ep_group = getattr(chunks[0].pg_collection, "ep", None)
    if experts and ep_group is not None and dist.get_world_size(ep_group) > 1:
        every = [None] * dist.get_world_size(ep_group)  # each EP rank's experts
        dist.all_gather_object(every, experts, group=ep_group)
        for part in every:
            mine.update(part)
    else:
        mine.update(experts)
    stages = [mine]
    pp_group = chunks[0].pg_collection.pp
    if dist.get_world_size(pp_group) > 1:
        stages = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, mine, group=pp_group)
    full = {}
    for stage in reversed(stages):  # tied embeddings: the first stage's copy wins
        full.update(stage)
    return _hf_from_megatron(full, shape)


def save_hf_checkpoint(model, config, shape: ModelShape, out_dir, source_config_json=None) -> None:
    """Write out_dir/model.safetensors and out_dir/config.json (rank 0; every rank must call).

    config.json is copied from source_config_json when given, else written from `shape`.
    """
    from safetensors.torch import save_file

    tensors = export_hf_weights(model, config, shape)
    if dist.get_rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, os.fspath(out / "model.safetensors"), metadata={"format": "pt"})
        if source_config_json is not None:
            shutil.copyfile(source_config_json, out / "config.json")
        else:
            dtype = str(config.params_dtype).removeprefix("torch.")
            (out / "config.json").write_text(json.dumps(hf_config_dict(shape, dtype), indent=2))
    dist.barrier()


# what transformers' AutoTokenizer and generate() read beside the weights and config.json
HF_COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")


def copy_hf_companions(out_dir, sources) -> list[str]:
    """Copy the tokenizer files and generation_config.json of the first directory in `sources`
    (the --tokenizer directory, then the --load-hf checkpoint; None entries skipped) that has
    each, into the export `out_dir`; the names copied (one process calls it)."""
    copied = []
    for name in HF_COMPANION_FILES:
        for src in (Path(d) for d in sources if d):
            if (src / name).is_file() and not (Path(out_dir) / name).exists():
                shutil.copyfile(src / name, Path(out_dir) / name)
                copied.append(name)
                break
    return copied

