"""The ledger of a traced step: every storage allocated, its bytes, host or device, what made it.

    ledger = Ledger(labeler)          # labeler(op) -> Label: the step's phase, module, source
    ledger.allocated(storage, op)     # memtrace/device.py calls this for every new storage
    ledger.device_peak, ledger.events, ledger.live_at(ledger.peak_event)

A storage is freed when its last tensor goes (a weakref finalizer on the storage), as the CUDA
caching allocator frees a block. Device allocations are recorded in order as events
(memtrace/allocator.py replays them through the caching allocator's rules); the running counts
here round each block as that allocator does (512 bytes), which is what
torch.cuda.max_memory_allocated reports up to the allocator's unsplit remainders (the replay has
those).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import NamedTuple

BLOCK = 512  # the CUDA caching allocator's rounding (kMinBlockSize)


def block_bytes(nbytes: int, block: int = BLOCK) -> int:
    """A request's bytes as the caching allocator's block: a multiple of `block` (512), at least
    one block."""
    return max(block, -(-nbytes // block) * block) if nbytes else 0


class Label(NamedTuple):
    """What made an allocation: the step's phase (build, forward, loss, backward, optimizer),
    the innermost module (qualified name, layers as *), the source (activation, kv_state,
    kept_attention, ...) and the op."""

    phase: str
    module: str
    source: str
    op: str


class Event(NamedTuple):
    """A device allocation (nbytes > 0) or free (nbytes == 0) of storage `key`."""

    key: int
    nbytes: int
    label: Label | None


class Ledger:
    """Live storages and peaks of one traced run (module docstring)."""

    def __init__(self, labeler: Callable[[object], Label] | None = None, block: int = BLOCK):
        self.labeler = labeler or (lambda op: Label("", "", "", str(op)))
        self.block = block  # running counts round to it: 512 as CUDA's allocator, 1 on a CPU
        self.events: list[Event] = []
        self._live: dict[int, tuple[int, bool]] = {}  # key -> (block bytes, host)
        self._host = False
        self.device_bytes = self.device_peak = 0
        self.host_bytes = self.host_peak = 0
        self.peak_event = -1  # index in events of the allocation that set device_peak
        self.scalar_reads = 0  # device values read back (each a sync on a GPU)
        self.phase_peaks: dict[str, int] = {}
        self._fused: int | None = None  # where the fused kernel being run began in events
        self.census = None  # memtrace/census.py Census: the kernels, where they are counted

    @contextlib.contextmanager
    def fused(self):
        """Code run as one fused GPU kernel (torch.compile'd): what it allocates and frees before
        it returns lives in the kernel's registers, never in device memory, so those allocations
        and frees are dropped from the events; the peak is taken when it returns, its outputs
        made. Nested regions are the outer one's."""
        if self._fused is not None:
            yield
            return
        self._fused = start = len(self.events)
        try:
            yield
        finally:
            self._fused = None
            kept: list[Event | None] = []
            made: dict[int, int] = {}  # storage key -> its allocation's index in kept
            for event in self.events[start:]:
                if event.nbytes:
                    made[event.key] = len(kept)
                elif event.key in made:  # made and freed inside: never on the device
                    kept[made.pop(event.key)] = None
                    continue
                kept.append(event)
            self.events[start:] = [e for e in kept if e is not None]
            if self.events[start:]:
                self._peaked(self.events[-1].label or Label("", "", "", ""), len(self.events) - 1)

    @contextlib.contextmanager
    def placing(self, host: bool):
        """Allocations made inside are host (True) or device (False) memory."""
        saved, self._host = self._host, host
        try:
            yield
        finally:
            self._host = saved

    def is_host(self, tensor) -> bool:
        entry = self._live.get(id(tensor.untyped_storage()))
        return entry is not None and entry[1]

    def allocated(self, storage, op) -> None:
        key = id(storage)
        if key in self._live:  # a view or an in-place result: no new storage
            return
        nbytes = block_bytes(storage.nbytes(), self.block)
        self._live[key] = (nbytes, self._host)
        weakref.finalize(storage, self._freed, key)
        if self._host:
            self.host_bytes += nbytes
            self.host_peak = max(self.host_peak, self.host_bytes)
            return
        label = self.labeler(op)
        self.events.append(Event(key, storage.nbytes(), label))
        self.device_bytes += nbytes
        if self._fused is None:
            self._peaked(label, len(self.events) - 1)

    def _peaked(self, label: Label, index: int) -> None:
        """The device bytes now, after event `index`, as a peak of the run and of its phase."""
        if self.device_bytes > self.phase_peaks.get(label.phase, 0):
            self.phase_peaks[label.phase] = self.device_bytes
        if self.device_bytes > self.device_peak:
            self.device_peak, self.peak_event = self.device_bytes, index

    def resized(self, storage, nbytes: int) -> None:
        """A storage resized in place (Megatron's CheckpointWithoutOutput frees a norm's output
        by resizing its storage to 0 and brings it back for the backward): its old block is
        freed and, for a size above 0, a new one allocated."""
        key = id(storage)
        if key not in self._live:
            return
        old, host = self._live[key]
        if host:
            self.host_bytes -= old
        elif old:
            self.device_bytes -= old
            self.events.append(Event(key, 0, None))
        new = block_bytes(nbytes, self.block)
        self._live[key] = (new, host)
        if host:
            self.host_bytes += new
        elif new:
            label = self.labeler("resize_")
            self.events.append(Event(key, nbytes, label))
            self.device_bytes += new
            if self._fused is None:
                self._peaked(label, len(self.events) - 1)

    def _freed(self, key: int) -> None:
        nbytes, host = self._live.pop(key)
        if host:
            self.host_bytes -= nbytes
            return
        if nbytes:  # a storage resized to 0 was freed then
            self.device_bytes -= nbytes
            self.events.append(Event(key, 0, None))

    def live_at(self, index: int) -> dict[int, Event]:
        """The device allocations live just after event `index`, by storage key."""
        live: dict[int, Event] = {}
        for event in self.events[: index + 1]:
            if event.nbytes:
                live[event.key] = event
            else:
                live.pop(event.key, None)
        return live
