"""`chunkflow simulate`'s result without its report: each stock baseline on its fastest fitting
layout against ChunkFlow on its own, on one device (cli/simulate.py prints it).

Besides the searched predictions: where ChunkFlow's loss runs in token pieces, the stock baselines
again with the same pieces (Megatron's per-sample CP runs Transformer Engine's path: as shipped
only), so the gain is attributed honestly; and every stock prediction again at CP overlap 0 and 1
(Hardware.cp_overlap's range, the layout searched again where it was searched), ChunkFlow's kept
(its CP does not overlap the way the stock ring does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.hybrid_cp import BASELINE as HYBRID
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.perfmodel.hardware import Hardware
from megatron_chunkflow.perfmodel.hybrid_cp import best_hybrid_cp
from megatron_chunkflow.perfmodel.predict import Prediction
from megatron_chunkflow.perfmodel.search import best_chunkflow, best_megatron

CP_OVERLAP_ENDS = (0.0, 1.0)


def speedup_of(stock: Prediction, cf: Prediction) -> float | None:
    """Stock step time over ChunkFlow's, None unless both fit."""
    return stock.step_s / cf.step_s if stock.fits and cf.fits else None


@dataclass
class Comparison:
    """Every named stock baseline's prediction against ChunkFlow's (module docstring)."""

    baselines: dict[str, Prediction]
    chunkflow: Prediction
    same_loss: dict[str, Prediction]  # the stock baselines given ChunkFlow's loss pieces
    cp_overlap_ends: dict[str, dict]  # "0" / "1" -> baseline -> step_s, speedup, layout, fits

    @property
    def speedups(self) -> dict[str, float | None]:
        return {n: speedup_of(p, self.chunkflow) for n, p in self.baselines.items()}

    @property
    def speedups_same_loss(self) -> dict[str, float | None]:
        return {n: speedup_of(p, self.chunkflow) for n, p in self.same_loss.items()}

    @property
    def ratios(self) -> dict[str, float]:
        """Step-time ratios, fitting or not."""
        return {n: p.step_s / self.chunkflow.step_s for n, p in self.baselines.items()}

    @property
    def strongest(self) -> str | None:
        """The fastest stock baseline that fits."""
        fitting = [n for n, p in self.baselines.items() if p.fits]
        return min(fitting, key=lambda n: self.baselines[n].step_s) if fitting else None


def compare(lengths: Sequence[int], shape: ModelShape, hw: Hardware, gpus: int, seq_length: int,
            names: Sequence[str], cp_groups: Callable, *,
            megatron_layout: ParallelConfig | None = None,
            chunkflow_layout: ParallelConfig | None = None, chunk_size: int = 8192,
            num_kept: int = 1, auto_chunking: bool = False, cp_kv: str | None = None,
            cp_placement: str = "hybrid", reforward: str | None = None,
            loss_piece: int | None = 0, max_seqlen: int | None = None) -> Comparison:
    """Search each of `names` (core/step.py BASELINES and megatron-hybrid-cp, whose scheduler
    groups `cp_groups` gives) and ChunkFlow on `gpus` GPUs of `hw` (perfmodel/search.py: a given
    layout is kept, None searches); ValueError naming the baseline that cannot run."""

    def stock(name: str, device: Hardware, piece: int = 0) -> Prediction:
        try:
            if name == HYBRID:
                return best_hybrid_cp(lengths, shape, device, gpus, cp_groups, megatron_layout,
                                      max_seqlen)
            return best_megatron(lengths, shape, device, gpus, seq_length, megatron_layout,
                                 name, piece)
        except ValueError as e:
            raise ValueError(f"--baseline {name}: {e}") from None

    baselines = {name: stock(name, hw) for name in names}
    cf = best_chunkflow(lengths, shape, hw, gpus, seq_length, chunkflow_layout, chunk_size,
                        num_kept, auto_chunking=auto_chunking, cp_kv=cp_kv,
                        cp_placement=cp_placement, reforward=reforward, loss_piece=loss_piece)
    same_loss = ({name: stock(name, hw, cf.loss_piece) for name in names if name != HYBRID}
                 if cf.loss_piece else {})
    ends = {}
    for end in CP_OVERLAP_ENDS:
        device = dataclasses.replace(hw, cp_overlap=end)
        again = {n: baselines[n] if end == hw.cp_overlap else stock(n, device) for n in names}
        ends[f"{end:g}"] = {n: {"step_s": p.step_s, "speedup": speedup_of(p, cf),
                                "layout": p.layout.to_json(), "fits": p.fits}
                            for n, p in again.items()}
    return Comparison(baselines, cf, same_loss, ends)
