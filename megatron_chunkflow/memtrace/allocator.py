"""The CUDA caching allocator replayed on a traced step's allocations: what
torch.cuda.max_memory_allocated and max_memory_reserved would report, and whether the step fits.

    stats = replay(ledger.events)                     # unlimited memory
    stats = replay(ledger.events, capacity=139.8 * 2**30)   # stats.oom: the first request refused

The rules are PyTorch's c10/cuda/CUDACachingAllocator.cpp (native allocator, default settings):
- a request is rounded up to a multiple of 512 bytes; requests of at most 1 MiB come from the small
  pool, larger ones from the large pool;
- a request is served by the smallest free cached block of its pool that is large enough
  (best fit); a block larger than needed is split when what remains is at least 512 bytes
  (small pool) or more than 1 MiB (large pool): an unsplit remainder stays in the block and counts
  as allocated;
- with no block to serve it, a new segment is reserved from the device (cudaMalloc): 2 MiB for a
  small request, 20 MiB for a large request under 10 MiB, else the request rounded up to 2 MiB;
- a freed block merges with its free neighbours in the same segment; segments stay reserved;
- when a new segment does not fit in `capacity`, the allocator first releases every cached
  segment that is wholly free (as it does before raising OutOfMemoryError) and tries again.
Reserved minus allocated is fragmentation: memory the step cannot use, which a plan's margin must
cover. Not modelled: expandable segments, max_split_size_mb, per-stream pools (a step uses one).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from megatron_chunkflow.memtrace.ledger import Event, block_bytes

MiB = 1 << 20
SMALL = 1 * MiB  # kSmallSize
SMALL_SEGMENT = 2 * MiB  # kSmallBuffer
LARGE_SEGMENT = 20 * MiB  # kLargeBuffer
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self):
        return (self.size, self.segment, self.offset)


@dataclass
class AllocatorStats:
    """What the replay saw: peaks of allocated and reserved bytes, the segments reserved, and the
    first request that did not fit in the capacity (None: all fit)."""

    peak_allocated: int = 0
    peak_reserved: int = 0
    num_segments: int = 0
    oom: dict | None = None
    peak_index: int = -1  # the event at which allocated peaked

    @property
    def fragmentation(self) -> float:
        """Reserved over allocated at their peaks, less one."""
        return self.peak_reserved / self.peak_allocated - 1 if self.peak_allocated else 0.0


@dataclass
class _Pool:
    free: list = field(default_factory=list)  # sorted (size, segment, offset) of free blocks
    blocks: dict = field(default_factory=dict)  # (segment, offset) -> _Block, free ones

    def add(self, b: _Block) -> None:
        bisect.insort(self.free, b.key())
        self.blocks[(b.segment, b.offset)] = b

    def remove(self, b: _Block) -> None:
        i = bisect.bisect_left(self.free, b.key())
        assert self.free[i] == b.key()
        del self.free[i]
        del self.blocks[(b.segment, b.offset)]

    def best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self.free, (size, -1, -1))
        if i == len(self.free):
            return None
        _, segment, offset = self.free[i]
        return self.blocks[(segment, offset)]


def segment_bytes(size: int) -> int:
    """cudaMalloc's size for a request of `size` (rounded) bytes with nothing cached to serve it."""
    if size <= SMALL:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def replay(events: Iterable[Event], capacity: float | None = None) -> AllocatorStats:
    """The caching allocator over `events` (memtrace/ledger.py order); `capacity`: the bytes the
    device can reserve (None: unlimited)."""
    pools = {True: _Pool(), False: _Pool()}  # small?, pool
    segments: dict[int, tuple[int, bool]] = {}  # segment -> (bytes, small)
    held: dict[int, _Block] = {}  # storage key -> its block
    stats = AllocatorStats()
    allocated = reserved = 0
    for index, event in enumerate(events):
        if not event.nbytes:
            b = held.pop(event.key, None)
            if b is None:
                continue
            allocated -= b.size
            _free(pools[segments[b.segment][1]], b)
            continue
        size = block_bytes(event.nbytes)
        small = size <= SMALL
        pool = pools[small]
        b = pool.best_fit(size)
        if b is None:
            grow = segment_bytes(size)
            if capacity is not None and reserved + grow > capacity:
                reserved -= _release_free_segments(pools, segments)
                if reserved + grow > capacity:
                    stats.oom = {"event": index, "requested": size, "allocated": allocated,
                                 "reserved": reserved, "capacity": capacity,
                                 "label": event.label}
                    break
            seg = stats.num_segments
            segments[seg] = (grow, small)
            reserved += grow
            stats.num_segments += 1
            b = _Block(seg, 0, grow)
            pool.add(b)
        pool.remove(b)
        remaining = b.size - size
        if remaining >= 512 if small else remaining > SMALL:
            rest = _Block(b.segment, b.offset + size, remaining, True, b, b.next)
            if b.next is not None:
                b.next.prev = rest
            b.next, b.size = rest, size
            pool.add(rest)
        b.free = False
        held[event.key] = b
        allocated += b.size
        if allocated > stats.peak_allocated:
            stats.peak_allocated, stats.peak_index = allocated, index
        stats.peak_reserved = max(stats.peak_reserved, reserved)
    return stats


def _free(pool: _Pool, b: _Block) -> None:
    """Free `b` and merge it with free neighbours of its segment."""
    b.free = True
    for nb in (b.prev, b.next):
        if nb is not None and nb.free:
            pool.remove(nb)
            if nb is b.prev:
                nb.size += b.size
                nb.next = b.next
                if b.next is not None:
                    b.next.prev = nb
                b = nb
            else:
                b.size += nb.size
                b.next = nb.next
                if nb.next is not None:
                    nb.next.prev = b
    pool.add(b)


def _release_free_segments(pools: dict, segments: dict) -> int:
    """Give back every segment that is one free block; the bytes released."""
    released = 0
    for small, pool in pools.items():
        for b in [b for b in pool.blocks.values() if b.prev is None and b.next is None]:
            pool.remove(b)
            released += segments.pop(b.segment)[0]
    return released
