"""A parallel layout: TP, CP, PP, DP and activation recompute, validated against a model.

Ranks are ordered as Megatron's default "tp-cp-ep-dp-pp" (TP fastest), so a TP group spans tp
consecutive GPUs, a CP group tp * cp, a DP group tp * cp * dp and a PP group all of them; a group
that spans more GPUs than a node has crosses the network (perfmodel/hardware.py: Hardware.link).
Sequence parallelism is on whenever TP > 1 (activations between TP regions are split over TP).

Recompute is one option of Megatron's menu (config.Recompute): none; selective with modules from
core_attn, mlp, layernorm; full (uniform, one layer per checkpoint); block:N (the first N layers of
each pipeline stage). Its text form is the layout flag's last field:
"4,1,2,selective:mlp+layernorm", "4,1,2,block:2". Megatron-LM asserts that PP divides the layers
(megatron/training/arguments.py: "Number of layers should be divisible by the
pipeline-model-parallel size") and that block's N lies in 1 .. num_layers // PP
(TransformerConfig.__post_init__), and so does make_layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_chunkflow.config import Recompute
from megatron_chunkflow.core.models import ModelShape

NO_RECOMPUTE = Recompute()


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism of one training job, and Megatron's activation recompute option.

    `recompute` is a config.Recompute; its text form ("none", "full", "selective:mlp",
    "block:2") is accepted too and parsed."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    recompute: Recompute = NO_RECOMPUTE

    def __post_init__(self):
        for name in ("tp", "cp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.upper()} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.recompute, str):
            object.__setattr__(self, "recompute", Recompute.parse(self.recompute, "recompute"))
        elif not isinstance(self.recompute, Recompute):
            raise ValueError(f"recompute must be a Recompute or its text form, got "
                             f"{self.recompute!r}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    @property
    def segment_multiple(self) -> int:
        """ChunkFlow under CP pads every segment of a chunk at its end to a multiple of this, so
        that it cuts into 2 x CP equal pieces (each a multiple of TP under sequence parallelism):
        2 x CP (x TP); 1 without CP. Megatron's CP needs the same of each sequence."""
        if self.cp == 1:
            return 1
        return 2 * self.cp * (self.tp if self.sequence_parallel else 1)

    @property
    def chunk_multiple(self) -> int:
        """ChunkFlow's chunk size must be a multiple of this: a full dependent chunk cannot be
        padded (its K/V is state), so it must split as segments do (segment_multiple) under CP,
        and over TP under sequence parallelism."""
        if self.cp > 1:
            return self.segment_multiple
        return self.tp if self.sequence_parallel else 1

    @property
    def parallel(self) -> Layout:
        """The same degrees without recompute (what the recompute-independent costs depend on)."""
        return Layout(self.tp, self.cp, self.pp, self.dp)

    def span(self, axis: str) -> int:
        """GPUs a group of this axis spans, in Megatron's rank order."""
        return {"tp": self.tp, "cp": self.tp * self.cp, "dp": self.tp * self.cp * self.dp,
                "pp": self.num_gpus}[axis]

    def describe(self) -> str:
        """e.g. "TP4 CP1 PP2 DP4 selective:mlp"."""
        return f"TP{self.tp} CP{self.cp} PP{self.pp} DP{self.dp} {self.recompute}"

    def to_flag(self) -> str:
        """The TP,CP,PP,RECOMPUTE form `chunkflow simulate` takes."""
        return f"{self.tp},{self.cp},{self.pp},{self.recompute}"

    def to_json(self) -> dict:
        """Degrees as numbers, recompute as its text form."""
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp,
                "recompute": str(self.recompute)}


def recomputed_layers(recompute: Recompute, layers: int) -> int:
    """How many of a stage's `layers` layers keep only their input and re-run whole in the
    backward: all under full, the first N under block:N (Megatron's block method checkpoints
    layer indices below N, transformer_block.py _checkpointed_forward), none otherwise."""
    if recompute.kind == "full":
        return layers
    if recompute.kind == "block":
        return min(recompute.num_layers, layers)
    return 0


def make_layout(tp: int, cp: int, pp: int, recompute: Recompute | str, num_gpus: int,
                shape: ModelShape, flag: str = "layout") -> Layout:
    """DP is what `num_gpus` leaves; errors name `flag` and the offending value."""
    for name, v in (("TP", tp), ("CP", cp), ("PP", pp)):
        if v < 1:
            raise ValueError(f"{flag}: {name} must be >= 1, got {v}")
    if isinstance(recompute, str):
        recompute = Recompute.parse(recompute, f"{flag}: RECOMPUTE")
    model_parallel = tp * cp * pp
    if num_gpus % model_parallel:
        raise ValueError(f"{flag}: TP*CP*PP = {tp}*{cp}*{pp} = {model_parallel} does not divide "
                         f"--gpus {num_gpus}")
    if shape.num_attention_heads % tp or shape.num_query_groups % tp:
        raise ValueError(f"{flag}: TP {tp} must divide the attention heads "
                         f"({shape.num_attention_heads}) and the K/V groups "
                         f"({shape.num_query_groups}), as Megatron requires")
    if shape.num_layers % pp:
        raise ValueError(f"{flag}: PP {pp} must divide the model's {shape.num_layers} layers, "
                         "as Megatron-LM requires")
    if recompute.kind == "block" and recompute.num_layers > shape.num_layers // pp:
        raise ValueError(f"{flag}: RECOMPUTE {recompute}: a pipeline stage has only "
                         f"{shape.num_layers // pp} layers (block:N needs 1 <= N <= "
                         f"{shape.num_layers // pp})")
    return Layout(tp, cp, pp, num_gpus // model_parallel, recompute)


def parse_layout(text: str, num_gpus: int, shape: ModelShape, flag: str) -> Layout:
    """Parse "TP,CP,PP,RECOMPUTE" (e.g. "4,1,2,full", "4,1,2,selective:mlp+layernorm")."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4:
        raise ValueError(f"{flag} {text!r}: expected TP,CP,PP,RECOMPUTE, e.g. 4,1,1,selective "
                         "or 4,1,2,block:2")
    try:
        tp, cp, pp = (int(p) for p in parts[:3])
    except ValueError:
        raise ValueError(f"{flag} {text!r}: TP, CP and PP must be integers") from None
    return make_layout(tp, cp, pp, parts[3], num_gpus, shape, flag=f"{flag} {text}")
