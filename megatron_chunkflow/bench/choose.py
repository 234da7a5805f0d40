"""What each system of `chunkflow bench` runs with, decided by the memory budget as a user would.

For every stock baseline, Megatron's recompute option (perfmodel/budget.py: choose_recompute); for
ChunkFlow its (chunk size, K) and the recompute option inside its chunks (choose_chunking). The
modelled peaks come from bytes per token measured on probe micro-batches under every option
(bench/systems.py: probe_rates, the exact meter); the times from the simulator's CPU device
fitted to this machine (bench/calibrate.py). `--megatron-recompute`, `--chunkflow-recompute`,
`--chunk-size` and `--chunkflow-k` fix a choice instead.

Also here: the FLOPs each configuration re-runs in a step (recompute_flops), for the report's
"where the time goes".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_chunkflow.config import ParallelConfig, Recompute
from megatron_chunkflow.core.costs import (
    attention_flops_per_pair_per_layer,
    chunk_attention_pairs,
    chunk_flops,
)
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.schedule import is_reforwarded
from megatron_chunkflow.core.step import baseline_microbatches
from megatron_chunkflow.core.types import DataChunk
from megatron_chunkflow.perfmodel.budget import (
    ActivationRates,
    Choice,
    choose_chunking,
    choose_recompute,
)
from megatron_chunkflow.perfmodel.predict import predict_chunkflow, predict_megatron


@dataclass(frozen=True)
class Plan:
    """One system's configuration: its recompute option and, for ChunkFlow, (C, K)."""

    name: str  # "chunkflow" or a baseline
    choice: Choice

    @property
    def recompute(self) -> Recompute:
        return self.choice.recompute


def menu(s, forced: str) -> list[Recompute]:
    """The recompute options to consider: the whole menu for `auto`, else the one given."""
    if forced != "auto":
        return [Recompute.parse(forced)]
    return Recompute.menu(s.shape.num_layers // s.parallel.pp)


def choose_all(s, dp: int, rates: ActivationRates, hw) -> tuple[dict[str, Plan], dict[str, str]]:
    """Every system's configuration (the same on every rank: deterministic in its inputs), and
    for each baseline that no option fits, why. ValueError when ChunkFlow does not fit, or no
    baseline does."""
    layout = ParallelConfig.layout(tp=s.parallel.tp, cp=1, pp=s.parallel.pp, dp=dp)
    out, unfit = {}, {}
    for baseline in s.baselines:
        def predict(option, baseline=baseline):
            lay = dataclasses.replace(layout, recompute=option)
            return predict_megatron(s.lengths, s.shape, hw, lay, s.seq_length, baseline).step_s

        try:
            out[baseline] = Plan(baseline, choose_recompute(
                s.lengths, s.seq_length, dp, s.shape, rates, s.budget_bytes, predict,
                menu(s, s.megatron_recompute), baseline))
        except ValueError as e:
            unfit[baseline] = str(e)
    if not out:
        raise ValueError("; ".join(unfit.values()))

    def predict_cf(c, num_kept, option):
        lay = dataclasses.replace(layout, recompute=option)
        return predict_chunkflow(s.lengths, s.shape, hw, lay, c, num_kept).step_s

    out["chunkflow"] = Plan("chunkflow", choose_chunking(
        s.lengths, s.seq_length, dp, s.shape, rates, s.chunkflow_budget, predict_cf,
        sizes=[s.chunk_size] if s.chunk_size else None,
        kept_counts=(s.num_kept,) if s.num_kept else None,
        options=menu(s, s.chunkflow_recompute)))
    return out, unfit


def _rerun_per_layer(chunk: DataChunk, shape: ModelShape, option: Recompute) -> float:
    """FLOPs one layer re-runs for `chunk` in its backward under a selective option."""
    tokens, h, f = chunk.computed_tokens, shape.hidden_size, shape.ffn_hidden_size
    out = 0.0
    if "core_attn" in option.modules:
        out += chunk_attention_pairs(chunk) * attention_flops_per_pair_per_layer(shape)
    if "mlp" in option.modules:
        out += tokens * 2 * 3 * h * f
    return out  # layernorm: memory traffic, no FLOPs


def recompute_flops(name: str, lengths: Sequence[int], shape: ModelShape, seq_length: int,
                    dp: int, pp: int, plan: Plan) -> float:
    """FLOPs re-run in one step: Megatron's recompute inside every micro-batch or chunk (full:
    every layer's forward; block N: N layers per stage; selective: the modules' forwards) and
    ChunkFlow's re-forwards (the whole stage, logits included) of every dependent chunk but the
    last K of its sequence."""
    option = plan.recompute
    if name == "chunkflow":
        choice = plan.choice
        chunks = build_chunks(lengths, choice.chunk_size, dp, choice.num_kept, shape).chunks
        out = sum(chunk_flops(c, shape).forward(shape.num_layers) for c in chunks
                  if is_reforwarded(c, plan.choice.num_kept))
    else:
        chunks = baseline_microbatches(lengths, seq_length, dp, name)
        out = 0.0
    layers = {"full": shape.num_layers, "block": option.num_layers * pp}.get(option.kind, 0)
    for c in chunks:
        if layers:
            out += chunk_flops(c, shape).per_layer * layers
        elif option.kind == "selective":
            out += _rerun_per_layer(c, shape, option) * shape.num_layers
    return out
