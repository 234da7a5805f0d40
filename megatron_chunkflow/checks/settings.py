"""VerifySettings: one `chunkflow verify` run, what it checks on which batches and layout. Every
rule that ties two of its flags together is checked here, before any process group starts
(ValueError naming the flags).

Modes: "exact" (chunked against unchunked megatron-core, checks/verify.py), "hf" (against
transformers, checks/hf_verify.py), "memory" and "memory_cp" (activation and K/V bytes of one
sequence per --lengths value, checks/memory.py), "sparse" (SpaCO's mean gradient against the exact
one, checks/sparse_verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.lengths import LengthsConfig
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.mcore.lora import LoRAConfig
from megatron_chunkflow.runtime.sparse import SparseConfig

MEMORY_MAX_LENGTH = 1 << 20  # each --lengths value runs through the real model on this machine
DEFAULT_DRAWS = 16


@dataclass(frozen=True)
class VerifySettings:
    """One verify run (cli/verify.py fills it from the flags)."""

    shape: ModelShape
    lengths: LengthsConfig
    chunkflow: ChunkFlowConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: Literal["float64", "float32"] = "float64"
    steps: int = 1  # training steps to check, each a new batch
    lora: LoRAConfig | None = None
    sparse: SparseConfig = field(default_factory=SparseConfig)
    draws: int | None = None  # SpaCO draws to average (DEFAULT_DRAWS with sparse)
    memory: str | None = None  # --lengths of the memory check, comma-separated; None: no check
    hf_reference: str | None = None  # a Hugging Face checkpoint directory
    default_batch: int = 32  # sequences a profile draws without --global-batch-size
    model_class: str = "auto"  # --model-class, resolved here (compat.resolve_model_class)

    def __post_init__(self):
        from megatron_chunkflow import compat

        if self.lora is not None and self.hf_reference:
            raise ValueError("--lora-rank cannot be combined with --hf-reference")
        if self.hf_reference:  # the checkpoint's config.json is the model (its layout checks)
            from megatron_chunkflow.mcore.hf import shape_from_hf_dir

            object.__setattr__(self, "shape", shape_from_hf_dir(self.hf_reference))
        object.__setattr__(self, "model_class", compat.resolve_model_class(
            self.model_class, moe=self.shape.is_moe))
        p = self.parallel
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        p.check_chunk_size(self.chunkflow.chunk_size)
        p.check_model(self.shape)
        if self.memory is not None:
            self.memory_lengths  # bad input stops before any process group starts
            if p.tp > 1 or p.pp > 1:
                raise ValueError("--memory measures at TP = PP = 1 (with --cp N: under torchrun "
                                 "with N processes)")
        if p.cp > 1:
            self._check_context_parallel()
        if self.sparse.enabled:
            if self.draws is None:
                object.__setattr__(self, "draws", DEFAULT_DRAWS)
            self._check_sparse()
        elif self.draws is not None:
            raise ValueError("--draws needs --chunkflow-sparse-backward")

    def _check_context_parallel(self) -> None:
        from megatron_chunkflow.attention.backends import check_context_parallel

        check_context_parallel(self.chunkflow.attention_backend, "cpu")  # verify runs on the CPU
        for flag, given in (("--lora-rank", self.lora is not None),
                            ("--chunkflow-sparse-backward", self.sparse.enabled)):
            if given:
                raise ValueError(f"{flag} is not checked with --context-parallel-size "
                                 f"{self.parallel.cp} yet; give --context-parallel-size 1")

    def _check_sparse(self) -> None:
        """--chunkflow-sparse-backward T: one batch, checked against the exact gradient, T below
        its longest sequence's chunk count; no --memory or --hf-reference."""
        for flag, given in (("--memory", self.memory is not None),
                            ("--hf-reference", self.hf_reference)):
            if given:
                raise ValueError(f"--chunkflow-sparse-backward cannot be combined with {flag}")
        if self.steps != 1:
            raise ValueError("--chunkflow-sparse-backward checks one batch; --steps must be 1, "
                             f"got {self.steps}")
        if self.draws < 2:
            raise ValueError(f"--draws must be >= 2 (the variance needs two draws), got "
                             f"{self.draws}")
        longest = max(self.step_lengths()[0][0])
        c = self.chunkflow.chunk_size
        self.sparse.check(-(-longest // c),
                          what=f" in this batch (longest {longest} tokens, --chunk-size {c})")

    @property
    def mode(self) -> str:
        if self.hf_reference:
            return "hf"
        if self.memory is not None:
            return "memory_cp" if self.parallel.cp > 1 else "memory"
        return "sparse" if self.sparse.enabled else "exact"

    @property
    def memory_lengths(self) -> list[int]:
        """--lengths as numbers (ValueError naming the flag)."""
        text = self.memory or ""
        try:
            lengths = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--lengths {text!r}: expected comma-separated integers") from None
        if not lengths or min(lengths) < 1:
            raise ValueError(f"--lengths {text!r}: lengths must be positive")
        if max(lengths) > MEMORY_MAX_LENGTH:
            raise ValueError(f"--lengths {text!r}: {max(lengths):,} tokens is more than the "
                             f"{MEMORY_MAX_LENGTH:,} the memory check runs")
        return lengths

    def step_lengths(self) -> tuple[list[list[int]], str]:
        """One list of lengths per step (a lengths file repeats; a profile draws --step, --step
        + 1, ..., each with --min-long sequences longer than the chunk size), and where they
        came from."""
        steps, source = [], ""
        for i in range(self.steps):
            lengths, source_i = self.lengths.lengths(self.default_batch,
                                                     self.chunkflow.chunk_size, i)
            steps.append(lengths)
            source = source or source_i
        return steps, source + (f", {self.steps} steps" if self.steps > 1 else "")
