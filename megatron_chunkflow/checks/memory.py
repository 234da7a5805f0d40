"""Activation bytes on CPU: bytes saved for backward (saved-tensor hooks) plus the K/V state.

`ActivationMeter` is an observer of a step (runtime/observe.py). Around each forward that keeps its
graph it counts the distinct storages autograd saves for backward, leaving out parameters (weights
are not activations). Storages that the K/V store registered as prefix copies (cat(prefix, own)
made for attention) are counted as *state*, with the store's own K/V and gradient accumulators and
the stage inputs kept for re-forwards; everything else as *activations*. A chunk's bytes are
released after its backward. Peaks are taken at every forward and backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.runtime.observe import StepObserver


class ActivationMeter(StepObserver):
    """Peak activation and state bytes of one stage over a step (see the module docstring)."""

    def __init__(self, model, store=None):
        self.store = store
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._held: dict[int, tuple[int, int]] = {}  # chunk -> (activation bytes, state bytes)
        self._extra: dict[int, int] = {}  # chunk -> saved stage input bytes (state-like)
        self.peak_activation = 0
        self.max_chunk_activation = 0  # the most one chunk's forward saved
        self.peak_state = 0
        self.peak_total = 0

    @contextlib.contextmanager
    def track(self, chunk: int):
        seen: set[int] = set()
        counts = [0, 0]
        prefix = self.store.prefix_copies if self.store is not None else set()

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen and ptr not in self._param_ptrs and storage.nbytes() > 0:
                seen.add(ptr)
                counts[1 if ptr in prefix else 0] += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._held[chunk] = (counts[0], counts[1])
        self.max_chunk_activation = max(self.max_chunk_activation, counts[0])
        self._update()

    @contextlib.contextmanager
    def forward(self, op, keeps_graph: bool):
        with (self.track(op.chunk) if keeps_graph else contextlib.nullcontext()):
            yield

    @contextlib.contextmanager
    def backward(self, op):
        yield
        self.release(op.chunk)

    def input_kept(self, chunk: int, tensor: torch.Tensor) -> None:
        self.hold_extra(chunk, tensor)

    def input_released(self, chunk: int) -> None:
        self.release_extra(chunk)

    def release(self, chunk: int) -> None:
        self._held.pop(chunk, None)
        self._update()

    def hold_extra(self, chunk: int, tensor: torch.Tensor) -> None:
        """A stage input kept for a later re-forward (pipeline stages after the first)."""
        self._extra[chunk] = tensor.numel() * tensor.element_size()
        self._update()

    def release_extra(self, chunk: int) -> None:
        self._extra.pop(chunk, None)
        self._update()

    def _update(self) -> None:
        act = sum(a for a, _ in self._held.values())
        state = sum(s for _, s in self._held.values()) + sum(self._extra.values())
        state += self.store.nbytes() if self.store is not None else 0
        self.peak_activation = max(self.peak_activation, act)
        self.peak_state = max(self.peak_state, state)
        self.peak_total = max(self.peak_total, act + state)


def kv_state_formula(length: int, chunk_size: int, kv_bytes_per_token: float,
                     acc_bytes_per_token: float) -> float:
    """Peak K/V-sized bytes for one sequence with K = 1 (docs/exactness.md, "Memory").

    N = ceil(L / C) chunks, u = K/V bytes per token (2 x kv heads x head dim x layers x dtype),
    a = the same for the gradient accumulators (fp32, or fp64 in fp64 runs). The peak is the larger
    of (a) after the last chunk's forward: stored K/V of chunks 0..N-2 plus its prefix copy of all L
    tokens, ((N-1)C + L) u; (b) after re-forwarding chunk N-2: stored K/V of chunks 0..N-3, its prefix
    copy ((N-1)C tokens) and accumulators for chunks 0..N-2: ((N-2)C + (N-1)C) u + (N-1)C a.
    Later steps each drop one chunk from all three terms.
    """
    n = -(-length // chunk_size)
    if n <= 1:
        return 0.0
    c = chunk_size
    after_last_forward = ((n - 1) * c + length) * kv_bytes_per_token
    prefix_copy = (n - 1) * c if n >= 3 else 0  # chunk 0 attends without a prefix copy
    after_first_reforward = ((n - 2) * c + prefix_copy) * kv_bytes_per_token \
        + (n - 1) * c * acc_bytes_per_token
    return max(after_last_forward, after_first_reforward)


@dataclass
class MemoryRow:
    activation: int  # peak bytes saved for backward, K/V-sized prefix copies excluded
    state: int  # peak K/V state: stored K/V, gradient accumulators, prefix copies
    state_formula: float | None  # K = 1 only


def measure_one_sequence(shape, length: int, chunkflow: ChunkFlowConfig, dtype, seed: int = 0,
                         lora=None) -> MemoryRow:
    """One training step of one sequence through ChunkFlow's schedule, metered (PP=1); with
    `lora` (training.lora.LoRAConfig) the base is frozen and only adapters train."""
    from megatron.core import parallel_state

    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.runtime.execute import execute_step, plan_step
    from megatron_chunkflow.runtime.loss import make_forward_step
    from megatron_chunkflow.runtime.model import apply_chunkflow
    from megatron_chunkflow.training.build import build_gpt_model, transformer_config, wrap_ddp

    config = transformer_config(shape, dtype)
    model = build_gpt_model(shape, config)
    if lora is not None:
        from megatron_chunkflow.training.lora import apply_lora

        apply_lora(model, lora, seed)
    store = apply_chunkflow(model, backend=chunkflow.attention_backend)
    model = wrap_ddp(model, config)
    sequences = make_sequences([length], shape.vocab_size, seed)
    step = plan_step(sequences, chunkflow, ParallelConfig(), shape, dp_size=1, dp_rank=0)
    meter = ActivationMeter(model, store)
    execute_step(step, model, make_forward_step(exact_loss=True), observers=[meter])
    from megatron_chunkflow.perfmodel.footprint import kv_state_bytes_per_token

    tp = parallel_state.get_tensor_model_parallel_world_size()
    kv, acc = (kv_state_bytes_per_token(shape, shape.num_layers, nbytes, tp, with_grad=False)
               for nbytes in (torch.finfo(dtype).bits // 8, 8 if dtype == torch.float64 else 4))
    formula = (kv_state_formula(length, chunkflow.chunk_size, kv, acc)
               if chunkflow.k == 1 else None)
    return MemoryRow(meter.peak_activation, meter.peak_state, formula)
