"""The settings of one `chunkflow train` run, composed of the configs of the parts they drive.

    TrainSettings(shape=..., model_name=..., chunkflow=ChunkFlowConfig(chunk_size=1024),
                  parallel=ParallelConfig(pp=2), optimizer=OptimizerConfig(lr=1e-3))

ChunkFlowConfig and ParallelConfig (config.py), OptimizerConfig (here), CheckpointConfig
(training/checkpoint.py), LoRAConfig (mcore/lora.py) and SparseConfig (runtime/sparse.py) are
each carried whole to the code that uses them; the command line derives its flags from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig, Recompute
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.runtime.sparse import SparseConfig
from megatron_chunkflow.training.checkpoint import CheckpointConfig
from megatron_chunkflow.mcore.lora import LoRAConfig

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


@dataclass(frozen=True)
class TrainSettings:
    """One training run: what to train, on which data order, with which system and layout."""

    shape: ModelShape
    model_name: str
    system: System = "chunkflow"  # a stock baseline: Megatron's own schedule, whole sequences
    chunkflow: ChunkFlowConfig = field(default_factory=ChunkFlowConfig)  # attention for both
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train_iters: int = 50
    global_batch_size: int = 16  # sequences per step
    seq_length: int = 32768  # the longest context; stock Megatron's micro-batch length
    seed: int = 1234
    exit_interval: int | None = None  # stop after this many steps of this run (Megatron-LM's)
    dtype: DType = "float32"
    recompute: Recompute = field(default_factory=Recompute)  # Megatron's, inside each
    # micro-batch or chunk
    hf_shape: ModelShape | None = None  # the --load-hf checkpoint's shape (unpadded vocabulary)
    lora: LoRAConfig | None = None  # adapters only, the base frozen
    sparse: SparseConfig = field(default_factory=SparseConfig)  # SpaCO (approximate)

    @property
    def uses_chunkflow(self) -> bool:
        return self.system == "chunkflow"

    @property
    def real_vocab_size(self) -> int:
        """The vocabulary the loss is taken over: the checkpoint's, without the rows Megatron pads
        (runtime/loss.py masks them; Megatron-LM keeps them in the softmax)."""
        return (self.hf_shape or self.shape).vocab_size
