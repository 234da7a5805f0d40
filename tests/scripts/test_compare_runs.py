"""scripts/compare_runs.py: two Megatron-LM logs (a stock and a ChunkFlow run of the SLURM scripts)
-> throughput and memory figures and their ratios; bad logs exit 2 naming the file and line.

    .venv/bin/python -m pytest tests/scripts/test_compare_runs.py -q

The logs are written here in the formats of Megatron-LM's _print_args, training_log and
report_memory, and of the plugin's [chunkflow] line. The script runs in-process (its main).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_compare_runs():
    spec = importlib.util.spec_from_file_location("compare_runs",
                                                  REPO / "scripts" / "compare_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


compare_runs = _load_compare_runs()


def megatron_args_dump(**values) -> list[str]:
    """megatron/training/arguments.py _print_args."""
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(values):
        lines.append("  {} {} {}".format(name, "." * (48 - len(name)), values[name]))
    return lines + ["-------------------- end of arguments ---------------------"]


def megatron_iteration(it, total, ms, tflops, loss, gbs, consumed) -> str:
    """megatron/training/training.py training_log, with --log-throughput."""
    s = f" [2025-06-01 10:00:{it % 60:02d}.123456]"
    s += " iteration {:8d}/{:8d} |".format(it, total)
    s += " consumed samples: {:12d} |".format(consumed)
    s += " elapsed time per iteration (ms): {:.1f} |".format(ms)
    s += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    s += f" learning rate: {1e-5:.6E} |"
    s += f" global batch size: {gbs:5d} |"
    s += " {}: {:.6E} |".format("lm loss", loss)
    s += f" loss scale: {1.0:.1f} |"
    s += f" grad norm: {1.234:.3f} |"
    s += " number of skipped iterations: {:3d} |".format(0)
    s += " number of nan iterations: {:3d} |".format(0)
    return s


def megatron_memory(rank, it, max_allocated_mb) -> str:
    """megatron/training/utils.py report_memory."""
    s = f"(after {it} iterations) memory (MB)"
    s += f" | allocated: {max_allocated_mb / 2:.2f} | max allocated: {max_allocated_mb:.2f}"
    s += f" | reserved: {max_allocated_mb * 1.1:.2f} | max reserved: {max_allocated_mb * 1.1:.2f}"
    return "[Rank {}] {}".format(rank, s)


def chunkflow_line(it, tokens, tps, peak_gib) -> str:
    return (f"[chunkflow] iteration {it} | tokens {tokens} | tokens/s/GPU {tps:.1f} | "
            f"model TFLOP/s/GPU 312.5 | chunks 40 | recompute 0.12 | "
            f"peak allocated GiB {peak_gib:.1f}")


@pytest.fixture
def logs(tmp_path):
    """A stock and a ChunkFlow log: 10 iterations, the first 2 slow (warm-up)."""
    stock = megatron_args_dump(world_size=16, seq_length=32768, global_batch_size=32,
                               micro_batch_size=1)
    for it in range(1, 11):
        warm = it <= 2
        stock.append(megatron_iteration(it, 10, 20000.0 if warm else 10000.0,
                                        100.0 if warm else 300.0, 2.0 - 0.1 * it, 32, 32 * it))
        if it in (1, 2, 10):
            stock += [megatron_memory(0, it, 70000.0), megatron_memory(8, it, 72000.0)]
    cf = megatron_args_dump(world_size=16, seq_length=32768, global_batch_size=1024,
                            micro_batch_size=1, chunkflow=True)
    for it in range(1, 11):
        warm = it <= 2
        cf.append(chunkflow_line(it, 1048576, 1000.0 if warm else 8192.0, 39.0))
        cf.append(megatron_iteration(it, 10, 8000.0, 250.0, 2.0 - 0.1 * it, 1024, 1024 * it))
        if it in (1, 2, 10):
            cf.append(megatron_memory(0, it, 40960.0))
    (tmp_path / "stock.log").write_text("\n".join(stock) + "\n")
    (tmp_path / "cf.log").write_text("\n".join(cf) + "\n")
    return tmp_path / "stock.log", tmp_path / "cf.log"


def test_compare_runs_figures_and_ratios(logs, capsys):
    assert compare_runs.main([str(logs[0]), str(logs[1]), "--skip", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    stock, cf = out["runs"]
    kept = stock["first_iteration"], stock["last_iteration"], stock["num_iterations"]
    assert kept == (3, 10, 8)
    assert stock["elapsed_ms_per_iteration"] == pytest.approx(10000.0)
    assert stock["megatron_tflops_per_gpu"] == pytest.approx(300.0)
    # 32 rows x 32768 tokens every 10 s on 16 GPUs
    assert stock["tokens_per_s_per_gpu"] == pytest.approx(32 * 32768 / (10.0 * 16))
    assert "counts padding" in stock["tokens_source"]
    assert stock["peak_allocated_gib"] == pytest.approx(72000.0 / 1024)
    assert stock["lm_loss_mean"] == pytest.approx(2.0 - 0.1 * 6.5)
    assert stock["lm_loss_last"] == pytest.approx(1.0)
    assert cf["tokens_per_s_per_gpu"] == pytest.approx(8192.0)
    assert cf["tokens_source"].startswith("[chunkflow] lines")
    assert cf["peak_allocated_gib"] == pytest.approx(40.0)
    assert cf["chunkflow_peak_allocated_gib"] == pytest.approx(39.0)
    ratios = out["ratios"]
    assert ratios["tokens_per_s_per_gpu"] == pytest.approx(8192.0 / 6553.6)
    assert ratios["peak_allocated_gib"] == pytest.approx(40.0 / (72000.0 / 1024))
    assert ratios["elapsed_ms_per_iteration"] == pytest.approx(0.8)
    assert ratios["megatron_tflops_per_gpu"] == pytest.approx(250.0 / 300.0)


def test_compare_runs_table_and_tokens_override(logs, capsys):
    assert compare_runs.main([str(logs[0]), str(logs[1]), "--tokens-per-iter", "524288"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s/GPU" in out and "--tokens-per-iter 524288" in out
    row = next(line for line in out.splitlines() if line.startswith("tokens/s/GPU"))
    assert row.split()[-3:] == ["3276.8", "8192.0", "2.500"]  # 524288 / (10 s x 16 GPUs)


def test_compare_runs_weights_log_intervals(tmp_path):
    # --log-interval 4: lines at 1 (first iteration), 4 and 8 average 1, 3 and 4 iterations
    lines = [megatron_iteration(it, 8, ms, 100.0, 1.0, 8, 8 * it)
             for it, ms in ((1, 100.0), (4, 200.0), (8, 300.0))]
    (tmp_path / "a.log").write_text("\n".join(lines) + "\n")
    summary = compare_runs.summarize(compare_runs.parse_log(str(tmp_path / "a.log")), skip=0)
    assert summary["num_iterations"] == 8
    assert summary["elapsed_ms_per_iteration"] == pytest.approx((100 + 3 * 200 + 4 * 300) / 8)
    assert summary["tokens_per_s_per_gpu"] is None  # no arguments dump
    # [chunkflow] lines average the same intervals: 1 step at 1000 tokens/s/GPU, 3 at 2000, 4 at 4K
    cf = [chunkflow_line(it, 1000, tps, 1.0) for it, tps in ((1, 1000.0), (4, 2000.0), (8, 4000.0))]
    (tmp_path / "b.log").write_text("\n".join(x for pair in zip(cf, lines) for x in pair) + "\n")
    summary = compare_runs.summarize(compare_runs.parse_log(str(tmp_path / "b.log")), skip=0)
    gpu_seconds = 1000 * (1 / 1000 + 3 / 2000 + 4 / 4000)
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(8 * 1000 / gpu_seconds)


def _cli(capsys, *argv):
    """`scripts/compare_runs.py ARGV` in-process: its exit code and stderr."""
    returncode = compare_runs.main(list(argv))
    return types.SimpleNamespace(returncode=returncode, stderr=capsys.readouterr().err)


def test_compare_runs_exits_2_on_garbage(logs, tmp_path, capsys):
    garbage = tmp_path / "garbage.log"
    garbage.write_bytes(b"\x00\xff not a log\nTraceback (most recent call last):\n")
    result = _cli(capsys, str(logs[0]), str(garbage))
    assert result.returncode == 2
    assert str(garbage) in result.stderr and "none of its 2 lines" in result.stderr
    result = _cli(capsys, str(tmp_path / "missing.log"), str(logs[1]))
    assert result.returncode == 2 and "missing.log: cannot read" in result.stderr


def test_compare_runs_names_the_bad_line(logs, tmp_path, capsys):
    lines = logs[0].read_text().splitlines()
    bad_index = next(i for i, line in enumerate(lines) if "iteration        5/" in line)
    lines[bad_index] = lines[bad_index].replace("(ms): 10000.0", "(ms): fast")
    bad = tmp_path / "bad.log"
    bad.write_text("\n".join(lines) + "\n")
    result = _cli(capsys, str(bad), str(logs[1]))
    assert result.returncode == 2
    assert f"{bad}:{bad_index + 1}: elapsed time per iteration (ms) is 'fast'" in result.stderr


def test_compare_runs_ignores_a_truncated_last_line(logs, tmp_path):
    text = logs[1].read_text() + megatron_iteration(11, 11, 8000.0, 250.0, 1.0, 1024, 0)[:60]
    cut = tmp_path / "cut.log"
    cut.write_text(text)  # no final newline: the job died while writing
    assert compare_runs.summarize(compare_runs.parse_log(str(cut)), 2)["last_iteration"] == 10


def test_compare_runs_skip_leaving_nothing(logs, capsys):
    result = _cli(capsys, str(logs[0]), str(logs[1]), "--skip", "10")
    assert result.returncode == 2 and "--skip 10 leaves none" in result.stderr


def test_compare_runs_refuses_swapped_logs(logs, capsys):
    stock, cf = logs
    result = _cli(capsys, str(cf), str(stock))
    assert result.returncode == 2
    assert f"the logs look swapped: STOCK_LOG {cf} is a ChunkFlow run" in result.stderr
    assert f"CHUNKFLOW_LOG {stock} is not" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert _cli(capsys, str(cf), str(stock), "--no-system-check").returncode == 0


def test_compare_runs_names_a_mislabelled_log(logs, tmp_path, capsys):
    stock, cf = logs
    result = _cli(capsys, str(stock), str(stock))  # no [chunkflow] lines in the second
    assert result.returncode == 2
    assert f"CHUNKFLOW_LOG {stock} is not a ChunkFlow run (no [chunkflow] lines" in result.stderr
    result = _cli(capsys, str(cf), str(cf))
    assert result.returncode == 2
    assert f"STOCK_LOG {cf} is a ChunkFlow run (10 [chunkflow] lines)" in result.stderr
    # the launcher's stock mode dumps chunkflow False: still a stock run
    launcher_stock = tmp_path / "launcher_stock.log"
    launcher_stock.write_text(stock.read_text().replace(
        "  micro_batch_size", "  chunkflow {} False\n  micro_batch_size".format("." * 39)))
    assert _cli(capsys, str(launcher_stock), str(cf)).returncode == 0
    # a ChunkFlow log whose [chunkflow] lines were filtered out: its arguments dump suffices
    bare = tmp_path / "bare_cf.log"
    bare.write_text("\n".join(line for line in cf.read_text().splitlines()
                              if "[chunkflow]" not in line) + "\n")
    assert _cli(capsys, str(stock), str(bare)).returncode == 0
