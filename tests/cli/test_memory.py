"""`chunkflow memory`: a job traced on this machine beside the model, and the verdict on a GPU.

    python -m pytest tests/cli/test_memory.py -q
"""

import json

import pytest

from megatron_chunkflow.cli import main

pytestmark = pytest.mark.slow
# Qwen2.5-1.5B's widths and vocabulary at 4 layers: seconds to trace
SHAPE = {"num_layers": 4, "hidden_size": 1536, "ffn_hidden_size": 8960,
         "num_attention_heads": 12, "num_query_groups": 2, "vocab_size": 151936,
         "tie_embeddings": True}


def _run(capsys, tmp_path, *argv):
    config = tmp_path / "shape.json"
    config.write_text(json.dumps(SHAPE))
    rc = main(["memory", "--model-config", str(config), "--seq-length", "16384",
               "--chunk-size", "4096", "--global-batch-size", "24", "--fast", "--json",
               *map(str, argv)])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if out.out.strip() else None), out.err


def test_a_job_that_fits(capsys, tmp_path):
    rc, obj, err = _run(capsys, tmp_path, "--chunkflow-k", 2)
    assert rc == 0 and obj["fits"] and obj["gpu"] == "h200"
    (rank, trace), = obj["ranks"].items()
    assert rank == "0" and trace["peak_phase"] in ("forward", "loss", "backward")
    assert trace["peak_allocated"] <= trace["needed"] <= obj["capacity_gib"] * 2**30
    assert obj["predicted"]["peak_mem_gib"] * 2**30 == pytest.approx(trace["peak_allocated"],
                                                                      rel=0.05)
    assert "fits" in err and "largest activations" in err


def test_a_job_that_does_not_fit_names_one_that_does(capsys, tmp_path):
    rc, obj, err = _run(capsys, tmp_path, "--chunk-size", 16384, "--gpu-set", "memory_gib=16")
    assert rc == 1 and not obj["fits"]
    assert "does NOT fit" in err and "the nearest plan the model finds that fits: --tp 1 " in err
    assert "--chunk-size" in err.split("fits: ")[-1]


def test_the_traced_ranks_are_the_models_worst_stages(capsys, tmp_path):
    rc, obj, _ = _run(capsys, tmp_path, "--tensor-model-parallel-size", 2,
                      "--pipeline-model-parallel-size", 2, "--sequence-parallel", "--world", 8)
    # 8 GPUs: TP 2, PP 2, DP 2; one DP rank, its first TP rank of each pipeline stage
    assert rc == 0 and len(obj["ranks"]) == 2
    stages = sorted(t["ranks"]["pp_rank"] for t in obj["ranks"].values())
    dp = {t["ranks"]["dp_rank"] for t in obj["ranks"].values()}
    assert stages == [0, 1] and len(dp) == 1 and obj["predicted"]["layout"]


@pytest.mark.parametrize("argv, message", [
    (["--world", 3, "--tensor-model-parallel-size", 2], "world size 3 is not a multiple"),
    (["--rank", 8, "--world", 8], "--rank 8 is not a rank of this job's 8 GPU(s) (0 to 7"),
    (["--rank", -1], "--rank -1 is not a rank of this job's 1 GPU(s)"),
    (["--stack", "torch-9"], "--stack 'torch-9': known stacks are"),
    (["--gpu-set", "memory_gib=1", "--gpu-set", "reserve_gib=2"], "reserve_gib 2.0 leaves"),
])
def test_bad_input_is_named(capsys, tmp_path, argv, message):
    rc, obj, err = _run(capsys, tmp_path, *argv)
    assert rc == 2 and obj is None and message in err and "Traceback" not in err
