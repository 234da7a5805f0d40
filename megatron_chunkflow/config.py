"""ChunkFlowConfig, ParallelConfig and Recompute (recompute.py, re-exported): the knobs every entry
point shares, carried whole to where they are used.

Each field's attribute docstring is its command-line help, and its flag is derived from it
(flags.py: add_config_arguments): one spelling per knob in every subcommand. ParallelConfig is the
one description of a layout, for the jobs that run and for the layouts the simulator searches;
every rule about which chunk sizes and models a layout can take is written here, once.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

from megatron_chunkflow.flags import MAX_COUNT, MAX_GPUS, MAX_TOKENS
from megatron_chunkflow.recompute import (  # noqa: F401  (re-exported: one import for the knobs)
    NO_RECOMPUTE,
    RECOMPUTE_MODULES,
    Recompute,
    RecomputeModule,
)

AttentionBackend = Literal["auto", "torch", "cpu_flash", "sdpa", "flex", "varlen", "flash", "te"]
CpKvState = Literal["sharded", "replicated"]
CpAttention = Literal["ring", "gather"]
CpPlacement = Literal["hybrid", "split"]
ReforwardAttention = Literal["recompute", "keep", "offload"]
LSE_BACKENDS = ("auto", "torch", "cpu_flash", "varlen", "flash")  # attention/lse.py's pairs


@dataclass(frozen=True)
class ChunkFlowConfig:
    """ChunkFlow settings shared by every entry point."""

    chunk_size: int = field(default=8192, metadata={"bounds": (1, MAX_TOKENS)})
    """Tokens per data chunk (C). Sequences longer than C are cut into dependent chunks; shorter ones
    are packed into standalone chunks of capacity C. Peak activation memory follows C."""

    num_kept: int = field(default=1, metadata={"flag": "--chunkflow-k", "deprecated": ("--k",),
                                               "bounds": (1, MAX_COUNT)})
    """Chunks of one long sequence that keep activations (K). The others run forward without a
    graph and are re-forwarded during the backward pass: more K, more memory, less recompute."""

    attention_backend: AttentionBackend = field(default="auto",
                                                metadata={"deprecated": ("--backend",)})
    """Chunk attention kernel: auto = the fastest installed kernel for this device and dtype
    (cpu_flash, ATen's fused CPU kernel, on CPU; on a GPU flash-attn's varlen kernel, else
    PyTorch's own varlen flash kernel, for bf16/fp16, and the tiled torch backend for fp32/fp64:
    attention/backends.py AUTO); torch is exact attention in plain torch, tiled (any device, saves
    only q, k, v, out and the log-sum-exp); sdpa the reference (a loop of
    F.scaled_dot_product_attention, materialises the scores); flex torch's flex_attention; varlen
    torch's own varlen flash kernel (CUDA)."""

    cp_kv: CpKvState = field(default="sharded", metadata={"flag": "--chunkflow-cp-kv"})
    """Under CP, a long sequence's K/V state: sharded (a chunk gathers [prefix ++ own] K/V, twice)
    or replicated (CP x the memory, whole on every rank; a chunk gathers its own, once)."""

    cp_attention: CpAttention = field(default="ring",
                                      metadata={"flag": "--chunkflow-cp-attention"})
    """Under CP, where the attention needs other ranks' K/V: ring (each rank's K/V block passed
    around the CP ranks while the kernel attends over the one at hand; backends cpu_flash, torch,
    flash, varlen) or gather (all-gathered first, one kernel call)."""

    cp_placement: CpPlacement = field(default="hybrid",
                                      metadata={"flag": "--chunkflow-cp-placement"})
    """Under CP, a packed chunk's segments: hybrid (each kept whole on one CP rank where the
    ranks stay balanced, its attention local; only segments too long to place, and every long
    sequence's chunks, cut into zigzag pieces over the ranks) or split (every segment cut)."""

    reforward_attention: ReforwardAttention = field(
        default="recompute", metadata={"flag": "--chunkflow-reforward-attention"})
    """A re-forwarded chunk's attention: recompute (its re-forward runs the whole layer again);
    keep (its first forward keeps each layer's attention output and log-sum-exp on the GPU, and
    the re-forward runs only the rest of the layer, the attention backward starting from them;
    under CP a re-forward moves no K/V but, with replicated state, its own); offload (the same, kept in host memory and copied back).
    keep and offload need a backend with the log-sum-exp pair: auto, torch, cpu_flash, varlen,
    flash."""

    loss_piece: int = field(default=0, metadata={"flag": "--chunkflow-loss-piece"})
    """Tokens per piece of the output layer and cross entropy (0: whole micro-batch, as stock
    Megatron computes it). With N > 0 a chunk's logits are made N tokens at a time and again in
    the backward, so the loss holds one piece's logits instead of the chunk's (16K tokens on a
    152K vocabulary: 14 GiB whole), for one more logits GEMM; exact. Applies to the stock
    baselines' micro-batches too (runtime/pieced_loss.py)."""

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.loss_piece < 0:
            raise ValueError(f"--chunkflow-loss-piece must be >= 0 (0: the whole micro-batch), "
                             f"got {self.loss_piece}")
        if self.num_kept < 1:
            raise ValueError(f"--chunkflow-k must be >= 1, got {self.num_kept}")
        for flag, value, kind in (("--chunkflow-cp-kv", self.cp_kv, CpKvState),
                                  ("--chunkflow-cp-attention", self.cp_attention, CpAttention),
                                  ("--chunkflow-cp-placement", self.cp_placement, CpPlacement),
                                  ("--chunkflow-reforward-attention", self.reforward_attention,
                                   ReforwardAttention),
                                  ("--attention-backend", self.attention_backend,
                                   AttentionBackend)):
            if value not in typing.get_args(kind):
                raise ValueError(f"{flag} {value!r}: choose from "
                                 f"{', '.join(typing.get_args(kind))}")
        if self.reforward_attention != "recompute" and self.attention_backend not in LSE_BACKENDS:
            raise ValueError(f"--chunkflow-reforward-attention {self.reforward_attention} needs "
                             "an attention backend with a backward from the log-sum-exp ("
                             f"{', '.join(LSE_BACKENDS)}); --attention-backend "
                             f"{self.attention_backend} has none")

    def check_context_parallel_flags(self, cp: int, name: str = "--context-parallel-size") -> None:
        """At CP 1 the CP choices do nothing: a value other than the default was meant for a CP
        run, so it is refused by flag instead of ignored."""
        if cp > 1:
            return
        changed = [f"{flag} {value}" for flag, value, default in (
            ("--chunkflow-cp-kv", self.cp_kv, "sharded"),
            ("--chunkflow-cp-attention", self.cp_attention, "ring"),
            ("--chunkflow-cp-placement", self.cp_placement, "hybrid")) if value != default]
        if changed:
            raise ValueError(f"{', '.join(changed)}: context-parallel choices, and {name} is 1 "
                             f"(no context parallelism); leave them out or raise {name}")


@dataclass(frozen=True)
class ParallelConfig:
    """The layout of one job: Megatron-LM's degrees of parallelism (DP is what the world leaves),
    sequence parallelism and the activation recompute option of every layer.

    Ranks are ordered as Megatron's default "tp-cp-ep-dp-pp" (TP fastest), so a TP group spans tp
    consecutive GPUs, a CP group tp x cp, a DP group tp x cp x dp and a PP group all of them
    (`span`). `recompute` also takes its text form ("full", "block:2")."""

    tp: int = field(default=1, metadata={"flag": "--tensor-model-parallel-size",
                                         "aliases": ("--tp",), "bounds": (1, MAX_GPUS)})
    """Tensor-parallel size (TP): each layer's weights split over TP ranks."""

    pp: int = field(default=1, metadata={"flag": "--pipeline-model-parallel-size",
                                         "aliases": ("--pp",), "bounds": (1, MAX_GPUS)})
    """Pipeline-parallel size (PP): the layers split into PP stages."""

    vpp: int = field(default=1, metadata={"flag": "--num-virtual-stages-per-pipeline-rank",
                                          "aliases": ("--vpp",), "bounds": (1, MAX_COUNT)})
    """Virtual pipeline stages (model chunks) per pipeline rank (V): the layers split into PP x V
    stages, rank r holding stages r, r + PP, ...; the interleaved schedule (needs PP >= 2)."""

    cp: int = field(default=1, metadata={"flag": "--context-parallel-size", "aliases": ("--cp",),
                                         "bounds": (1, MAX_GPUS)})
    """Context-parallel size (CP): every chunk's tokens split over CP ranks (2 x CP zigzag pieces
    per segment), a long sequence's K/V state sharded with them; attention all-gathers K/V."""

    dp: int | None = field(default=None, metadata={"flag": "--data-parallel-size",
                                                   "aliases": ("--dp",), "bounds": (1, MAX_GPUS)})
    """Data-parallel size (DP); in a job it is world size / (TP x CP x PP)."""

    ep: int = field(default=1, metadata={"flag": "--expert-model-parallel-size",
                                         "aliases": ("--ep",), "bounds": (1, MAX_GPUS)})
    """Expert-parallel size (EP): each MoE layer's experts split over EP of a stage's ranks."""

    etp: int | None = field(default=None, metadata={
        "flag": "--expert-tensor-parallel-size", "aliases": ("--etp",), "bounds": (1, MAX_GPUS)})
    """Expert tensor-parallel size (ETP; Megatron's default: TP)."""

    sequence_parallel: bool = False
    """Sequence parallelism: activations between TP regions split over the TP ranks (needs TP > 1;
    every chunk is padded to a multiple of TP)."""

    recompute: Recompute = NO_RECOMPUTE
    """Megatron's activation recompute inside each micro-batch or chunk: none, selective
    (core_attn), selective:M1+M2 (modules core_attn, mlp, layernorm), full, or block:N (the
    first N layers of each pipeline stage)."""

    def __post_init__(self):
        for name in ("tp", "pp", "vpp", "cp", "dp", "ep", "etp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{_named(name)} must be >= 1, got {value}")
        if self.vpp > 1 and self.pp < 2:
            raise ValueError(f"{_named('vpp')} {self.vpp} needs {_named('pp')} >= 2 (virtual "
                             "stages interleave a pipeline)")
        if self.etp is not None and self.etp != self.tp and self.ep == 1:
            raise ValueError(f"{_named('etp')} {self.etp} != {_named('tp')} {self.tp} needs EP "
                             "> 1: without it megatron-core reduces expert gradients over DP "
                             "only, not over the TP ranks sharing each expert")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(f"--sequence-parallel needs {_named('tp')} > 1")
        if isinstance(self.recompute, str):
            object.__setattr__(self, "recompute", Recompute.parse(self.recompute))
        elif not isinstance(self.recompute, Recompute):
            raise ValueError(f"recompute must be a Recompute or its text form, got "
                             f"{self.recompute!r}")

    @classmethod
    def layout(cls, *, tp: int = 1, cp: int = 1, pp: int = 1, dp: int = 1,
               recompute: Recompute | str = NO_RECOMPUTE, vpp: int = 1) -> ParallelConfig:
        """A whole layout as Megatron-LM users run it and the simulator models it: every degree
        given, sequence parallelism whenever TP > 1."""
        return cls(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, sequence_parallel=tp > 1,
                   recompute=recompute)

    @classmethod
    def parse(cls, text: str, num_gpus: int, shape, flag: str) -> ParallelConfig:
        """"TP,CP,PP,RECOMPUTE" (e.g. "4,1,2,full", "4,1,2,selective:mlp+layernorm") on `num_gpus`
        GPUs, as `layout` builds it, checked against the model (core.models.ModelShape); PP may
        be "PPxV" for V virtual stages per pipeline rank ("4,1,4x2,full": PP 4, V 2).
        ValueErrors name `flag` and the text."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 4:
            raise ValueError(f"{flag} {text!r}: expected TP,CP,PP,RECOMPUTE, e.g. 4,1,1,selective "
                             "or 4,1,2,block:2 (PP as PPxV for V virtual stages: 4,1,4x2,full)")
        pp_text, x, v_text = parts[2].lower().partition("x")
        try:
            tp, cp, pp = (int(p) for p in (*parts[:2], pp_text))
            vpp = int(v_text) if x else 1
        except ValueError:
            raise ValueError(f"{flag} {text!r}: TP, CP and PP must be integers, PP optionally "
                             "PPxV (V virtual stages per pipeline rank, e.g. 4x2)") from None
        return cls.on_gpus(tp, cp, pp, parts[3], num_gpus, shape, f"{flag} {text}", vpp)

    @classmethod
    def on_gpus(cls, tp: int, cp: int, pp: int, recompute: Recompute | str, num_gpus: int,
                shape, where: str = "layout", vpp: int = 1) -> ParallelConfig:
        """`layout` with DP what `num_gpus` leaves, checked against the model; errors start with
        `where` and name the offending value."""
        for name, v in (("TP", tp), ("CP", cp), ("PP", pp), ("V", vpp)):
            if v < 1:
                raise ValueError(f"{where}: {name} must be >= 1, got {v}")
        if vpp > 1 and pp < 2:
            raise ValueError(f"{where}: V {vpp} virtual stages per pipeline rank need PP >= 2, "
                             f"got PP {pp}")
        if isinstance(recompute, str):
            recompute = Recompute.parse(recompute, f"{where}: RECOMPUTE")
        if num_gpus % (tp * cp * pp):
            raise ValueError(f"{where}: TP*CP*PP = {tp}*{cp}*{pp} = {tp * cp * pp} does not "
                             f"divide --gpus {num_gpus}")
        out = cls.layout(tp=tp, cp=cp, pp=pp, dp=num_gpus // (tp * cp * pp), recompute=recompute,
                         vpp=vpp)
        out.check_model(shape, where)
        return out

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one model replica (one DP rank's share of the batch): TP x CP x PP."""
        return self.tp * self.cp * self.pp

    @property
    def num_gpus(self) -> int:
        """TP x CP x PP x DP (DP must be known)."""
        return self.model_parallel_size * self.dp

    @property
    def degrees(self) -> ParallelConfig:
        """The same layout without recompute (what the recompute-independent costs depend on)."""
        return dataclasses.replace(self, recompute=NO_RECOMPUTE)

    @property
    def pad_multiple(self) -> int:
        """Micro-batches (chunks) are padded to a multiple of this many tokens: TP under sequence
        parallelism (each TP rank holds an equal slice of the tokens), else 1."""
        return self.tp if self.sequence_parallel else 1

    @property
    def segment_multiple(self) -> int:
        """Under context parallelism every segment of a chunk is padded at its end to a multiple of
        this, so that it cuts into 2 x CP equal pieces; 1 without CP. Megatron's CP needs the same
        of each sequence."""
        return 2 * self.cp if self.cp > 1 else 1

    @property
    def chunk_multiple(self) -> int:
        """ChunkFlow's chunk size must be a multiple of this: a full dependent chunk cannot be
        padded (its K/V is state), so it must split as segments do under CP, each rank's share
        over TP under sequence parallelism: 2 x CP x TP, or TP without CP."""
        return 2 * self.cp * self.pad_multiple if self.cp > 1 else self.pad_multiple

    @property
    def chunk_padding(self) -> int:
        """Under context parallelism every chunk is padded (its last segment) to a multiple of
        chunk_multiple, so that each CP rank's share splits over TP under sequence parallelism;
        1 without CP (sequence parallelism alone pads with a segment of its own,
        runtime/inputs.py)."""
        return self.chunk_multiple if self.cp > 1 else 1

    def check_chunk_size(self, chunk_size: int, flag: str = "--chunk-size",
                         naming: Literal["flags", "megatron-lm", "axes"] = "flags") -> None:
        """ValueError naming `flag` unless `chunk_size` is a multiple of chunk_multiple; the axes
        are named by their flags and aliases, by Megatron-LM's flags alone (the launcher) or as
        the simulator's layouts name them (CP 2, TP 4)."""
        if chunk_size % self.chunk_multiple == 0:
            return

        def axis(name):
            if naming == "axes":
                return f"{name.upper()} "
            return (_named(name) if naming == "flags" else _flag(name)) + " "

        sp_name = "sequence parallelism" if naming == "axes" else "--sequence-parallel"
        if self.cp > 1:
            sp = f" x {axis('tp')}{self.tp} ({sp_name})" if self.sequence_parallel else ""
            m = self.chunk_multiple
            raise ValueError(
                f"{flag} {chunk_size} is not a multiple of 2 x {axis('cp')}{self.cp}{sp} = {m}: "
                f"context parallelism cuts every chunk into 2 x CP equal pieces; give {flag} "
                f"{max(m, chunk_size // m * m)}")
        raise ValueError(f"{flag} {chunk_size} is not a multiple of the tensor-parallel size "
                         f"{self.tp}, which {sp_name} requires (it splits every chunk over the TP "
                         "ranks)")

    def with_world(self, world_size: int) -> ParallelConfig:
        """This layout in a job of `world_size` ranks, DP filled in; ValueError if TP x CP x PP
        does not divide it (or a given DP does not match)."""
        cp = f" x {_named('cp')} {self.cp}" if self.cp > 1 else ""
        if world_size % self.model_parallel_size:
            raise ValueError(f"world size {world_size} is not a multiple of {_named('tp')} "
                             f"{self.tp}{cp} x {_named('pp')} {self.pp}")
        dp = world_size // self.model_parallel_size
        if self.dp is not None and self.dp != dp:
            raise ValueError(f"{_named('dp')} {self.dp} does not match world size {world_size} "
                             f"/ (TP {self.tp} x CP {self.cp} x PP {self.pp}) = {dp}")
        if (self.tp * self.cp * dp) % (self.expert_tp * self.ep):  # a stage's ranks
            raise ValueError(f"{_named('ep')} {self.ep} x expert TP {self.expert_tp} must "
                             f"divide TP x CP x DP = {self.tp * self.cp * dp}")
        return dataclasses.replace(self, dp=dp)

    @property
    def expert_tp(self) -> int:  # ETP where given, else TP (Megatron's default)
        return self.tp if self.etp is None else self.etp

    def check_model(self, shape, where: str | None = None) -> None:
        """Megatron's requirements on a model (core.models.ModelShape): TP divides the attention
        heads and K/V groups, PP divides the layers (even stages; megatron/training/arguments.py)
        and block:N has 1 <= N <= layers per stage (TransformerConfig.__post_init__). Messages
        name the flags, or start with `where` (a simulator layout's flag and text)."""
        def name(axis):
            return f"{where}: {axis.upper()}" if where else _named(axis)

        if shape.num_attention_heads % self.tp or shape.num_query_groups % self.tp:
            raise ValueError(f"{name('tp')} {self.tp} must divide the attention heads "
                             f"({shape.num_attention_heads}) and the K/V groups "
                             f"({shape.num_query_groups}), as Megatron requires")
        if shape.ffn_hidden_size % self.tp:
            raise ValueError(f"{name('tp')} {self.tp} must divide the FFN width "
                             f"({shape.ffn_hidden_size}), as Megatron's column-parallel MLP "
                             "requires")
        if shape.num_layers % self.pp:
            raise ValueError(f"{name('pp')} {self.pp} must divide the model's "
                             f"{shape.num_layers} layers, as Megatron-LM requires")
        if shape.num_layers % (self.pp * self.vpp):
            raise ValueError(f"{name('vpp')} {self.vpp} must divide the model's "
                             f"{shape.num_layers // self.pp} layers per pipeline stage (PP "
                             f"{self.pp}), as Megatron requires")
        if (self.ep > 1 or self.etp is not None) and not shape.is_moe:
            raise ValueError(f"{_named('ep' if self.ep > 1 else 'etp')} is for a mixture-of-"
                             "experts model; this one is dense")
        if shape.is_moe and shape.num_experts % self.ep:
            raise ValueError(f"{name('ep')} {self.ep} must divide the {shape.num_experts} experts")
        self.recompute.check_layers(shape.num_layers // self.num_virtual_stages,
                                    f"{where}: RECOMPUTE" if where else "--recompute")

    @property
    def num_virtual_stages(self) -> int:
        """PP x V: the stages a chunk's forward passes through (PP without virtual stages)."""
        return self.pp * self.vpp

    def span(self, axis: str) -> int:
        """GPUs a group of this axis spans, in Megatron's rank order."""
        return {"tp": self.tp, "cp": self.tp * self.cp, "dp": self.tp * self.cp * self.dp,
                "pp": self.num_gpus}[axis]

    def describe(self) -> str:
        """e.g. "TP4 CP1 PP2 DP4 selective:mlp"."""
        pp = f"PP{self.pp}" + (f"xV{self.vpp}" if self.vpp > 1 else "")
        return f"TP{self.tp} CP{self.cp} {pp} DP{self.dp} {self.recompute}"

    def to_flag(self) -> str:
        """The TP,CP,PP,RECOMPUTE form `chunkflow simulate` takes (PP as PPxV with virtual
        stages)."""
        pp = f"{self.pp}x{self.vpp}" if self.vpp > 1 else f"{self.pp}"
        return f"{self.tp},{self.cp},{pp},{self.recompute}"

    def to_json(self) -> dict:
        """Degrees as numbers, recompute as its text form: the simulator's layout record
        (sequence parallelism is on whenever TP > 1 there)."""
        out = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp,
               "recompute": str(self.recompute)}
        if self.vpp > 1:
            out["vpp"] = self.vpp
        return out


def _flag(name: str) -> str:
    """A ParallelConfig field's flag (Megatron-LM's name)."""
    return next(f for f in dataclasses.fields(ParallelConfig) if f.name == name).metadata["flag"]


def _named(name: str) -> str:
    """A ParallelConfig field's flag and its short alias, as an error message names them."""
    f = next(f for f in dataclasses.fields(ParallelConfig) if f.name == name)
    return f"{f.metadata['flag']} ({'/'.join(f.metadata['aliases'])})"
