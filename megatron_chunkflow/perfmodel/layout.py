"""A parallel layout: TP, CP, PP, DP and activation recompute, validated against a model.

Ranks are ordered as Megatron's default "tp-cp-ep-dp-pp" (TP fastest), so a TP group spans tp
consecutive GPUs, a CP group tp * cp, a DP group tp * cp * dp and a PP group all of them; a group
that spans more GPUs than a node has crosses the network (perfmodel/hardware.py: Hardware.link).
Sequence parallelism is on whenever TP > 1 (activations between TP regions are split over TP).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_chunkflow.core.models import ModelShape

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism of one training job, and Megatron's activation recompute mode.

    recompute: "none"; "selective" (Megatron's default module, core attention, re-run in the
    backward); "full" (every transformer layer keeps only its input and is re-run whole).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    recompute: str = "none"

    def __post_init__(self):
        for name in ("tp", "cp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.upper()} must be >= 1, got {getattr(self, name)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, "
                             f"got {self.recompute!r}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    def span(self, axis: str) -> int:
        """GPUs a group of this axis spans, in Megatron's rank order."""
        return {"tp": self.tp, "cp": self.tp * self.cp, "dp": self.tp * self.cp * self.dp,
                "pp": self.num_gpus}[axis]

    def describe(self) -> str:
        return f"TP{self.tp} CP{self.cp} PP{self.pp} DP{self.dp} {self.recompute}"

    def to_flag(self) -> str:
        """The TP,CP,PP,RECOMPUTE form `chunkflow simulate` takes."""
        return f"{self.tp},{self.cp},{self.pp},{self.recompute}"

    def to_json(self) -> dict:
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp,
                "recompute": self.recompute}


def make_layout(tp: int, cp: int, pp: int, recompute: str, num_gpus: int,
                shape: ModelShape, flag: str = "layout") -> Layout:
    """DP is what `num_gpus` leaves; errors name `flag` and the offending value."""
    for name, v in (("TP", tp), ("CP", cp), ("PP", pp)):
        if v < 1:
            raise ValueError(f"{flag}: {name} must be >= 1, got {v}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"{flag}: RECOMPUTE must be one of {', '.join(RECOMPUTE)}, "
                         f"got {recompute!r}")
    model_parallel = tp * cp * pp
    if num_gpus % model_parallel:
        raise ValueError(f"{flag}: TP*CP*PP = {tp}*{cp}*{pp} = {model_parallel} does not divide "
                         f"--gpus {num_gpus}")
    if shape.num_attention_heads % tp or shape.num_query_groups % tp:
        raise ValueError(f"{flag}: TP {tp} must divide the attention heads "
                         f"({shape.num_attention_heads}) and the K/V groups "
                         f"({shape.num_query_groups}), as Megatron requires")
    if pp > shape.num_layers:
        raise ValueError(f"{flag}: PP {pp} is more than the model's {shape.num_layers} layers")
    return Layout(tp, cp, pp, num_gpus // model_parallel, recompute)


def parse_layout(text: str, num_gpus: int, shape: ModelShape, flag: str) -> Layout:
    """Parse "TP,CP,PP,RECOMPUTE" (e.g. "4,1,2,full")."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4:
        raise ValueError(f"{flag} {text!r}: expected TP,CP,PP,RECOMPUTE, e.g. 4,1,1,selective")
    try:
        tp, cp, pp = (int(p) for p in parts[:3])
    except ValueError:
        raise ValueError(f"{flag} {text!r}: TP, CP and PP must be integers") from None
    return make_layout(tp, cp, pp, parts[3], num_gpus, shape, flag=f"{flag} {text}")
