"""runtime/trace.py: the debugging observers CHUNKFLOW_TRACE and CHUNKFLOW_NVTX attach (the
traced pipeline itself is tests/runtime/test_pipeline.py's).

    python -m pytest tests/runtime/test_trace.py -q
"""

import io
import re

from megatron_chunkflow.core.types import Op
from megatron_chunkflow.runtime.observe import observing
from megatron_chunkflow.runtime.trace import OpTrace, debug_observers


def test_every_event_prints_begin_and_end_with_rank_and_stage():
    out = io.StringIO()
    trace = OpTrace(stage=1, stream=out)
    trace.step_began()
    with observing([trace], "communicate", "recv_forward", Op("F", 3)):
        pass
    with observing([trace], "forward", Op("F", 3), False):
        pass
    with observing([trace], "backward", Op("B", 3)):
        pass
    trace.step_ended()
    lines = [re.sub(r"^.* \+[0-9.]+s ", "", line) for line in out.getvalue().splitlines()]
    assert lines == ["step began", "begin recv_forward chunk 3", "end recv_forward chunk 3",
                     "begin F chunk 3 (no graph)", "end F chunk 3 (no graph)",
                     "begin B chunk 3", "end B chunk 3", "step ended"]
    assert out.getvalue().startswith("[chunkflow trace] rank 0 stage 1 +")


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("CHUNKFLOW_TRACE", raising=False)
    monkeypatch.delenv("CHUNKFLOW_NVTX", raising=False)
    assert debug_observers(0) == []
    monkeypatch.setenv("CHUNKFLOW_TRACE", "1")
    monkeypatch.setenv("CHUNKFLOW_NVTX", "1")  # no CUDA here: no NVTX ranges
    assert [type(o) for o in debug_observers(0)] == [OpTrace]
