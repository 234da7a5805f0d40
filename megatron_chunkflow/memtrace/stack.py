"""The GPU software stack a memory trace stands for: which CUDA kernels keep what for backward.

    stack = get_stack("torch-2.11")      # the H200 measurements of docs/benchmarks-appendix.md
    stack = installed_stack()            # the torch installed here, as its CUDA build behaves

Only what changes the bytes a step holds is described, each read from torch's own code:
- fused_rms_norm: torch.nn.RMSNorm on CUDA runs aten::_fused_rms_norm (saves input, weight and a
  per-row fp32 rstd), where the composite path the meta device takes keeps fp32 copies of the
  input (torch >= 2.8 on CUDA; aten/src/ATen/native/layer_norm.cpp rms_norm_symint);
- varlen_gqa: torch.nn.attention.varlen.varlen_attn takes enable_gqa (torch 2.13); without it
  (2.10-2.12) the varlen backend (attention/backends.py) repeats K and V to every query head, and
  the kernel saves the repeated copies.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stack:
    """One software stack's memory-relevant kernel behaviours (module docstring)."""

    name: str
    fused_rms_norm: bool = True
    varlen_gqa: bool = True

    @contextlib.contextmanager
    def applied(self):
        """While tracing: torch's varlen_attn shows this stack's signature (enable_gqa or not)."""
        try:
            import torch.nn.attention.varlen as varlen
        except ImportError:  # torch < 2.10: no varlen backend to shape
            yield
            return
        original = varlen.varlen_attn
        takes_gqa = "enable_gqa" in inspect.signature(original).parameters
        if self.varlen_gqa or not takes_gqa:
            yield
            return

        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                        return_aux=None, scale=None, window_size=(-1, -1)):
            return original(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                            return_aux=return_aux, scale=scale, window_size=window_size)

        varlen.varlen_attn = varlen_attn
        try:
            yield
        finally:
            varlen.varlen_attn = original


STACKS = {
    "torch-2.11": Stack("torch-2.11", fused_rms_norm=True, varlen_gqa=False),
    "torch-2.13": Stack("torch-2.13", fused_rms_norm=True, varlen_gqa=True),
}


def installed_stack() -> Stack:
    """The installed torch's CUDA build (its varlen signature read here)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    try:
        import torch.nn.attention.varlen as varlen

        gqa = "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters
    except ImportError:
        gqa = False
    return Stack(f"torch-{major}.{minor}", fused_rms_norm=(major, minor) >= (2, 8),
                 varlen_gqa=gqa)


def get_stack(name: str | None) -> Stack:
    """A named stack (STACKS), or the installed one for None / "installed"; ValueError naming
    the known ones otherwise."""
    if name in (None, "installed"):
        return installed_stack()
    if name not in STACKS:
        raise ValueError(f"--stack {name!r}: known stacks are {', '.join(sorted(STACKS))} and "
                         "installed")
    return STACKS[name]
