"""Trace the GPU memory of a real training step on this CPU: `chunkflow memory`, the start guard
and the footprint model's checks.

    trace = trace_memory(settings, lengths, world=8, rank=3)    # one rank of an 8-GPU job
    trace.peak_allocated, trace.at_peak["activations"], trace.terms[:5]

The step is the one `chunkflow train` and the Megatron-LM launcher take (mcore/step.py:
build_training, then training_step), on `settings` as they run on a GPU (settings.device "cuda":
Megatron's GPU initialisation, fusions, attention backend), with the GPU played by the meta device
(memtrace/device.py) and the job by torch's fake process group (memtrace/job.py). Nothing is
computed, so any model size and chunk plan traces in seconds to minutes. Two steps run on the
global batch: the first creates Adam's states, as a real run's first step does; the peak reported
is the second's, when every static byte is there (the first's is in `phase_peaks` too).

What is counted is every storage the step allocates on the device, rounded and placed by the CUDA
caching allocator's rules (memtrace/allocator.py): `peak_allocated` is what
torch.cuda.max_memory_allocated reports, `peak_reserved` what the allocator reserved (its
fragmentation included). At the peak every live byte is attributed to what made it (`at_peak`):
static (weights, the gradient buffer, the optimizer's master weights and states, alive when the step
began), activations (made in a forward, outside the loss), kv_state and kept_attention
(runtime/state.py, runtime/reforward.py), loss (the output layer and cross entropy, forward or
backward), backward (gradients being made), optimizer, and `terms`: the activations by module and
op, every layer summed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch

from megatron_chunkflow.memtrace.allocator import AllocatorStats, replay
from megatron_chunkflow.memtrace.census import Census
from megatron_chunkflow.memtrace.device import traced_device
from megatron_chunkflow.memtrace.job import traced_rank
from megatron_chunkflow.memtrace.ledger import BLOCK, Label, Ledger, block_bytes
from megatron_chunkflow.memtrace.stack import Stack, get_stack
from megatron_chunkflow.runtime.ranks import Ranks

GiB = 1 << 30
# source files (path endings) and what an allocation made under them is
_SOURCES = (
    ("megatron/core/optimizer/", "optimizer"), ("torch/optim/", "optimizer"),
    ("tensor_parallel/cross_entropy.py", "loss"), ("megatron_chunkflow/runtime/loss.py", "loss"),
    ("megatron_chunkflow/runtime/pieced_loss.py", "loss"),
    ("megatron_chunkflow/runtime/state.py", "kv_state"),
    ("megatron_chunkflow/runtime/reforward.py", "kept_attention"),
    ("megatron_chunkflow/runtime/p2p.py", "p2p"),
)
# frames where the search for a source stops: a module's call (the code outside it is another
# module's) and the autograd engine's entry (the code outside it called backward)
_BOUNDARIES = ("torch/nn/modules/module.py", "torch/autograd/graph.py")
_LOSS_NODES = ("_VocabParallelCrossEntropyBackward", "PiecedCrossEntropyBackward")


@dataclass
class MemoryTrace:
    """One rank's traced step (module docstring); bytes throughout."""

    ranks: Ranks
    stack: str
    peak_allocated: int
    peak_reserved: int
    peak_phase: str  # the phase of the allocation that reached the peak
    peak_where: str  # its module (or backward node) and op
    at_peak: dict[str, int]  # bytes live at the peak by what made them
    static: dict[str, int]  # weights, grad_buffer, optimizer, other: alive when the step began
    terms: list[tuple[str, int]]  # activations live at the peak by module and op, largest first
    phase_peaks: dict[str, int]  # the highest allocated count reached in each phase
    host_peak: int
    scalar_reads: int  # device values the step read back (zeros here; syncs on a GPU)
    fits: bool | None = None  # with a capacity: whether the replayed allocator fit in it
    oom: dict | None = None
    events: list = field(default_factory=list, repr=False)  # the device allocations, in order
    census: Census | None = field(default=None, repr=False)  # the second step's kernels
    _needed: int | None = field(default=None, repr=False)

    @property
    def needed(self) -> int:
        """The least device memory in which the replayed caching allocator never fails: the
        allocated peak plus the fragmentation it cannot avoid (1 MiB steps)."""
        if self._needed is None:
            lo, hi = self.peak_allocated, max(self.peak_reserved, self.peak_allocated)
            while hi - lo > 1 << 20:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if replay(self.events, mid).oom is None else (mid, hi)
            self._needed = hi
        return self._needed

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if not f.name.startswith("_") and f.name not in ("events", "census")}
        out["ranks"] = dataclasses.asdict(self.ranks)
        out["terms"] = [list(t) for t in self.terms]
        out["needed"] = self.needed
        if self.oom and self.oom.get("label") is not None:
            out["oom"] = {**self.oom, "label": list(self.oom["label"])}
        return out


@dataclass
class _Labeler:
    """Label(phase, module, source, op) of the allocation being made (frames, module stack)."""

    names: dict[int, str] = field(default_factory=dict)  # id(module) -> qualified name
    stack: list[str] = field(default_factory=list)
    phase: str = "build"
    _codes: dict = field(default_factory=dict)

    def __call__(self, op) -> Label:
        source = self._source()
        node = torch._C._current_autograd_node()
        module = self.stack[-1] if self.stack else ""
        if self.phase == "build":
            return Label("build", module, source, str(op))
        if source == "optimizer":
            phase = "optimizer"
        elif source == "loss" or "output_layer" in module or (
                node is not None and type(node).__name__ in _LOSS_NODES):
            phase = "loss"
        else:
            phase = "backward" if node is not None else "forward"
        if node is not None:
            module = type(node).__name__
        return Label(phase, module, source or "activation", str(op))

    def _source(self) -> str:
        """The innermost known source file on the stack inside the innermost module call (or
        backward): "" when none."""
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            kind = self._codes.get(code)
            if kind is None:
                name = code.co_filename.replace("\\", "/")
                kind = "|" if any(b in name for b in _BOUNDARIES) else next(
                    (k for end, k in _SOURCES if end in name), "")
                self._codes[code] = kind
            if kind:
                return "" if kind == "|" else kind
            frame = frame.f_back
        return ""

    def watch(self, models) -> list:
        """Module hooks naming the innermost module running; the handles to remove."""
        for model in models:
            for name, module in model.named_modules():
                parts = name.split(".")
                if "layers" in parts and parts.index("layers") + 1 < len(parts):
                    parts[parts.index("layers") + 1] = "*"
                self.names[id(module)] = ".".join(p for p in parts if p != "module")
        def enter(module, args):
            self.stack.append(self.names.get(id(module), type(module).__name__))

        def leave(module, args, output):
            if self.stack:
                self.stack.pop()

        return [torch.nn.modules.module.register_module_forward_pre_hook(enter),
                torch.nn.modules.module.register_module_forward_hook(leave)]


@contextlib.contextmanager
def _stock_shapes(settings, lengths, ranks: Ranks):
    """A stock baseline's pipeline exchanges each micro-batch's shape before its tensor (Megatron's
    variable_seq_lengths); the traced rank has no neighbour to send one, so its receives get the
    shapes of its own micro-batches in Megatron's order (forward inputs, then output gradients,
    micro-batch by micro-batch), as its neighbours would send them."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_chunkflow.core.step import baseline_microbatches

    if settings.uses_chunkflow or settings.parallel.pp == 1:
        yield
        return
    pad, tp = settings.parallel.pad_multiple, settings.parallel.tp
    split = tp if settings.parallel.sequence_parallel else 1
    shapes = [[(c.computed_tokens + -c.computed_tokens % pad) // split, 1,
               settings.shape.hidden_size]
              for c in baseline_microbatches(lengths, settings.seq_length, ranks.dp,
                                             settings.system)
              if c.dp_rank == ranks.dp_rank]
    received = {"prev": 0, "next": 0}
    original = P2PCommunicator._communicate_shapes

    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        out = []
        for side, wanted in (("prev", recv_prev), ("next", recv_next)):
            if wanted:
                out.append(shapes[received[side] % len(shapes)])
                received[side] += 1
            else:
                out.append([0, 0, 0])
        return tuple(out)

    P2PCommunicator._communicate_shapes = communicate_shapes
    try:
        yield
    finally:
        P2PCommunicator._communicate_shapes = original


def trace_memory(settings, lengths, *, world: int | None = None, rank: int = 0,
                 stack: Stack | str | None = None, capacity: float | None = None,
                 seed: int = 0, warm_optimizer: bool = False, census: bool = False) -> MemoryTrace:
    """Trace rank `rank` of a `world`-GPU job (default: the layout's model parallel size, one
    DP rank) training `settings` (mcore/settings.py TrainSettings) on one global batch of
    `lengths`, on GPU software stack `stack` (memtrace/stack.py; default the installed torch's).
    `capacity`: the bytes the GPU can allocate, for `fits` and `oom`. `warm_optimizer`: Adam's
    states made by an optimizer step on zero gradients instead of a first training step (the
    same allocated peak in about a quarter of the time; the allocator's cache has another
    history, so the reserved bytes differ). `census`: the second step's kernels counted too
    (memtrace/census.py), in MemoryTrace.census. A settings.device "cpu" traces a CPU run (every
    byte exact, no allocator rounding: what the tests compare with a real CPU run)."""
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.step import build_training, training_step

    cpu = settings.device == "cpu"
    stack = stack if isinstance(stack, Stack) else get_stack(stack)
    world = world or settings.parallel.model_parallel_size
    sequences = make_sequences(lengths, settings.shape.vocab_size, seed)
    labeler = _Labeler()
    ledger = Ledger(labeler, block=1 if cpu else BLOCK)
    handles = []
    with traced_rank(settings.parallel, world, rank, seed) as job:
        try:
            with traced_device(ledger, stack, settings.device), \
                    _stock_shapes(settings, lengths, job.ranks):
                tr = build_training(settings, job)
                handles = labeler.watch(tr.chunkflow_model.models)
                params = {id(p.untyped_storage()) for m in tr.chunkflow_model.models
                          for p in m.parameters()}
                buffers = {id(b.grad_data.untyped_storage()) for d in tr.chunkflow_model.ddps
                           for b in d.buffers}
                labeler.phase = "step"
                if warm_optimizer:  # Adam's states as a first step makes them, no forward
                    tr.optimizer.step()
                else:
                    training_step(settings, tr, sequences, 0)
                begun = len(ledger.events) - 1
                first, ledger.phase_peaks = ledger.phase_peaks, {}
                ledger.census = Census() if census else None
                training_step(settings, tr, sequences, 1)
                ledger.census, kernels = None, ledger.census
        finally:
            for h in handles:
                h.remove()
    if cpu:  # the host's allocator: bytes as asked
        stats = AllocatorStats(ledger.device_peak, ledger.device_peak, 0, None, ledger.peak_event)
    else:  # build and both steps: max_memory_allocated's view
        stats = replay(ledger.events)
    bounded = replay(ledger.events, capacity) if capacity is not None and not cpu else stats
    live = ledger.live_at(stats.peak_index)
    at_peak, terms, static = _attribute(live, ledger.live_at(begun), params, buffers,
                                        ledger.block)
    label = ledger.events[stats.peak_index].label
    phase_peaks = {f"step 0 {k}": v for k, v in first.items()} | ledger.phase_peaks
    return MemoryTrace(
        ranks=job.ranks, stack=stack.name, peak_allocated=stats.peak_allocated,
        peak_reserved=stats.peak_reserved, peak_phase=label.phase,
        peak_where=f"{label.module} {label.op}".strip(), at_peak=at_peak, static=static,
        terms=terms, phase_peaks=phase_peaks, host_peak=ledger.host_peak,
        scalar_reads=ledger.scalar_reads,
        fits=None if capacity is None else bounded.oom is None, oom=bounded.oom,
        events=[] if cpu else ledger.events, census=kernels,
        _needed=stats.peak_allocated if cpu else None)


def _attribute(live: dict, static_live: dict, params: set, buffers: set, block: int):
    """(bytes at the peak by what made them, activation terms, static bytes by kind)."""
    at_peak: Counter = Counter()
    terms: Counter = Counter()
    static: Counter = Counter()
    for key, event in live.items():
        n = block_bytes(event.nbytes, block)
        if key in static_live and static_live[key] is event:
            kind = ("weights" if key in params else "grad_buffer" if key in buffers
                    else "optimizer" if event.label.source == "optimizer" else "other")
            static[kind] += n
            at_peak["static"] += n
            continue
        label = event.label
        if label.source in ("kv_state", "kept_attention", "p2p"):
            what = label.source
        elif label.phase in ("loss", "backward", "optimizer"):
            what = label.phase
        else:
            what = "activations"
            terms[f"{label.module} {label.op}".strip()] += n
        at_peak[what] += n
    return dict(at_peak), terms.most_common(), dict(static)
