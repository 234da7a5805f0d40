"""`chunkflow calibrate` (cli/calibrate.py, bench/gpu_profile.py): every microbenchmark runs and the
profile it writes is one `simulate` reads; without a GPU and without --dry-run it says so."""

import json

import torch

from megatron_chunkflow.cli import main
from megatron_chunkflow.perfmodel.gpu_profiles import LABELS, load_profile

RATES = {"gemm_max_eff", "attn_fwd_eff", "attn_bwd_eff", "mem_eff", "kernel_launch_us", "spec",
         "fused_swiglu", "kv_repeat"}


def test_a_dry_run_writes_a_profile_simulate_reads(tmp_path, capsys):
    if not torch.cuda.is_available():
        assert main(["calibrate", "--out", str(tmp_path / "none.json")]) == 1
        assert "no CUDA GPU here" in capsys.readouterr().err
        assert not (tmp_path / "none.json").exists()
    out = tmp_path / "dry.json"
    assert main(["calibrate", "--dry-run", "--no-fusions", "--repeats", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["calibrated"] is False and RATES <= set(data["rates"])
    assert all(e["label"] in LABELS and e["source"] for e in data["rates"].values())
    bench = data["benchmarks"]
    assert len(bench["gemm"]) == 2 and len(bench["attention"]) == 2
    mix, launch = bench["elementwise"], bench["launch"]
    # the memory-bound mix is counted kernel by kernel: norms, rotary, SwiGLU, the loss's
    assert mix["kernels"] > 40 and mix["bytes"] > 0 and "silu" in mix["by_op"]
    assert launch["kernels"] > 100 and launch["kernel_launch_us"] > 0
    hw = load_profile(str(out))
    assert hw.spec == "local" and not hw.fused_swiglu and not hw.calibrated
    assert hw.kernel_launch_us == data["rates"]["kernel_launch_us"]["value"]
    assert main(["simulate", "--gpus", "8", "--global-batch-size", "64", "--gpu-profile",
                 str(out), "--megatron-parallel", "2,1,1,none", "--chunkflow-parallel",
                 "2,1,1,none"]) == 0
    out = capsys.readouterr()
    assert "(not calibrated)" in out.out + out.err


def test_bad_flags_exit_2(tmp_path, capsys):
    assert main(["calibrate", "--dry-run", "--repeats", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert main(["calibrate", "--dry-run", "--out", str(tmp_path / "no" / "x.json")]) == 2
    assert "--out" in capsys.readouterr().err


def test_kernel_families_of_a_profiled_step():
    from megatron_chunkflow.bench.gpu_profile import kernel_family, profile_families

    assert [kernel_family(k) for k in (
        "aten::mm", "aten::addmm", "aten::_flash_attention_forward", "aten::_varlen_attn",
        "aten::_foreach_addcdiv_", "c10d::allreduce_", "aten::mul", "aten::_fused_rms_norm",
        "aten::nll_loss_forward")] == ["gemm", "gemm", "attention", "attention", "optimizer",
                                       "communication", "elementwise", "elementwise", "loss"]
    a = torch.randn(256, 256, requires_grad=True)
    summary = profile_families(lambda: (a @ a).relu().sum().backward(), "cpu")
    assert summary["seconds"]["gemm"] > 0 and "elementwise" in summary["seconds"]
