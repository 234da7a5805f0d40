"""`chunkflow plan`: cut, pack and schedule one global batch, and compare with stock Megatron.

    chunkflow plan --profile B --global-batch-size 2000 --chunk-size 8192 --chunkflow-k 1 \
        --pp 4 --dp 2
    chunkflow plan --lengths-file lengths.txt --chunk-size 4096 --json
    chunkflow plan --png plan.png
    chunkflow plan --cp 2 --chunk-size 8192     # every chunk split over 2 CP ranks
    chunkflow plan --pp 4 --vpp 2               # 2 virtual stages (model chunks) per PP rank

Times are FLOPs on the critical path of one GPU under the named model's cost model (attention
counted per segment, a baseline's padding included), with the seconds they take at the device's
peak rate as a lower bound (`chunkflow simulate` times the step); the ratio of the two systems is
what to read. Memory is perfmodel/footprint.py's model (the simulator's) in bf16 without recompute:
activations the plan holds at once and, for ChunkFlow, the long sequence's K/V state, on top of
each pipeline rank's weights, gradients and distributed-optimizer states (TP 1); a plan whose peak
passes the device's usable memory (--gpu, default h100) does not fit, and no speedup is given
against it or for it: `chunkflow simulate` searches layouts and recompute for one that fits. Stock
Megatron is planned as each of core/step.py's BASELINES (megatron-sft: first-fit lines padded to
--seq-length; megatron-packed: best fit, no padding, the strongest and the JSON's "baseline";
megatron-unpacked: one sequence per micro-batch), and as megatron-hybrid-cp (Megatron's per-sample
CP on all PP x CP x DP GPUs as its pool, PP 1: each sequence alone on a power-of-two CP group,
core/hybrid_cp.py; its FLOPs per GPU a sequence's over its CP size; planned where the pool is a
power of two, else a note says why not). With --cp N both systems split every micro-batch
over N context-parallel ranks (ChunkFlow: segments padded to 2N pieces, runtime/cp.py; stock: each
sequence padded to 2N): times and memory are per GPU, FLOPs / N and the footprint model's
per-rank bytes. The FLOPs leave out CP's communication and ChunkFlow's CP attention forward run
again in the backward; `chunkflow simulate` times both. With --vpp V both systems interleave V
model chunks per pipeline rank (ChunkFlow's interleaved plan, Megatron's interleaved 1F1B, which
refuses some micro-batch counts); stages in the output are pipeline ranks.
"""

from __future__ import annotations

import argparse

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.console import Output
from megatron_chunkflow.core.hybrid_cp import BASELINE as HYBRID
from megatron_chunkflow.core.hybrid_cp import FLAG as MAX_SEQLEN_FLAG
from megatron_chunkflow.core.lengths import AS_DRAWN, LengthsConfig
from megatron_chunkflow.core.models import MODEL_SHAPES, get_model_shape
from megatron_chunkflow.core.simulate import SimResult
from megatron_chunkflow.core.types import PipelinePlan
from megatron_chunkflow.flags import (
    MAX_GPUS,
    MAX_TOKENS,
    add_config_arguments,
    Bounded,
    check_output_file,
    config_from_args,
    given,
)
from megatron_chunkflow.mcore.hybrid_cp import balanced_cp_groups
from megatron_chunkflow.perfmodel.batch_plan import (
    baseline_summary,
    hybrid_static,
    plan_batch,
    static_per_stage,
)
from megatron_chunkflow.perfmodel.gpu_profiles import add_device_arguments, device_from_args

SCENARIO = dict(model="qwen2.5-7b", global_batch_size=2000)  # README, "Defaults"
GIB = 2.0**30
STRONGEST = "megatron-packed"  # the JSON's "baseline" (kept for compatibility)


def _gib(values) -> str:
    return "[" + ", ".join(f"{v / GIB:.1f}" for v in values) + "]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sequence lengths")
    add_config_arguments(g, LengthsConfig, fields=AS_DRAWN, default_help={
        "profile": "B", "global_batch_size": SCENARIO["global_batch_size"]})
    g = parser.add_argument_group("chunkflow")
    add_config_arguments(g, ChunkFlowConfig, fields=("chunk_size", "num_kept"))
    g = parser.add_argument_group("layout and cost model")
    add_config_arguments(g, ParallelConfig, fields=("pp", "vpp", "cp", "dp"), defaults={"dp": 1})
    g.add_argument("--dp-rank", type=int, action=Bounded, bounds=(0, MAX_GPUS - 1), default=0,
                   help="the DP rank whose per-stage ops are printed (default: 0)")
    g.add_argument("--seq-length", type=int, action=Bounded, bounds=(1, MAX_TOKENS), default=None,
                   help="the baseline's micro-batch length (default: the longest sequence, "
                        "padded to a multiple of 2 x CP)")
    g.add_argument("--model", default=SCENARIO["model"], choices=sorted(MODEL_SHAPES),
                   help=f"shape used by the cost model (default: {SCENARIO['model']})")
    g.add_argument(MAX_SEQLEN_FLAG, type=int, action=Bounded, bounds=(1, MAX_TOKENS),
                   default=None, metavar="M",
                   help=f"{HYBRID}'s tokens per rank before a sequence gets a CP group (default: "
                        "--chunk-size, doubled until the longest sequence fits the pool)")
    g = parser.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("--png", metavar="PATH", help="draw both plans' per-stage timelines")
    g = parser.add_argument_group("device (memory verdict)")
    add_device_arguments(g, "h100")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(ChunkFlowConfig, args)
    parallel = config_from_args(ParallelConfig, args)  # validates --pp, --cp and --dp
    parallel.check_chunk_size(cfg.chunk_size)  # under CP: a chunk size the 2 x CP split divides
    if not 0 <= args.dp_rank < args.dp:
        raise ValueError(f"--dp-rank must be in [0, {args.dp}), got {args.dp_rank}")
    check_output_file("--png", args.png)
    out = Output(args.json)
    hw = device_from_args(args)
    if args.seq_length is not None and args.seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1 (leave it out for the longest sequence), "
                         f"got {args.seq_length}")
    shape = get_model_shape(args.model)
    shape.require_dense(args.model, "plan")
    layout = ParallelConfig.layout(pp=args.pp, dp=args.dp, cp=parallel.cp, vpp=parallel.vpp)
    layout.check_model(shape)  # PP and V divide the layers (no stage without layers), naming them
    lengths, source = config_from_args(LengthsConfig, args).lengths(SCENARIO["global_batch_size"])
    longest = max(lengths)  # by default the baseline's micro-batch holds it, padded to 2 x CP
    seq_length = args.seq_length or longest + (-longest % (2 * parallel.cp) if parallel.cp > 1
                                               else 0)

    cp, vpp = parallel.cp, parallel.vpp
    plans = plan_batch(lengths, shape, cfg, layout, seq_length, balanced_cp_groups,
                       args.max_seqlen_per_dp_cp_rank)
    batch, cf, bases = plans.batch, plans.chunkflow, plans.baselines
    base = bases[STRONGEST]
    r = args.dp_rank
    plan, sim = cf.plans[r], cf.sims[r]
    static = static_per_stage(shape, layout)
    gpus = args.pp * args.dp * cp

    def total(activations) -> list[float]:
        return [a + b for a, b in zip(activations, static)]

    cf_total = total(cf.peak_memory_bytes(r))
    cf_fits = max(cf_total) <= hw.usable_bytes
    fits = {b: max(total(p.peak_memory_bytes(r))) <= hw.usable_bytes for b, p in bases.items()}

    def speedup_over(name: str, step_time: float) -> float | None:
        return step_time / cf.step_time if cf_fits and fits[name] else None

    def seconds(flops: float) -> str:
        return f"{flops:.3e} FLOPs, >= {flops / hw.peak_flops:.2f} s at peak"

    def verdict(name: str, need: float, step_time: float) -> str:
        if not fits[name]:
            return (f"does NOT fit on {gpus} {hw.name} GPUs ({need / GIB:.1f} GiB of "
                    f"{hw.usable_bytes / GIB:.1f}): no ratio")
        if not cf_fits:
            return "fits; ChunkFlow's plan does not: no ratio"
        return f"-> ChunkFlow speedup {step_time / cf.step_time:.2f}x"

    num_long = len({c.parent for c in batch.chunks if c.is_dependent})
    num_dep = len(batch.chunks) - batch.num_standalone
    out.say(f"{len(lengths)} sequences ({source}): {batch.num_tokens:,} tokens, "
            f"longest {max(lengths):,}")
    out.say(f"ChunkFlow  C={cfg.chunk_size} K={cfg.num_kept} PP={args.pp} "
            + (f"V={vpp} " if vpp > 1 else "")
            + (f"CP={cp} " if cp > 1 else "") + f"DP={args.dp}: "
            f"{len(batch.chunks)} chunks = {num_dep} dependent (from {num_long} long sequences) "
            f"+ {batch.num_standalone} standalone (lower bound {batch.bins_lower_bound}); "
            f"padding {batch.padding_fraction:.1%}")
    out.say(f"  DP rank {r}: {len(cf.chunks[r])} chunks, bubble {sim.bubble_ratio:.1%}, "
            f"peak chunks holding activations per stage {list(sim.peak_held)}, "
            f"{sim.num_recompute} re-forwarded")
    out.say(f"ChunkFlow peak memory per stage, GiB (bf16, no recompute; activations with the K/V "
            f"state: {_gib(cf.peak_memory_bytes(r))}, with weights, gradients and optimizer "
            f"states: {_gib(cf_total)} of {hw.usable_bytes / GIB:.1f} usable on {hw.name}: "
            f"{'fits' if cf_fits else 'does NOT fit'}); step time {seconds(cf.step_time)} "
            f"(model {args.model}, slowest DP rank)")
    summaries = {b: baseline_summary(p, r) for b, p in bases.items()}
    hybrid, note = plans.hybrid, plans.note
    for b, x in summaries.items():
        need = total(bases[b].peak_memory_bytes(r))
        x["peak_total_gib"] = [round(v / GIB, 3) for v in need]
        x["fits"] = fits[b]
        out.say(f"Stock {b:<17} seq-length {seq_length}: {x['num_microbatches']} micro-batches, "
                f"padding {x['padding_fraction']:.1%}, DP rank {r} bubble "
                f"{x['bubble_ratio']:.1%}, peak GiB {_gib(need)}, step time "
                f"{seconds(x['step_time'])} {verdict(b, max(need), x['step_time'])}")
    if hybrid is not None:
        need = hybrid["peak_memory_gib"][0] * GIB + hybrid_static(shape, hybrid["pool"])
        fits[HYBRID] = need <= hw.usable_bytes
        hybrid.update(peak_total_gib=[round(need / GIB, 3)], fits=fits[HYBRID])
        out.say(f"Stock {HYBRID} (PP 1, pool {hybrid['pool']}, M "
                f"{hybrid['max_seqlen_per_dp_cp_rank']}): {hybrid['num_microbatches']} "
                f"sequences in {hybrid['num_groups']} group(s), CP sizes {hybrid['cp_sizes']}, "
                f"idle {hybrid['bubble_ratio']:.1%}, peak GiB [{need / GIB:.1f}], step time "
                f"{seconds(hybrid['step_time'])} {verdict(HYBRID, need, hybrid['step_time'])}")
        summaries[HYBRID] = hybrid
    else:
        out.say(note)
    if not all(fits.values()) or not cf_fits:
        drawn = " ".join(f"--{f.replace('_', '-')} {getattr(args, f)}" for f in AS_DRAWN
                         if given(args, f))
        out.say(f"a plan marked NOT fit cannot run on {hw.name} at this layout (TP 1, no "
                f"recompute); each system's fastest plan that fits, searched over layouts and "
                f"recompute: chunkflow simulate --model {args.model} --gpus {gpus} --gpu "
                f"{hw.name} --seq-length {seq_length}" + (f" {drawn}" if drawn else ""))
    if len(cf.chunks[r]) < args.pp:
        out.say(f"note: DP rank {r} has {len(cf.chunks[r])} chunks for {args.pp} pipeline "
                "stages; the pipeline cannot fill")
    if args.png:
        base_total = max(total(base.peak_memory_bytes(r)))
        draw_timelines(args.png, [
            (f"ChunkFlow C={cfg.chunk_size} K={cfg.num_kept}, DP rank {r}, peak "
             f"{max(cf_total) / GIB:.1f} GiB of {hw.usable_bytes / GIB:.1f} on {hw.name}"
             + ("" if cf_fits else " (does NOT fit)"), sim, plan),
            (f"stock Megatron ({STRONGEST}) 1F1B, seq-length {seq_length}, DP rank {r}, peak "
             f"{base_total / GIB:.1f} GiB" + ("" if fits[STRONGEST] else " (does NOT fit)"),
             base.sims[r], base.plans[r]),
        ])
        out.say(f"timeline written to {args.png}")

    out.result({
        "chunks": [c.to_json() for c in batch.chunks],
        "stages": plan.to_json(),
        "stats": {
            "num_chunks": len(batch.chunks),
            "num_sequences": len(lengths),
            "tokens": batch.num_tokens,
            "padding_fraction": batch.padding_fraction,
            "bins_lower_bound": batch.bins_lower_bound,
            "num_standalone": batch.num_standalone,
            "bubble_ratio": sim.bubble_ratio,
            "peak_held_chunks": list(sim.peak_held),
            "recompute_chunks": sim.num_recompute,
            "step_time": cf.step_time,
            "peak_memory_gib": [round(b / GIB, 3) for b in cf.peak_memory_bytes(r)],
            "peak_total_gib": [round(b / GIB, 3) for b in cf_total],
            "fits": cf_fits,
        },
        "baseline": {
            "seq_length": seq_length,
            "name": STRONGEST,
            "num_microbatches": sum(len(c) for c in base.chunks),
            "bubble_ratio": base.sims[r].bubble_ratio,
            "peak_held_chunks": list(base.sims[r].peak_held),
            "step_time": base.step_time,
            "peak_memory_gib": [round(b / GIB, 3) for b in base.peak_memory_bytes(r)],
            "peak_total_gib": summaries[STRONGEST]["peak_total_gib"],
            "fits": fits[STRONGEST],
        },
        "baselines": summaries,
        "notes": [note] if note else [],
        "speedup": speedup_over(STRONGEST, base.step_time),
        "speedups": {b: speedup_over(b, x["step_time"]) for b, x in summaries.items()},
        "device": {"gpu": hw.name, "usable_gib": hw.usable_bytes / GIB, "profile": hw.profile},
        "setup": {"chunk_size": cfg.chunk_size, "k": cfg.num_kept, "pp": args.pp, "vpp": vpp,
                  "cp": cp, "dp": args.dp,
                  "dp_rank": r, "model": args.model, "source": source},
    })
    return 0


COLORS = {"F": "#4c78a8", "F0": "#a9c4e4", "R": "#f58518", "B": "#54a24b"}
LABELS = {"F": "forward (keeps activations)", "F0": "forward without graph (state only)",
          "R": "re-forward", "B": "backward"}


def draw_timelines(path: str, panels: list[tuple[str, SimResult, PipelinePlan]]) -> None:
    """Per-stage timeline pictures of simulated plans, one panel per (title, simulation, plan),
    on a shared time axis (matplotlib, imported only when drawing)."""
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
    fig.legend(handles=[Patch(color=COLORS[kind], label=LABELS[kind]) for kind in COLORS],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
