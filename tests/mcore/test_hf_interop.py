"""Hugging Face checkpoints <-> megatron-core GPTModel weights (mcore/hf.py), on CPU with gloo,
for every supported family (Qwen2, Qwen3, Llama 3, Mistral; Qwen3-MoE, Qwen2-MoE and Mixtral also
under expert parallelism).

    python -m pytest tests/mcore/test_hf_interop.py -q

Tiny random checkpoints (tests/mcore/hf_checkpoints.py) are built and saved with save_pretrained
(nothing is downloaded). Each layout (TP=1, TP=2, PP=2, EP=2) imports them in one set of spawned
processes, runs the megatron model (its own local attention, one sequence, no packing),
exports, and sends back logits and tensors; the tests compare them with the HF model's.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_chunkflow.config import ParallelConfig
from tests.mcore.hf_checkpoints import CASES, FAMILY_CASES, MOE_CASES, build_checkpoints

pytest.importorskip("transformers", reason="HF interop tests need transformers")
pytest.importorskip("safetensors", reason="HF interop tests need safetensors")

LAYOUTS = {  # name -> (TP, PP, cases[, EP over DP])
    "tp1": (1, 1, ["gqa2_tied", "gqa7_hidden56", *FAMILY_CASES, *MOE_CASES,
                   "gqa2_untied_sharded"]),  # the last: error checks
    "tp2": (2, 1, ["gqa2_tied", "gqa2_untied_sharded", "gqa4_kv1", *FAMILY_CASES]),
    "pp2": (1, 2, ["gqa2_tied", "gqa2_untied_sharded", *FAMILY_CASES, *MOE_CASES]),
    "ep2": (1, 1, MOE_CASES, 2),  # each rank holds half the experts
}


def _world(layout: str) -> int:
    tp, pp, _, *ep = LAYOUTS[layout]
    return tp * pp * (ep[0] if ep else 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, HF state dict, tokens [1, SEQ], HF logits [1, SEQ, 1000])."""
    return build_checkpoints(tmp_path_factory)


def _megatron_logits(job, model, tokens):
    """Logits [1, s, V_padded], TP shards gathered, on the last stage; None on the others."""
    import torch.distributed as dist

    pos = torch.arange(tokens.shape[1]).view(1, -1)
    hidden_shape = (tokens.shape[1], 1, model.config.hidden_size)  # [s, b, h]
    stage, pp_group = job.ranks.pp_rank, job.groups.pp
    if not job.is_first_stage():
        recv = torch.empty(hidden_shape)
        dist.recv(recv, src=dist.get_global_rank(pp_group, stage - 1))
        model.set_input_tensor(recv)
    with torch.no_grad():
        out = model(tokens, pos, None)
    if not job.is_last_stage():
        dist.send(out.contiguous(), dst=dist.get_global_rank(pp_group, stage + 1))
        return None
    shards = [torch.empty_like(out) for _ in range(job.ranks.tp)]
    dist.all_gather(shards, out.contiguous(), group=job.groups.tp)
    return torch.cat(shards, dim=-1)


def _run_layout(layout, cases, out_root, bad_inputs=None):
    """Per case: (logits or None, exported tensors on rank 0), as numpy; also saves each case."""
    import dataclasses

    from megatron_chunkflow.mcore.build import build_gpt_model, transformer_config
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.hf import (
        export_hf_weights,
        import_hf_weights,
        padded_vocab_size,
        save_hf_checkpoint,
        shape_from_hf_dir,
    )

    rank = int(os.environ["RANK"])
    tp, pp, _, *ep = LAYOUTS[layout]
    job = init_distributed(ParallelConfig(tp=tp, pp=pp, ep=ep[0] if ep else 1))
    results = {}
    for name, (path, tokens) in cases.items():
        shape = shape_from_hf_dir(path)
        padded = dataclasses.replace(shape, vocab_size=padded_vocab_size(shape.vocab_size, tp))
        config = transformer_config(padded, job, torch.float32)
        model = build_gpt_model(padded, config, job).eval()
        import_hf_weights(model, path, config, shape)
        logits = _megatron_logits(job, model, tokens)
        exported = export_hf_weights(model, config, shape)
        source = path / "config.json" if layout != "pp2" else None  # pp2: a generated config
        save_hf_checkpoint(model, config, shape, out_root / f"{layout}_{name}", source)
        # numpy: torch tensors would travel through shared memory that dies with this process
        results[name] = (None if logits is None else logits.numpy(),
                         {k: v.numpy() for k, v in exported.items()} if rank == 0 else None)
    if bad_inputs:  # each bad state dict's ValueError message, against the last case's model
        results["errors"] = {kind: _import_error(model, sd, config, shape)
                             for kind, sd in bad_inputs.items()}
    shutdown()
    return results


@pytest.fixture(scope="module")
def layout_results(gloo, checkpoints, tmp_path_factory):
    """layout -> (results per rank, directory of the re-saved checkpoints)."""
    cache = {}

    def get(layout):
        if layout not in cache:
            names = LAYOUTS[layout][2]
            out_root = tmp_path_factory.mktemp(f"export_{layout}")
            cases = {n: (checkpoints[n][0], checkpoints[n][2]) for n in names}
            bad = _bad_inputs(checkpoints[names[-1]][1]) if layout == "tp1" else None
            cache[layout] = (gloo.run(_run_layout, _world(layout), layout, cases, out_root, bad,
                                      timeout=300), out_root)
        return cache[layout]

    return get


def _hf_tensors(state, tied):
    return {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_hf_after_import(checkpoints, layout_results, layout):
    per_rank, _ = layout_results(layout)
    for name in LAYOUTS[layout][2]:
        hf_logits = checkpoints[name][3]
        for rank_results in per_rank:
            logits = rank_results[name][0]
            if logits is None:  # a first pipeline stage
                continue
            assert logits.shape[-1] == 1024  # padded to a multiple of 128 * TP
            logits = torch.from_numpy(logits[..., :1000])
            err = float((logits - hf_logits).abs().max() / hf_logits.abs().max())
            assert err <= 1e-5, f"{layout} {name}: relative logits error {err:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_round_trip_is_bitwise(checkpoints, layout_results, layout):
    from safetensors.torch import load_file

    from megatron_chunkflow.mcore.hf_moe import checkpoint_layout

    per_rank, out_root = layout_results(layout)
    for name in LAYOUTS[layout][2]:  # MoE: transformers 5's stacked experts as in checkpoints
        want = checkpoint_layout(_hf_tensors(checkpoints[name][1], CASES[name][5]),
                                 CASES[name][0])
        got = {k: torch.from_numpy(v) for k, v in per_rank[0][name][1].items()}
        saved = load_file(out_root / f"{layout}_{name}" / "model.safetensors")
        for tensors in (got, saved):
            assert sorted(tensors) == sorted(want), f"{layout} {name}"
            for k, v in want.items():
                assert torch.equal(tensors[k], v), f"{layout} {name}: {k} differs"


@pytest.mark.slow
def test_saved_checkpoint_loads_in_transformers(checkpoints, layout_results):
    """pp2 wrote its own config.json: transformers loads the export and gives the same logits
    (a Mistral shape is written as Llama: the same architecture, with no sliding window; the MoE
    families' experts one tensor each, as released checkpoints hold them)."""
    from transformers import AutoModelForCausalLM

    _, out_root = layout_results("pp2")
    family = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama", "mistral": "llama",
              **{kind: kind for kind in ("qwen3_moe", "qwen2_moe", "mixtral")}}
    for name in LAYOUTS["pp2"][2]:
        path = out_root / f"pp2_{name}"
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == family[CASES[name][0]], name
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        _, _, tokens, hf_logits = checkpoints[name]
        with torch.no_grad():
            assert torch.equal(model(tokens).logits, hf_logits), name


def _import_error(model, state, config, shape):
    from megatron_chunkflow.mcore.hf import import_hf_weights

    try:
        import_hf_weights(model, state, config, shape)
    except ValueError as e:
        return str(e)
    return None


def _bad_inputs(state):
    """Broken copies of a 2-layer, GQA 4:2, hidden 64 checkpoint's state dict."""
    return {
        "missing": {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"},
        "unexpected": {**state, "model.layers.1.self_attn.o_proj.bias": torch.zeros(64)},
        "shape": {**state, "model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)},
    }


@pytest.mark.slow
def test_bad_checkpoints_name_the_tensor(layout_results):
    errors = layout_results("tp1")[0][0]["errors"]
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in errors["missing"]
    assert "unexpected tensor model.layers.1.self_attn.o_proj.bias" in errors["unexpected"]
    assert "model.layers.0.self_attn.k_proj.weight" in errors["shape"]
    assert "[64, 64]" in errors["shape"] and "[32, 64]" in errors["shape"]


def test_shape_and_padding(checkpoints, tmp_path):
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.mcore.hf import padded_vocab_size, shape_from_hf_dir

    shape = shape_from_hf_dir(checkpoints["gqa7_hidden56"][0])
    assert (shape.hidden_size, shape.num_attention_heads, shape.num_query_groups) == (56, 7, 1)
    assert shape.rotary_base == 1e6 and shape.norm_eps == 1e-6 and not shape.tie_embeddings
    assert [padded_vocab_size(1000, tp) for tp in (1, 2, 8)] == [1024, 1024, 1024]
    assert padded_vocab_size(151646, 4) == 152064
    # transformers 4 style (rope_theta at the top level), Qwen/Qwen2.5-0.5B's config.json values
    qwen25_05b = {"model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
                  "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                  "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
                  "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "rope_scaling": None,
                  "use_sliding_window": False, "sliding_window": 32768}
    (tmp_path / "config.json").write_text(json.dumps(qwen25_05b))
    assert shape_from_hf_dir(tmp_path) == get_model_shape("qwen2.5-0.5b")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="config.json: model_type 'gpt2' is not supported"):
        shape_from_hf_dir(tmp_path)
    # a dropout the run would not train is refused, not silently dropped
    (tmp_path / "config.json").write_text(json.dumps({**qwen25_05b, "attention_dropout": 0.1}))
    with pytest.raises(ValueError, match=r"config.json: attention_dropout 0.1: training here runs "
                                         "without dropout"):
        shape_from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**qwen25_05b, "attention_dropout": 0.0}))
    assert shape_from_hf_dir(tmp_path) == get_model_shape("qwen2.5-0.5b")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gqa2_untied_sharded", "qwen2_moe"])
def test_train_from_and_to_hf_checkpoint(gloo, checkpoints, tmp_path, case):
    """`chunkflow train --load-hf DIR --save-hf OUT`: the model comes from config.json, the
    trained weights load back into transformers and differ from the start (a Qwen2-MoE: its
    experts, router and shared expert, the balancing loss from router_aux_loss_coef)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from transformers import AutoModelForCausalLM

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    g = torch.Generator().manual_seed(0)
    for n in (40, 200, 13, 90, 150, 7, 64, 33):
        builder.add_item(torch.randint(0, 1000, (n,), generator=g))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    src, out = checkpoints[case][0], tmp_path / "trained"
    code, stdout, stderr = gloo.cli(
        1, "train", "--load-hf", src, "--save-hf", out, "--data-path", prefix, "--seq-length", 256,
        "--chunk-size", 64, "--global-batch-size", 4, "--train-iters", 3, "--lr-warmup-iters", 0,
        "--lr", "1e-3")
    assert code == 0, stderr[-3000:]
    assert "model " + str(src) in stdout
    said = stdout + stderr  # the run log names where the weights came from and went
    assert f"weights: the Hugging Face checkpoint {src}" in said
    assert f"Hugging Face export: {out} (model.safetensors, config.json" in said
    for name in ("generation_config.json", "tokenizer.json"):  # beside the weights when the
        assert (out / name).is_file() == (Path(src) / name).is_file()  # source has them
    if not (Path(src) / "tokenizer.json").is_file():
        assert "no tokenizer files to copy" in said
    if case.endswith("_moe"):
        assert "| balancing loss " in stderr and "expert load max " in stderr
    before = AutoModelForCausalLM.from_pretrained(src).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(after[k].shape == before[k].shape for k in before)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gqa2_untied_sharded", *FAMILY_CASES])
def test_step1_loss_is_hugging_faces_at_tp1_and_tp2(gloo, tmp_path, family):
    """A vocab-300 checkpoint of each family: Megatron pads the vocabulary to 384 rows at TP 1 and
    512 at TP 2; `train` leaves the padded rows out of the softmax, so step 1's loss (before any
    update) is the Hugging Face model's on the same tokens, at both TP sizes (and, for Qwen2, for
    the stock baseline too)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from transformers import AutoModelForCausalLM

    from tests.mcore.hf_checkpoints import hf_config

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(hf_config(family, vocab_size=300)).eval()
    model.save_pretrained(tmp_path / "hf")
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 300, (n,), generator=g) for n in (40, 150, 13, 90)]
    for doc in docs:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    total = count = 0.0
    with torch.no_grad():
        for doc in docs:
            logits = model(doc.view(1, -1)).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, doc[1:], reduction="sum"))
            count += doc.numel() - 1
    hf_loss = total / count
    losses = {}
    runs = [(1, []), (2, [])]
    if family == "gqa2_untied_sharded":
        runs.append((2, ["--no-chunkflow", "--baseline", "megatron-packed"]))
    for tp, system in runs:
        log = tmp_path / f"tp{tp}{len(system)}.jsonl"
        code, _, stderr = gloo.cli(
            tp, "train", "--load-hf", tmp_path / "hf", "--data-path", prefix, "--seq-length", 256,
            "--chunk-size", 64, "--global-batch-size", 4, "--train-iters", 1,
            "--lr-warmup-iters", 0, "--tp", tp, "--log-json", log, *system)
        assert code == 0, stderr[-3000:]
        losses[tp, bool(system)] = json.loads(log.read_text().splitlines()[0])["loss"]
    assert losses == {key: pytest.approx(hf_loss, rel=2e-6) for key in losses}
