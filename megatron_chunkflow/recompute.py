"""Recompute: one option of Megatron's activation recompute menu, its text form and the whole menu
(config.py re-exports it with the other knobs)."""

from __future__ import annotations

import itertools
import typing
from dataclasses import dataclass
from typing import Literal

RecomputeModule = Literal["core_attn", "mlp", "layernorm"]
RECOMPUTE_MODULES: tuple[str, ...] = typing.get_args(RecomputeModule)


@dataclass(frozen=True)
class Recompute:
    """One option of Megatron's activation recompute menu (TransformerConfig's recompute_*).

    - none: every layer keeps what its backward needs;
    - selective: the listed modules of every layer re-run in the backward instead of keeping
      their activations (core_attn: the attention core; mlp: the MLP; layernorm: the two norms,
      whose outputs are not kept);
    - full: every layer keeps only its input and re-runs whole in the backward (Megatron's
      uniform method, one layer per checkpoint);
    - block N: the first N layers of each pipeline stage do that, the others keep everything.

    The text form (`parse`, `str`) is what flags and reports use: none, selective (core_attn),
    selective:mlp+layernorm, full, block:2."""

    kind: Literal["none", "selective", "full", "block"] = "none"
    modules: tuple[RecomputeModule, ...] = ()  # selective only, in RECOMPUTE_MODULES order
    num_layers: int = 0  # block only: N

    def __post_init__(self):
        if self.kind == "selective":
            unknown = [m for m in self.modules if m not in RECOMPUTE_MODULES]
            if unknown or not self.modules:
                raise ValueError(f"selective recompute {self.modules!r}: modules must be a "
                                 f"non-empty subset of {', '.join(RECOMPUTE_MODULES)}")
            ordered = tuple(m for m in RECOMPUTE_MODULES if m in self.modules)
            object.__setattr__(self, "modules", ordered)
        elif self.modules:
            raise ValueError(f"recompute {self.kind!r} takes no modules, got {self.modules!r}")
        if self.kind == "block" and self.num_layers < 1:
            raise ValueError(f"block recompute needs N >= 1 layers (block:N), got "
                             f"{self.num_layers}")
        if self.kind != "block" and self.num_layers:
            raise ValueError(f"recompute {self.kind!r} takes no number of layers, got "
                             f"{self.num_layers}")

    @classmethod
    def parse(cls, text: str, flag: str = "--recompute") -> Recompute:
        """From its text form; ValueError naming `flag` and the accepted forms."""
        kind, _, rest = text.strip().partition(":")
        try:
            if kind in ("none", "full") and not rest:
                return cls(kind)
            if kind == "selective":
                return cls("selective", tuple((rest or "core_attn").split("+")))
            if kind == "block" and rest.isdigit():
                return cls("block", num_layers=int(rest))
        except ValueError as e:
            raise ValueError(f"{flag} {text!r}: {e}") from None
        raise ValueError(f"{flag} {text!r}: expected none, full, block:N, selective or "
                         f"selective:M1+M2 with modules from {', '.join(RECOMPUTE_MODULES)}")

    def __str__(self) -> str:
        if self.kind == "selective":
            return "selective" if self.modules == ("core_attn",) else \
                "selective:" + "+".join(self.modules)
        return f"block:{self.num_layers}" if self.kind == "block" else self.kind

    def megatron_kwargs(self) -> dict:
        """The TransformerConfig fields that select this option."""
        if self.kind == "selective":
            return dict(recompute_granularity="selective", recompute_modules=list(self.modules))
        if self.kind == "full":
            return dict(recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=1)
        if self.kind == "block":
            return dict(recompute_granularity="full", recompute_method="block",
                        recompute_num_layers=self.num_layers)
        return {}

    def layers_recomputed(self, layers: int) -> int:
        """How many of a stage's `layers` layers keep only their input and re-run whole in the
        backward: all under full, the first N under block:N (Megatron's block method checkpoints
        layer indices below N, transformer_block.py _checkpointed_forward), none otherwise."""
        if self.kind == "full":
            return layers
        if self.kind == "block":
            return min(self.num_layers, layers)
        return 0

    def check_layers(self, layers_per_stage: int, flag: str = "--recompute") -> None:
        """Block N needs 1 <= N <= the layers of a pipeline stage; ValueError naming `flag`."""
        if self.kind == "block" and self.num_layers > layers_per_stage:
            raise ValueError(f"{flag} {self}: a pipeline stage has only {layers_per_stage} "
                             f"layers (block:N needs 1 <= N <= {layers_per_stage})")

    @staticmethod
    def menu(layers_per_stage: int) -> list[Recompute]:
        """Every option for stages of `layers_per_stage` layers: none, the 7 selective module
        sets, block 1 .. layers_per_stage - 1, full (block with every layer is full)."""
        subsets = [c for n in range(1, len(RECOMPUTE_MODULES) + 1)
                   for c in itertools.combinations(RECOMPUTE_MODULES, n)]
        return ([Recompute()] + [Recompute("selective", s) for s in subsets]
                + [Recompute("block", num_layers=n) for n in range(1, layers_per_stage)]
                + [Recompute("full")])


NO_RECOMPUTE = Recompute()
