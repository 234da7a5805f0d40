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
import time
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
            loss_piece: int | None = 0, max_seqlen: int | None = None,
            progress: Callable[[str], None] | None = None,
            overlap_ends: bool = True) -> Comparison:
    """Search each of `names` (core/step.py BASELINES and megatron-hybrid-cp, whose scheduler
    groups `cp_groups` gives) and ChunkFlow on `gpus` GPUs of `hw` (perfmodel/search.py: a given
    layout is kept, None searches); ValueError naming the baseline that cannot run. `progress`
    is told each search as it starts and what it found, with its time (a 72B search at 256K on
    128 GPUs takes minutes). `overlap_ends=False` leaves out the stock searches again at CP
    overlap 0 and 1 (the gain map's cells: cp_overlap_ends then holds the device's value only)."""
    say = progress or (lambda text: None)

    def timed(what: str, searched: bool, find: Callable[[], Prediction]) -> Prediction:
        if not searched:
            return find()
        say(f"searching {what} ...")
        start = time.perf_counter()
        p = find()
        say(f"  {what}: {p.layout.describe()}"
            + (f", C={p.chunk_size} K={p.num_kept}" if p.system == "chunkflow" else "")
            + f", {p.step_s:.2f} s a step, {'fits' if p.fits else 'does not fit'} "
              f"({time.perf_counter() - start:.0f} s)")
        return p

    def stock(name: str, device: Hardware, piece: int = 0) -> Prediction:
        try:
            if name == HYBRID:
                return best_hybrid_cp(lengths, shape, device, gpus, cp_groups, megatron_layout,
                                      max_seqlen)
            return best_megatron(lengths, shape, device, gpus, seq_length, megatron_layout,
                                 name, piece)
        except ValueError as e:
            raise ValueError(f"--baseline {name}: {e}") from None

    stock_searched = megatron_layout is None
    baselines = {name: timed(f"{name}'s layouts and recompute", stock_searched,
                             lambda name=name: stock(name, hw)) for name in names}
    cf = timed("ChunkFlow's layouts, recompute, chunk size, K and re-forward"
               if auto_chunking else "ChunkFlow's layouts and recompute",
               chunkflow_layout is None or auto_chunking,
               lambda: best_chunkflow(lengths, shape, hw, gpus, seq_length, chunkflow_layout,
                                      chunk_size, num_kept, auto_chunking=auto_chunking,
                                      cp_kv=cp_kv, cp_placement=cp_placement,
                                      reforward=reforward, loss_piece=loss_piece))
    same_loss = ({name: timed(f"{name} with the loss in pieces of {cf.loss_piece}",
                              stock_searched, lambda name=name: stock(name, hw, cf.loss_piece))
                  for name in names if name != HYBRID} if cf.loss_piece else {})
    ends = {}
    for end in CP_OVERLAP_ENDS if overlap_ends else (hw.cp_overlap,):
        device = dataclasses.replace(hw, cp_overlap=end)
        again = {n: baselines[n] if end == hw.cp_overlap else
                 timed(f"{n} at CP overlap {end:g}", stock_searched,
                       lambda n=n: stock(n, device)) for n in names}
        ends[f"{end:g}"] = {n: {"step_s": p.step_s, "speedup": speedup_of(p, cf),
                                "layout": p.layout.to_json(), "fits": p.fits}
                            for n, p in again.items()}
    return Comparison(baselines, cf, same_loss, ends)


HELPS = 1.05  # a predicted gain below the simulator's measured time error (4%) is no gain


def _parts(p: Prediction) -> dict[str, float]:
    """A predicted step in seconds: compute on the slowest rank (recompute, re-forwards, CP
    traffic and padding included), its pipeline bubbles, and the step's end (the exposed
    gradient reduce-scatter and parameter all-gather, the optimizer)."""
    return {"compute": p.pipeline_s * (1 - p.bubble), "bubbles": p.pipeline_s * p.bubble,
            "step end": p.step_s - p.pipeline_s}


def _compute_notes(cf: Prediction, stock: Prediction) -> str:
    """What the two steps' compute differs in, as the predictions record it."""
    notes = []
    if cf.recompute_chunks:
        notes.append(f"ChunkFlow re-forwards {cf.recompute_chunks} of {cf.num_microbatches} "
                     "chunks")
    if str(cf.layout.recompute) != str(stock.layout.recompute):
        notes.append(f"recompute {cf.layout.recompute} against {stock.layout.recompute}")
    if cf.layout.cp != stock.layout.cp:
        notes.append(f"CP {cf.layout.cp} against {stock.layout.cp}")
    if cf.layout.tp != stock.layout.tp:
        notes.append(f"TP {cf.layout.tp} against {stock.layout.tp}")
    if abs(cf.padding_fraction - stock.padding_fraction) > 0.005:
        notes.append(f"padding {cf.padding_fraction:.1%} against {stock.padding_fraction:.1%}")
    return "; ".join(notes) or "the same work on another layout"


def cause(cf: Prediction, stock: Prediction, name: str) -> str:
    """Where the two steps differ, in seconds, the largest difference first: compute (with what
    it differs in: re-forwards, recompute, CP traffic, TP, padding), pipeline bubbles, and the
    step's end (the exposed gradient reduce-scatter and parameter all-gather, the optimizer)."""
    a, b = _parts(cf), _parts(stock)
    notes = {"compute": _compute_notes(cf, stock),
             "bubbles": f"{cf.bubble:.1%} of the pipeline against {stock.bubble:.1%}",
             "step end": "gradient reduce-scatter, parameter all-gather, optimizer"}
    order = sorted(a, key=lambda k: -abs(a[k] - b[k]))
    return (f"per step, ChunkFlow against {name}: "
            + ", ".join(f"{k} {a[k] - b[k]:+.2f} s ({notes[k]})" for k in order))


def _plan(p: Prediction) -> str:
    text = f"--{'chunkflow' if p.system == 'chunkflow' else 'megatron'}-parallel " \
           f"{p.layout.to_flag()}"
    if p.system == "chunkflow":
        text += f" --chunk-size {p.chunk_size} --chunkflow-k {p.num_kept}"
        if p.reforward_attention != "recompute":
            text += f" --chunkflow-reforward-attention {p.reforward_attention}"
        if p.layout.cp > 1:
            text += f" --chunkflow-cp-kv {p.cp_kv}"
        if p.loss_piece:
            text += f" --chunkflow-loss-piece {p.loss_piece}"
    if p.max_seqlen_per_rank:
        text += f" --max-seqlen-per-dp-cp-rank {p.max_seqlen_per_rank}"
    return text


def verdict(result: Comparison, gpus: int) -> dict:
    """Whether ChunkFlow helps on this job, in a line a user can act on: the speedup against
    the strongest stock baseline that fits, the plan to run, and where the steps differ
    (cause()). JSON:
    helps (True, False, or None when nothing fits), against, speedup, cause, text."""
    cf, name = result.chunkflow, result.strongest
    if name is None:
        if not cf.fits:
            text = (f"nothing fits on {gpus} GPUs: ChunkFlow's best plan needs "
                    f"{cf.peak_mem_bytes / 2**30:.1f} GiB of {cf.usable_bytes / 2**30:.1f} "
                    "(more GPUs, a smaller --seq-length, or a larger device)")
            return {"helps": None, "against": None, "speedup": None, "cause": None,
                    "text": text}
        return {"helps": True, "against": None, "speedup": None,
                "cause": "no stock baseline fits",
                "text": f"ChunkFlow helps here: no stock baseline fits on {gpus} GPUs; "
                        f"ChunkFlow's plan {_plan(cf)} does"}
    stock = result.baselines[name]
    if not cf.fits:
        return {"helps": False, "against": name, "speedup": None,
                "cause": "ChunkFlow does not fit",
                "text": f"ChunkFlow does not help here: its plan does not fit on {gpus} GPUs; "
                        f"run {name} with {_plan(stock)}"}
    x = stock.step_s / cf.step_s
    why = cause(cf, stock, name)
    if x >= HELPS:
        text = (f"ChunkFlow helps here: {x:.2f}x against {name}, the strongest stock baseline "
                f"that fits; run {_plan(cf)}. {why[0].upper()}{why[1:]}")
    else:
        within = ", inside the simulator's 4% time error" if x > 2 - HELPS else ""
        text = (f"ChunkFlow does not help here: {x:.2f}x against {name}{within}; run {name} "
                f"with {_plan(stock)}, or ChunkFlow's plan {_plan(cf)}. "
                f"{why[0].upper()}{why[1:]}")
    return {"helps": x >= HELPS, "against": name, "speedup": x, "cause": why, "text": text}
