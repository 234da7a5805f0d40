"""Shipped configs (for Megatron-LM's pretrain_gpt.py); the SLURM scripts are in test_slurm.py.

    .venv/bin/python -m pytest tests/scripts/test_configs.py -q

Every configs/models/*.sh (Qwen2.5, Qwen3, Llama 3.x, Mistral) must be exactly what
scripts/gen_model_configs.py writes from core/models.py (`make configs` regenerates them). Each is
also parsed by bash and checked against core/models.HF_MODELS (the Hugging Face shapes), then built
at 2 layers as a real megatron-core
GPTModel on the meta device (no memory: the 72B embedding alone is 1.2B parameters). With a
Megatron-LM checkout (MEGATRON_LM_DIR, or third_party/Megatron-LM) its own parser, validate_args
and gpt_builder also read every model and run config, and its RoPE frequencies are transformers'.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from megatron_chunkflow.config import AttentionBackend
from megatron_chunkflow.core.models import HF_CARDS, HF_MODELS, ModelShape
from megatron_chunkflow.mcore.dist import run_processes

REPO = Path(__file__).resolve().parents[2]
MODEL_FILES = {p.stem: p for p in sorted((REPO / "configs" / "models").glob("*.sh"))}
RUN_FILES = sorted((REPO / "configs" / "runs").glob("h100_*.sh"))
CONTEXTS = {"32k": 32768, "128k": 131072, "256k": 262144}  # configs/runs/h100_{context}_*.sh


def run_models(context: str) -> list[str]:
    """The models of a context's LAYOUT tables (the ChunkFlow file's, in its order)."""
    text = (REPO / "configs" / "runs" / f"h100_{context}_chunkflow.sh").read_text()
    return re.findall(r'^\s*\[([\w.\-]+)\]="', text, re.M)


RUNS = {c: run_models(c) for c in CONTEXTS}
RUN_CASES = [(run_file, model) for run_file in sorted(
    (REPO / "configs" / "runs").glob("h100_*.sh")) for model in RUNS[run_file.stem.split("_")[1]]]
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
SUBMIT = REPO / "scripts" / "slurm" / "submit.sh"
SHELL_FILES = [*MODEL_FILES.values(), REPO / "configs" / "runs" / "common.sh", *RUN_FILES,
               SBATCH, SUBMIT]
SYSTEMS_CONTEXTS = [(c, s) for c in CONTEXTS for s in ("stock", "chunkflow")]
BACKENDS = typing.get_args(AttentionBackend)  # --chunkflow-attention-backend's choices


def bash(script: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=REPO, text=True,
                          capture_output=True, check=check,
                          env={**os.environ, **(env or {})})


def bash_arrays(script: str, *names: str) -> list[list[str]]:
    """The bash arrays `names` after running `script`, each as a list of words."""
    out = bash(f"{script}\n{_print_arrays(names)}").stdout
    return [part.split("\0")[:-1] for part in out.split("@@")]


def _print_arrays(names) -> str:
    """Bash that prints each array's words NUL-terminated, arrays separated by '@@'."""
    return "; echo -n '@@'; ".join(f'for w in "${{{n}[@]}}"; do printf "%s\\0" "$w"; done'
                                   for n in names)


MULTI_VALUE = {"--recompute-modules"}  # Megatron-LM's nargs="+" flags among those written here


def flags(argv: list[str]) -> dict[str, str | bool | list[str]]:
    """--flag value / --flag (True) / --flag v1 v2 (a list, MULTI_VALUE flags only); a later
    occurrence wins, as in argparse."""
    out, i = {}, 0
    while i < len(argv):
        assert argv[i].startswith("--"), f"stray word {argv[i]!r} in {argv}"
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        values = argv[i + 1:j]
        assert len(values) <= 1 or argv[i] in MULTI_VALUE, f"stray words {values[1:]} in {argv}"
        out[argv[i]] = (values if argv[i] in MULTI_VALUE else values[0]) if values else True
        i = j
    return out


def model_args(name: str) -> list[str]:
    return bash_arrays(f"source {MODEL_FILES[name]}", "MODEL_ARGS")[0]


def shape_from_flags(f: dict) -> ModelShape:
    """The ModelShape a parsed MODEL_ARGS describes (vocabulary: the padded one)."""
    return ModelShape(
        num_layers=int(f["--num-layers"]), hidden_size=int(f["--hidden-size"]),
        ffn_hidden_size=int(f["--ffn-hidden-size"]),
        num_attention_heads=int(f["--num-attention-heads"]),
        num_query_groups=int(f["--num-query-groups"]), vocab_size=int(f["--padded-vocab-size"]),
        tie_embeddings="--untie-embeddings-and-output-weights" not in f,
        qkv_bias="--add-qkv-bias" in f, rotary_base=float(f["--rotary-base"]),
        norm_eps=float(f["--norm-epsilon"]), kv_channels=int(f["--kv-channels"]),
        qk_norm="--qk-layernorm" in f,
        rope_scaling_factor=float(f["--rope-scaling-factor"]) if "--use-rope-scaling" in f else None)


# ---- shell syntax -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_bash_syntax(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---- model configs ------------------------------------------------------------------------------


def test_every_model_has_a_model_config():
    assert sorted(MODEL_FILES) == sorted(HF_MODELS)


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_model_config_matches_hf_shape(name):
    shape = HF_MODELS[name]
    f = flags(model_args(name))
    # layers, sizes, heads, groups, head dim, tie, bias, QK norm, eps, base, RoPE scaling
    assert shape_from_flags(f) == shape
    assert int(f["--kv-channels"]) == shape.head_dim
    assert f["--group-query-attention"] is True and f["--swiglu"] is True
    assert f["--disable-bias-linear"] is True
    assert ("--add-qkv-bias" in f) == (HF_CARDS[name].model_type == "qwen2")
    assert ("--qk-layernorm" in f) == (HF_CARDS[name].model_type == "qwen3")
    assert ("--use-rope-scaling" in f) == (HF_CARDS[name].model_type == "llama")
    assert f["--normalization"] == "RMSNorm" and f["--position-embedding-type"] == "rope"
    assert float(f["--attention-dropout"]) == 0.0 and float(f["--hidden-dropout"]) == 0.0
    assert f["--tokenizer-type"] == "HuggingFaceTokenizer"
    # the padded vocabulary is the checkpoint's, and splits evenly over TP = 1, 2, 4, 8
    assert int(f["--padded-vocab-size"]) == shape.vocab_size and shape.vocab_size % 8 == 0


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_model_config_header_cites_its_hf_config(name):
    text = MODEL_FILES[name].read_text()
    assert HF_CARDS[name].config_url in text
    shape = HF_MODELS[name]
    for key, value in [("num_hidden_layers", shape.num_layers), ("hidden_size", shape.hidden_size),
                       ("intermediate_size", shape.ffn_hidden_size),
                       ("num_key_value_heads", shape.num_query_groups),
                       ("head_dim", shape.head_dim), ("vocab_size", shape.vocab_size)]:
        assert re.search(rf"\b{key} {value}\b", text), f"{key} {value} not in the header"
    assert f"tie_word_embeddings {str(shape.tie_embeddings).lower()}" in text


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_model_configs",
                                                  REPO / "scripts" / "gen_model_configs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_model_configs = _load_generator()


def test_model_configs_are_generated():
    """The shipped files are byte for byte what the generator writes from core/models.py."""
    problems = gen_model_configs.stale(MODEL_FILES["qwen2.5-7b"].parent)
    assert not problems, ("stale model configs, run `make configs` "
                          "(python scripts/gen_model_configs.py):\n"
                          + "".join(diff for _, diff in problems))


def test_model_config_generator_names_stale_files(tmp_path, capsys):
    for path in MODEL_FILES.values():
        (tmp_path / path.name).write_text(path.read_text())
    edited = tmp_path / "qwen2.5-7b.sh"
    edited.write_text(edited.read_text().replace("--num-layers 28", "--num-layers 29"))
    (tmp_path / "qwen2.5-3b.sh").unlink()
    (tmp_path / "qwen2.5-9b.sh").write_text("MODEL_ARGS=()\n")
    problems = dict(gen_model_configs.stale(tmp_path))
    assert sorted(p.name for p in problems) == ["qwen2.5-3b.sh", "qwen2.5-7b.sh", "qwen2.5-9b.sh"]
    assert "-    --num-layers 29\n+    --num-layers 28\n" in problems[edited]
    assert sorted(p.name for p in gen_model_configs.write(tmp_path)) == ["qwen2.5-3b.sh",
                                                                         "qwen2.5-7b.sh"]
    assert "qwen2.5-9b.sh: not generated" in capsys.readouterr().err  # named, not deleted
    assert [p.name for p, _ in gen_model_configs.stale(tmp_path)] == ["qwen2.5-9b.sh"]
    assert edited.read_text() == MODEL_FILES["qwen2.5-7b"].read_text()


def test_tokenizer_variable_reaches_the_flags():
    argv = bash_arrays(f"TOKENIZER=/ckpt/tok; source {MODEL_FILES['qwen2.5-7b']}", "MODEL_ARGS")[0]
    assert flags(argv)["--tokenizer-model"] == "/ckpt/tok"


def _build_on_meta(job, shapes):
    """(child) Build each shape with mcore/build.py on the meta device."""
    import torch

    from megatron_chunkflow.mcore.build import build_gpt_model, transformer_config

    out = {}
    for name, shape in shapes.items():
        config = transformer_config(shape, job, dtype=torch.bfloat16)
        with torch.device("meta"):
            model = build_gpt_model(shape, config, job, max_seq_length=4096)
        out[name] = {k: (tuple(p.shape), p.device.type) for k, p in model.named_parameters()}
    return out


def _child(shapes, megatron_lm_dir, model_argvs, run_argvs):
    """One child process (world of one, gloo) for everything that needs process groups."""
    import torch

    from megatron_chunkflow.mcore.dist import init_distributed, shutdown

    has_cuda = torch.cuda.is_available()  # before mcore/cpu.py's shims
    job = init_distributed()
    try:
        out = {"core": _build_on_meta(job, shapes)}
        if megatron_lm_dir is not None:
            out.update(_megatron_lm_parse(megatron_lm_dir, model_argvs, run_argvs, has_cuda))
        return out
    finally:
        shutdown()


@pytest.fixture(scope="module")
def child_results():
    """Every model config built at 2 layers by build.py and, with a checkout, by Megatron-LM's
    gpt_builder; every run config through Megatron-LM's validate_args."""
    shapes = {name: dataclasses.replace(shape_from_flags(flags(model_args(name))), num_layers=2)
              for name in MODEL_FILES}
    model_argvs, run_argvs = {}, {}
    if MEGATRON_LM_OK:
        model_argvs = {name: model_args(name) for name in MODEL_FILES}
        for run_file, model in RUN_CASES:
            rc = run_config(run_file, model)
            # what train.sbatch passes, data flags aside (mock data here)
            run_argvs[(run_file.stem, model)] = (
                rc["model_args"] + rc["parallel_args"] + rc["training_args"]
                + rc["chunkflow_args"] + (["--dataloader-type", "external"]
                                          if rc["chunkflow_args"] else []),
                rc["nodes"] * rc["gpus"])
    megatron_lm = MEGATRON_LM if MEGATRON_LM_OK else None
    return run_processes(_child, 1, shapes, megatron_lm, model_argvs, run_argvs, timeout=300)[0]


def check_parameter_shapes(params: dict, shape: ModelShape) -> None:
    """QKV (with Qwen2's bias, Qwen3's QK norms), MLP, embedding and output rows of a GPTModel
    (TP = 1)."""
    h, hd, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    qkv_rows = (shape.num_attention_heads + 2 * shape.num_query_groups) * hd
    layer = "decoder.layers.0."
    assert params[layer + "self_attention.linear_qkv.weight"] == (qkv_rows, h)
    assert params.get(layer + "self_attention.linear_qkv.bias") == (
        (qkv_rows,) if shape.qkv_bias else None)
    for norm in ("q_layernorm", "k_layernorm"):
        assert params.get(f"{layer}self_attention.{norm}.weight") == (
            (hd,) if shape.qk_norm else None)
    proj = params[layer + "self_attention.linear_proj.weight"]
    assert proj == (h, shape.num_attention_heads * hd)
    assert layer + "self_attention.linear_proj.bias" not in params  # --disable-bias-linear
    assert params[layer + "mlp.linear_fc1.weight"] == (2 * f, h)  # gate and up (SwiGLU)
    assert params[layer + "mlp.linear_fc2.weight"] == (h, f)
    assert params["embedding.word_embeddings.weight"] == (shape.vocab_size, h)
    assert ("output_layer.weight" in params) == (not shape.tie_embeddings)
    if not shape.tie_embeddings:
        assert params["output_layer.weight"] == (shape.vocab_size, h)
    assert "embedding.position_embeddings.weight" not in params  # RoPE


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_model_config_builds_at_reduced_depth(name, child_results):
    built = child_results["core"][name]
    assert {device for _, device in built.values()} == {"meta"}
    check_parameter_shapes({k: s for k, (s, _) in built.items()}, HF_MODELS[name])
    # the cost model's parameter count (perfmodel/footprint.py) is the built model's
    from megatron_chunkflow.perfmodel.footprint import total_params

    count = sum(math.prod(s) for s, _ in built.values())
    assert count == total_params(dataclasses.replace(HF_MODELS[name], num_layers=2))


# ---- run configs --------------------------------------------------------------------------------


def run_config(run_file: Path, model: str) -> dict:
    script = (f"source {MODEL_FILES[model]}; source {run_file}; run_config {model}; "
              "echo $NODES $GPUS_PER_NODE $TP $PP $CP $DP $RECOMPUTE $SYSTEM $SEQ_LENGTH "
              "$GLOBAL_BATCH_SIZE ${CHUNK_SIZE:-0} ${CHUNKFLOW_K:-0} $VPP ${LOSS_PIECE:-0} >&2")
    names = ("model_args", "parallel_args", "training_args", "chunkflow_args")
    result = bash(f"{script}\n{_print_arrays(n.upper() for n in names)}")
    keys = "nodes gpus tp pp cp dp recompute system seq gbs chunk k vpp piece".split()
    out = dict(zip(keys, result.stderr.split()))
    out = {k: (v if k in ("recompute", "system") else int(v)) for k, v in out.items()}
    out.update({n: part.split("\0")[:-1] for n, part in zip(names, result.stdout.split("@@"))})
    return out


@pytest.mark.parametrize("run_file,model", RUN_CASES, ids=lambda x: getattr(x, "stem", x))
def test_run_config_layout_is_consistent(run_file, model):
    rc = run_config(run_file, model)
    shape = HF_MODELS[model]
    tp, pp, cp, world = rc["tp"], rc["pp"], rc["cp"], rc["nodes"] * rc["gpus"]
    assert tp * pp * cp * rc["dp"] == world
    assert rc["gbs"] % rc["dp"] == 0  # micro-batch size 1
    assert shape.num_layers % (pp * rc["vpp"]) == 0
    assert shape.num_query_groups % tp == 0 and shape.num_attention_heads % tp == 0
    assert shape.vocab_size % tp == 0
    f = flags(rc["model_args"] + rc["parallel_args"] + rc["training_args"])
    assert int(f["--seq-length"]) == rc["seq"] == CONTEXTS[run_file.stem.split("_")[1]]
    assert int(f["--max-position-embeddings"]) >= rc["seq"]  # Megatron asserts it
    assert int(f["--tensor-model-parallel-size"]) == tp
    assert int(f["--context-parallel-size"]) == cp
    assert ("--sequence-parallel" in f) == (tp > 1)
    if rc["system"] == "chunkflow":
        c = flags(rc["chunkflow_args"])
        assert int(c["--chunk-size"]) == rc["chunk"] and int(c["--chunkflow-k"]) == rc["k"]
        assert int(c.get("--chunkflow-loss-piece", 0)) == rc["piece"]
        assert rc["chunk"] % tp == 0, "sequence parallelism splits every chunk over TP"
        if cp > 1:
            assert rc["chunk"] % (2 * cp * tp) == 0, "CP cuts every chunk into 2 x CP pieces"
        assert c["--chunkflow"] is True and "--no-rope-fusion" in f
        assert c["--chunkflow-attention-backend"] in BACKENDS
    else:
        assert rc["chunkflow_args"] == [] and "--chunkflow" not in f
    kind, _, arg = rc["recompute"].partition(":")
    expected = {"none": [],
                "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "1"],
                "block": ["--recompute-granularity", "full", "--recompute-method", "block",
                          "--recompute-num-layers", arg],
                "selective": ["--recompute-granularity", "selective",
                              *(["--recompute-modules", *arg.split("+")] if arg else [])]}[kind]
    vpp = ["--num-virtual-stages-per-pipeline-rank", str(rc["vpp"])] if rc["vpp"] > 1 else []
    end = len(rc["parallel_args"]) - len(vpp)
    assert rc["parallel_args"][end:] == vpp  # a PPxV row: Megatron-LM's V flag, last
    assert "--num-virtual-stages-per-pipeline-rank" not in rc["parallel_args"][:end]
    given = [a for a in rc["parallel_args"][6:end] if a != "--sequence-parallel"]
    assert given == expected  # after TP, PP and CP: Megatron's flags for the row's recompute


@pytest.mark.parametrize("context,model", [(c, m) for c in CONTEXTS for m in RUNS[c]])
def test_stock_and_chunkflow_runs_get_the_same_nodes(context, model):
    runs = REPO / "configs" / "runs"
    stock = run_config(runs / f"h100_{context}_stock.sh", model)
    chunkflow = run_config(runs / f"h100_{context}_chunkflow.sh", model)
    assert stock["nodes"] == chunkflow["nodes"]


def test_run_config_reads_virtual_stages(tmp_path):
    """A LAYOUT row's PP column written PPxV (scripts/slurm/layouts.py writes it so when the
    search interleaves): PP and Megatron-LM's --num-virtual-stages-per-pipeline-rank V."""
    src = (REPO / "configs/runs/h100_32k_chunkflow.sh").read_text()
    src = src.replace("source \"$(dirname \"${BASH_SOURCE[0]}\")/common.sh\"",
                      f"source {REPO / 'configs/runs/common.sh'}")
    src = re.sub(r'(\[qwen2\.5-32b\]=")[^"]*"', r'\g<1>4 4 4x2 1 none 8192 1"', src)
    run_file = tmp_path / "h100_32k_chunkflow.sh"
    run_file.write_text(src)
    rc = run_config(run_file, "qwen2.5-32b")
    assert (rc["pp"], rc["vpp"], rc["dp"]) == (4, 2, 2)
    assert rc["parallel_args"][-2:] == ["--num-virtual-stages-per-pipeline-rank", "2"]
    assert rc["parallel_args"][:6] == ["--tensor-model-parallel-size", "4",
                                       "--pipeline-model-parallel-size", "4",
                                       "--context-parallel-size", "1"]


def test_run_config_names_an_unknown_model():
    result = bash(f"source {REPO / 'configs/runs/h100_32k_chunkflow.sh'}; run_config qwen2.5-3b",
                  check=False)
    assert result.returncode != 0
    assert "no layout for model 'qwen2.5-3b'" in result.stderr and "qwen2.5-7b" in result.stderr


# ---- Megatron-LM's own parser (needs a core_v0.16.1 checkout) ------------------------------------


def _megatron_lm_dir() -> Path | None:
    for candidate in (os.environ.get("MEGATRON_LM_DIR"), REPO / "third_party" / "Megatron-LM"):
        if candidate and (Path(candidate) / "pretrain_gpt.py").is_file():
            return Path(candidate)
    return None


MEGATRON_LM = _megatron_lm_dir()
MEGATRON_LM_OK = MEGATRON_LM is not None and importlib.util.find_spec("six") is not None
needs_megatron_lm = pytest.mark.skipif(
    not MEGATRON_LM_OK,
    reason="needs a Megatron-LM core_v0.16.1 checkout (MEGATRON_LM_DIR or third_party/Megatron-LM)"
           " and the `six` package that megatron.training imports")

# CPU stand-ins for runtime flags whose kernels need CUDA / Transformer Engine (not model shape)
CPU_FLAGS = ["--transformer-impl", "local", "--no-rope-fusion", "--no-bias-swiglu-fusion",
             "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
             "--no-persist-layer-norm", "--use-cpu-initialization"]


def _megatron_lm_parse(megatron_lm_dir, model_argvs, run_argvs, has_cuda):
    """(child) Megatron-LM's parser with the launcher's flags, validate_args and the launcher's
    checks on every config; gpt_builder on meta."""
    import argparse
    import contextlib
    import io

    import torch

    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # validate_args asserts it when TP/CP > 1
    if not has_cuda:  # what the launcher installs on CPU (triton-only kernels, CUDA queries)
        from megatron_chunkflow.megatron_lm.cpu import install_megatron_lm_cpu_shims

        install_megatron_lm_cpu_shims()
    # the installed megatron.core first: the checkout's root has its own megatron/core, which would
    # shadow it once the checkout is on sys.path
    importlib.import_module("megatron.core")

    sys.path.append(str(megatron_lm_dir))
    from megatron.training import arguments, global_vars

    from megatron_chunkflow.megatron_lm.args import (
        add_chunkflow_arguments,
        check_chunkflow_args,
    )
    from megatron_chunkflow.megatron_lm.weights import rope_factor_provider

    if not has_cuda:
        arguments.get_device_arch_version = lambda: 9  # the configs' target: Hopper
    import gpt_builders

    def parse(argv, world_size):
        parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
        args = add_chunkflow_arguments(parser).parse_args(argv)
        args.rank, args.world_size = 0, world_size
        with contextlib.redirect_stdout(io.StringIO()):
            arguments.validate_args(args, {})
            check_chunkflow_args(args, args.dataloader_type)
        return args

    models = {}
    for name, argv in model_argvs.items():
        args = parse(argv + ["--num-layers", "2", "--seq-length", "4096", "--micro-batch-size",
                             "1", "--train-iters", "1", "--lr", "1e-5", "--mock-data"]
                     + CPU_FLAGS, 1)
        global_vars.set_args(args)
        with torch.device("meta"), contextlib.redirect_stdout(io.StringIO()):
            # the launcher's provider: gpt_builder, then --rope-scaling-factor honoured
            model = rope_factor_provider(gpt_builders.gpt_builder, args, args, True, True)
        global_vars.set_args(None)
        models[name] = {"params": {k: tuple(p.shape) for k, p in model.named_parameters()},
                        "inv_freq": model.rotary_pos_emb.inv_freq.tolist(),
                        "padded_vocab_size": args.padded_vocab_size,
                        "layernorm_epsilon": args.layernorm_epsilon}
    runs = {}
    for key, (argv, world_size) in run_argvs.items():
        args = parse(argv + ["--mock-data"], world_size)
        runs[key] = {"data_parallel_size": args.data_parallel_size,
                     "sequence_parallel": args.sequence_parallel,
                     "context_parallel_size": args.context_parallel_size,
                     "chunkflow": args.chunkflow}
    return {"models": models, "runs": runs}


@pytest.mark.megatron
@pytest.mark.slow
@needs_megatron_lm
@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_megatron_lm_builds_each_model_config(name, child_results):
    built = child_results["models"][name]
    shape = HF_MODELS[name]
    assert built["padded_vocab_size"] == shape.vocab_size  # --padded-vocab-size is honoured
    assert built["layernorm_epsilon"] == shape.norm_eps
    check_parameter_shapes(built["params"], shape)
    # RoPE frequencies bit for bit transformers' for the model's config.json (Llama 3's scaling
    # with its factor: core_v0.16.1's gpt_builder alone would build Llama 3.2 with factor 8)
    assert built["inv_freq"] == hf_inv_freq(shape)


def hf_inv_freq(shape: ModelShape) -> list[float]:
    """transformers' RoPE frequencies for the config.json of `shape` (float32)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from megatron_chunkflow.core.hf_config import hf_config_dict

    config = transformers.AutoConfig.for_model(**{**hf_config_dict(shape), "model_type": "llama"})
    return LlamaRotaryEmbedding(config).inv_freq.tolist()


@pytest.mark.megatron
@pytest.mark.slow
@needs_megatron_lm
@pytest.mark.parametrize("run_file,model", RUN_CASES, ids=lambda x: getattr(x, "stem", x))
def test_megatron_lm_validates_each_run_config(run_file, model, child_results):
    rc = run_config(run_file, model)
    got = child_results["runs"][(run_file.stem, model)]
    assert got["data_parallel_size"] == rc["dp"]
    assert got["context_parallel_size"] == rc["cp"]
    assert got["sequence_parallel"] == (rc["tp"] > 1)
    assert got["chunkflow"] == (rc["system"] == "chunkflow")
