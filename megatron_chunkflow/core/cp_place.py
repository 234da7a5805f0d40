"""Hybrid context parallelism of a packed chunk (--chunkflow-cp-placement hybrid): which of its
segments stay whole on one CP rank and which are cut into 2 x CP zigzag pieces over all of them.

A segment kept whole on one rank needs no other rank's keys: its attention is local, with no
traffic, no partial results to merge and no kernel launches per ring step. Only the segments too
long to place are split (a long sequence's chunks always are: their K/V is the sequence's state).
Every rank ends with the same number of tokens (the pipeline's tensors and the ring's blocks have
one shape per chunk), padded with a segment of its own where the placement leaves it short.

Placement, the same on every rank: segments longest first, each to the rank holding the fewest
tokens (longest-processing-time order); a segment longer than a rank's share is split. If the
placement pads the ranks by more than SLACK of the tokens it keeps whole (padding is computed
like any token: it must cost far less than the traffic it saves), the longest placed segment is
split instead and the rest placed again, down to none placed (the plain zigzag layout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

SLACK = 1 / 16  # the padding a placement may add, as a fraction of the tokens it keeps whole
SPLIT = -1  # owner of a segment cut into zigzag pieces over every CP rank


class Placement(NamedTuple):
    """owners[i]: the CP rank holding segment i whole, or SPLIT; padding[r]: padding tokens rank r
    appends as a segment of its own; local_tokens: every rank's tokens."""

    owners: tuple[int, ...]
    padding: tuple[int, ...]
    local_tokens: int


def place_segments(lengths: Sequence[int], cp: int, multiple: int = 1,
                   slack: float = SLACK) -> Placement | None:
    """The hybrid placement of a chunk's segments of `lengths` over `cp` ranks, each rank's tokens
    a multiple of `multiple` (TP under sequence parallelism) and of 2; None where no segment can
    be placed within `slack` (every segment split: the zigzag layout). Split segments must cut
    into 2 x CP pieces (core/packer pads them). Pure, and asked for the same chunk by every
    prediction of a search: cached."""
    return _place(tuple(lengths), cp, multiple, slack)


@lru_cache(maxsize=1 << 16)
def _place(lengths: tuple[int, ...], cp: int, multiple: int, slack: float) -> Placement | None:
    if cp < 2:
        raise ValueError(f"a hybrid placement needs CP >= 2, got {cp}")
    total = sum(lengths)
    step = math.lcm(2, multiple)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    split = {i for i in order if lengths[i] * cp > total}
    while len(split) < len(lengths):
        for i in split:
            if lengths[i] % (2 * cp):
                raise ValueError(f"segment {i} has {lengths[i]} tokens, which do not cut into "
                                 f"2 x CP = {2 * cp} equal pieces")
        shared = sum(lengths[i] for i in split) // cp
        loads = [0] * cp
        owners = [SPLIT] * len(lengths)
        for i in order:
            if i not in split:
                r = min(range(cp), key=lambda j: (loads[j], j))
                owners[i] = r
                loads[r] += lengths[i]
        size = -(-(max(loads) + shared) // step) * step
        padding = tuple(size - load - shared for load in loads)
        if sum(padding) <= slack * (total - shared * cp):
            return Placement(tuple(owners), padding, size)
        split.add(next(i for i in order if i not in split))
    return None
