"""`chunkflow bench` output: the side-by-side table and the plots (matplotlib, imported to draw)."""

from __future__ import annotations

import os

MIB = 2.0**20


def report_lines(r: dict) -> list[str]:
    """The human report: setup, one column per system, ChunkFlow against each baseline."""
    cf, st = r["chunkflow"], r["setup"]
    sh, lay = st["shape"], st["layout"]
    names = list(r["baselines"]) + ["chunkflow"]
    systems = [r["baselines"][b] for b in r["baselines"]] + [cf]
    lines = [
        f"model {st['model']} ({sh['num_layers']} layers, hidden {sh['hidden_size']}, "
        f"{sh['num_attention_heads']} heads / {sh['num_query_groups']} K/V groups, vocab "
        f"{sh['vocab_size']}); TP={lay['tp']} PP={lay['pp']} DP={lay['dp']} on {lay['world']} "
        f"processes x {st['threads_per_rank']} threads; {st['dtype']}, attention "
        f"{st['backend']} in every system",
        f"batch: {st['num_sequences']} sequences ({st.get('source', '')}), {st['tokens']:,} "
        f"tokens, longest {st['longest']:,}; --seq-length {st['seq_length']}",
        f"budget {st['budget_bytes'] / MIB:.0f} MiB of activations per rank"
        + (f" (ChunkFlow's: {st['chunkflow_budget_bytes'] / MIB:.0f} MiB)"
           if st["chunkflow_budget_bytes"] != st["budget_bytes"] else "")
        + "; recompute chosen: "
        + "; ".join(f"{n} {x['recompute']}" for n, x in zip(names, systems))
        + f"; ChunkFlow C={cf['chunk_size']} K={cf['k']}",
        "load average (1 min) at the start and after each round of steps: "
        + " ".join(f"{x:.1f}" for x in st["load_average_1min"])
        + f" on {os.cpu_count()} cores (other processes make times noisy)",
        f"simulator's cpu device: kernel rates and two timed probe micro-batches, measured "
        f"{len(st['calibrations'])} times (medians); dense work in the model takes "
        f"{st['model_fit']['dense_scale']:.2f}x the isolated kernels' time, plus "
        f"{st['model_fit']['op_overhead_s'] * 1e3:.1f} ms host time per op",
        "",
    ]
    width = 2 + max(19, *(len(n) for n in names), *(len(x["recompute"]) for x in systems))
    lines.append(f"{'':<34}" + "".join(f"{n:>{width}}" for n in names))

    def row(label, key, fmt):
        values = [key(x) if callable(key) else x[key] for x in systems]
        lines.append(f"{label:<34}" + "".join(f"{fmt(v):>{width}}" for v in values))

    n = len(cf["step_s_repeats"])
    row("recompute", "recompute", str)
    row(f"step time (s, median of {n})", "step_s", lambda x: f"{x:.2f}")
    row("tokens/s", "tokens_per_s", lambda x: f"{x:,.0f}")
    row("model TFLOP/s", "model_tflops", lambda x: f"{x:.4f}")
    row("peak activation memory (MiB)", "peak_activation_bytes", lambda x: f"{x / MIB:,.1f}")
    row("  per stage (MiB)", "peak_activation_bytes_per_stage",
        lambda x: "/".join(f"{v / MIB:.0f}" for v in x))
    row("  modelled by the budget (MiB)", "modelled_peak_activation_bytes",
        lambda x: f"{x / MIB:,.1f}")
    row("  of which K/V state (MiB)", lambda x: max(x["kv_state_bytes_per_stage"]),
        lambda x: f"{x / MIB:,.1f}")
    row("  recompute working set (MiB)", "recompute_working_set_bytes",
        lambda x: f"{x / MIB:,.1f}")
    row("peak RSS, process (MiB)", "peak_rss_bytes", lambda x: f"{x / MIB:,.0f}")
    row("bubble (measured)", "bubble", lambda x: f"{x:.1%}")
    row("recompute (FLOPs re-run / model)", "recompute_fraction", lambda x: f"{x:.1%}")
    row("GFLOP/s per rank while busy", "busy_flops_per_s", lambda x: f"{x / 1e9:.1f}")
    row("micro-batches / chunks", "num_microbatches", str)
    row("predicted step (s), simulator", "predicted_step_s", lambda x: f"{x:.2f}")
    row("  predicted / measured - 1", "prediction_error", lambda x: f"{x:+.0%}")
    row("predicted bubble", "predicted_bubble", lambda x: f"{x:.1%}")
    lines.append("")
    for b in r["baselines"]:
        f = r["speedup_factors_per_baseline"][b]
        lines.append(f"ChunkFlow vs {b}: {r['speedups'][b]:.2f}x faster (predicted "
                     f"{r['predicted_speedups'][b]:.2f}x), activation memory ratio "
                     f"{r['activation_memory_ratios'][b]:.2f}; where the time goes: less work "
                     f"(recompute) {f['work']:.2f}x * faster work while busy "
                     f"{f['busy_rate']:.2f}x * less idle (bubble) {f['utilization']:.2f}x * "
                     f"outside the pipeline {f['outside_pipeline']:.2f}x")
    for b, why in r.get("not_run", {}).items():
        lines.append(f"{b} not run: {why}")
    within = all(abs(x["prediction_error"]) <= 0.25 for x in systems)
    lines.append(f"simulator {'within' if within else 'NOT within'} 25% of every measured step "
                 "time")
    budgets = [st["budget_bytes"]] * (len(systems) - 1) + [st["chunkflow_budget_bytes"]]
    over = [n for n, x, b in zip(names, systems, budgets) if x["peak_activation_bytes"] > b]
    if over:
        lines.append(f"measured peak above the budget: {', '.join(over)}")
    return lines


def write_plots(r: dict, directory: str) -> list[str]:
    """throughput.png, memory.png and timelines.png (every system's measured per-op intervals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(r["baselines"]) + ["ChunkFlow"]
    systems = [r["baselines"][b] for b in r["baselines"]] + [r["chunkflow"]]
    colors = ["#c7c7c7", "#9d9d9d", "#6f6f6f"][:len(names) - 1] + ["#4c78a8"]
    paths = []

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.bar(names, [x["tokens_per_s"] for x in systems], color=colors)
    ax.bar(names, [r["setup"]["tokens"] / x["predicted_step_s"] for x in systems], fill=False,
           edgecolor="black", linestyle="--", label="simulator")
    ax.set_ylabel("tokens/s (measured; dashed: predicted)")
    ax.set_title("ChunkFlow's speedup:\n" + ", ".join(
        f"{v:.2f}x vs {b}" for b, v in r["speedups"].items()), fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    paths.append(_save(fig, plt, directory, "throughput.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = set()

    def once(label):
        if label in labels:
            return None
        labels.add(label)
        return label

    for i, x in enumerate(systems):  # parts at the worst stage's peak (bounded by their maxima)
        total = x["peak_activation_bytes"] / MIB
        state = min(max(x["kv_state_bytes_per_stage"]) / MIB, total)
        work = min(x["recompute_working_set_bytes"] / MIB, total - state)
        ax.bar(names[i], total - state - work, color=colors[i])
        ax.bar(names[i], work, bottom=total - state - work, color="#b279a2",
               label=once("recompute working set") if work else None)
        ax.bar(names[i], state, bottom=total - state, color="#f58518",
               label=once("K/V state") if state else None)
    ax.axhline(r["setup"]["budget_bytes"] / MIB, color="red", linestyle=":", label="budget")
    if r["setup"]["chunkflow_budget_bytes"] != r["setup"]["budget_bytes"]:
        ax.axhline(r["setup"]["chunkflow_budget_bytes"] / MIB, color="#4c78a8", linestyle=":",
                   label="ChunkFlow's budget")
    ax.set_ylabel("peak activation memory per rank (MiB)")
    ax.set_title("ChunkFlow's activation memory:\n" + ", ".join(
        f"{v:.2f}x of {b}" for b, v in r["activation_memory_ratios"].items()), fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="lower right")
    paths.append(_save(fig, plt, directory, "memory.png"))

    kinds = {"F": "#4c78a8", "R": "#f58518", "B": "#54a24b"}
    end = max(t["span"] for x in systems for t in x["timeline"])
    fig, axes = plt.subplots(len(systems), 1, figsize=(12, 1.2 + 1.6 * len(systems)),
                             sharex=True, squeeze=False)
    axes = axes[:, 0]
    for ax, name, x in zip(axes, names, systems):
        p = len(x["timeline"])
        for t in x["timeline"]:
            for kind, color in kinds.items():
                spans = [(s, e - s) for k, _, s, e in t["ops"] if k == kind]
                ax.broken_barh(spans, (p - 1 - t["stage"] + 0.1, 0.8), facecolors=color,
                               edgecolor="white", linewidth=0.2)
        ax.set_yticks([p - 1 - s + 0.5 for s in range(p)], [f"stage {s}" for s in range(p)])
        ax.set_title(f"{name}, recompute {x['recompute']} (measured, {x['step_s']:.1f} s step): "
                     f"bubble {x['bubble']:.1%}",
                     fontsize=10, loc="left")
    axes[-1].set_xlim(0, end)
    axes[-1].set_xlabel("seconds since the step began (forward F, re-forward R, backward B)")
    paths.append(_save(fig, plt, directory, "timelines.png"))
    return paths


def _save(fig, plt, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
