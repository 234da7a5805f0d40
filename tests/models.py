"""The CPU tests' models: the tiny presets (core/models.py TINY) with as few layers as a layout
needs.

    shape = tiny("tiny-qwen3", stages=pp * vpp)

A chunk's operation count, not its width, sets a CPU test's time, and every layer adds the same
operations and collectives again. Two layers already give the second one keys and values that
depend on earlier chunks through the first, so the exactness tests use two, or one per model chunk
where the pipeline has more (PP 4, virtual stages)."""

from __future__ import annotations

import dataclasses

from megatron_chunkflow.core.models import ModelShape, get_model_shape


def tiny(name: str = "tiny", stages: int = 1) -> ModelShape:
    """Preset `name` with max(2, stages) layers."""
    return dataclasses.replace(get_model_shape(name), num_layers=max(2, stages))
