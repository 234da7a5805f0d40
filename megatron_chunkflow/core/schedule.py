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
                     costs: OpCosts, num_model_chunks: int = 1) -> PipelinePlan:
    """Plan one DP rank's chunks with state-aware scheduling (1F1B when num_stages >= 2; the
    interleaved variant over num_stages x num_model_chunks virtual stages when V >= 2). `costs`
    is indexed by virtual stage."""
    if num_stages < 1:
        raise ValueError(f"pipeline size must be >= 1, got {num_stages}")
    if num_kept < 1:
        raise ValueError(f"K must be >= 1, got {num_kept}")
    if num_model_chunks < 1 or (num_model_chunks > 1 and num_stages < 2):
        raise ValueError(f"virtual stages per pipeline rank must be >= 1 (and 1 without a "
                         f"pipeline), got {num_model_chunks} with {num_stages} stage(s)")
    return _Planner(list(chunks), num_stages, num_model_chunks, num_kept, costs).run()


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


def interleaving_problem(num_microbatches: int, num_stages: int, num_model_chunks: int,
                         group_size: int | None = None) -> str | None:
    """Why Megatron's interleaved schedule (core_v0.16.1) refuses this many micro-batches, or
    None. Micro-batches run in groups of `group_size` (--microbatch-group-size-per-virtual-
    pipeline-stage, default PP) per model chunk: PP <= group <= M, and the last group is whole or
    at least PP."""
    if num_model_chunks == 1:
        return None
    group = num_stages if group_size is None else group_size
    m = num_microbatches
    if not num_stages <= group <= m:
        return (f"{m} micro-batches per pipeline: Megatron's interleaved schedule needs at least "
                f"{group} (the group size, PP = {num_stages} by default)")
    if 0 < m % group < num_stages:
        return (f"{m} micro-batches per pipeline: Megatron's interleaved schedule needs a "
                f"multiple of {group} or a last group of at least PP = {num_stages}")
    return None


def megatron_interleaved_plan(microbatches: Sequence[DataChunk], num_stages: int,
                              num_model_chunks: int, group_size: int | None = None
                              ) -> PipelinePlan:
    """Megatron's interleaved 1F1B (forward_backward_pipelining_with_interleaving): per rank r,
    warmup of 2 (PP - r - 1) + (V - 1) x group forwards, then one forward and one backward;
    forwards take model chunks 0..V-1 over each group of micro-batches, backwards V-1..0.
    ValueError where Megatron refuses the micro-batch count (interleaving_problem)."""
    problem = interleaving_problem(len(microbatches), num_stages, num_model_chunks, group_size)
    if problem:
        raise ValueError(problem)
    if num_model_chunks == 1:
        return megatron_1f1b_plan(microbatches, num_stages)
    ids, v_count = [c.id for c in microbatches], num_model_chunks
    m, group = len(ids), group_size or num_stages
    table = []  # (micro-batch, model chunk) of each forward, Megatron's schedule table
    for first in range(0, m, group):
        last = m if first + group >= m else first + group
        table += [(i, v) for v in range(v_count) for i in range(first, last)]
    total, stages = len(table), []
    for r in range(num_stages):
        warmup = min(2 * (num_stages - r - 1) + (v_count - 1) * group, total)
        fwd = [Op("F", ids[i], v) for i, v in table]
        bwd = [Op("B", ids[i], v_count - 1 - v) for i, v in table]
        ops = fwd[:warmup]
        for j in range(total - warmup):
            ops += [fwd[warmup + j], bwd[j]]
        ops += bwd[total - warmup:]
        stages.append(tuple(ops))
    return PipelinePlan(tuple(stages), tuple(microbatches), v_count)


class _Planner:
    """Event-driven list scheduler over virtual stages k = v x p + r (rank r runs one op at a
    time over its model chunks v); positions (0..M-1) index chunks internally."""

    def __init__(self, chunks: list[DataChunk], p: int, v: int, num_kept: int, costs: OpCosts):
        self.chunks, self.p, self.v, self.num_kept, self.costs = chunks, p, v, num_kept, costs
        self.n = n = p * v  # virtual stages
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
        standalone = [pos_of[c.id] for c in chunks if not c.is_dependent]
        if p == 1 and v == 1 and len(standalone) > 1:
            # no pipeline: the last op is the last standalone chunk's B, and DP's gradient
            # reduce-scatter (launched as its buckets fill) hides behind it: the costliest last
            last = max(reversed(standalone), key=lambda i: costs("B", chunks[i].id, 0))
            standalone.remove(last)
            standalone.append(last)
        self.sa_queue = deque(standalone)
        self.arrived = [deque() for _ in range(n)]  # stages > 0: forwards received, in order
        self.fwd_rank = [0] * m  # order of F on the first stage (B tie-break)
        self.num_fwd = 0
        # unmet conditions: B needs activations, (k < n-1) the next stage's B, the next sibling's B
        self.need_b = [[1 + (k < n - 1) + (self.next_sib[i] >= 0) for k in range(n)]
                       for i in range(m)]
        self.need_r = [[2] * n for _ in range(m)]  # F done here, and B of the K-later sibling
        self.ready_b = [[] for _ in range(n)]  # last stage: heap by priority
        self.b_order = [deque() for _ in range(n)]  # other stages: the next stage's B order
        self.b_ready = [set() for _ in range(n)]
        self.ready_r = [[] for _ in range(n)]
        self.held = [0] * n
        self.open_seq = None  # the sequence whose state lives (first stage's view)
        self.window_open = False  # between a sequence's first and last kept F on the first stage
        self.idle = [True] * p
        self.ops: list[list[Op]] = [[] for _ in range(p)]
        self.events: list = []
        self.counter = 0

    # ---- readiness ------------------------------------------------------------------------------
    def _dec_b(self, i: int, k: int) -> None:
        self.need_b[i][k] -= 1
        if self.need_b[i][k] == 0:
            if k == self.n - 1:
                heapq.heappush(self.ready_b[k], (not self.dep[i], self.fwd_rank[i], i))
            else:
                self.b_ready[k].add(i)

    def _dec_r(self, i: int, k: int) -> None:
        self.need_r[i][k] -= 1
        if self.need_r[i][k] == 0:
            heapq.heappush(self.ready_r[k], (-self.fwd_rank[i], i))  # latest chunk first

    def stage_cap(self, k: int) -> int:
        """Chunks virtual stage k may hold when a standalone chunk enters: 1F1B's in-flight count
        p - s without virtual stages; with them the most Megatron's interleaved 1F1B holds on
        that virtual stage (model chunk v of rank r): 2p up to model chunk V-3, then
        p + 2(p - r) - 1 (at most 2p) on model chunk V-2 and 2(p - r) - 1 (at most p) on V-1."""
        if self.v == 1:
            return self.p - k
        v, r = divmod(k, self.p)
        if v == self.v - 1:
            return min(self.p, 2 * (self.p - r) - 1)
        if v == self.v - 2:
            return min(2 * self.p, self.p + 2 * (self.p - r) - 1)
        return 2 * self.p

    def _cap(self, i: int, k: int) -> int:
        return max(self.stage_cap(k), self.num_kept) if self.dep[i] else self.stage_cap(k)

    def _may_forward(self, i: int, k: int) -> bool:
        return not self.kept[i] or self.held[k] < self._cap(i, k)

    def _first_stage_candidate(self) -> tuple[int, bool] | None:
        """(chunk, from the dependent queue) the first stage may start now, or None."""
        if self.dep_queue:
            i = self.dep_queue[0]
            if self.open_seq in (None, self.chunks[i].parent) and self._may_forward(i, 0):
                return i, True
        if self.sa_queue and not self.window_open and self._may_forward(self.sa_queue[0], 0):
            return self.sa_queue[0], False
        return None

    def _start_first_stage(self, i: int, dependent: bool) -> None:
        if dependent:
            self.dep_queue.popleft()
            self.open_seq = self.chunks[i].parent
            if self.kept[i]:
                self.window_open = self.next_sib[i] >= 0
        else:
            self.sa_queue.popleft()
        self.fwd_rank[i] = self.num_fwd
        self.num_fwd += 1

    def _pick(self, r: int) -> tuple[Op, int] | None:
        """Rank r's next op and its virtual stage, or None. Without virtual stages: a backward,
        else a re-forward, else a forward (1F1B). With them: a re-forward, else the ready op that
        comes first in Megatron's interleaved order for this rank (_position), so equal
        standalone chunks run in the step time Megatron takes for its micro-batches."""
        candidates = []  # (priority, kind, virtual stage, chunk)
        for k in range(r + (self.v - 1) * self.p, r - 1, -self.p):  # deepest first
            if self.ready_b[k]:
                candidates.append((self._priority("B", self.ready_b[k][0][2], k), "B", k))
            elif self.b_order[k] and self.b_order[k][0] in self.b_ready[k]:
                candidates.append((self._priority("B", self.b_order[k][0], k), "B", k))
            if self.ready_r[k] and self.held[k] < self.max_cap(k):
                candidates.append((self._priority("R", self.ready_r[k][0][1], k), "R", k))
            if k > 0 and self.arrived[k] and self._may_forward(self.arrived[k][0], k):
                candidates.append((self._priority("F", self.arrived[k][0], k), "F", k))
        if r == 0 and (self.v > 1 or not candidates):
            first = self._first_stage_candidate()
            if first is not None:
                candidates.append((self._priority("F", None, 0), "F0", 0))
        if not candidates:
            return None
        _, kind, k = min(candidates)
        v = k // self.p
        if kind == "B":
            i = heapq.heappop(self.ready_b[k])[2] if k == self.n - 1 else self.b_order[k].popleft()
        elif kind == "R":
            i = heapq.heappop(self.ready_r[k])[1]
        elif kind == "F":
            i = self.arrived[k].popleft()
        else:
            i, dependent = first
            self._start_first_stage(i, dependent)
            kind = "F"
        return Op(kind, i, v), k

    def _priority(self, kind: str, i: int | None, k: int) -> tuple:
        """Order of ready ops on one rank (smaller first); `i` None: the next chunk to enter."""
        rank = {"B": 0, "R": 1, "F": 2}[kind]
        if self.v == 1:
            return (rank,)
        q = self.num_fwd if i is None else self.fwd_rank[i]
        # a ready R first: it became ready when its sibling's B freed the slot it takes, and a
        # forward taking that slot instead could leave the sequence's backward chain, and every
        # chunk whose B is ordered behind it, waiting for a slot forever
        return (kind != "R", self._position(kind, q, k), rank, -k)

    def _position(self, kind: str, q: int, k: int) -> float:
        """Where Megatron's interleaved schedule puts this op in rank k % p's sequence, for the
        q-th chunk to enter: forwards take groups of p chunks through model chunks 0..V-1
        (table index t), backwards the same groups through V-1..0; W = 2(p - r - 1) +
        (V - 1) p forwards of warmup, then one forward and one backward. R just before its B."""
        v, r = divmod(k, self.p)
        if kind != "F":
            v = self.v - 1 - v
        first = q - q % self.p
        group = min(self.p, len(self.chunks) - first)
        t = first * self.v + v * group + q % self.p
        warmup = 2 * (self.p - r - 1) + (self.v - 1) * self.p
        if kind == "F":
            return t if t < warmup else warmup + 2 * (t - warmup)
        return warmup + 2 * t + (1 if kind == "B" else 0.5)

    def max_cap(self, k: int) -> int:
        return max(self.stage_cap(k), self.num_kept)

    # ---- event loop -----------------------------------------------------------------------------
    def _try_start(self, r: int, now: float) -> None:
        if not self.idle[r]:
            return
        picked = self._pick(r)
        if picked is None:
            return
        op, k = picked
        i = op.chunk
        if op.kind == "R" or (op.kind == "F" and self.kept[i]):
            self.held[k] += 1
        self.idle[r] = False
        self.ops[r].append(op)
        end = now + self.costs(op.kind, self.chunks[i].id, k)
        self.counter += 1
        heapq.heappush(self.events, (end, self.counter, k, op))

    def _finish(self, k: int, op: Op) -> None:
        i, n = op.chunk, self.n
        if op.kind == "F":
            if k + 1 < n:
                self.arrived[k + 1].append(i)
            if self.kept[i]:
                self._dec_b(i, k)
            else:
                self._dec_r(i, k)
        elif op.kind == "R":
            self._dec_b(i, k)
        else:  # B
            self.held[k] -= 1
            if k > 0:
                self.b_order[k - 1].append(i)
                self._dec_b(i, k - 1)
            if self.prev_sib[i] >= 0:
                self._dec_b(self.prev_sib[i], k)
            if self.sib_num_kept_earlier[i] >= 0:
                self._dec_r(self.sib_num_kept_earlier[i], k)
            if k == 0 and self.dep[i] and self.prev_sib[i] < 0:
                self.open_seq = None  # the sequence's first chunk is done: its state is freed

    def run(self) -> PipelinePlan:
        for r in range(self.p):
            self._try_start(r, 0.0)
        while self.events:
            now = self.events[0][0]
            while self.events and self.events[0][0] == now:  # finish everything due now first
                _, _, k, op = heapq.heappop(self.events)
                self.idle[k % self.p] = True
                self._finish(k, op)
            for r in range(self.p):
                self._try_start(r, now)
        expected = self.v * (2 * len(self.chunks) + sum(not kept for kept in self.kept))
        if any(len(ops) != expected for ops in self.ops):
            raise RuntimeError(f"planner stalled: ops per stage {[len(o) for o in self.ops]}, "
                               f"expected {expected} (a bug; please report the input)")
        ids = [c.id for c in self.chunks]
        return PipelinePlan(
            tuple(tuple(Op(op.kind, ids[op.chunk], op.model_chunk) for op in ops)
                  for ops in self.ops),
            tuple(self.chunks), self.v)

