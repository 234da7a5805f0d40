"""Megatron-LM's own pretrain_gpt.py (tag core_v0.16.1) with the plugin, on CPU with gloo.

Needs a Megatron-LM checkout: MEGATRON_LM_DIR, or third_party/Megatron-LM (`make megatron-lm`);
skipped with that reason otherwise. Each run is a job of the unmodified script through
`python -m megatron_chunkflow.launch` with torchrun's environment, its ranks forked from a process
that has done their imports (tests/megatron_lm/forked.py; the PP 2 layout goes through torchrun
itself); losses are compared with `chunkflow train` on the same indexed data and the same Hugging
Face weights.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_chunkflow import compat
from megatron_chunkflow.mcore.dist import free_port as _free_port
from megatron_chunkflow.megatron_lm.args import LaunchError
from megatron_chunkflow.megatron_lm.plugin import check_versions, checkout_version
from tests.megatron_lm.forked import fork_job

ROOT = Path(__file__).resolve().parents[2]
MEGATRON_LM = Path(os.environ.get(
        "MEGATRON_LM_DIR", ROOT / "third_party" / f"Megatron-LM-{compat.megatron_lm_tag()}"))
needs_megatron_lm = pytest.mark.skipif(
    not (MEGATRON_LM / "pretrain_gpt.py").is_file(),
    reason=f"no Megatron-LM checkout at {MEGATRON_LM} (set MEGATRON_LM_DIR, or `make megatron-lm`)")

LENGTHS = (40, 300, 13, 90, 150, 7, 64, 33, 500, 21, 77, 260, 5, 120, 48, 199)
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "176",
         "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
         "--max-position-embeddings", "512", "--position-embedding-type", "rope",
         "--rotary-base", "1000000", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
         "--swiglu", "--disable-bias-linear", "--add-qkv-bias", "--attention-dropout", "0",
         "--hidden-dropout", "0"]
# NullTokenizer's vocabulary of 1000 ids (the test checkpoint's), as this release counts it
NULL_VOCAB = str(compat.null_tokenizer_vocab_flag(1000))
# what pretrain_gpt.py needs on CPU: gloo, the local spec, no CUDA fusions
CPU = ["--distributed-backend", "gloo", "--transformer-impl", "local", "--no-persist-layer-norm",
       "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
       "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-bias-swiglu-fusion",
       "--use-cpu-initialization", "--tokenizer-type", "NullTokenizer", "--vocab-size", NULL_VOCAB,
       "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1"]
ITERS, GBS, SEQ, C = 4, 4, 512, 128
SCHEDULE = {"--train-iters": ITERS, "--global-batch-size": GBS, "--lr": "1e-3", "--min-lr": "1e-4",
            "--lr-warmup-iters": 1, "--weight-decay": "0.1", "--clip-grad": "1.0", "--seed": 1234,
            "--seq-length": SEQ, "--chunk-size": C, "--chunkflow-k": 1}


def without(flags: list[str], *names: str) -> list[str]:
    """`flags` without each of `names` and its value (the next item, unless it is a flag)."""
    out, skip = [], False
    for i, x in enumerate(flags):
        if skip:
            skip = False
            continue
        if x in names:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            continue
        out.append(x)
    return out


def _flags(d: dict) -> list[str]:
    return [str(x) for kv in d.items() for x in kv]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny random Qwen2 checkpoint (vocab 1000, tied) and an indexed corpus of LENGTHS."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("megatron_lm")
    config = Qwen2Config(hidden_size=64, num_hidden_layers=4, intermediate_size=176,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                         attention_dropout=0.0, dtype=torch.float32)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.05 * torch.randn_like(p))
    model.save_pretrained(path / "hf")
    builder = IndexedDatasetBuilder(str(path / "corpus.bin"), dtype=np.int32)
    g = torch.Generator().manual_seed(0)
    for n in LENGTHS:
        builder.add_item(torch.randint(0, 1000, (n,), generator=g))
        builder.end_document()
    builder.finalize(str(path / "corpus.idx"))
    return path


def _torchrun(nproc: int, module_args: list[str], cwd, timeout=600, env=None, real=False):
    """`torchrun --nproc_per_node nproc -m MODULE ARGS` (module_args: MODULE, ARGS...): its ranks
    forked from a warm process (tests/megatron_lm/forked.py), or with `real` torchrun itself."""
    if not real:
        return fork_job(nproc, module_args[0], module_args[1:], cwd, env, timeout)
    # --standalone: torchrun binds a free port itself (a port chosen here could be taken by
    # another test's connection before torchrun listens on it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), "-m", *module_args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _megatron_losses(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", log)]


# TP, PP, CP[, virtual stages per pipeline rank]
LAYOUTS = {"pp1": (1, 1, 1), "pp2": (1, 2, 1), "tp2": (2, 1, 1), "cp2": (1, 1, 2),
           "pp2_vpp2": (1, 2, 1, 2), "cp2_replicated": (1, 1, 2), "cp2_offload": (1, 1, 2),
           "hybrid_pp1": (1, 1, 1), "hybrid_pp2_vpp2": (1, 2, 1, 2)}
EXTRA = {"cp2_replicated": ["--chunkflow-cp-kv", "replicated"],  # the same in both commands
         "cp2_offload": ["--chunkflow-reforward-attention", "offload"]}
# pretrain_hybrid.py (core_v0.19.0): the same 4 layers as attention + MLP layers, stages as
# segments of the pattern, the local modules (no Transformer Engine on CPU)
HYBRID = {"hybrid_pp1": "*-*-*-*-", "hybrid_pp2_vpp2": "*-|*-|*-|*-"}
HYBRID_FLAGS = ["--spec", "megatron_chunkflow.megatron_lm.specs", "local_stack_spec"]


def _needs_hybrid(layout: str = "hybrid") -> list:
    """pretrain_hybrid.py's cases skip without the script or megatron-core's HybridModel."""
    if not layout.startswith("hybrid"):
        return []
    why = None if (MEGATRON_LM / "pretrain_hybrid.py").is_file() else \
        f"{MEGATRON_LM} has no pretrain_hybrid.py (core_v0.19.0 has)"
    if not compat.has_hybrid_model():
        why = f"megatron-core {compat.version_text()} has no HybridModel (0.18 added it)"
    return [pytest.mark.skip(reason=why)] if why else []


# CI's second megatron-core release runs these layouts (README "Tests"), the rest on the first
# on the second release: HybridModel; PP 2 is test_sft_conversations_at_pp2_..., the other
# process-group shapes the float64 exactness core's
RELEASE_LAYOUTS = tuple(HYBRID)


@needs_megatron_lm
@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param(n, marks=[
    *([pytest.mark.medium] if n == "pp1" else []),
    *([pytest.mark.release] if n in RELEASE_LAYOUTS else []), *_needs_hybrid(n)])
    for n in LAYOUTS])
def test_pretrain_gpt_chunkflow_matches_chunkflow_train(gloo, workdir, layout):
    """The same weights, data, sampler and schedule: the losses agree at float32 precision
    (`chunkflow train` runs in the tests' gloo job of the same size, as under torchrun); the
    hybrid layouts through pretrain_hybrid.py against `chunkflow train --model-class hybrid`."""
    tp, pp, cp, *vpp = LAYOUTS[layout]
    nproc = tp * pp * cp
    par = {"--tensor-model-parallel-size": tp, "--pipeline-model-parallel-size": pp,
           "--context-parallel-size": cp}
    # virtual stages: Megatron-LM's layers-per-virtual-stage flag (4 layers, PP 2: 1 -> V = 2)
    # (a hybrid pattern's segments) against chunkflow train's
    # --num-virtual-stages-per-pipeline-rank
    mlm_vpp = ["--num-layers-per-virtual-pipeline-stage", "1"] if vpp else []
    train_vpp = ["--num-virtual-stages-per-pipeline-rank", str(vpp[0])] if vpp else []
    script, model_class = "pretrain_gpt.py", ["--model-class", "gpt"]
    if layout in HYBRID:
        script, model_class = "pretrain_hybrid.py", ["--model-class", "hybrid"]
        mlm_vpp = ["--hybrid-layer-pattern", HYBRID[layout], *HYBRID_FLAGS]
    mlm = _torchrun(nproc, [
        "megatron_chunkflow.launch", str(MEGATRON_LM / script), *MODEL, *CPU,
        *_flags(SCHEDULE), *_flags(par), *mlm_vpp, "--micro-batch-size", "1",
        "--lr-decay-style", "cosine", "--data-path", "corpus", "--chunkflow",
        "--chunkflow-load-hf", "hf", *EXTRA.get(layout, [])], workdir,
        real=layout == "pp2")  # one layout through torchrun itself
    assert mlm.returncode == 0, mlm.stdout[-3000:] + mlm.stderr[-3000:]
    code, _, err = gloo.cli(nproc, "train", "--load-hf", workdir / "hf", "--data-path",
                            workdir / "corpus", *_flags(SCHEDULE), *_flags(par), *train_vpp,
                            *model_class, *EXTRA.get(layout, []), "--log-json",
                            workdir / f"train_{layout}.jsonl")
    assert code == 0, err[-3000:]
    steps = [json.loads(line) for line in (workdir / f"train_{layout}.jsonl").open()]
    expected = [s["loss"] for s in steps]
    # Megatron-LM logs the first iteration without resetting its running sums, so its second
    # line is the mean of iterations 1 and 2.
    expected[1] = (expected[0] + expected[1]) / 2
    assert _megatron_losses(mlm.stdout) == pytest.approx(expected, rel=1e-5)
    tokens = [s["tokens"] for s in steps]
    tokens[1] = (tokens[0] + tokens[1]) // 2  # the [chunkflow] line keeps Megatron's intervals
    lines = re.findall(r"\[chunkflow\] iteration (\d+) \| tokens (\d+) \|", mlm.stdout)
    assert [int(t) for _, t in lines] == tokens
    assert "--dataloader-type external" in mlm.stdout  # the settings ChunkFlow made are announced


@needs_megatron_lm
@pytest.mark.slow
@pytest.mark.release
def test_stock_path_is_untouched(workdir):
    """Without --chunkflow the plugin's hooks delegate: Megatron's own mock data and schedule."""
    run = _torchrun(1, ["megatron_chunkflow.launch", str(MEGATRON_LM / "pretrain_gpt.py"), *MODEL,
                        *CPU, "--seq-length", "256", "--micro-batch-size", "2",
                        "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
                        "--mock-data"], workdir)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = _megatron_losses(run.stdout)
    assert len(losses) == 2 and all(6 < x < 8 for x in losses)  # ~ln(1000) at the start
    assert "[chunkflow]" not in run.stdout


def _launch_one(workdir, args: list[str], world_size: int = 1, timeout: int = 120):
    """One process (forked warm, tests/megatron_lm/forked.py) that believes it is rank 0 of
    `world_size`: flag checks run before the rendezvous, so a refused run exits without waiting
    for the other ranks."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    return fork_job(1, "megatron_chunkflow.launch", [str(MEGATRON_LM / "pretrain_gpt.py"), *args],
                    workdir, timeout=timeout, rank_env=env)


class Refused:
    """One refused launch's result, as subprocess.run's (returncode, stdout, stderr)."""

    def __init__(self, result: dict):
        self.returncode, self.stdout, self.stderr = (result["code"], result["stdout"],
                                                     result["stderr"])


def launch_many(workdir, cases: dict[str, tuple[list[str], int]],
                timeout: int = 300) -> dict[str, Refused]:
    """Launches that are refused before Megatron builds anything, in one Python process
    (tests/megatron_lm/refusals.py): name -> (args, world size) as _launch_one takes them, args
    starting with the script's name where it is not pretrain_gpt.py."""
    spec = {"cwd": str(workdir), "cases": [
        {"argv": [str(MEGATRON_LM / args[0]) if args[0].endswith(".py") else
                  str(MEGATRON_LM / "pretrain_gpt.py"), *args[args[0].endswith(".py"):]],
         "env": {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR":
                 "127.0.0.1", "MASTER_PORT": str(_free_port())}} for args, world in cases.values()]}
    path = Path(workdir) / f"refusals_{os.getpid()}.json"
    path.write_text(json.dumps(spec))
    run = fork_job(1, "tests.megatron_lm.refusals", [str(path)], ROOT, timeout=timeout,
                   rank_env={})
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    return {name: Refused(r) for name, r in zip(cases, results)}


# the flag checks' refusals, each a case of one batched process (module fixture `refused`)
BAD_INPUT = [
    (["--chunkflow", "--chunkflow-load-hf", "nowhere"],
     "--chunkflow-load-hf nowhere: nowhere/config.json: no such file"),
    (["--chunkflow-load-hf", "not_json"],  # also without --chunkflow
     "--chunkflow-load-hf not_json: not_json/config.json:1: not valid JSON"),
    (["--chunkflow", "--chunkflow-load-hf", "hf", "--num-layers", "2"],
     "--chunkflow-load-hf hf: the model flags do not build this checkpoint's model: "
     "--num-layers 2 (config.json: 4)"),
    (["--chunkflow", "--data-path", "missing.jsonl"],
     "--data-path missing.jsonl: no such file or directory"),
    (["--chunkflow", "--data-path", "corpus.idx"], "--data-path corpus.idx: unknown file type"),
    (["--chunkflow", "--context-parallel-size", "2", "--chunk-size", "126"],
     "--chunkflow cannot run with --chunk-size 126 is not a multiple of 2 x "
     "--context-parallel-size 2 = 4: context parallelism cuts every chunk into 2 x CP equal "
     "pieces; give --chunk-size 124"),
    (["--chunkflow", "--context-parallel-size", "2", "--seq-length", "510"],
     "--chunkflow cannot run with --seq-length 510, not a multiple of 2 x "
     "--context-parallel-size 2"),
    (["--chunkflow", "--sft", "--eval-iters", "2"],
     "--chunkflow cannot run with --sft and --eval-iters 2: Megatron-LM's --sft validation"),
    (["--chunkflow", "--chunkflow-cp-kv", "replicated"],
     "--chunkflow-cp-kv replicated: context-parallel choices, and --context-parallel-size is 1"),
    (["--chunkflow", "--num-experts", "4"],
     "--chunkflow cannot run with --num-experts 4: Megatron's router adds its load-balancing"),
    (["--chunkflow", "--attention-backend", "flash"],
     "--chunkflow-attention-backend flash needs a CUDA GPU; this run is on cpu (use auto) "
     "(carried over from --attention-backend flash)"),
    # pretrain_hybrid.py (core_v0.19.0): a layer pattern ChunkFlow cannot run
    (["pretrain_hybrid.py", "--chunkflow", "--hybrid-layer-pattern", "M-*-G-D-"],
     "--chunkflow cannot run with --hybrid-layer-pattern M-*-G-D-: ChunkFlow runs attention ('*') "
     "and MLP ('-') layers only, not 'D' (DeepSeek sparse attention (DSA)), 'G' (gated delta net "
     "(GDN)), 'M' (Mamba)"),
    (["pretrain_hybrid.py", "--chunkflow", "--hybrid-layer-pattern", "**--"],
     "--chunkflow cannot run with --hybrid-layer-pattern **--: ChunkFlow plans each layer as an "
     "attention layer followed by an MLP layer ('*-'); the stage '**--' is not such layers"),
]
# what Megatron-LM would assert (a traceback) or find at the first save, refused first by flag,
# with and without --chunkflow: (extra flags, processes, message)
PREFLIGHT = [
    (["--global-batch-size", "0"], 1, "--global-batch-size must be >= 1, got 0"),
    ([], 1, "--micro-batch-size is required"),  # left out: Megatron-LM has no default
    (["--chunkflow", "--global-batch-size", "7"], 2,
     "--global-batch-size 7 is not a multiple of --micro-batch-size 1 x 2 data-parallel ranks"),
    (["--global-batch-size", "7"], 2, "--global-batch-size 7 is not a multiple of"),
    (["--tensor-model-parallel-size", "3"], 1, "--tensor-model-parallel-size 3 x "
     "--pipeline-model-parallel-size 1 x --context-parallel-size 1 = 3 processes per model "
     "replica, and this job has 1 (WORLD_SIZE)"),
    (["--chunkflow", "--context-parallel-size", "2"], 1, "= 2 processes per model replica, and "
                                                         "this job has 1"),
    (["--chunkflow", "--num-layers-per-virtual-pipeline-stage", "1"], 1,
     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2"),
    (["--chunkflow", "--save", "a_file"], 1, "--save a_file"),
    (["--save", "a_file"], 1, "--save a_file"),
]
SINGLE_PROCESS = [
    (["--context-parallel-size", "2", "--chunkflow-attention-backend", "flex"],
     "--chunkflow-attention-backend flex: context parallelism recomputes attention"),
]


def _refusal_cases() -> dict[str, tuple[list[str], int]]:
    cases = {"layouts": ([
        *MODEL, *CPU, *_flags(SCHEDULE), "--chunk-size", "127", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--context-parallel-size", "2", "--dataloader-type", "cyclic", "--data-path", "corpus",
        "--hidden-dropout", "0.1", "--chunkflow"], 4),
        "unknown_backend": ([*MODEL, *CPU, *_flags(SCHEDULE), "--micro-batch-size", "1",
                             "--mock-data", "--chunkflow", "--chunkflow-attention-backend",
                             "cudnn"], 1),
        "overlong": ([*MODEL, *CPU, *_flags({**SCHEDULE, "--seq-length": 256,
                                            "--max-position-embeddings": 256}),
                      "--micro-batch-size", "1", "--data-path", "corpus", "--chunkflow"], 1)}
    no_chunk = {k: v for k, v in SCHEDULE.items() if k != "--chunk-size"}
    for i, (extra, _) in enumerate(SINGLE_PROCESS):
        cases[f"single_process_{i}"] = ([*MODEL, *CPU, *_flags(no_chunk), "--micro-batch-size",
                                         "1", "--mock-data", "--chunkflow", *extra], 1)
    for i, (extra, _) in enumerate(BAD_INPUT):
        script = extra[:1] if extra[0].endswith(".py") else []
        if script and not (MEGATRON_LM / script[0]).is_file():
            continue  # the test skips, saying why
        cases[f"bad_input_{i}"] = ([*script, *MODEL, *CPU,
                                    *_flags({**SCHEDULE, "--train-iters": 2}),
                                    "--micro-batch-size", "1",
                                    *([] if "--data-path" in extra else ["--mock-data"]),
                                    *extra[len(script):]], 1)
    for i, (extra, world, _) in enumerate(PREFLIGHT):
        batch = ["--micro-batch-size", "1"] if extra else []  # the case without extra flags
        cases[f"preflight_{i}"] = ([*MODEL, *CPU, *_flags(SCHEDULE), *batch, "--mock-data",
                                    *extra], world)
    return cases


@pytest.fixture(scope="module")
def refused(workdir):
    (workdir / "a_file").write_text("not a directory")
    (workdir / "not_json").mkdir(exist_ok=True)
    (workdir / "not_json" / "config.json").write_text("{not json")
    return launch_many(workdir, _refusal_cases())


@needs_megatron_lm
@pytest.mark.slow
@pytest.mark.release
def test_refused_layouts_name_every_flag(refused):
    run = refused["layouts"]
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    err = run.stderr
    assert "chunkflow-megatron: error: --chunkflow cannot run with" in err
    for needle in ("--micro-batch-size 2", "--chunk-size 127",
                   "--sequence-parallel", "--dataloader-type cyclic", "--hidden-dropout 0.1: give 0"):
        assert needle in err, needle


@needs_megatron_lm
@pytest.mark.slow
def test_unknown_backend_lists_the_choices(refused):
    run = refused["unknown_backend"]
    assert run.returncode == 2
    assert "--chunkflow-attention-backend: invalid choice: 'cudnn'" in run.stderr
    assert "'auto', 'torch', 'cpu_flash', 'sdpa', 'flex', 'varlen', 'flash', 'te'" in run.stderr


@needs_megatron_lm
@pytest.mark.slow
def test_overlong_document_is_named_not_cut(refused):
    run = refused["overlong"]
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "corpus:doc 1: 300 tokens, more than --seq-length 256" in run.stderr
    assert "--overlong split" in run.stderr


@pytest.mark.release
def test_version_check_names_both_versions(tmp_path):
    """A checkout of another release line than the installed megatron-core stops with both
    versions named, unless allowed (a warning); one outside the range likewise."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    other = "0.19.0" if compat.installed() < (0, 19, 0) else "0.16.1"
    major, minor, patch = other.split(".")
    (core / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\n"
                                          "PRE_RELEASE = 'rc1'\n")
    assert checkout_version(tmp_path) == f"{other}rc1"
    with pytest.raises(LaunchError, match=rf"is {other}rc1 and megatron-core .* is "
                                          rf"{compat.version_text()}: the checkout's training "
                                          r"package needs .*--chunkflow-allow-untested-megatron"):
        check_versions(tmp_path, allow_untested=False)
    with pytest.warns(UserWarning, match=f"{other}rc1"):
        check_versions(tmp_path, allow_untested=True)
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 20\nPATCH = 0\n")
    with pytest.raises(LaunchError, match="runs on Megatron-LM core_v0.16.1 and core_v0.19.0"):
        check_versions(tmp_path, allow_untested=False)
    mine = compat.version_text()
    major, minor, patch = mine.split(".")
    (core / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\n")
    check_versions(tmp_path, allow_untested=False)  # the same release: no word
    with pytest.raises(LaunchError, match="not a Megatron-LM checkout"):
        checkout_version(tmp_path / "elsewhere")


@needs_megatron_lm
@pytest.mark.slow
def test_a_megatron_that_skips_the_plugins_checks_stops(workdir, tmp_path):
    """A Megatron-LM whose training loop validates its arguments through a function the plugin did
    not patch stops before building a model, naming the supported versions, instead of training
    with --chunkflow unchecked."""
    driver = tmp_path / "driver.py"
    driver.write_text(f"""
import sys
from megatron_chunkflow.megatron_lm import launcher, plugin
plugin.install({str(MEGATRON_LM)!r})
from megatron.training import arguments, initialize
original = next(c.cell_contents for c in arguments.validate_args.__closure__
                if getattr(c.cell_contents, "__module__", "") == "megatron.training.arguments")
arguments.validate_args = initialize.validate_args = original
sys.exit(launcher.launch(sys.argv[1:], "driver", "driver"))
""")
    args = [*MODEL, *CPU, *_flags({**SCHEDULE, "--train-iters": 1}), "--micro-batch-size", "1",
            "--mock-data", "--chunkflow"]
    run = subprocess.run([sys.executable, str(driver), str(MEGATRON_LM / "pretrain_gpt.py"),
                          *args], cwd=workdir, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "did not run the plugin's argument checks" in run.stderr
    assert "supports Megatron-LM core_v0.16.1 and core_v0.19.0" in run.stderr


def test_launcher_usage_errors(tmp_path):
    run = subprocess.run([sys.executable, "-m", "megatron_chunkflow.launch",
                          str(tmp_path / "pretrain_gpt.py")], capture_output=True, text=True)
    assert run.returncode == 2 and "no such script" in run.stderr
    run = subprocess.run([sys.executable, "-m", "megatron_chunkflow.launch"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "usage:" in run.stderr


@needs_megatron_lm
@pytest.mark.slow
@pytest.mark.release
def test_patched_pretrain_gpt_runs_chunkflow(workdir, tmp_path):
    """patches/pretrain_gpt.chunkflow.patch applies to the checkout (core_v0.16.1 or
    core_v0.19.0), and the patched script, run directly (no launcher), trains with --chunkflow."""
    patch = ROOT / "patches" / "pretrain_gpt.chunkflow.patch"
    checkout = tmp_path / "Megatron-LM"  # the checkout's modules, the patched script beside them
    checkout.mkdir()
    for name in ("megatron", "gpt_builders.py", "model_provider.py"):
        (checkout / name).symlink_to(MEGATRON_LM / name)
    (checkout / "pretrain_gpt.py").write_text((MEGATRON_LM / "pretrain_gpt.py").read_text())
    applied = subprocess.run(["git", "apply", str(patch)], cwd=checkout,
                             capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    assert "install_chunkflow(" in (checkout / "pretrain_gpt.py").read_text()
    hybrid = MEGATRON_LM / "pretrain_hybrid.py"
    if hybrid.is_file():  # core_v0.19.0: the same hunk
        (checkout / hybrid.name).write_text(hybrid.read_text())
        applied = subprocess.run(["git", "apply", str(ROOT / "patches" / f"{hybrid.stem}.chunkflow."
                                                      "patch")], cwd=checkout, capture_output=True,
                                 text=True)
        assert applied.returncode == 0, applied.stderr
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    run = subprocess.run([sys.executable, str(checkout / "pretrain_gpt.py"), *MODEL, *CPU,
                          *_flags(SCHEDULE), "--train-iters", "2", "--micro-batch-size", "1",
                          "--mock-data", "--chunkflow"], cwd=workdir, capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert len(_megatron_losses(run.stdout)) == 2
    assert len(re.findall(r"\[chunkflow\] iteration", run.stdout)) == 2


def _chat_corpus(directory: Path) -> None:
    """A word-level Hugging Face tokenizer with the ChatML specials, a Qwen2 checkpoint of its
    vocabulary, and a JSONL of conversations (one longer than the chunk size)."""
    import tokenizers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    words = ["[UNK]", "system", "user", "assistant", "hello", "there", "you", "are", "qwen"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    (directory / "tok").mkdir()
    tok.save(str(directory / "tok" / "tokenizer.json"))
    (directory / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    config = Qwen2Config(hidden_size=64, num_hidden_layers=4, intermediate_size=176,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=12,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                         dtype=torch.float32)
    torch.manual_seed(1)
    Qwen2ForCausalLM(config).save_pretrained(directory / "hf_chat")
    g = torch.Generator().manual_seed(1)
    with (directory / "chat.jsonl").open("w") as f:
        for i in range(12):
            n = int(torch.randint(2, 60, (1,), generator=g)) * (8 if i == 3 else 1)
            reply = " ".join(words[4 + int(j)] for j in torch.randint(0, 5, (n,), generator=g))
            f.write(json.dumps({"messages": [{"role": "user", "content": "hello you"},
                                             {"role": "assistant", "content": reply}]}) + "\n")


@needs_megatron_lm
@pytest.mark.slow
@pytest.mark.release
def test_sft_conversations_at_pp2_with_the_distributed_optimizer(gloo, workdir):
    """`--sft` JSONL conversations through Megatron's HuggingFaceTokenizer flags (ChatML,
    assistant-only loss), PP 2, Megatron's distributed optimizer: the same losses as `chunkflow
    train --tokenizer DIR --pp 2` on the same file and weights."""
    pytest.importorskip("tokenizers")
    if not (workdir / "chat.jsonl").exists():
        _chat_corpus(workdir)
    sched = {**SCHEDULE, "--train-iters": 3}
    cpu = [*without(CPU, "--tokenizer-type", "--vocab-size"), "--tokenizer-type",
           "HuggingFaceTokenizer", "--tokenizer-model", "tok"]
    mlm = _torchrun(2, ["megatron_chunkflow.launch", str(MEGATRON_LM / "pretrain_gpt.py"), *MODEL,
                        *cpu, *_flags(sched), "--micro-batch-size", "1", "--data-path",
                        "chat.jsonl", "--sft", "--pipeline-model-parallel-size", "2",
                        "--use-distributed-optimizer", "--chunkflow", "--chunkflow-load-hf",
                        "hf_chat"], workdir)
    assert mlm.returncode == 0, mlm.stdout[-3000:] + mlm.stderr[-3000:]
    assert "--sft: ChunkFlow reads --data-path itself" in mlm.stdout
    code, _, err = gloo.cli(2, "train", "--load-hf", workdir / "hf_chat", "--tokenizer",
                            workdir / "tok", "--data-path", workdir / "chat.jsonl",
                            "--pipeline-model-parallel-size", "2", "--model-class", "gpt",
                            *_flags(sched), "--log-json", workdir / "chat.jsonl.log")
    assert code == 0, err[-3000:]
    expected = [json.loads(line)["loss"] for line in (workdir / "chat.jsonl.log").open()]
    expected[1] = (expected[0] + expected[1]) / 2
    assert _megatron_losses(mlm.stdout) == pytest.approx(expected, rel=1e-5)


@needs_megatron_lm
@pytest.mark.slow
@pytest.mark.release
def test_torch_dist_checkpoint_save_and_resume(workdir, tmp_path):
    """Megatron-LM's default checkpoint format (torch_dist) through the launcher on CPU: its
    writer spawns a helper process, which must not re-import pretrain_gpt.py without the CPU
    shims. Two iterations, a save, a resume: iterations 3-4 train as in an unbroken run. With
    --chunkflow (the shims and the checkpoint seams are the same without it, whose steps
    test_stock_path_is_untouched checks)."""
    args = [*MODEL, *CPU, *_flags({**SCHEDULE, "--seq-length": 256, "--chunk-size": 64}),
            "--micro-batch-size", "1", "--mock-data", "--save-interval", "2", "--chunkflow"]
    whole = _launch_one(workdir, args, timeout=300)  # unbroken, unsaved: the reference losses
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    ckpt = str(tmp_path / "ckpt")
    first = _launch_one(workdir, [*args, "--save", ckpt, "--load", ckpt, "--exit-interval", "2"],
                        timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "in torch_dist format" in first.stdout
    resumed = _launch_one(workdir, [*args, "--save", ckpt, "--load", ckpt], timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "successfully loaded checkpoint" in resumed.stdout
    expected = _megatron_losses(whole.stdout)
    got = _megatron_losses(resumed.stdout)
    assert len(expected) == ITERS and len(got) == 2
    # the first line after a (re)start keeps Megatron's running sums: iteration 4's line is the
    # mean of iterations 3 and 4, as iteration 2's is of 1 and 2 in the unbroken run
    assert got == pytest.approx([expected[2], (expected[2] + expected[3]) / 2], rel=1e-5)


@needs_megatron_lm
def test_cpu_shim_has_the_memory_stats_megatron_logs():
    """--log-memory-to-tensorboard reads these torch.cuda.memory_stats() keys in training_log."""
    source = (MEGATRON_LM / "megatron" / "training" / "training.py").read_text()
    keys = set(re.findall(r'mem_stats\["([^"]+)"\]', source))
    assert keys
    code = ("import torch, json; from megatron_chunkflow.megatron_lm.cpu import "
            "install_megatron_lm_cpu_shims as i; i(); print(json.dumps(torch.cuda.memory_stats()))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert keys <= set(stats)


@needs_megatron_lm
@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(SINGLE_PROCESS)))
def test_single_process_refusal_comes_before_megatrons_assertion(refused, case):
    """One process with CP 2 (and a backend that cannot run it): Megatron's own
    world-size assertion would fire first; the plugin's refusal is what the user sees, with the
    defaulted chunk size named as the default."""
    needle = SINGLE_PROCESS[case][1]
    run = refused[f"single_process_{case}"]
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "AssertionError" not in run.stderr
    assert needle in run.stderr
    assert "--chunk-size 8192 (the default) above --seq-length 512: give --chunk-size 512 or " \
           "less" in run.stderr


@needs_megatron_lm
@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(PREFLIGHT)))
def test_megatrons_assertions_come_first_by_flag(refused, case):
    """What Megatron-LM's validate_args asserts (a traceback, exit 1) or finds at the first save
    (--save), refused before anything is built, with and without --chunkflow: exit 2, one line."""
    run = refused[f"preflight_{case}"]
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stderr + run.stdout
    assert "chunkflow-megatron: error: " in run.stderr and PREFLIGHT[case][2] in run.stderr


@needs_megatron_lm
@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(i, marks=_needs_hybrid(
    "hybrid" if extra[0].endswith(".py") else "")) for i, (extra, _) in enumerate(BAD_INPUT)],
                         ids=[needle.split(":")[0] for _, needle in BAD_INPUT])
def test_launcher_bad_input_exits_2_without_a_traceback(refused, case):
    needle = BAD_INPUT[case][1]
    run = refused[f"bad_input_{case}"]
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stderr + run.stdout
    assert "chunkflow-megatron: error: " + needle in run.stderr
    if needle.startswith("--data-path"):  # found by the flag checks, before any model is built
        assert "building GPT model" not in run.stdout + run.stderr
