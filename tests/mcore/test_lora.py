"""LoRA on megatron-core (float64, CPU, gloo): chunked == unchunked, TP-invariant, merge, training.

    python -m pytest tests/mcore/test_lora.py -q

- run_verify with adapters (B drawn at random so A's gradient is not zero): ChunkFlow's adapter
  gradients equal stock Megatron's to 1e-10, at PP = 1 (K = 1, 2, a subset of targets, Megatron's
  full recompute), TP = 2 with sequence parallelism, and PP = 2;
- TP-invariance (an independent check of the TP handling, which the comparison above shares between
  both sides): the same base weights (through the HF converter) and adapters at TP = 2, with and
  without sequence parallelism, give the TP = 1 loss and adapter gradients; merging the adapters
  leaves the logits unchanged on every layout;
- training: only adapters change and only they have optimizer state; ChunkFlow trains like stock
  Megatron with the same adapters; resume from a checkpoint reproduces the losses (also at TP = 2
  with sequence parallelism, where the adapters' checkpoint entries are TP-sharded); --save-hf
  exports merged weights.
"""


import pytest

from megatron_chunkflow.config import ParallelConfig
from tests.models import tiny

pytestmark = pytest.mark.slow

C = 32  # sequences of 2-4 chunks, as tests/checks/test_exact.py
MIXED = [70, 5, 33, 100, 12, 64, 1, 16, 48, 9]
DEPENDENT = [100, 37, 65]  # every sequence longer than C
# name -> (K, steps, targets, recompute)
SINGLE = {
    "k1": (1, [MIXED, DEPENDENT], "qkv,proj,fc1,fc2", "none"),
    "k2": (2, [MIXED], "qkv,proj,fc1,fc2", "none"),
    "qkv_fc2": (1, [MIXED], "qkv,fc2", "none"),
    "recompute_full": (1, [MIXED], "qkv,proj,fc1,fc2", "full"),
}
LAYOUTS = {"tp2_sequence_parallel": (2, 1, True), "pp2": (1, 2, False),
           "pp2_vpp2": (1, 2, False, 2)}  # TP, PP, sequence parallel[, virtual stages]


def _summary(results):
    return [(r.max_rel_grad_err, r.worst_param, r.loss_ref, r.loss_chunked,
             [n for n, _ in r.param_errors]) for r in results]


def _verify_single():
    from megatron_chunkflow.checks.verify import run_verify
    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.mcore.dist import shutdown
    from megatron_chunkflow.mcore.lora import LoRAConfig

    out = {name: _summary(run_verify(tiny("tiny"), steps,
                                     ChunkFlowConfig(C, k, "torch"),
                                     ParallelConfig(recompute=recompute), seed=1,
                                     lora=LoRAConfig(rank=4, targets=targets)))
           for name, (k, steps, targets, recompute) in SINGLE.items()}
    shutdown()
    return out


def _verify_layout(tp, pp, sp, vpp=1):
    from megatron_chunkflow.checks.verify import run_verify
    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.mcore.dist import shutdown
    from megatron_chunkflow.mcore.lora import LoRAConfig

    out = _summary(run_verify(tiny("tiny", pp * vpp), [MIXED, DEPENDENT],
                              ChunkFlowConfig(C, 1, "torch"),
                              ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp, vpp=vpp),
                              seed=2, lora=LoRAConfig(rank=4)))
    shutdown()
    return out


def _check(name, rows, targets="qkv,proj,fc1,fc2", layers=2):
    for step, (err, worst, loss_ref, loss_cf, params) in enumerate(rows):
        assert err <= 1e-10, f"{name} step {step}: max relative grad error {err:.2e} at {worst}"
        assert loss_cf == pytest.approx(loss_ref, rel=1e-10)
        assert params and all(".lora_" in p for p in params)  # adapters only: the base is frozen
        assert len(params) == layers * 2 * len(targets.split(","))


@pytest.fixture(scope="module")
def single_results(gloo):
    return gloo.run(_verify_single, 1, timeout=900)[0]


@pytest.mark.parametrize("name", SINGLE)
def test_lora_chunked_equals_unchunked(single_results, name):
    _check(name, single_results[name], SINGLE[name][2])


@pytest.mark.parametrize("name", LAYOUTS)
def test_lora_chunked_equals_unchunked_layout(gloo, name):
    tp, pp, *rest = LAYOUTS[name]
    for rows in gloo.run(_verify_layout, tp * pp, tp, pp, *rest, timeout=900):
        _check(name, rows, layers=tiny("tiny", pp * (rest[1] if len(rest) > 1 else 1)).num_layers)


def _full_grads(job, model):
    """Adapter gradients gathered over TP into their TP = 1 layout (fc1's B by gate/up halves)."""
    from megatron_chunkflow.mcore.hf import gather_tensor_parallel

    group, tp = job.groups.tp, job.ranks.tp
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        out[name] = gather_tensor_parallel(p.main_grad.detach().clone(), p,
                                           name.endswith("linear_fc1.lora_b"), tp, group)
    return out


def _tp_invariance():
    import torch

    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.build import build_gpt_model, transformer_config, wrap_ddp
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.hf import export_hf_weights, import_hf_weights
    from megatron_chunkflow.mcore.lora import LoRAConfig, apply_lora, merge_lora
    from megatron_chunkflow.runtime.execute import execute_step, plan_step
    from megatron_chunkflow.runtime.loss import global_loss, make_forward_step
    from megatron_chunkflow.runtime.model import apply_chunkflow

    shape = tiny("tiny")
    sequences = make_sequences(MIXED, shape.vocab_size, seed=4)
    base, out = None, {}
    for tp, sp in [(1, False), (2, False), (2, True)]:
        job = init_distributed(ParallelConfig(tp=tp, sequence_parallel=sp), 4)
        config = transformer_config(shape, job, torch.float64, sequence_parallel=sp)
        model = build_gpt_model(shape, config, job)
        if base is None:
            # a copy: on CPU at TP = 1 the exported tensors are the parameters themselves
            base = {k: v.clone() for k, v in export_hf_weights(model, config, shape).items()}
        else:
            import_hf_weights(model, base, config, shape)
        apply_lora(model, LoRAConfig(rank=4, alpha=8), seed=4, b_init_std=0.05)
        apply_chunkflow(model, backend="torch")
        ddp = wrap_ddp(model, config)
        step = plan_step(sequences, ChunkFlowConfig(C, 1, "torch"), job.parallel, shape,
                         job.ranks)
        reports = execute_step(step, ddp, make_forward_step(job.groups.tp, exact_loss=True),
                               pg_collection=job.groups)
        loss_sum, count = global_loss(reports, tp)
        grads = _full_grads(job, model)
        standalone = next(c for c, m in step.metas.items() if not m.dependent)
        inp = step.inputs[standalone]
        with torch.no_grad():
            logits = [model(inp.tokens, inp.position_ids, None,
                            packed_seq_params=inp.packed_seq_params).clone()]
            merged = merge_lora(model)
            logits.append(model(inp.tokens, inp.position_ids, None,
                                packed_seq_params=inp.packed_seq_params))
        merge_err = float((logits[1] - logits[0]).abs().max() / logits[0].abs().max())
        ref = out[(1, False)][1] if out else grads  # TP = 1 runs first, on every rank
        errors = {n: float((g - ref[n]).abs().max() / ref[n].abs().max()) for n, g in grads.items()}
        out[(tp, sp)] = (loss_sum / count, grads, errors, merge_err, merged,
                         any(".lora_" in n for n, _ in model.named_parameters()))
    shutdown()
    return {key: (loss, sorted(errors.items()), *rest)  # plain numbers back to the test
            for key, (loss, _, errors, *rest) in out.items()}


def test_lora_is_tensor_parallel_invariant_and_merges(gloo):
    ranks = gloo.run(_tp_invariance, 2, timeout=900)
    ref_loss = ranks[0][(1, False)][0]
    for per_rank in ranks:
        for (tp, sp), (loss, errors, merge_err, merged, left) in per_rank.items():
            assert loss == pytest.approx(ref_loss, rel=1e-12), (tp, sp)
            assert len(errors) == 16  # 2 layers x 4 targets x (A, B), gradients all nonzero
            for name, err in errors:
                assert err <= 1e-10, (tp, sp, name, err)
            assert merged == 8 and not left  # 2 layers x 4 targets
            assert merge_err <= 1e-12, (tp, sp, merge_err)


TRAIN_LENGTHS = [70, 5, 33, 100, 12, 64, 2, 16, 48, 9, 130, 21, 7, 90, 3, 40, 55, 11]


def _settings(warmup: int = 1, **kw):
    from megatron_chunkflow.config import ChunkFlowConfig
    from megatron_chunkflow.mcore.lora import LoRAConfig
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings

    base = dict(shape=tiny("tiny"), model_name="tiny", train_iters=6,
                global_batch_size=6, seq_length=160, chunkflow=ChunkFlowConfig(C, 1),
                optimizer=OptimizerConfig(lr=3e-2, min_lr=3e-3, lr_warmup_iters=warmup),
                dtype="float64", seed=5, lora=LoRAConfig(rank=4))
    return TrainSettings(**{**base, **kw})


def _train(ckpt, hf_dir):
    import torch

    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.settings import CheckpointConfig
    from megatron_chunkflow.mcore.step import batch_forward_backward, build_training
    from megatron_chunkflow.training.loop import train

    dataset = make_sequences(TRAIN_LENGTHS, 1000, seed=3)
    out = {}
    # one step by hand: what is trainable, what has optimizer state, what changes
    s = _settings(warmup=0)  # (warmup starts at lr 0)
    tr = build_training(s, init_distributed(seed=s.seed))
    model, optimizer = tr.model, tr.optimizer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch_forward_backward(s, tr, dataset[:6])
    optimizer.step()
    out["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    out["optimizer_params"] = sum(len(g["params"]) for g in optimizer.param_groups)
    out["changed"] = sorted(n for n, p in model.named_parameters()
                            if not torch.equal(p.detach(), before[n]))
    embedding = before["embedding.word_embeddings.weight"]
    qkv = before["decoder.layers.0.self_attention.linear_qkv.weight"]
    runs = {"chunkflow": dict(checkpoint=CheckpointConfig(save_hf=hf_dir)),
            "megatron": dict(system="megatron-packed"),
            "first": dict(checkpoint=CheckpointConfig(save=ckpt, save_interval=3),
                          exit_interval=3),
            "resumed": dict(checkpoint=CheckpointConfig(load=ckpt))}
    for name, kw in runs.items():
        job = init_distributed(seed=s.seed)
        out[name] = [m["loss"] for m in train(_settings(**kw), job, dataset)]
    shutdown()
    from safetensors.torch import load_file

    hf = load_file(f"{hf_dir}/model.safetensors")
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    out["hf_embedding_unchanged"] = torch.equal(hf["model.embed_tokens.weight"], embedding)
    out["hf_q_merged"] = float((q - qkv.view(2, 4, 16, 64)[:, :2].reshape(64, 64)).abs().max())
    return out


def test_lora_training(gloo, tmp_path):
    """Adapters only train; ChunkFlow == stock Megatron with LoRA (float64, 6 steps); resume from a
    checkpoint with adapters and their optimizer state; --save-hf exports merged weights."""
    out = gloo.run(_train, 1, str(tmp_path / "ckpt"), str(tmp_path / "hf"),
                        timeout=900)[0]
    assert len(out["trainable"]) == 16 and all(".lora_" in n for n in out["trainable"])
    assert out["optimizer_params"] == 16  # 2 layers x 4 targets x (A, B)
    assert out["changed"] and set(out["changed"]) <= set(out["trainable"])
    assert len(out["chunkflow"]) == len(out["megatron"]) == 6
    for step, (a, b) in enumerate(zip(out["chunkflow"], out["megatron"]), start=1):
        assert a == pytest.approx(b, rel=1e-8), f"step {step}: {a} vs {b}"
    assert out["chunkflow"][-1] < out["chunkflow"][0]
    assert out["first"] == pytest.approx(out["chunkflow"][:3], rel=1e-12)
    assert out["resumed"] == pytest.approx(out["chunkflow"][3:], rel=1e-10)
    assert out["hf_embedding_unchanged"] and out["hf_q_merged"] > 1e-6


def _resume_tp2(ckpt):
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.mcore.settings import CheckpointConfig
    from megatron_chunkflow.runtime.sparse import SparseConfig
    from megatron_chunkflow.training.loop import train

    dataset = make_sequences(TRAIN_LENGTHS[:12], 1000, seed=3)
    out = []
    for kw in [{}, dict(checkpoint=CheckpointConfig(save=ckpt, save_interval=2),
                        exit_interval=2), dict(checkpoint=CheckpointConfig(load=ckpt))]:
        job = init_distributed(ParallelConfig(tp=2), 5)
        s = _settings(train_iters=4, warmup=0,
                      parallel=ParallelConfig(tp=2, sequence_parallel=True),
                      sparse=SparseConfig(2), **kw)
        out.append([m["loss"] for m in train(s, job, dataset)])
    shutdown()
    return out


def test_lora_checkpoint_under_tensor_parallelism(gloo, tmp_path):
    """TP = 2 with sequence parallelism (and SpaCO): the adapters' TP-sharded checkpoint entries
    (fc1's B through the swiglu factory) save and load; the resumed run repeats the losses."""
    for whole, first, resumed in gloo.run(_resume_tp2, 2, str(tmp_path / "ckpt"),
                                               timeout=900):
        assert first + resumed == pytest.approx(whole, rel=1e-12)
