"""The settings of one training system, ChunkFlow or a stock baseline: a `chunkflow train` run, a
system `chunkflow bench` measures, the device check's runs.

    TrainSettings(shape=..., model_name=..., chunkflow=ChunkFlowConfig(chunk_size=1024),
                  parallel=ParallelConfig(pp=2, recompute="full"), optimizer=OptimizerConfig())

ChunkFlowConfig and ParallelConfig (config.py), OptimizerConfig and CheckpointConfig (here),
LoRAConfig (mcore/lora.py) and SparseConfig (runtime/sparse.py) are each carried whole to the
code that uses them; the command line derives its flags from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.flags import check_output_dir
from megatron_chunkflow.mcore.lora import LoRAConfig
from megatron_chunkflow.runtime.sparse import SparseConfig

DType = Literal["float32", "float64", "bfloat16"]
# ChunkFlow, or one of the stock baselines (core/step.py: BASELINES)
System = Literal["chunkflow", "megatron-sft", "megatron-packed", "megatron-unpacked"]


@dataclass(frozen=True)
class OptimizerConfig:
    """Megatron's Adam with weight decay and clipping, and its warmup + cosine LR schedule."""

    lr: float = 1e-3
    """Peak learning rate."""

    min_lr: float = 1e-4
    """Floor of the cosine decay (reached at the last step)."""

    lr_warmup_iters: int = 5
    """Steps of linear warmup from 0 to the peak."""

    weight_decay: float = 0.1
    """AdamW weight decay."""

    clip_grad: float = 1.0
    """Gradient clipping by global norm (0: off)."""

    def __post_init__(self):
        for flag, value, low in (("--lr", self.lr, "> 0"), ("--min-lr", self.min_lr, ">= 0"),
                                 ("--weight-decay", self.weight_decay, ">= 0"),
                                 ("--clip-grad", self.clip_grad, ">= 0 (0: off)")):
            bad = not math.isfinite(value) or value < 0 or (low == "> 0" and value == 0)
            if bad:
                raise ValueError(f"{flag} must be a finite number {low}, got {value}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}: the cosine decay "
                             "falls from --lr to --min-lr")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where a run saves and resumes (Megatron-LM's flags), and Hugging Face import and export."""

    save: str | None = None
    """Checkpoint directory (Megatron-LM's layout, dist_checkpointing)."""

    load: str | None = None
    """Resume from the newest complete checkpoint in this directory."""

    save_interval: int | None = None
    """Save every N steps (and at the end)."""

    load_hf: str | None = None
    """Start from a Hugging Face checkpoint directory: Qwen2/2.5, Qwen3, Llama 3.x, Mistral (its
    config.json sets the model; overrides --model)."""

    save_hf: str | None = None
    """Write the trained model as a Hugging Face checkpoint (safetensors) here."""

    max_position_embeddings: int | None = None
    """With --load-hf: the positions the run may use (Megatron-LM's flag; default: the
    checkpoint's config.json). RoPE keeps no position table, so raising it past --seq-length
    trains on positions the model never saw: a choice made by name, as Megatron-LM asks."""

    override_lr_schedule: bool = False
    """With --load: this run's --lr, --min-lr, --lr-warmup-iters and --train-iters set the
    learning-rate schedule, continued from the checkpoint's step (Megatron-LM's
    --override-opt_param-scheduler); without it the checkpoint's schedule continues."""

    def __post_init__(self):
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"--save-interval must be >= 1, got {self.save_interval}")
        check_output_dir("--save", self.save)  # before any work, not at the first save
        check_output_dir("--save-hf", self.save_hf)
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ValueError(f"--max-position-embeddings must be >= 1, got "
                             f"{self.max_position_embeddings}")

    def check_positions(self, seq_length: int) -> None:
        """--seq-length within the --load-hf checkpoint's positions (or the raised
        --max-position-embeddings): ValueError naming both otherwise."""
        if not self.load_hf:
            if self.max_position_embeddings is not None:
                raise ValueError("--max-position-embeddings applies to --load-hf (a checkpoint's "
                                 "trained positions); a model from --model has none")
            return
        from megatron_chunkflow.mcore.hf import hf_max_positions

        trained = hf_max_positions(self.load_hf)
        allowed = self.max_position_embeddings or trained
        if allowed is not None and seq_length > allowed:
            where = (f"--max-position-embeddings {allowed}" if self.max_position_embeddings
                     else f"the --load-hf checkpoint's max_position_embeddings {allowed} "
                          f"({self.load_hf}/config.json)")
            raise ValueError(f"--seq-length {seq_length} is past {where}: the model was not "
                             "trained on those positions. Give --seq-length <= "
                             f"{allowed}, or --max-position-embeddings {seq_length} to train "
                             "past them (Megatron-LM asks the same)")


@dataclass(frozen=True)
class TrainSettings:
    """One training run: what to train, on which data order, with which system and layout.
    Every rule that ties two of its flags together is checked here (ValueError naming both)."""

    shape: ModelShape
    model_name: str
    system: System = "chunkflow"  # a stock baseline: Megatron's own schedule, whole sequences
    chunkflow: ChunkFlowConfig = field(default_factory=ChunkFlowConfig)  # attention for both
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # recompute included
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train_iters: int = 50
    global_batch_size: int = 16  # sequences per step
    seq_length: int = 32768  # the longest context; stock Megatron's micro-batch length
    seed: int = 1234
    exit_interval: int | None = None  # stop after this many steps of this run (0, None: off)
    dtype: DType = "float32"
    hf_shape: ModelShape | None = None  # the --load-hf checkpoint's shape (unpadded vocabulary)
    lora: LoRAConfig | None = None  # adapters only, the base frozen
    sparse: SparseConfig = field(default_factory=SparseConfig)  # SpaCO (approximate)
    device: Literal["cuda", "cpu"] = field(default_factory=lambda: default_device())
    # where the run trains: this machine's GPU if it has one (a memory trace, memtrace/, plays a
    # GPU on the meta device and says "cuda" on a CPU machine)
    fusions: bool = True  # on a GPU, Megatron's fused kernels that need no Transformer Engine
    # or Apex (bias-SwiGLU, bias-dropout-add) as Megatron-LM turns them on; CPU runs have none
    memory_check: bool = True  # on a GPU, refuse before step 1 a first step that does not fit
    # (memtrace/guard.py; --chunkflow-skip-memory-check)
    model_class: str = "auto"  # megatron-core's GPTModel or HybridModel (--model-class): "auto"
    # is the installed release's recommendation (compat.py), resolved here

    def __post_init__(self):
        from megatron_chunkflow import compat

        object.__setattr__(self, "model_class", compat.resolve_model_class(
            self.model_class, moe=self.shape.is_moe))
        for flag, value in (("--global-batch-size", self.global_batch_size),
                            ("--seq-length", self.seq_length), ("--train-iters", self.train_iters)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed must be in [0, 2**32), got {self.seed}")
        if self.exit_interval is not None and self.exit_interval < 0:
            raise ValueError(f"--exit-interval must be >= 0 (0: off), got {self.exit_interval}")
        if not 0 <= self.optimizer.lr_warmup_iters < self.train_iters:
            raise ValueError(f"--lr-warmup-iters {self.optimizer.lr_warmup_iters} must be in [0, "
                             f"--train-iters {self.train_iters})")
        self.parallel.check_model(self.shape)
        c = self.chunkflow.chunk_size
        if self.uses_chunkflow:
            if c > self.seq_length:
                raise ValueError(f"--chunk-size {c} is larger than --seq-length "
                                 f"{self.seq_length}")
            self.parallel.check_chunk_size(c)
        if self.uses_chunkflow:
            self.chunkflow.check_context_parallel_flags(self.parallel.cp,
                                                        "--context-parallel-size (--cp)")
        if self.parallel.cp > 1:
            self._check_context_parallel()
        p = self.parallel
        experts_span_dp = (p.tp * p.cp) % (p.expert_tp * p.ep) != 0  # beyond one replica
        if self.sparse.enabled and experts_span_dp:
            raise ValueError(f"--chunkflow-sparse-backward with --expert-model-parallel-size "
                             f"{p.ep} across data-parallel ranks: the chunks it leaves out of "
                             "backward would put the expert group's all-to-alls out of step")
        if not self.uses_chunkflow and experts_span_dp:
            # an expert group over DP ranks: every rank must run as many micro-batches, which the
            # stock baselines' packing does not give (observed: the all-to-all waits forever)
            raise ValueError(f"--expert-model-parallel-size {p.ep} with --no-chunkflow: the expert "
                             "group spans data-parallel ranks, whose stock micro-batch counts "
                             "differ, and its all-to-all needs them in step; keep EP x expert TP "
                             f"within TP x CP = {p.tp * p.cp}, or train with ChunkFlow")
        if (self.parallel.vpp > 1 and self.parallel.pp == 2 and not self.uses_chunkflow
                and self.system != "megatron-sft"):
            # core_v0.16.1's interleaved schedule exchanges variable shapes with both neighbours
            # in one batch; at PP = 2 they are one rank and the two shapes cross (observed: a
            # stage receives another micro-batch's activations)
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank {self.parallel.vpp} at "
                             f"--pipeline-model-parallel-size 2 with --baseline {self.system}: "
                             "Megatron's interleaved schedule (core_v0.16.1) mixes up variable "
                             "micro-batch shapes when both pipeline neighbours are one rank; use "
                             "--baseline megatron-sft (fixed --seq-length shapes) or PP >= 3")
        self.sparse.check(-(-self.seq_length // c), self.uses_chunkflow,
                          f" (--seq-length {self.seq_length} / --chunk-size {c})")
        if self.dtype == "bfloat16" and self.device != "cuda":
            raise ValueError("--dtype bfloat16 needs a GPU; CPU runs train in float32 (or "
                             "--dtype float64)")
        if self.uses_chunkflow:
            self._check_attention_backend(self.device)

    def _check_attention_backend(self, device: str) -> None:
        """The chunk attention kernel can train these chunks here (attention/backends.py)."""
        import torch

        from megatron_chunkflow.attention.trainable import check_trainable, device_memory_bytes

        check_trainable(self.chunkflow.attention_backend, device, getattr(torch, self.dtype),
                        "--attention-backend",
                        heads=self.shape.num_attention_heads // self.parallel.tp,
                        chunk=self.chunkflow.chunk_size // self.parallel.cp,
                        keys=self.seq_length, memory_bytes=device_memory_bytes(device))

    def _check_context_parallel(self) -> None:
        cp = f"--context-parallel-size {self.parallel.cp}"
        if not self.uses_chunkflow:
            raise ValueError(f"{cp} with --no-chunkflow: the stock path here runs "
                             "megatron-core's local attention, which has no context parallelism "
                             "(Transformer Engine's has: run stock CP through Megatron-LM's "
                             "pretrain_gpt.py)")
        from megatron_chunkflow.attention.backends import check_context_parallel

        check_context_parallel(self.chunkflow.attention_backend, self.device)
        for flag, given in (("--lora-rank", self.lora is not None),
                            ("--chunkflow-sparse-backward", self.sparse.enabled)):
            if given:
                raise ValueError(f"{flag} is not checked with {cp} yet (chunkflow verify "
                                 "refuses the pair too); give --context-parallel-size 1")

    @staticmethod
    def system_of(chunkflow: bool, baseline: str | None) -> System:
        """--chunkflow/--no-chunkflow and --baseline as one system name."""
        if chunkflow and baseline:
            raise ValueError(f"--baseline {baseline} names a stock path: add --no-chunkflow")
        return "chunkflow" if chunkflow else baseline or "megatron-packed"

    @property
    def uses_chunkflow(self) -> bool:
        return self.system == "chunkflow"

    @property
    def distributed_optimizer(self) -> bool:
        """Megatron's distributed optimizer (fp32 master weights and Adam's states sharded over
        DP x CP) on a GPU, as the shipped Megatron-LM jobs run it (--use-distributed-optimizer)
        and the simulator plans; CPU runs keep them whole (megatron-core's distributed optimizer
        takes CUDA tensors only), which is the same memory at DP x CP = 1."""
        return self.device == "cuda"

    @property
    def real_vocab_size(self) -> int:
        """The vocabulary the loss is taken over: the checkpoint's, without the rows Megatron pads
        (runtime/loss.py masks them; Megatron-LM keeps them in the softmax)."""
        return (self.hf_shape or self.shape).vocab_size


def add_model_class_argument(group) -> None:
    """--model-class, for the commands that build the model (train, verify)."""
    group.add_argument("--model-class", choices=("auto", "gpt", "hybrid"), default="auto",
                       help="megatron-core's model class: GPTModel, or HybridModel (0.18 on: the "
                            "same transformer as an attention layer and an MLP layer per layer) "
                            "(default auto: what the installed megatron-core recommends, "
                            "HybridModel from 0.19, which deprecates GPTModel; resuming, the "
                            "checkpoint's)")


def default_device() -> str:
    """"cuda" on a machine with a GPU, else "cpu"."""
    from megatron_chunkflow.mcore.cpu import has_real_cuda

    return "cuda" if has_real_cuda() else "cpu"


def model_of(model: str, model_config: str | None, load_hf: str | None,
             tp: int) -> tuple[ModelShape, ModelShape | None, str]:
    """(the shape to build, the --load-hf checkpoint's own shape or None, the model's name) of
    --model, --model-config or --load-hf (config.json sets the model; Megatron's vocabulary is
    padded for TP)."""
    if load_hf:
        import dataclasses

        from megatron_chunkflow.mcore.hf import (
            check_hf_checkpoint,
            padded_vocab_size,
            shape_from_hf_dir,
        )

        hf = shape_from_hf_dir(load_hf)
        check_hf_checkpoint(load_hf, hf)  # damaged weights named before any work
        return dataclasses.replace(hf, vocab_size=padded_vocab_size(hf.vocab_size, tp)), hf, load_hf
    from megatron_chunkflow.core.hf_config import load_model_shape

    shape = load_model_shape(model, model_config)
    if shape.vocab_size % tp:  # TP splits the output layer's rows: padded as Megatron-LM pads,
        import dataclasses  # the padded rows masked out of the loss (real_vocab_size)

        from megatron_chunkflow.mcore.hf import padded_vocab_size

        padded = dataclasses.replace(shape, vocab_size=padded_vocab_size(shape.vocab_size, tp))
        return padded, shape, model_config or model
    return shape, None, model_config or model
