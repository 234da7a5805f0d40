"""Per-stage timeline pictures of simulated plans (matplotlib, imported only when drawing)."""

from __future__ import annotations

from megatron_chunkflow.core.simulate import SimResult
from megatron_chunkflow.core.types import StagePlan

COLORS = {"F": "#4c78a8", "F0": "#a9c4e4", "R": "#f58518", "B": "#54a24b"}
LABELS = {"F": "forward (keeps activations)", "F0": "forward without graph (state only)",
          "R": "re-forward", "B": "backward"}


def draw_timelines(path: str, panels: list[tuple[str, SimResult, StagePlan]]) -> None:
    """One panel per (title, simulation, plan), on a shared time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    end = max(sim.step_time for _, sim, _ in panels) or 1.0
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + 0.6 * sum(
        sim and len(sim.busy) for _, sim, _ in panels)), sharex=True, squeeze=False)
    for ax, (title, sim, plan) in zip(axes[:, 0], panels):
        p = len(sim.timeline)
        for s, ops in enumerate(sim.timeline):
            recomputed = {t.op.chunk for t in ops if t.op.kind == "R"}
            by_kind: dict[str, list] = {}
            for t in ops:
                kind = "F0" if t.op.kind == "F" and t.op.chunk in recomputed else t.op.kind
                by_kind.setdefault(kind, []).append((t.start / end, (t.end - t.start) / end))
            for kind, spans in by_kind.items():
                ax.broken_barh(spans, (p - 1 - s + 0.1, 0.8), facecolors=COLORS[kind],
                               edgecolor="white", linewidth=0.2)
        ax.set_yticks([p - 1 - s + 0.5 for s in range(p)], [f"stage {s}" for s in range(p)])
        ax.set_ylim(0, p)
        ax.set_title(f"{title}: bubble {sim.bubble_ratio:.1%}", fontsize=10, loc="left")
    axes[-1, 0].set_xlim(0, 1.0)
    axes[-1, 0].set_xlabel("time (fraction of the slower plan's step)")
    fig.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
