"""A Hugging Face checkpoint's tensors by name (mcore/hf.py reads them through this): a state dict,
or a directory of safetensors files (sharded with model.safetensors.index.json, or not), checked
against the tensors a model shape needs before anything is built; an MoE checkpoint's stacked
experts (transformers 5's in-memory layout) read by the released checkpoints' names
(mcore/hf_moe.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.mcore.hf_moe import stacked_views, view_of

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers that old transformers versions saved


class HFSource:
    """HF tensors by name: a state dict, or a directory of (possibly sharded) safetensors files;
    an MoE `family`'s stacked experts (transformers 5's layout) read by their checkpoint names."""

    def __init__(self, src, family: str = ""):
        if isinstance(src, Mapping):
            self.where, self._dict, self._files = "HF state dict", src, {}
            self.shapes = {k: tuple(t.shape) for k, t in src.items()}
            self._stacked_views(family)
            return
        from safetensors import safe_open

        root = Path(src)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            self.where = str(index)
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: "
                                 f"{e}); the checkpoint is damaged or incomplete") from None
            self._files = {k: root / v for k, v in weight_map.items()}
        elif (root / "model.safetensors").is_file():
            self.where = str(root / "model.safetensors")
            self._files = None
        else:
            raise ValueError(f"{root}: neither model.safetensors nor model.safetensors.index.json")
        self._dict, self.shapes = None, {}
        files = sorted(set(self._files.values())) if self._files else [root / "model.safetensors"]
        by_name = {}
        for file in files:
            try:
                with safe_open(file, framework="pt") as fh:
                    for k in fh.keys():
                        self.shapes[k] = tuple(fh.get_slice(k).get_shape())
                        by_name[k] = file
            except Exception as e:  # noqa: BLE001  safetensors' errors are its own types
                raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: "
                                 f"{str(e)[:200]}); the checkpoint is damaged or incomplete") \
                    from None
        self._files = by_name
        self._stacked_views(family)

    def _stacked_views(self, family: str) -> None:
        self._views = stacked_views(self.shapes, family)  # empty without stacked experts
        for name, (source, *_, shp) in self._views.items():
            self.shapes.pop(source, None)
            self.shapes[name] = shp

    def get(self, name: str) -> torch.Tensor:
        if name in self._views:
            source, expert, half, _ = self._views[name]
            return view_of(self._stored(source, expert), None, half)
        return self._stored(name)

    def _stored(self, name: str, expert: int | None = None) -> torch.Tensor:
        """Tensor `name`, or its row `expert` (from a file, only that row is read)."""
        if self._dict is not None:
            return self._dict[name] if expert is None else self._dict[name][expert]
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as fh:
            return fh.get_tensor(name) if expert is None else fh.get_slice(name)[expert]

    def check(self, shape: ModelShape, expected: dict[str, tuple[int, ...]]) -> None:
        """ValueError naming the first missing, unexpected or wrongly shaped tensor of the
        `expected` ones (name -> shape: mcore/hf.py hf_tensor_shapes) of `shape`."""
        missing = sorted(set(expected) - set(self.shapes))
        extra = sorted(k for k in set(self.shapes) - set(expected)
                       if not k.endswith(_IGNORED_SUFFIXES)
                       and not (shape.tie_embeddings and k == "lm_head.weight"))
        for kind, names in (("missing", missing), ("unexpected", extra)):
            if names:
                more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
                raise ValueError(f"{self.where}: {kind} tensor {names[0]}{more} for a "
                                 f"{shape.num_layers}-layer {shape.family} model with "
                                 f"tie_word_embeddings={shape.tie_embeddings}")
        for k, want in expected.items():
            if self.shapes[k] != want:
                raise ValueError(f"{self.where}: tensor {k} has shape {list(self.shapes[k])}, "
                                 f"the model config expects {list(want)}")
