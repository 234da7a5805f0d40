"""scripts/slurm: train.sbatch's dry run (the command each system gets) and submit.sh's checks,
which run before anything is submitted (a fake `sbatch` on PATH logs what would be).

    .venv/bin/python -m pytest tests/scripts/test_slurm.py -q
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.test_configs import (
    REPO,
    RUNS,
    SBATCH,
    SUBMIT,
    SYSTEMS_CONTEXTS,
    flags,
    run_config,
)


def dry_run(tmp_path, **env) -> subprocess.CompletedProcess:
    base = {"DRY_RUN": "1", "MEGATRON_LM_DIR": "/opt/Megatron-LM", "OUT": str(tmp_path),
            "DATA": "/data/sft/prefix", "REPO_DIR": str(REPO)}
    return subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True,
                          env={**os.environ, **base, **env})


@pytest.mark.parametrize("context,system,model", [(c, s, m) for c, s in SYSTEMS_CONTEXTS
                                                  for m in RUNS[c]])
def test_sbatch_dry_run_command(tmp_path, context, system, model):
    result = dry_run(tmp_path, MODEL=model, CONTEXT=context, SYSTEM=system,
                     CHECKPOINT="/ckpt/megatron", TOKENIZER="/ckpt/hf")
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout.splitlines()[-1])
    rc = run_config(REPO / "configs" / "runs" / f"h100_{context}_{system}.sh", model)
    assert words[:3] == ["srun", "--nodes", str(rc["nodes"])]
    torchrun = words.index("torchrun")
    assert words[torchrun + 1:torchrun + 5] == ["--nnodes", str(rc["nodes"]),
                                                "--nproc-per-node", "8"]
    if system == "chunkflow":
        start = words.index("-m")
        assert words[start:start + 3] == ["-m", "megatron_chunkflow.launch",
                                          "/opt/Megatron-LM/pretrain_gpt.py"]
        argv = words[start + 3:]
    else:
        assert "-m" not in words and "--chunkflow" not in words
        argv = words[words.index("/opt/Megatron-LM/pretrain_gpt.py") + 1:]
    f = flags(argv)
    assert f["--load"] == "/ckpt/megatron" and f["--finetune"] is True
    assert f["--tokenizer-model"] == "/ckpt/hf"
    assert f["--data-path"] == "/data/sft/prefix"
    assert f["--tensorboard-dir"].startswith(str(tmp_path))
    assert f == {**f, **flags(rc["parallel_args"] + rc["training_args"] + rc["chunkflow_args"])}
    if system == "chunkflow":
        assert f["--dataloader-type"] == "external"


def test_sbatch_refuses_jsonl_for_stock(tmp_path):
    result = dry_run(tmp_path, MODEL="qwen2.5-7b", CONTEXT="32k", SYSTEM="stock",
                     DATA="/data/sft.jsonl")
    assert result.returncode == 2 and "indexed dataset" in result.stderr


def test_sbatch_chunkflow_text_data_needs_a_tokenizer_directory(tmp_path):
    kw = dict(MODEL="qwen2.5-7b", CONTEXT="32k", SYSTEM="chunkflow", DATA="/data/sft.jsonl")
    result = dry_run(tmp_path, **kw)
    assert result.returncode == 2 and "needs TOKENIZER" in result.stderr
    result = dry_run(tmp_path, **kw, TOKENIZER=str(tmp_path))
    assert result.returncode == 0, result.stderr


def test_sbatch_mock_data_uses_the_context_profile(tmp_path):
    result = dry_run(tmp_path, MODEL="qwen2.5-7b", CONTEXT="256k", SYSTEM="chunkflow", MOCK="1",
                     DATA="")
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout.splitlines()[-1])
    f = flags(words[words.index("-m") + 3:])
    assert f["--mock-data"] is True and f["--chunkflow-mock-profile"] == "B"
    assert "--data-path" not in f


def test_sbatch_names_missing_variables(tmp_path):
    result = dry_run(tmp_path, MODEL="qwen2.5-7b", CONTEXT="64k", SYSTEM="stock")
    assert result.returncode == 2 and "h100_64k_stock.sh" in result.stderr
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    result = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True,
                            env={**env, "MODEL": "qwen2.5-7b", "CONTEXT": "32k",
                                 "SYSTEM": "stock", "MEGATRON_LM_DIR": "/x"})
    assert result.returncode != 0 and "OUT" in result.stderr


# the variables submit.sh reads; each test sets its own
SUBMIT_VARS = ("MEGATRON_LM_DIR", "OUT", "DATA", "MOCK", "TOKENIZER", "CHECKPOINT", "VENV", "HW",
               "TRAIN_ITERS", "SAVE_INTERVAL", "MASTER_PORT", "OVERLONG", "DRY_RUN", "EXTRA_ARGS",
               "CHUNKFLOW_ATTENTION_BACKEND", "SLURM_NNODES", "SLURM_JOB_NODELIST", "PYTHON")


@pytest.fixture
def submit_env(tmp_path):
    """A valid environment for submit.sh (a stub Megatron-LM checkout, an indexed prefix, a chat
    JSONL, a tokenizer directory) and a fake `sbatch` on PATH that logs its arguments."""
    (tmp_path / "Megatron-LM").mkdir()
    (tmp_path / "Megatron-LM" / "pretrain_gpt.py").write_text("")
    (tmp_path / "data").mkdir()
    for name in ("train_text_document.bin", "train_text_document.idx", "chat.jsonl"):
        (tmp_path / "data" / name).write_text("")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "bin").mkdir()
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text('#!/bin/bash\necho "$*" >> "$SBATCH_CALLS"\necho "Submitted batch job 1"\n')
    sbatch.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in SUBMIT_VARS}
    env.update(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
               SBATCH_CALLS=str(tmp_path / "sbatch_calls"),
               MEGATRON_LM_DIR=str(tmp_path / "Megatron-LM"), OUT=str(tmp_path / "out"),
               DATA=str(tmp_path / "data" / "train_text_document"))
    return env


def submit(env: dict, *args: str, **overrides) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run submit.sh; its result and the fake sbatch's calls (one string each)."""
    env = {**env, **overrides}
    for name in [k for k, v in overrides.items() if v is None]:
        del env[name]
    result = subprocess.run([str(SUBMIT), *args], capture_output=True, text=True, env=env)
    calls = Path(env["SBATCH_CALLS"])
    return result, (calls.read_text().splitlines() if calls.exists() else [])


def test_submit_submits_both_systems_on_an_indexed_prefix(submit_env):
    result, calls = submit(submit_env, "qwen2.5-7b", "32k", "both", "--time", "01:00:00")
    assert result.returncode == 0, result.stderr
    assert [c.split()[:4] for c in calls] == [
        ["--nodes", "2", "--job-name", "qwen2.5-7b_32k_stock"],
        ["--nodes", "2", "--job-name", "qwen2.5-7b_32k_chunkflow"]]
    assert all(c.endswith(f"--time 01:00:00 {SBATCH}") for c in calls)


def test_submit_chunkflow_on_jsonl_and_mock_data(submit_env, tmp_path):
    chat = str(tmp_path / "data" / "chat.jsonl")
    result, calls = submit(submit_env, "qwen2.5-7b", "32k", "chunkflow", DATA=chat,
                           TOKENIZER=str(tmp_path / "tok"))
    assert result.returncode == 0, result.stderr
    assert len(calls) == 1
    Path(submit_env["SBATCH_CALLS"]).unlink()
    result, calls = submit(submit_env, "qwen2.5-7b", "256k", "both", DATA=None, MOCK="1")
    assert result.returncode == 0, result.stderr
    assert len(calls) == 2


@pytest.mark.parametrize("args,env,message", [
    (("qwen2.5-7b", "32k", "both"), dict(MEGATRON_LM_DIR=None), "MEGATRON_LM_DIR is not set"),
    (("qwen2.5-7b", "32k", "both"), dict(MEGATRON_LM_DIR="{tmp}"),
     "MEGATRON_LM_DIR={tmp} has no pretrain_gpt.py"),
    (("qwen2.5-7b", "32k", "both"), dict(OUT=None), "OUT is not set"),
    (("qwen2.5-7b", "32k", "both"), dict(OUT="{tmp}/tok/tokenizer.json"), "OUT={tmp}/tok/"),
    (("qwen2.5-7b", "32k", "both"), dict(DATA=None), "DATA is not set"),
    (("qwen2.5-7b", "32k", "both"), dict(DATA="{tmp}/data/missing"),
     "DATA={tmp}/data/missing: no such file or directory"),
    (("qwen2.5-7b", "32k", "both"), dict(DATA="{tmp}/data/train_text_document.bin"),
     "give the indexed-dataset prefix without .bin/.idx"),
    # the README's old example: a chat JSONL for both systems
    (("qwen2.5-7b", "32k", "both"), dict(DATA="{tmp}/data/chat.jsonl", TOKENIZER="{tmp}/tok"),
     "DATA={tmp}/data/chat.jsonl: stock Megatron-LM reads only an indexed-dataset prefix"),
    (("qwen2.5-7b", "32k", "stock"), dict(DATA="{tmp}/data"), "DATA={tmp}/data: stock"),
    (("qwen2.5-7b", "32k", "chunkflow"), dict(DATA="{tmp}/data/chat.jsonl"),
     "TOKENIZER='': ChunkFlow on DATA={tmp}/data/chat.jsonl needs"),
    (("qwen2.5-7b", "32k", "chunkflow"), dict(DATA="{tmp}/Megatron-LM/pretrain_gpt.py"),
     "DATA={tmp}/Megatron-LM/pretrain_gpt.py: ChunkFlow reads .jsonl"),
    (("qwen2.5-7b", "32k", "both"), dict(TOKENIZER="/no/such/model"),
     "TOKENIZER=/no/such/model: no such directory"),
    (("qwen2.5-7b", "32k", "both"), dict(CHECKPOINT="{tmp}/no-ckpt"), "CHECKPOINT={tmp}/no-ckpt"),
    (("qwen2.5-7b", "32k", "both"), dict(VENV="{tmp}/venv"), "VENV={tmp}/venv: no bin/activate"),
    (("qwen2.5-7b", "32k", "both"), dict(TRAIN_ITERS="1e3"), "TRAIN_ITERS=1e3: not a whole number"),
    (("qwen2.5-7b", "32k", "both"), dict(SAVE_INTERVAL="0"), "SAVE_INTERVAL=0: not a whole number"),
    (("qwen2.5-7b", "32k", "both"), dict(MASTER_PORT="70000"), "MASTER_PORT=70000: not a port"),
    (("qwen2.5-7b", "32k", "both"), dict(MOCK="yes"), "MOCK=yes: give 1"),
    (("qwen2.5-7b", "32k", "chunkflow"), dict(OVERLONG="truncate"), "OVERLONG=truncate: give"),
    (("qwen2.5-8b", "32k", "both"), {}, "MODEL 'qwen2.5-8b': no configs/models/qwen2.5-8b.sh"),
    (("qwen2.5-3b", "32k", "both"), {}, "MODEL 'qwen2.5-3b': configs/runs/h100_32k_stock.sh: "
                                        "no layout for model 'qwen2.5-3b'"),
    # the first model's jobs are fine, the second's are not: nothing is submitted
    (("qwen2.5-7b qwen2.5-3b", "32k", "both"), {}, "MODEL 'qwen2.5-3b'"),
    (("qwen2.5-7b", "64k", "both"), {}, "CONTEXT '64k': no run config"),
    (("qwen2.5-7b", "32k", "all"), {}, "SYSTEM 'all': give chunkflow, stock or both"),
    (("qwen2.5-7b", "32k", "both"), dict(HW="a100"), "configs/runs/a100_32k_stock.sh (HW=a100"),
    (("qwen2.5-7b", "32k", "chunkflow"), dict(CHUNKFLOW_ATTENTION_BACKEND="cudnn"),
     "CHUNKFLOW_ATTENTION_BACKEND=cudnn: give auto"),
    (("qwen2.5-7b", "32k", "both"), dict(EXTRA_ARGS="--lr 1e-4 --chunk-size 0",
                                         PYTHON=sys.executable),
     "EXTRA_ARGS: --chunk-size must be >= 1, got 0"),
    (("qwen2.5-7b", "32k", "chunkflow"), dict(EXTRA_ARGS="--chunkflow-cp-kv both",
                                              PYTHON=sys.executable),
     "argument --chunkflow-cp-kv: invalid choice: 'both'"),
])
def test_submit_checks_everything_before_submitting(submit_env, tmp_path, args, env, message):
    env = {k: v if v is None else v.format(tmp=tmp_path) for k, v in env.items()}
    result, calls = submit(submit_env, *args, **env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("submit.sh: ")
    assert message.format(tmp=tmp_path) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert calls == [] and result.stdout == ""


def test_a_failed_sbatch_says_what_is_already_queued(submit_env, tmp_path):
    """The second of two sbatch calls fails: exit 1, naming the failed command and the job the
    first call queued (so the user does not submit it twice)."""
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text('#!/bin/bash\n[[ "$*" == *_chunkflow* ]] && { echo "sbatch: error: '
                      'QOSMaxJobsPerUserLimit" >&2; exit 1; }\necho "$*" >> "$SBATCH_CALLS"\n')
    result, calls = submit(submit_env, "qwen2.5-7b", "32k", "both", EXTRA_ARGS="--lr 1e-4",
                           PYTHON=sys.executable)
    assert result.returncode == 1 and len(calls) == 1, result.stderr
    assert "submit.sh: sbatch failed: sbatch --nodes 2 --job-name qwen2.5-7b_32k_chunkflow" \
        in result.stderr
    assert "submit.sh: already queued (1): qwen2.5-7b_32k_stock" in result.stderr


def test_submit_without_sbatch_or_arguments(submit_env):
    path = os.pathsep.join(p for p in submit_env["PATH"].split(os.pathsep)[1:]
                           if not (Path(p) / "sbatch").exists())
    result, calls = submit(submit_env, "qwen2.5-7b", "32k", "both", PATH=path)
    assert result.returncode == 2 and "sbatch not found on PATH" in result.stderr
    result, _ = submit(submit_env, "qwen2.5-7b", "32k", "both", PATH=path, DRY_RUN="1")
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 2
    result, calls = submit(submit_env, "qwen2.5-7b", "32k")
    assert result.returncode == 2 and "MODEL CONTEXT SYSTEM" in result.stderr and calls == []


def test_submit_all_dry_run(submit_env):
    result, calls = submit(submit_env, "all", "all", "both", "--time", "04:00:00", DRY_RUN="1")
    assert result.returncode == 0, result.stderr
    assert calls == []
    lines = [shlex.split(line) for line in result.stdout.splitlines()]
    assert len(lines) == 2 * sum(len(models) for models in RUNS.values())  # every row, both
    for words in lines:
        model, context, system = words[words.index("--job-name") + 1].split("_")
        rc = run_config(REPO / "configs" / "runs" / f"h100_{context}_{system}.sh", model)
        assert words[:3] == ["sbatch", "--nodes", str(rc["nodes"])]
        assert words[-3:] == ["--time", "04:00:00", str(SBATCH)]


def test_sbatch_header_names_the_jobs_own_data_parallel_size(tmp_path):
    """A job of another node count than its layout was sized for: the header says the DP that
    torchrun will run, and a count TP x PP x CP does not divide stops before anything runs."""
    kw = dict(MODEL="qwen2.5-7b", CONTEXT="32k", SYSTEM="chunkflow", TOKENIZER="/ckpt/hf")
    rc = run_config(REPO / "configs" / "runs" / "h100_32k_chunkflow.sh", "qwen2.5-7b")
    sized = dry_run(tmp_path, **kw)
    assert f"DP={rc['dp']}," in sized.stdout.splitlines()[0]
    doubled = dry_run(tmp_path, **kw, SLURM_NNODES=str(2 * rc["nodes"]))
    assert doubled.returncode == 0, doubled.stderr
    assert f"DP={2 * rc['dp']}," in doubled.stdout.splitlines()[0]
    assert "the data-parallel size" in doubled.stderr
    odd = dry_run(tmp_path, MODEL="qwen2.5-72b", CONTEXT="256k", SYSTEM="chunkflow",
                  TOKENIZER="/ckpt/hf", SLURM_NNODES="3")
    assert odd.returncode == 2 and "3 nodes x 8 GPUs is not a multiple of TP x PP x CP" in \
        odd.stderr
