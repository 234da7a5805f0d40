"""Step plans as data: per pipeline stage, the ordered ops one DP rank executes.

Ops (core.types.Op): F is a chunk's first forward, R its re-forward with grad, B its backward.

State-aware scheduling (ChunkFlow Algorithm 2, with the backward pass in descending order):
- A sequence of N dependent chunks keeps activations for its last K chunks only. Chunks 0..N-K-1
  run F without an autograd graph (keeping only their K/V state and, on stages after the first,
  their stage input), and later R (re-forward with grad) right before their B.
- Forwards ascend, backwards strictly descend: chunk j's K/V gradient is complete only after every
  later chunk has run backward. R(j) waits for B(j + K), so at most K chunks of a sequence hold
  activations on a stage at any time.
- R is local to a stage: it re-runs the stage's layers from the saved stage input and needs no
  communication; only F (forward activations) and B (their gradients) cross stages.

State-aware 1F1B (PP >= 2) is list scheduling with the rules above and these limits per stage s of
p: at most p - s chunks hold activations when a standalone chunk enters (exactly 1F1B's in-flight
count), at most max(p - s, K) when a dependent chunk enters; one long sequence's state at a time
(the next sequence starts on the first stage once the previous one's backward is complete there);
no standalone chunk enters the first stage between a sequence's first and last kept forward, so
every stage sees the K-window contiguously (this is what makes the plan deadlock-free). Ties go to
B, then R, then F; on the last stage, among B, dependent chunks (the critical chain) first. The
first stage prefers the next dependent chunk (longest sequence first) and fills with standalone
chunks when it must wait. Every later stage forwards in the first stage's order, and every earlier
stage runs its backwards in the last stage's order: point-to-point messages between two stages are
then received in the order they are sent (NCCL matches them by order, not by tag). With standalone
chunks of equal cost this gives exactly Megatron's 1F1B. PP = 1 is the same code with p = 1.

Plans are built by replaying the schedule against a deterministic cost model, so every rank that
rebuilds them from the same chunks gets the identical plan.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.types import DataChunk, Op, PipelinePlan


def is_reforwarded(chunk: DataChunk, num_kept: int) -> bool:
    """A dependent chunk before the last `num_kept` of its sequence: its first forward keeps no
    activations, and it is re-forwarded (R) right before its backward."""
    return chunk.is_dependent and chunk.index < chunk.num_siblings - num_kept


def state_aware_plan(chunks: Sequence[DataChunk], num_stages: int, num_kept: int,
                     costs: OpCosts) -> PipelinePlan:
    """Plan one DP rank's chunks with state-aware scheduling (1F1B when num_stages >= 2)."""
    if num_stages < 1:
        raise ValueError(f"pipeline size must be >= 1, got {num_stages}")
    if num_kept < 1:
        raise ValueError(f"K must be >= 1, got {num_kept}")
    return _Planner(list(chunks), num_stages, num_kept, costs).run()


def megatron_1f1b_plan(microbatches: Sequence[DataChunk], num_stages: int) -> PipelinePlan:
    """Megatron's non-interleaved 1F1B order (schedules.py: warmup, steady 1F1B, cooldown)."""
    ids = [c.id for c in microbatches]
    m, stages = len(ids), []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, m)
        ops = [Op("F", ids[i]) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [Op("F", ids[warmup + i]), Op("B", ids[i])]
        ops += [Op("B", ids[i]) for i in range(m - warmup, m)]
        stages.append(tuple(ops))
    return PipelinePlan(tuple(stages), tuple(microbatches))


class _Planner:
    """Event-driven list scheduler; positions (0..M-1) index chunks internally."""

    def __init__(self, chunks: list[DataChunk], p: int, num_kept: int, costs: OpCosts):
        self.chunks, self.p, self.num_kept, self.costs = chunks, p, num_kept, costs
        m = len(chunks)
        pos_of = {c.id: i for i, c in enumerate(chunks)}
        self.dep = [c.is_dependent for c in chunks]
        self.kept = [not is_reforwarded(c, num_kept) for c in chunks]
        # positions of siblings: next/previous (descending backward) and the one num_kept (K)
        # earlier, whose R waits for this chunk's B (the R window)
        self.next_sib, self.prev_sib = [-1] * m, [-1] * m
        self.sib_num_kept_earlier = [-1] * m
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(chunks):
            if c.is_dependent:
                groups.setdefault(c.parent, []).append(i)
        for members in groups.values():
            members.sort(key=lambda i: chunks[i].index)
            assert [chunks[i].index for i in members] == list(range(len(members))), \
                "a sequence's dependent chunks must all be on this rank"
            for j, i in enumerate(members):
                if j + 1 < len(members):
                    self.next_sib[i] = members[j + 1]
                if j > 0:
                    self.prev_sib[i] = members[j - 1]
                if j >= num_kept:
                    self.sib_num_kept_earlier[i] = members[j - num_kept]
        # first stage's forward queues: longest sequence first, then standalone in id order
        order = sorted(groups.values(), key=lambda g: (-sum(chunks[i].num_tokens for i in g),
                                                        chunks[g[0]].parent))
        self.dep_queue = deque(i for g in order for i in g)
        self.sa_queue = deque(pos_of[c.id] for c in chunks if not c.is_dependent)
        self.arrived = [deque() for _ in range(p)]  # stages > 0: forwards received, in order
        self.fwd_rank = [0] * m  # order of F on the first stage (B tie-break)
        self.num_fwd = 0
        # unmet conditions: B needs activations, (s < p-1) the next stage's B, the next sibling's B
        self.need_b = [[1 + (s < p - 1) + (self.next_sib[i] >= 0) for s in range(p)]
                       for i in range(m)]
        self.need_r = [[2] * p for _ in range(m)]  # F done here, and B of the K-later sibling
        self.ready_b = [[] for _ in range(p)]  # last stage: heap by priority
        self.b_order = [deque() for _ in range(p)]  # other stages: the next stage's B order
        self.b_ready = [set() for _ in range(p)]
        self.ready_r = [[] for _ in range(p)]
        self.held = [0] * p
        self.open_seq = None  # the sequence whose state lives (first stage's view)
        self.window_open = False  # between a sequence's first and last kept F on the first stage
        self.idle = [True] * p
        self.ops: list[list[Op]] = [[] for _ in range(p)]
        self.events: list = []
        self.counter = 0

    # ---- readiness ------------------------------------------------------------------------------
    def _dec_b(self, i: int, s: int) -> None:
        self.need_b[i][s] -= 1
        if self.need_b[i][s] == 0:
            if s == self.p - 1:
                heapq.heappush(self.ready_b[s], (not self.dep[i], self.fwd_rank[i], i))
            else:
                self.b_ready[s].add(i)

    def _dec_r(self, i: int, s: int) -> None:
        self.need_r[i][s] -= 1
        if self.need_r[i][s] == 0:
            heapq.heappush(self.ready_r[s], (-self.fwd_rank[i], i))  # latest chunk first

    def _cap(self, i: int, s: int) -> int:
        return max(self.p - s, self.num_kept) if self.dep[i] else self.p - s

    def _may_forward(self, i: int, s: int) -> bool:
        return not self.kept[i] or self.held[s] < self._cap(i, s)

    def _pick_forward_first_stage(self) -> int | None:
        if self.dep_queue:
            i = self.dep_queue[0]
            parent = self.chunks[i].parent
            if self.open_seq in (None, parent) and self._may_forward(i, 0):
                self.dep_queue.popleft()
                self.open_seq = parent
                if self.kept[i]:
                    self.window_open = self.next_sib[i] >= 0
                return i
        if self.sa_queue and not self.window_open and self._may_forward(self.sa_queue[0], 0):
            return self.sa_queue.popleft()
        return None

    def _pick(self, s: int) -> Op | None:
        if self.ready_b[s]:
            return Op("B", heapq.heappop(self.ready_b[s])[2])
        if self.b_order[s] and self.b_order[s][0] in self.b_ready[s]:
            return Op("B", self.b_order[s].popleft())
        if self.ready_r[s] and self.held[s] < self.max_cap(s):
            return Op("R", heapq.heappop(self.ready_r[s])[1])
        if s == 0:
            i = self._pick_forward_first_stage()
            if i is not None:
                self.fwd_rank[i] = self.num_fwd
                self.num_fwd += 1
        elif self.arrived[s] and self._may_forward(self.arrived[s][0], s):
            i = self.arrived[s].popleft()
        else:
            i = None
        return None if i is None else Op("F", i)

    def max_cap(self, s: int) -> int:
        return max(self.p - s, self.num_kept)

    # ---- event loop -----------------------------------------------------------------------------
    def _try_start(self, s: int, now: float) -> None:
        if not self.idle[s]:
            return
        op = self._pick(s)
        if op is None:
            return
        i = op.chunk
        if op.kind == "R" or (op.kind == "F" and self.kept[i]):
            self.held[s] += 1
        self.idle[s] = False
        self.ops[s].append(op)
        end = now + self.costs(op.kind, self.chunks[i].id, s)
        self.counter += 1
        heapq.heappush(self.events, (end, self.counter, s, op))

    def _finish(self, s: int, op: Op) -> None:
        i, p = op.chunk, self.p
        if op.kind == "F":
            if s + 1 < p:
                self.arrived[s + 1].append(i)
            if self.kept[i]:
                self._dec_b(i, s)
            else:
                self._dec_r(i, s)
        elif op.kind == "R":
            self._dec_b(i, s)
        else:  # B
            self.held[s] -= 1
            if s > 0:
                self.b_order[s - 1].append(i)
                self._dec_b(i, s - 1)
            if self.prev_sib[i] >= 0:
                self._dec_b(self.prev_sib[i], s)
            if self.sib_num_kept_earlier[i] >= 0:
                self._dec_r(self.sib_num_kept_earlier[i], s)
            if s == 0 and self.dep[i] and self.prev_sib[i] < 0:
                self.open_seq = None  # the sequence's first chunk is done: its state is freed

    def run(self) -> PipelinePlan:
        for s in range(self.p):
            self._try_start(s, 0.0)
        while self.events:
            now = self.events[0][0]
            touched = set()
            while self.events and self.events[0][0] == now:  # finish everything due now first
                _, _, s, op = heapq.heappop(self.events)
                self.idle[s] = True
                self._finish(s, op)
                touched.update(t for t in (s - 1, s, s + 1) if 0 <= t < self.p)
            for t in sorted(touched):
                self._try_start(t, now)
        expected = 2 * len(self.chunks) + sum(not kept for kept in self.kept)
        if any(len(ops) != expected for ops in self.ops):
            raise RuntimeError(f"planner stalled: ops per stage {[len(o) for o in self.ops]}, "
                               f"expected {expected} (a bug; please report the input)")
        ids = [c.id for c in self.chunks]
        return PipelinePlan(
            tuple(tuple(Op(op.kind, ids[op.chunk]) for op in ops) for ops in self.ops),
            tuple(self.chunks),
        )
