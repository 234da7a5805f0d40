"""Activation bytes: what autograd holds saved for backward, plus the K/V state, at every moment.

`ActivationMeter`, an observer of a step (runtime/observe.py), is the one meter: `chunkflow verify`
(--memory, per-stage peaks; checks/memory.py) and `chunkflow bench` (on ChunkFlow's schedule and on
Megatron's own, through runtime/observe.py's observing_megatron) use it.

- Saved tensors: the forward and the backward contexts both install saved-tensor hooks; pack hands
  autograd a holder whose __del__ uncounts it. A storage counts from its first save, in a forward
  or in a recompute inside a backward (Megatron's full, block, selective recompute), until autograd
  frees its last saved tensor (layer by layer in the backward). Views of one storage count once,
  the model's parameters and buffers never, a storage its current size: resizes while saved are
  followed (Megatron's CheckpointWithoutOutput, selective layernorm recompute, frees outputs with
  resize_(0) and restores them in the backward), so a 0-byte storage counts nothing.
- Total = live saved bytes + store.nbytes() (K/V buffers, gradient accumulators) + stage inputs kept
  for re-forwards, sampled at every rise (save, growth, kept input, store change), just before every
  fall (free, shrink) and around every forward and backward. store.nbytes() is read again only after
  the store may have changed: in kv_with_state (wrapped for the contexts), after the relay's
  backward (a hook on its autograd node) and when its `version` moved (kept attention,
  runtime/reforward.py); a store without kv_with_state is read at every sample.
- Split: activation (saved storages); state (store, kept inputs). A saved view of the store's K/V
  buffer (a storage in store.storages: what kv_with_state returns, saved by attention) is state,
  counted once in store.nbytes(). Recompute: storages first saved (or regrown) inside a backward.
  Running maxima: peak_total, peak_activation, peak_state, peak_recompute; at_peak: the split when
  peak_total was reached; max_chunk_activation: the most one forward's own activation storages
  reached (what one micro-batch's forward saves; with no recompute, its whole footprint).

Only saves the meter's hooks see count: hooks installed inside its contexts (a second meter,
torch.utils.checkpoint's non-reentrant mode) hide saves from it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megatron_chunkflow.runtime.observe import StepObserver

_STATE, _BACKWARD = 1, 2  # a live storage's kind: the store's K/V buffer; saved in a backward


@dataclass(frozen=True)
class Breakdown:
    """Bytes live at one moment, by kind (recompute is part of activation)."""

    activation: int = 0  # saved storages but the store's K/V buffers
    kv_store: int = 0  # store.nbytes(): K/V buffers, gradient accumulators, kept attention
    kept_inputs: int = 0  # stage inputs kept for re-forwards
    recompute: int = 0  # saved storages first saved (or regrown) inside a backward

    @property
    def state(self) -> int:
        return self.kv_store + self.kept_inputs

    @property
    def total(self) -> int:
        return self.activation + self.state


class _Saved:
    """What the pack hook hands autograd: a detached alias of the saved tensor (the same storage,
    no graph reference); autograd dropping it uncounts the storage."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._unref(self.key)


def _unpack(packed):
    return packed.tensor if type(packed) is _Saved else packed


class ActivationMeter(StepObserver):
    """Peak saved-tensor and state bytes of one stage over a step (see the module docstring).
    `model`: its parameters and buffers are never counted; `store`: runtime/state.py's
    KVStateStore (or anything with `nbytes()` and `storages`), or None."""

    def __init__(self, model, store=None):
        self.model, self.store = model, store
        self._excluded = self._weights()
        self._live: dict[int, list] = {}  # storage -> [saved refs, bytes now, kind]
        self._bytes = [0, 0, 0]  # live: activation, backward-saved; kept inputs
        self._kept: dict[int, int] = {}  # chunk -> bytes of its kept stage input
        self._forward: dict[int, int] | None = None  # the open forward's activation storages
        self._forward_bytes = 0
        self._in_backward = False
        self._store_bytes, self._store_dirty = 0, True
        self._store_version = 0  # store.version when last read: kept attention changes it
        self._store_watched = hasattr(store, "kv_with_state")  # else read at every sample
        self._patched = 0
        self.peak_total = self.peak_activation = self.peak_state = self.peak_recompute = 0
        self.max_chunk_activation = 0
        self.at_peak = Breakdown()

    # ---- observer hooks -------------------------------------------------------------------------
    def step_began(self) -> None:
        self._excluded = self._weights()
        self._sample(fresh=True)

    @contextlib.contextmanager
    def forward(self, op, keeps_graph: bool):
        if not keeps_graph:  # under torch.no_grad nothing is saved; the store may grow
            self._sample(fresh=True)
            yield
            self._sample(fresh=True)
            return
        outer, self._forward, self._forward_bytes = self._forward, {}, 0
        try:
            with self._hooks(backward=False):
                yield
        finally:
            self._forward, self._forward_bytes = outer, 0

    @contextlib.contextmanager
    def backward(self, op):
        outer, self._in_backward = self._in_backward, True
        try:
            with self._hooks(backward=True):
                yield
        finally:
            self._in_backward = outer

    def input_kept(self, key: tuple[int, int], tensor: torch.Tensor) -> None:
        self._bytes[2] += tensor.numel() * tensor.element_size() - self._kept.get(key, 0)
        self._kept[key] = tensor.numel() * tensor.element_size()
        self._sample(fresh=True)

    def input_released(self, key: tuple[int, int]) -> None:
        self._sample(fresh=True)
        self._bytes[2] -= self._kept.pop(key, 0)

    def step_ended(self) -> None:
        self._sample(fresh=True)

    @property
    def live(self) -> Breakdown:
        """The bytes live now, by kind."""
        act, recompute, kept = self._bytes
        store = self.store.nbytes() if self.store is not None else 0
        return Breakdown(act, store, kept, recompute)

    # ---- hooks ----------------------------------------------------------------------------------
    def _weights(self) -> set[int]:
        modules = self.model if isinstance(self.model, (list, tuple)) else [self.model]
        Module = torch.nn.Module  # Megatron's DDP shadows `buffers` with its grad buffers
        return {t.untyped_storage().data_ptr() for m in modules
                for t in (*Module.parameters(m), *Module.buffers(m))}

    @contextlib.contextmanager
    def _hooks(self, backward: bool):
        """Saved-tensor hooks, storage resizes followed, the store watched (forward or backward)."""
        self._sample(fresh=True)
        pack = self._pack_backward if backward else self._pack_forward
        try:
            with self._resizes(), self._store_watch(), \
                    torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                yield
        finally:
            self._sample(fresh=True)

    @contextlib.contextmanager
    def _resizes(self):
        """UntypedStorage.resize_ reports resizes of storages this meter counts (Megatron's
        CheckpointWithoutOutput frees an output that way and restores it in its recompute)."""
        if self._patched:  # already patched by this meter
            yield
            return
        own = torch.UntypedStorage.__dict__.get("resize_")  # None: torch's own, inherited
        plain, meter = torch.UntypedStorage.resize_, self

        def resize_(storage, size):
            key, before = storage._cdata, storage.nbytes()
            if key in meter._live:
                meter._sample()  # the moment before it may shrink
            out = plain(storage, size)
            if key in meter._live:
                meter._resized(key, before, storage.nbytes())
            return out

        torch.UntypedStorage.resize_ = resize_
        self._patched = 1
        try:
            yield
        finally:
            self._patched = 0
            if own is None:
                del torch.UntypedStorage.resize_
            else:
                torch.UntypedStorage.resize_ = own

    @contextlib.contextmanager
    def _store_watch(self):
        """store.nbytes() is read again only after the store may have changed: KVStateStore changes
        only inside _ChunkKV (runtime/state.py), whose forward runs in store.kv_with_state (wrapped
        here for the context) and whose backward is followed by a hook on its autograd node. A
        store without kv_with_state is read at every sample."""
        store = self.store
        if not self._store_watched:
            yield
            return
        inner, meter = store.kv_with_state, self

        def changed(*args):
            meter._store_dirty = True

        def kv_with_state(*args, **kwargs):
            k, v = inner(*args, **kwargs)
            meter._store_dirty = True
            if k.grad_fn is not None:
                k.grad_fn.register_hook(changed)
            return k, v

        own = store.__dict__.get("kv_with_state")
        store.kv_with_state = kv_with_state
        try:
            yield
        finally:
            if own is None:
                del store.kv_with_state
            else:
                store.kv_with_state = own

    # ---- counting -------------------------------------------------------------------------------
    def _pack_forward(self, tensor):
        return self._pack(tensor, 0)

    def _pack_backward(self, tensor):
        return self._pack(tensor, _BACKWARD)

    def _pack(self, tensor: torch.Tensor, kind: int):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._excluded:
            return tensor
        key, nbytes = storage._cdata, storage.nbytes()
        entry = self._live.get(key)
        if entry is None:
            if self.store is not None and storage.data_ptr() in self.store.storages:
                entry = self._live[key] = [0, 0, _STATE]  # counted in store.nbytes()
            else:
                entry = self._live[key] = [0, nbytes, kind]
                self._add(kind, nbytes)
        entry[0] += 1
        if self._forward is not None and not entry[2] & _STATE and key not in self._forward:
            self._forward[key] = entry[1]
            self._forward_bytes += entry[1]
            self.max_chunk_activation = max(self.max_chunk_activation, self._forward_bytes)
        self._sample()
        return _Saved(tensor.detach(), self, key)

    def _unref(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0]:
            return
        self._sample()  # the moment before the free
        del self._live[key]
        self._add(entry[2], -entry[1])
        if self._forward is not None and key in self._forward:
            self._forward_bytes -= self._forward.pop(key)

    def _resized(self, key: int, before: int, after: int) -> None:
        entry = self._live[key]
        kind = entry[2] | (_BACKWARD if self._in_backward and after > before else 0)
        self._add(entry[2], -entry[1])
        self._add(kind, after)
        entry[1], entry[2] = after, kind
        if self._forward is not None and key in self._forward:
            self._forward_bytes += after - self._forward[key]
            self._forward[key] = after
            self.max_chunk_activation = max(self.max_chunk_activation, self._forward_bytes)
        self._sample()

    def _add(self, kind: int, nbytes: int) -> None:
        if kind & _STATE:
            return
        self._bytes[0] += nbytes
        if kind & _BACKWARD:
            self._bytes[1] += nbytes

    def _sample(self, fresh: bool = False) -> None:
        """Take the peaks at this moment; the store is read if it may have changed (or `fresh`)."""
        store = self.store
        if store is not None and (fresh or self._store_dirty or not self._store_watched
                                  or getattr(store, "version", 0) != self._store_version):
            self._store_bytes, self._store_dirty = store.nbytes(), False
            self._store_version = getattr(store, "version", 0)
        act, recompute, kept = self._bytes
        state = self._store_bytes + kept
        self.peak_activation = max(self.peak_activation, act)
        self.peak_state = max(self.peak_state, state)
        self.peak_recompute = max(self.peak_recompute, recompute)
        if act + state > self.peak_total:
            self.peak_total = act + state
            self.at_peak = Breakdown(act, self._store_bytes, kept, recompute)
