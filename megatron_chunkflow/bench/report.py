"""`chunkflow bench` output: the side-by-side table and the plots (matplotlib, imported to draw)."""

from __future__ import annotations

import os

MIB = 2.0**20


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def report_lines(r: dict) -> list[str]:
    mg, cf, st = r["baseline"], r["chunkflow"], r["setup"]
    sh, lay = st["shape"], st["layout"]
    lines = [
        f"model {st['model']} ({sh['num_layers']} layers, hidden {sh['hidden_size']}, "
        f"{sh['num_attention_heads']} heads / {sh['num_query_groups']} K/V groups, vocab "
        f"{sh['vocab_size']}); TP={lay['tp']} PP={lay['pp']} DP={lay['dp']} on {lay['world']} "
        f"processes x {st['threads_per_rank']} threads; {st['dtype']}, attention "
        f"{st['backend']} in both",
        f"batch: {st['num_sequences']} sequences ({st.get('source', '')}), {st['tokens']:,} "
        f"tokens, longest {st['longest']:,}; --seq-length {st['seq_length']}",
        f"budget {st['budget_bytes'] / MIB:.0f} MiB of activations per rank: stock Megatron "
        f"recompute {mg['recompute']}; ChunkFlow C={cf['chunk_size']} K={cf['k']} (modelled "
        f"peak {cf['modelled_peak_activation_bytes'] / MIB:.0f} MiB)",
        "load average (1 min) at the start and after each pair of steps: "
        + " ".join(f"{x:.1f}" for x in st["load_average_1min"])
        + f" on {os.cpu_count()} cores (other processes make times noisy)",
        f"simulator's cpu device: kernel rates and two timed probe micro-batches, measured "
        f"{len(st['calibrations'])} times (medians); dense work in the model takes "
        f"{st['model_fit']['dense_scale']:.2f}x the isolated kernels' time, plus "
        f"{st['model_fit']['op_overhead_s'] * 1e3:.1f} ms host time per op",
        "",
        f"{'':<34}{'stock Megatron':>16}{'ChunkFlow':>14}{'ChunkFlow / stock':>20}",
    ]

    def row(label, a, b, fmt, ratio=None):
        lines.append(f"{label:<34}{fmt(a):>16}{fmt(b):>14}{ratio or '':>20}")

    n = len(mg["step_s_repeats"])
    row(f"step time (s, median of {n})", mg["step_s"], cf["step_s"], lambda x: f"{x:.2f}",
        f"speedup {r['speedup']:.2f}x")
    row("tokens/s", mg["tokens_per_s"], cf["tokens_per_s"], lambda x: f"{x:,.0f}",
        _ratio(cf["tokens_per_s"], mg["tokens_per_s"]))
    row("model TFLOP/s", mg["model_tflops"], cf["model_tflops"], lambda x: f"{x:.4f}")
    row("peak activation memory (MiB)", mg["peak_activation_bytes"] / MIB,
        cf["peak_activation_bytes"] / MIB, lambda x: f"{x:,.1f}",
        f"{r['activation_memory_ratio']:.2f}")
    row("  per stage (MiB)", mg["peak_activation_bytes_per_stage"],
        cf["peak_activation_bytes_per_stage"], lambda x: "/".join(f"{v / MIB:.0f}" for v in x))
    row("  of which K/V state (MiB)", max(mg["kv_state_bytes_per_stage"]) / MIB,
        max(cf["kv_state_bytes_per_stage"]) / MIB, lambda x: f"{x:,.1f}")
    row("  recompute working set (MiB)", mg["recompute_working_set_bytes"] / MIB,
        cf["recompute_working_set_bytes"] / MIB, lambda x: f"{x:,.1f}")
    row("peak RSS, process (MiB)", mg["peak_rss_bytes"] / MIB, cf["peak_rss_bytes"] / MIB,
        lambda x: f"{x:,.0f}", f"{r['rss_ratio']:.2f}")
    row("bubble (measured)", mg["bubble"], cf["bubble"], lambda x: f"{x:.1%}")
    row("recompute (FLOPs re-run / model)", mg["recompute_fraction"], cf["recompute_fraction"],
        lambda x: f"{x:.1%}")
    row("GFLOP/s per rank while busy", mg["busy_flops_per_s"] / 1e9,
        cf["busy_flops_per_s"] / 1e9, lambda x: f"{x:.1f}")
    row("micro-batches / chunks", mg["num_microbatches"], cf["num_microbatches"], str)
    row("predicted step (s), simulator", mg["predicted_step_s"], cf["predicted_step_s"],
        lambda x: f"{x:.2f}", f"predicted {r['predicted_speedup']:.2f}x")
    row("  predicted / measured - 1", mg["prediction_error"], cf["prediction_error"],
        lambda x: f"{x:+.0%}")
    row("predicted bubble", mg["predicted_bubble"], cf["predicted_bubble"], lambda x: f"{x:.1%}")
    f = r["speedup_factors"]
    lines += ["", f"where the time goes: speedup {r['speedup']:.2f}x = less work (recompute) "
              f"{f['work']:.2f}x * faster work while busy {f['busy_rate']:.2f}x * less idle "
              f"(bubble) {f['utilization']:.2f}x * outside the pipeline (optimizer, planning) "
              f"{f['outside_pipeline']:.2f}x"]
    within = all(abs(x["prediction_error"]) <= 0.25 for x in (mg, cf))
    lines += [f"speedup {r['speedup']:.2f}x, activation memory ratio "
              f"{r['activation_memory_ratio']:.2f}; simulator "
              f"{'within' if within else 'NOT within'} 25% of both measured step times"]
    fits = [name for name, x in (("stock Megatron", mg), ("ChunkFlow", cf))
            if x["peak_activation_bytes"] > st["budget_bytes"]]
    if fits:
        lines.append(f"measured peak above the budget: {', '.join(fits)}")
    return lines


def write_plots(r: dict, directory: str) -> list[str]:
    """throughput.png, memory.png and timelines.png (both systems' measured per-op intervals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, systems = ["stock Megatron", "ChunkFlow"], [r["baseline"], r["chunkflow"]]
    colors = ["#9d9d9d", "#4c78a8"]
    paths = []

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(names, [x["tokens_per_s"] for x in systems], color=colors)
    ax.bar(names, [r["setup"]["tokens"] / x["predicted_step_s"] for x in systems], fill=False,
           edgecolor="black", linestyle="--", label="simulator")
    ax.set_ylabel("tokens/s (measured; dashed: predicted)")
    ax.set_title(f"throughput: {r['speedup']:.2f}x", fontsize=10)
    paths.append(_save(fig, plt, directory, "throughput.png"))

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, x in enumerate(systems):  # parts at the worst stage's peak (bounded by their maxima)
        total = x["peak_activation_bytes"] / MIB
        state = min(max(x["kv_state_bytes_per_stage"]) / MIB, total)
        work = min(x["recompute_working_set_bytes"] / MIB, total - state)
        ax.bar(names[i], total - state - work, color=colors[i])
        ax.bar(names[i], work, bottom=total - state - work, color="#b279a2",
               label="recompute working set" if work else None)
        ax.bar(names[i], state, bottom=total - state, color="#f58518",
               label="K/V state" if state else None)
    ax.axhline(r["setup"]["budget_bytes"] / MIB, color="red", linestyle=":", label="budget")
    ax.set_ylabel("peak activation memory per rank (MiB)")
    ax.set_title(f"activation memory ratio {r['activation_memory_ratio']:.2f}", fontsize=10)
    ax.legend(fontsize=8)
    paths.append(_save(fig, plt, directory, "memory.png"))

    kinds = {"F": "#4c78a8", "R": "#f58518", "B": "#54a24b"}
    end = max(t["span"] for x in systems for t in x["timeline"])
    fig, axes = plt.subplots(2, 1, figsize=(12, 4.5), sharex=True)
    for ax, name, x in zip(axes, names, systems):
        p = len(x["timeline"])
        for t in x["timeline"]:
            for kind, color in kinds.items():
                spans = [(s, e - s) for k, _, s, e in t["ops"] if k == kind]
                ax.broken_barh(spans, (p - 1 - t["stage"] + 0.1, 0.8), facecolors=color,
                               edgecolor="white", linewidth=0.2)
        ax.set_yticks([p - 1 - s + 0.5 for s in range(p)], [f"stage {s}" for s in range(p)])
        ax.set_title(f"{name} (measured, {x['step_s']:.1f} s step): bubble {x['bubble']:.1%}",
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
