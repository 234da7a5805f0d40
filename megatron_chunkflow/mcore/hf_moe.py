"""The mixture-of-experts half of mcore/hf.py: Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints <->
megatron-core's MoE layer as mcore/build.py builds it (router, SequentialMLP experts, Qwen2-MoE's
gated shared expert).

Megatron, per layer (names of the PP = 1 model under decoder.layers.N., expert i numbered over all
EP ranks; mcore/names.py):

    mlp.router.weight                               [E, h]
    mlp.experts.local_experts.{i}.linear_fc1.weight [2f, h]  cat(gate_i, up_i)
    mlp.experts.local_experts.{i}.linear_fc2.weight [h, f]
    mlp.shared_experts.linear_fc1.weight            [2s, h]  cat(gate, up)       (Qwen2-MoE)
    mlp.shared_experts.linear_fc2.weight            [h, s]
    mlp.shared_experts.gate_weight                  [1, h]   sigmoid gate

Hugging Face, per layer (the checkpoints' names under model.layers.N., one tensor per expert):

    Qwen:    mlp.gate.weight; mlp.experts.{i}.{gate,up,down}_proj.weight;
             mlp.shared_expert.{gate,up,down}_proj.weight; mlp.shared_expert_gate.weight
    Mixtral: block_sparse_moe.gate.weight; block_sparse_moe.experts.{i}.{w1,w3,w2}.weight
             (gate, up, down)

transformers 5 holds a layer's experts as two stacked parameters instead (mlp.experts.gate_up_proj
[E, 2f, h], each expert's cat(gate, up); mlp.experts.down_proj [E, h, f]; Mixtral's block under
`mlp` too). `stacked_views` reads those as the checkpoint names, so a state dict (or a gradient
dict) of either layout imports, and exports are always in the checkpoints' layout.

Under expert tensor parallelism an expert's linear_fc1 / linear_fc2 are split over the expert TP
group as a dense layer's are over TP (fc1 by gate/up halves); the router, the shared expert's gate
and (split over TP) the shared expert are as in a dense layer.
"""

from __future__ import annotations

import re

from megatron_chunkflow.core.models import ModelShape

_EXPERT_PARTS = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


def _block(family: str) -> tuple[str, tuple[str, str, str]]:
    """(the MoE block's name in a layer, the names of an expert's gate, up and down)."""
    if family == "mixtral":
        return "block_sparse_moe", _EXPERT_PARTS["mixtral"]
    return "mlp", _EXPERT_PARTS["qwen"]


def moe_layer_names(shape: ModelShape) -> dict[str, tuple[str, ...]]:
    """One layer's MoE tensors: Megatron name (after decoder.layers.N.) -> the Hugging Face names
    (after model.layers.N.) whose concatenation along dim 0 it is."""
    block, (gate, up, down) = _block(shape.family)
    out = {"mlp.router.weight": (f"{block}.gate.weight",)}
    for i in range(shape.num_experts):
        m, h = f"mlp.experts.local_experts.{i}.", f"{block}.experts.{i}."
        out[m + "linear_fc1.weight"] = (f"{h}{gate}.weight", f"{h}{up}.weight")
        out[m + "linear_fc2.weight"] = (f"{h}{down}.weight",)
    if shape.moe_shared_expert_size:
        out.update({"mlp.shared_experts.linear_fc1.weight": ("mlp.shared_expert.gate_proj.weight",
                                                             "mlp.shared_expert.up_proj.weight"),
                    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_expert.down_proj.weight",),
                    "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight",)})
    return out


def moe_hf_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """One layer's MoE tensors of a Hugging Face checkpoint (after model.layers.N.) with their
    shapes."""
    h, f, s = shape.hidden_size, shape.moe_ffn_hidden_size, shape.moe_shared_expert_size
    block, (gate, up, down) = _block(shape.family)
    out = {f"{block}.gate.weight": (shape.num_experts, h)}
    for i in range(shape.num_experts):
        p = f"{block}.experts.{i}."
        out.update({f"{p}{gate}.weight": (f, h), f"{p}{up}.weight": (f, h),
                    f"{p}{down}.weight": (h, f)})
    if s:
        out.update({"mlp.shared_expert.gate_proj.weight": (s, h),
                    "mlp.shared_expert.up_proj.weight": (s, h),
                    "mlp.shared_expert.down_proj.weight": (h, s),
                    "mlp.shared_expert_gate.weight": (1, h)})
    return out


_STACKED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def stacked_views(shapes: dict[str, tuple[int, ...]], family: str) -> dict[str, tuple]:
    """For the stacked expert tensors among `shapes` (transformers 5's layout: name -> shape),
    each checkpoint name they hold -> (stacked name, expert index, which half of dim 0: 0, 1 or
    None for all of it, the tensor's shape); Mixtral's router under `mlp` -> its checkpoint name.
    Empty for a checkpoint in the released layout."""
    block, (gate, up, down) = _block(family)
    out = {}
    for name, shp in shapes.items():
        m = _STACKED.match(name)
        if m is None:
            if family == "mixtral" and re.match(r"^model\.layers\.\d+\.mlp\.gate\.weight$", name):
                out[name.replace(".mlp.", f".{block}.")] = (name, None, None, shp)
            continue
        layer, kind = m.groups()
        for i in range(shp[0]):
            p = f"{layer}.{block}.experts.{i}."
            if kind == "gate_up_proj":
                half = (shp[1] // 2, shp[2])
                out[f"{p}{gate}.weight"] = (name, i, 0, half)
                out[f"{p}{up}.weight"] = (name, i, 1, half)
            else:
                out[f"{p}{down}.weight"] = (name, i, None, tuple(shp[1:]))
    return out


def view_of(tensor, expert: int | None, half: int | None):
    """The checkpoint tensor a stacked one holds (stacked_views' index and half)."""
    t = tensor if expert is None else tensor[expert]
    return t if half is None else t.chunk(2)[half]


def checkpoint_layout(state: dict, family: str) -> dict:
    """A Hugging Face state dict (or gradients keyed like its parameters) in the checkpoints'
    layout: stacked experts split per expert, Mixtral's block under its checkpoint name."""
    views = stacked_views({k: tuple(v.shape) for k, v in state.items()}, family)
    stacked = {source for source, *_ in views.values()}
    out = {k: v for k, v in state.items() if k not in stacked}
    out.update({name: view_of(state[source], expert, half).contiguous()
                for name, (source, expert, half, _) in views.items()})
    return out
