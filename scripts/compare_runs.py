"""Compare two Megatron-LM training logs (stock and ChunkFlow): throughput, memory, loss.

    python scripts/compare_runs.py OUT/logs/qwen2.5-7b_32k_stock_123.log \\
        OUT/logs/qwen2.5-7b_32k_chunkflow_124.log --skip 5
    python scripts/compare_runs.py stock.log chunkflow.log --json > comparison.json

Reads the lines Megatron-LM core_v0.16.1 prints (megatron/training/training.py training_log,
megatron/training/utils.py report_memory, the arguments dump) and the plugin's per-iteration
`[chunkflow] iteration N | tokens T | tokens/s/GPU X | ...` lines. Iterations up to --skip are
warm-up and left out. Each figure is time-weighted over the iterations kept:

- elapsed ms per iteration and TFLOP/s/GPU as Megatron logs them (`--log-throughput`);
- tokens/s/GPU: from the [chunkflow] lines when the log has them; otherwise tokens per iteration =
  global batch size x sequence length (or --tokens-per-iter), which counts padding and, for packed
  rows, every token of the row;
- peak memory: the largest `max allocated` of any rank's memory report (torch's peak since the
  start of the run, so warm-up is included), and the [chunkflow] lines' own peak;
- lm loss: mean over the iterations kept, and the last value.

Exit status 2, with FILE:LINE where one is at fault, when a log cannot be read or has no usable
iteration line, and, naming the argument, when STOCK_LOG is a ChunkFlow run or CHUNKFLOW_LOG is
not one (swapped or wrong logs; --no-system-check compares any two runs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field

ITERATION_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
MEMORY_RE = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\)(.*)$")
CHUNKFLOW_RE = re.compile(r"\[chunkflow\] iteration (\d+)\s*\|(.*)$")
CHUNKFLOW_MARK = "[chunkflow] "  # every line the plugin prints with --chunkflow, and only then
ARG_RE = re.compile(r"(?:^|\s)(\w+) \.{3,} (.*?)\s*$")  # "  seq_length ........ 32768"
ARGS_WANTED = ("world_size", "seq_length", "global_batch_size", "chunkflow")


class LogError(Exception):
    """A log that cannot be used; the message names the file (and line)."""


@dataclass
class Run:
    """What one log says, per iteration."""

    path: str
    args: dict = field(default_factory=dict)
    iterations: dict = field(default_factory=dict)  # iteration -> {field: value} (Megatron line)
    chunkflow: dict = field(default_factory=dict)  # iteration -> {field: value} ([chunkflow] line)
    max_allocated_mb: float | None = None
    num_lines: int = 0
    chunkflow_marks: int = 0  # lines starting "[chunkflow] " (iteration, data, set: ...)


def _fields(text: str, sep: str) -> dict[str, str]:
    """'| a: 1 | b: 2 |' -> {'a': '1', 'b': '2'} (sep ':'), or 'a 1 | b 2' (sep ' ')."""
    out = {}
    for part in text.split("|"):
        part = part.strip()
        if not part:
            continue
        key, _, value = part.rpartition(sep) if sep == " " else part.partition(sep)
        out[key.strip()] = value.strip()
    return out


def _number(value: str, where: str, name: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise LogError(f"{where}: {name} is {value!r}, not a number") from None


def parse_log(path: str) -> Run:
    """Read one log; LogError names the file and line of anything malformed."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise LogError(f"{path}: cannot read: {e.strerror}") from None
    run = Run(path)
    lines = raw.decode("utf-8", errors="replace").split("\n")
    run.num_lines = len(lines) - (lines[-1] == "")
    for lineno, line in enumerate(lines, 1):
        where = f"{path}:{lineno}"
        truncated = lineno == len(lines) and line != ""  # a job killed mid-line
        if CHUNKFLOW_MARK in line:
            run.chunkflow_marks += 1
        if m := CHUNKFLOW_RE.search(line):
            f = _fields(m.group(2), " ")
            try:
                values = {k: _number(v, where, k) for k, v in f.items()}
            except LogError:
                if truncated:
                    continue
                raise
            run.chunkflow[int(m.group(1))] = values
        elif m := ITERATION_RE.search(line):
            f = _fields(m.group(3), ":")
            key = "elapsed time per iteration (ms)"
            if key not in f:
                if truncated:
                    continue
                raise LogError(f"{where}: iteration line without '{key}'")
            values = {}
            for k, v in f.items():
                if k in (key, "throughput per GPU (TFLOP/s/GPU)", "lm loss", "global batch size"):
                    values[k] = _number(v, where, k)
            run.iterations[int(m.group(1))] = values
        elif m := MEMORY_RE.search(line):
            f = _fields(m.group(3), ":")
            if "max allocated" not in f:
                raise LogError(f"{where}: memory report without 'max allocated'")
            mb = _number(f["max allocated"], where, "max allocated")
            run.max_allocated_mb = max(run.max_allocated_mb or 0.0, mb)
        elif m := ARG_RE.search(line):
            if m.group(1) in ARGS_WANTED:
                run.args[m.group(1)] = m.group(2)
    if not run.iterations:
        raise LogError(f"{path}: none of its {run.num_lines} lines is a Megatron iteration line "
                       "(' iteration N/ M | ... | elapsed time per iteration (ms): ...')")
    return run


def chunkflow_evidence(run: Run) -> str | None:
    """Why `run` is a --chunkflow run, or None when its log shows no sign of one."""
    if run.chunkflow_marks:
        return f"{run.chunkflow_marks} [chunkflow] lines"
    if run.args.get("chunkflow") == "True":
        return "'chunkflow ... True' in its arguments"
    return None


def check_systems(stock: Run, chunkflow: Run) -> None:
    """LogError, naming the argument, unless STOCK_LOG is a stock run and CHUNKFLOW_LOG a
    ChunkFlow run."""
    stock_is_cf, cf_is_cf = chunkflow_evidence(stock), chunkflow_evidence(chunkflow)
    if stock_is_cf and not cf_is_cf:
        raise LogError(f"the logs look swapped: STOCK_LOG {stock.path} is a ChunkFlow run "
                       f"({stock_is_cf}) and CHUNKFLOW_LOG {chunkflow.path} is not; give the "
                       "stock run's log first")
    if stock_is_cf:
        raise LogError(f"STOCK_LOG {stock.path} is a ChunkFlow run ({stock_is_cf}); give the "
                       "stock run's log (or --no-system-check)")
    if not cf_is_cf:
        raise LogError(f"CHUNKFLOW_LOG {chunkflow.path} is not a ChunkFlow run (no [chunkflow] "
                       "lines, no 'chunkflow ... True' in its arguments); give the --chunkflow "
                       "run's log (or --no-system-check)")


def summarize(run: Run, skip: int, tokens_per_iter: int | None = None) -> dict:
    """Time-weighted figures over the iterations after `skip`."""
    its = sorted(run.iterations)
    kept = [i for i in its if i > skip]
    if not kept:
        raise LogError(f"{run.path}: logged iterations {its[0]}-{its[-1]}; --skip {skip} "
                       "leaves none")
    # Megatron averages each logged line over the iterations since the previous one.
    prev = {i: (its[k - 1] if k else 0) for k, i in enumerate(its)}
    n = {i: i - prev[i] for i in kept}
    seconds = {i: run.iterations[i]["elapsed time per iteration (ms)"] / 1e3 * n[i] for i in kept}
    total_s, total_n = sum(seconds.values()), sum(n.values())
    out = {"log": run.path, "first_iteration": kept[0], "last_iteration": kept[-1],
           "num_iterations": total_n, "elapsed_ms_per_iteration": 1e3 * total_s / total_n}
    tflops = [i for i in kept if "throughput per GPU (TFLOP/s/GPU)" in run.iterations[i]]
    out["megatron_tflops_per_gpu"] = (
        sum(run.iterations[i]["throughput per GPU (TFLOP/s/GPU)"] * seconds[i] for i in tflops)
        / sum(seconds[i] for i in tflops) if tflops else None)
    losses = [i for i in kept if "lm loss" in run.iterations[i]]
    out["lm_loss_mean"] = (sum(run.iterations[i]["lm loss"] * n[i] for i in losses)
                           / sum(n[i] for i in losses) if losses else None)
    out["lm_loss_last"] = run.iterations[losses[-1]]["lm loss"] if losses else None
    out["peak_allocated_gib"] = (run.max_allocated_mb / 1024
                                 if run.max_allocated_mb is not None else None)
    out.update(_tokens(run, kept, n, total_s, total_n, tokens_per_iter))
    return out


def _tokens(run: Run, kept: list[int], n: dict[int, int], total_s: float, total_n: int,
            tokens_per_iter: int | None) -> dict:
    """tokens/s/GPU and where the token count came from."""
    cf = [i for i in kept if i in run.chunkflow and "tokens/s/GPU" in run.chunkflow[i]]
    if cf:
        # a line averages the iterations since Megatron's previous line, as Megatron's own does
        tokens = sum(run.chunkflow[i]["tokens"] * n[i] for i in cf)
        gpu_seconds = sum(run.chunkflow[i]["tokens"] * n[i] / run.chunkflow[i]["tokens/s/GPU"]
                          for i in cf)
        peaks = [run.chunkflow[i].get("peak allocated GiB", run.chunkflow[i].get("peak RSS GiB"))
                 for i in cf]
        peaks = [p for p in peaks if p is not None]
        return {"tokens_per_s_per_gpu": tokens / gpu_seconds,
                "tokens_per_iteration": tokens / sum(n[i] for i in cf),
                "tokens_source": f"[chunkflow] lines ({len(cf)} iterations): real tokens",
                "chunkflow_peak_allocated_gib": max(peaks) if peaks else None}
    world = run.args.get("world_size")
    if run.args.get("chunkflow") == "True" and tokens_per_iter is None:
        return {"tokens_per_s_per_gpu": None, "tokens_per_iteration": None,
                "tokens_source": "unknown: a ChunkFlow run without [chunkflow] lines"}
    if tokens_per_iter is not None:
        source = f"--tokens-per-iter {tokens_per_iter}"
    elif "global_batch_size" in run.args and "seq_length" in run.args:
        gbs, seq = int(run.args["global_batch_size"]), int(run.args["seq_length"])
        tokens_per_iter = gbs * seq
        source = (f"global batch size {gbs} x seq length {seq}: counts padding and every "
                  "token of a packed row")
    else:
        return {"tokens_per_s_per_gpu": None, "tokens_per_iteration": None,
                "tokens_source": "unknown: no arguments dump and no --tokens-per-iter"}
    if world is None:
        return {"tokens_per_s_per_gpu": None, "tokens_per_iteration": tokens_per_iter,
                "tokens_source": source + "; world size unknown (no arguments dump)"}
    return {"tokens_per_s_per_gpu": tokens_per_iter * total_n / (total_s * int(world)),
            "tokens_per_iteration": tokens_per_iter, "tokens_source": source}


RATIO_KEYS = ("elapsed_ms_per_iteration", "megatron_tflops_per_gpu", "tokens_per_s_per_gpu",
              "peak_allocated_gib", "lm_loss_mean")


def compare(a: dict, b: dict) -> dict:
    """b / a for every figure both runs have."""
    return {k: (b[k] / a[k] if a.get(k) and b.get(k) is not None else None) for k in RATIO_KEYS}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(labels: list[str], runs: list[dict], ratios: dict) -> str:
    rows = [("", *labels, f"{labels[1]}/{labels[0]}"),
            ("iterations", *[f"{r['first_iteration']}-{r['last_iteration']} "
                             f"({r['num_iterations']})" for r in runs], "")]
    spec = {"elapsed_ms_per_iteration": ("elapsed ms/iteration", ".1f"),
            "megatron_tflops_per_gpu": ("Megatron TFLOP/s/GPU [1]", ".1f"),
            "tokens_per_s_per_gpu": ("tokens/s/GPU [2]", ".1f"),
            "peak_allocated_gib": ("peak max allocated GiB", ".2f"),
            "lm_loss_mean": ("lm loss (mean)", ".4f")}
    for key, (name, f) in spec.items():
        rows.append((name, *[_fmt(r[key], f) for r in runs], _fmt(ratios[key], ".3f")))
    rows.append(("lm loss (last)", *[_fmt(r["lm_loss_last"], ".4f") for r in runs], ""))
    if any(r.get("chunkflow_peak_allocated_gib") is not None for r in runs):
        peaks = [_fmt(r.get("chunkflow_peak_allocated_gib"), ".2f") for r in runs]
        rows.append(("[chunkflow] line peak GiB", *peaks, ""))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("[1] as Megatron logs it: stock counts global batch x seq length tokens with "
                 "attention over whole rows; the ChunkFlow launcher counts the real sequences")
    for label, r in zip(labels, runs):
        lines.append(f"[2] {label}: {r['tokens_source']}")
    lines.append("Compare tokens/s/GPU: ms/iteration differ when the global batches differ "
                 "(stock counts rows, ChunkFlow sequences).")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stock_log", metavar="STOCK_LOG", help="Megatron log of the baseline run")
    parser.add_argument("chunkflow_log", metavar="CHUNKFLOW_LOG",
                        help="Megatron log of the ChunkFlow run")
    parser.add_argument("--skip", type=int, default=5, metavar="N",
                        help="leave out iterations 1..N as warm-up (default: 5)")
    parser.add_argument("--tokens-per-iter", type=int, metavar="T",
                        help="tokens per iteration of the stock run (default: global batch size "
                             "x seq length from its arguments dump)")
    parser.add_argument("--labels", nargs=2, default=["stock", "chunkflow"], metavar="NAME")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--no-system-check", action="store_true",
                        help="compare any two runs: do not require STOCK_LOG to be a stock run "
                             "and CHUNKFLOW_LOG a ChunkFlow run")
    args = parser.parse_args(argv)
    try:
        stock, chunkflow = parse_log(args.stock_log), parse_log(args.chunkflow_log)
        if not args.no_system_check:
            check_systems(stock, chunkflow)
        runs = [summarize(stock, args.skip, args.tokens_per_iter),
                summarize(chunkflow, args.skip)]
    except LogError as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    ratios = compare(*runs)
    if args.json:
        print(json.dumps({"labels": args.labels, "skip": args.skip, "runs": runs,
                          "ratios": ratios}, indent=2))
    else:
        print(format_table(args.labels, runs, ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
