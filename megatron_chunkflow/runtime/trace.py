"""Debugging aids attached to ChunkFlow's schedule as observers (runtime/observe.py), switched on
from the environment so that `chunkflow train`, `verify` and Megatron-LM's pretrain_gpt.py get
them without new flags (as NCCL_DEBUG or TORCH_DISTRIBUTED_DEBUG work):

    CHUNKFLOW_TRACE=1 torchrun ... train ...    # every op and exchange, as it starts and ends
    CHUNKFLOW_NVTX=1 nsys profile ...           # NVTX ranges per op and exchange (CUDA)

OpTrace prints one line to stderr when an op (F, R, B) or a point-to-point exchange of a stage
starts and when it ends, prefixed with the global rank and stage, so a hung pipeline shows each
rank's last unmatched "begin": the op or the send/receive it waits in. NvtxRanges pushes an NVTX
range around the same events, for Nsight Systems timelines.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

from megatron_chunkflow.core.types import Op
from megatron_chunkflow.runtime.observe import StepObserver


def debug_observers(stage: int) -> list[StepObserver]:
    """The observers CHUNKFLOW_TRACE and CHUNKFLOW_NVTX ask for (none by default)."""
    out: list[StepObserver] = []
    if os.environ.get("CHUNKFLOW_TRACE", "0") not in ("", "0"):
        out.append(OpTrace(stage))
    if os.environ.get("CHUNKFLOW_NVTX", "0") not in ("", "0") and torch.cuda.is_available():
        out.append(NvtxRanges())
    return out


class OpTrace(StepObserver):
    """One stderr line per event: `[chunkflow trace] rank R stage S +T.TTTs begin F chunk 3`."""

    def __init__(self, stage: int, stream=None):
        import torch.distributed as dist

        self.prefix = (f"[chunkflow trace] rank {dist.get_rank() if dist.is_initialized() else 0}"
                       f" stage {stage}")
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()

    def _say(self, text: str) -> None:
        print(f"{self.prefix} +{time.perf_counter() - self.t0:.3f}s {text}", file=self.stream,
              flush=True)

    @contextlib.contextmanager
    def _event(self, what: str):
        self._say(f"begin {what}")
        yield
        self._say(f"end {what}")

    def step_began(self) -> None:
        self.t0 = time.perf_counter()
        self._say("step began")

    def forward(self, op: Op, keeps_graph: bool):
        return self._event(f"{op.kind} chunk {op.chunk}" + ("" if keeps_graph else " (no graph)"))

    def backward(self, op: Op):
        return self._event(f"B chunk {op.chunk}")

    def communicate(self, what: str, op: Op):
        return self._event(f"{what} chunk {op.chunk}")

    def step_ended(self) -> None:
        self._say("step ended")


class NvtxRanges(StepObserver):
    """An NVTX range per op and exchange: `F chunk 3`, `recv_backward chunk 3`, ..."""

    @contextlib.contextmanager
    def _range(self, name: str):
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()

    def forward(self, op: Op, keeps_graph: bool):
        return self._range(f"{op.kind} chunk {op.chunk}")

    def backward(self, op: Op):
        return self._range(f"B chunk {op.chunk}")

    def communicate(self, what: str, op: Op):
        return self._range(f"{what} chunk {op.chunk}")
