"""LoRA adapters on megatron-core's tensor-parallel linear layers: frozen base, trainable A and B.

    lora = LoRAConfig(rank=8, alpha=16, targets="qkv,proj,fc1,fc2")
    apply_lora(model, lora, seed)      # before wrap_ddp: DDP and the optimizer see only adapters
    ...train...
    merge_lora(model)                  # W += (alpha / r) B A in place, adapters removed (export)

A target linear y = W x (+ b) becomes y = W x (+ b) + s B (A x), s = alpha / r, with A [r, in] and
B [out, r]; every other parameter of the model is frozen (requires_grad False), so Megatron's DDP
builds gradient buffers and get_megatron_optimizer keeps Adam state for the adapters only, and the
frozen linears take Megatron's LinearWithFrozenWeight path (no weight gradient, no saved input).

Tensor parallelism (Megatron letters: [s, b, h] activations, tp ranks):
- column-parallel (linear_qkv, linear_fc1): W is split by output rows, so B is too (B_r
  [out/tp, r]) and A is whole on every rank. U = x A^T is computed from the layer's replicated
  input and passed through copy_to_tensor_model_parallel_region (its backward all-reduces dU over
  the ranks' output shards); under sequence parallelism x is [s/tp, b, h], so U is all-gathered
  along s instead (backward: reduce-scatter) and A's gradient, a sum over sequence shards, is
  all-reduced by finalize_model_grads (A carries `sequence_parallel`, like the norms).
- row-parallel (linear_proj, linear_fc2): W is split by input columns, so A is too (A_r
  [r, in/tp]) and B is whole. U = sum_r x_r A_r^T is all-reduced (reduce-scattered along s under
  sequence parallelism, where B then carries `sequence_parallel`).
- linear_fc1 of the SwiGLU MLP is cat(gate, up) and TP rank r holds cat(gate_r, up_r); B follows
  the same layout (initialised from the TP = 1 matrix by halves), so B_r A lines up with the local
  W rows and merging is local. Its checkpoint entry uses Megatron's swiglu sharded factory.
Initialisation is TP- and PP-invariant: each adapter is drawn whole from a generator seeded by
(seed, its PP = 1 parameter name), A uniform in +-1/sqrt(in) (PEFT's kaiming default), B zero (or
N(0, b_init_std) for gradient checks, where B = 0 would make A's gradient 0), then sliced.
No LoRA dropout (the adapters are deterministic, as the exactness checks need). With Megatron's full
activation recompute the embedding output is made to require grad (see apply_lora).
"""

from __future__ import annotations

import types
import zlib
from dataclasses import dataclass

import torch

from megatron_chunkflow.mcore.job import tensor_parallel_of
from megatron_chunkflow.mcore.names import full_model_name

TARGETS = {  # --lora-targets name -> (module path inside a transformer layer, parallel mode)
    "qkv": ("self_attention.linear_qkv", "column"),
    "proj": ("self_attention.linear_proj", "row"),
    "fc1": ("mlp.linear_fc1", "column"),
    "fc2": ("mlp.linear_fc2", "row"),
}


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA settings; `chunkflow train` and `chunkflow verify` derive --lora-* flags from them."""

    rank: int = 8
    """LoRA rank r: train low-rank adapters (A [r, in], B [out, r]) on the --lora-targets linear
    layers of every transformer layer and freeze all other weights. Omit for full fine-tuning."""

    alpha: float = 16.0
    """LoRA scale numerator: an adapter adds (alpha / r) B A x to its layer's output."""

    targets: str = "qkv,proj,fc1,fc2"
    """Comma-separated layers that get adapters: qkv (linear_qkv), proj (linear_proj), fc1
    (linear_fc1, gate and up), fc2 (linear_fc2)."""

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"--lora-rank must be >= 1, got {self.rank}")
        if not 0 < self.alpha < float("inf"):
            raise ValueError(f"--lora-alpha must be a finite number > 0, got {self.alpha}")
        names = self.target_names
        unknown = [t for t in names if t not in TARGETS]
        if unknown or not names:
            raise ValueError(f"--lora-targets {self.targets!r}: unknown entry "
                             f"{(unknown or [''])[0]!r}; choose from {', '.join(TARGETS)}")

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_args(cls, args) -> LoRAConfig | None:
        """From --lora-rank/--lora-alpha/--lora-targets (dest lora_*); None without --lora-rank."""
        if args.lora_rank is None:
            given = [f"--lora-{n}" for n in ("alpha", "targets")
                     if getattr(args, f"lora_{n}") != getattr(cls, n)]
            if given:
                raise ValueError(f"{given[0]} needs --lora-rank")
            return None
        return cls(rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets)


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _local(full: torch.Tensor, dim: int, tp: int, rank: int, glu: bool) -> torch.Tensor:
    """This TP rank's slice of a whole adapter matrix (fc1's B: the slice of each half)."""
    if glu:
        return torch.cat([h.chunk(tp, dim)[rank] for h in full.chunk(2, dim)], dim)
    return full.chunk(tp, dim)[rank]


def apply_lora(model, lora: LoRAConfig, seed: int = 0, b_init_std: float = 0.0) -> list[str]:
    """Add adapters to the target layers of a built GPTModel stage and freeze everything else.

    Call before wrap_ddp (and after loading base weights). Returns the adapter parameter names.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        set_tensor_model_parallel_attributes,
    )

    gpt = _unwrap(model)
    config = gpt.config
    tp, tp_rank, _ = tensor_parallel_of(gpt)
    for p in gpt.parameters():
        p.requires_grad_(False)
    wanted = {TARGETS[t][0]: TARGETS[t][1] for t in lora.target_names}
    added = []
    for name, module in gpt.named_modules():
        parts = name.split(".")
        if parts[:2] != ["decoder", "layers"] or ".".join(parts[3:]) not in wanted:
            continue
        mode = wanted[".".join(parts[3:])]
        cls = ColumnParallelLinear if mode == "column" else RowParallelLinear
        if not isinstance(module, cls) or (mode == "row" and not module.input_is_parallel) or \
                (mode == "column" and module.gather_output):
            raise ValueError(f"LoRA supports megatron-core's {cls.__name__} (the local layer "
                             f"spec); {name} is a {type(module).__name__}")
        out_full, in_full = module.output_size, module.input_size
        glu = mode == "column" and parts[-1] == "linear_fc1" and config.gated_linear_unit
        full = full_model_name(name, gpt)
        dtype = module.weight.dtype
        a = torch.empty(lora.rank, in_full, dtype=torch.float64)
        a.uniform_(-in_full ** -0.5, in_full ** -0.5, generator=_generator(seed, full + ".lora_a"))
        b = torch.zeros(out_full, lora.rank, dtype=torch.float64)
        if b_init_std:
            b.normal_(0.0, b_init_std, generator=_generator(seed, full + ".lora_b"))
        if mode == "column":
            b = _local(b, 0, tp, tp_rank, glu)
        else:
            a = _local(a, 1, tp, tp_rank, False)
        device = module.weight.device
        module.lora_a = torch.nn.Parameter(a.to(device, dtype).contiguous())
        module.lora_b = torch.nn.Parameter(b.to(device, dtype).contiguous())
        set_tensor_model_parallel_attributes(module.lora_a, mode == "row", 1, 1)
        set_tensor_model_parallel_attributes(module.lora_b, mode == "column", 0, 1)
        partial_grad = module.lora_a if mode == "column" else module.lora_b
        partial_grad.sequence_parallel = config.sequence_parallel and tp > 1
        module.lora_scale = lora.scale
        module.lora_mode = mode
        module.forward = types.MethodType(
            _column_forward if mode == "column" else _row_forward, module)
        module.sharded_state_dict = types.MethodType(_sharded_state_dict(mode, glu), module)
        added += [f"{name}.lora_a", f"{name}.lora_b"]
    if not added:
        raise ValueError(f"--lora-targets {lora.targets!r} matched no layer of this model")
    if config.recompute_granularity == "full" and getattr(gpt, "pre_process", False):
        # Megatron's full recompute is a reentrant autograd Function: with a frozen embedding no
        # input of the first checkpointed block needs grad, so autograd would skip the block's
        # backward and its adapters would get no gradient (HF's enable_input_require_grads fix).
        gpt.embedding.register_forward_hook(_input_requires_grad)
    return added


def _input_requires_grad(module, inputs, output):
    return output.requires_grad_(True) if not output.requires_grad else output


def _column_forward(self, input_, weight=None, runtime_gather_output=None):
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    out, bias = type(self).forward(self, input_, weight, runtime_gather_output)
    u = torch.matmul(input_, self.lora_a.t())  # [s(/tp), b, r]
    if self.sequence_parallel:
        u = gather_from_sequence_parallel_region(u, True, group=self.tp_group)
    else:
        u = copy_to_tensor_model_parallel_region(u, group=self.tp_group)
    return out + self.lora_scale * torch.matmul(u, self.lora_b.t()), bias


def _row_forward(self, input_):
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    out, bias = type(self).forward(self, input_)
    u = torch.matmul(input_, self.lora_a.t())  # [s, b, r], partial over the input shards
    if self.sequence_parallel:
        u = reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)
    else:
        u = reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
    return out + self.lora_scale * torch.matmul(u, self.lora_b.t()), bias


def _sharded_state_dict(mode: str, glu: bool):
    axes = {"weight": 0, "bias": 0, "lora_b": 0} if mode == "column" else \
        {"weight": 1, "lora_a": 1}

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(
            state, prefix, axes, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if glu:  # like MLP.sharded_state_dict does for the weight: gate and up halves
            key = f"{prefix}lora_b"
            singleton = (metadata or {}).get("singleton_local_shards", False)
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
        return out

    return sharded_state_dict


def lora_modules(model):
    """(name, module) of every linear that carries an adapter."""
    return [(n, m) for n, m in _unwrap(model).named_modules() if hasattr(m, "lora_a")]


@torch.no_grad()
def merge_lora(model) -> int:
    """W += (alpha / r) B A on each rank's own shards (no communication), then remove the
    adapters and restore the layers; returns how many layers were merged. Base weights stay
    frozen: this is for export (e.g. --save-hf), after training."""
    merged = 0
    chunks = model if isinstance(model, list) else [model]  # virtual stages: every model chunk
    for _, m in (pair for chunk in chunks for pair in lora_modules(chunk)):
        delta = torch.matmul(m.lora_b.double(), m.lora_a.double()) * m.lora_scale
        m.weight.add_(delta.to(m.weight.dtype))
        for attr in ("lora_a", "lora_b", "lora_scale", "lora_mode", "forward",
                     "sharded_state_dict"):
            delattr(m, attr)
        merged += 1
    return merged
