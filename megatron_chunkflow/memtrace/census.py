"""The kernels a traced step launches and the bytes they move: the time model's check, as the
memory trace is the memory model's.

    trace = trace_memory(settings, lengths, census=True)
    trace.census.phases["forward"].kernels, trace.census.phases["backward"].memory_bytes

Every ATen op the traced step (memtrace/trace.py) runs on the device is one GPU kernel unless it
launches none: a view, an empty tensor, a scalar read. A kernel is one of

- a GEMM (mm, addmm, bmm, baddbmm): its FLOPs (2 m n k) and bytes;
- attention (an op whose name says attention or flash): calls and bytes; its FLOPs follow from
  the plan's (query, key) pairs, which the meta device cannot see (cu_seqlens hold no values);
- a collective (c10d): calls and the bytes of its tensors;
- memory-bound (everything else): bytes read plus bytes written, each tensor once (an in-place
  op reads and writes its target, a fill or an out= op only writes it; a gather reads the rows
  it selects, a scatter reads and writes the elements it selects).

A function Megatron compiles with torch.compile (its jit fusions) and torch's fused RMSNorm are
one kernel each, moving their inputs and outputs, as on a GPU. Kernels are counted per phase of
the step as memory/trace.py labels them: forward, backward, loss (the output layer and the cross
entropy, both passes), optimizer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from megatron_chunkflow.memtrace.metacache import tensors_in

aten = torch.ops.aten
GEMMS = frozenset(("mm", "addmm", "bmm", "baddbmm"))
# ops that launch nothing: views and aliases, new uninitialised storage, metadata
NO_KERNEL = frozenset((
    "_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "_local_scalar_dense", "detach", "alias", "lift_fresh", "set_", "resize_", "as_strided",
    "view", "_reshape_alias", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
    "squeeze", "split", "split_with_sizes", "unbind", "chunk", "narrow", "unfold", "diagonal",
    "_to_copy_meta", "record_stream", "is_same_size", "_has_compatible_shallow_copy_type"))
WRITE_ONLY = frozenset(("zero_", "fill_", "copy_", "normal_", "uniform_", "random_", "zeros",
                        "ones", "full", "zeros_like", "ones_like", "full_like", "scalar_tensor"))
PHASES = ("forward", "backward", "loss", "optimizer")
# ops that read only the rows they select (their output's size) and the indices
GATHERS = frozenset(("embedding", "index", "gather", "index_select"))
# in-place scatters: read and write only the selected elements (the values' size)
SCATTERS = frozenset(("index_put_", "scatter_", "scatter_add_", "index_add_", "index_fill_"))


@dataclass
class PhaseCensus:
    """One phase's kernels (module docstring); bytes and FLOPs summed."""

    kernels: int = 0
    memory_kernels: int = 0
    memory_bytes: int = 0
    gemms: int = 0
    gemm_flops: float = 0.0
    gemm_bytes: int = 0
    attention_kernels: int = 0
    attention_bytes: int = 0
    collectives: int = 0
    collective_bytes: int = 0
    by_op: Counter = field(default_factory=Counter)  # op name -> kernels
    bytes_by_op: Counter = field(default_factory=Counter)  # op name -> bytes (memory-bound)


@dataclass
class Census:
    """The kernels of one traced step, by phase (PHASES)."""

    phases: dict[str, PhaseCensus] = field(
        default_factory=lambda: {p: PhaseCensus() for p in PHASES})
    fused_depth: int = 0

    @property
    def kernels(self) -> int:
        return sum(p.kernels for p in self.phases.values())

    def phase(self, label_phase: str) -> PhaseCensus:
        return self.phases.get(label_phase) or self.phases["forward"]

    def op(self, func, args, kwargs, out, phase: str, on_device) -> None:
        """One dispatched ATen op (`on_device`: whether a tensor is device memory)."""
        if self.fused_depth:
            return
        name = func._schema.name.split("::")[-1]
        if name in NO_KERNEL or _is_view(func):
            return
        written = _written(func, args, kwargs)
        reads = [t for t in tensors_in((args, kwargs.values())) if on_device(t)
                 and (id(t) not in written or not _write_only(func, name))]
        writes = [t for t in tensors_in(out) if on_device(t)]
        if not reads and not writes:
            return
        if name in GATHERS:  # the source's selected rows: as many bytes as the output
            nbytes = 2 * _bytes(writes) + _bytes(
                [t for t in reads if not t.is_floating_point()])
        elif name in SCATTERS:  # the selected elements read and written, the values read
            nbytes = 3 * _bytes([t for t in reads if id(t) not in written
                                 and t.is_floating_point()]) + _bytes(
                [t for t in reads if not t.is_floating_point()])
        else:
            nbytes = _bytes(reads) + _bytes(writes)
        p = self.phase(phase)
        p.kernels += 1
        p.by_op[name] += 1
        if func.namespace == "c10d":
            p.collectives += 1
            p.collective_bytes += nbytes
        elif name in GEMMS:
            p.gemms += 1
            p.gemm_flops += _gemm_flops(name, [t for t in tensors_in(args) if on_device(t)])
            p.gemm_bytes += nbytes
        elif "attn" in name or "attention" in name or "flash" in name:
            p.attention_kernels += 1
            p.attention_bytes += nbytes
        else:
            _memory_kernel(p, name, nbytes)

    def kernel(self, name: str, phase: str, reads, writes) -> None:
        """One fused kernel (a compiled function, the fused RMSNorm): its tensors moved once."""
        if self.fused_depth:
            return
        p = self.phase(phase)
        p.kernels += 1
        p.by_op[name] += 1
        _memory_kernel(p, name, _bytes(reads) + _bytes(writes))

    def summary(self) -> dict:
        return {k: {"kernels": p.kernels, "memory_bytes": p.memory_bytes,
                    "gemm_flops": p.gemm_flops, "attention_kernels": p.attention_kernels,
                    "collectives": p.collectives} for k, p in self.phases.items()}


def _memory_kernel(p: PhaseCensus, name: str, nbytes: int) -> None:
    p.memory_kernels += 1
    p.memory_bytes += nbytes
    p.bytes_by_op[name] += nbytes


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def _written(func, args, kwargs) -> set[int]:
    """ids of the tensor arguments the op writes (in place or out=)."""
    out = set()
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            out.update(id(t) for t in tensors_in(value))
    return out


def _write_only(func, name: str) -> bool:
    """Whether the op's written arguments are not also read: fills, copies, out= overloads."""
    return name in WRITE_ONLY or func._overloadname.startswith("out")


def _gemm_flops(name: str, tensors) -> float:
    """2 m n k of a GEMM from its matrix operands (addmm/baddbmm: the last two)."""
    a, b = tensors[-2], tensors[-1]
    if a.dim() < 2 or b.dim() < 2:
        return 0.0
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
