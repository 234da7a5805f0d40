"""`chunkflow verify --hf-reference` (checks/hf_verify.py): ChunkFlow on megatron-core against
transformers' unchunked model (Qwen2, Qwen3, Llama 3, Mistral, Qwen3-MoE, Qwen2-MoE, Mixtral),
float64, on CPU with gloo.

    python -m pytest tests/checks/test_hf_verify.py -q

The tiny random checkpoints are tests/mcore/hf_checkpoints.py's (nothing is downloaded);
each case runs in one set of spawned processes.
"""

import pytest

from tests.mcore.hf_checkpoints import FAMILY_CASES, MOE_CASES, build_checkpoints

pytest.importorskip("transformers", reason="HF interop tests need transformers")
pytest.importorskip("safetensors", reason="HF interop tests need safetensors")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, HF state dict, tokens [1, SEQ], HF logits [1, SEQ, 1000])."""
    return build_checkpoints(tmp_path_factory)


def _hf_verify(path, tp, pp, sp=False, cp=1, vpp=1):
    from megatron_chunkflow.checks.hf_verify import run_hf_verify
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.mcore.dist import shutdown

    r = run_hf_verify(str(path), [70, 5, 33, 100, 12, 64, 1, 16, 48],
                      ChunkFlowConfig(16, 1, "torch"),
                      ParallelConfig(tp=tp, pp=pp, cp=cp, sequence_parallel=sp, vpp=vpp),
                      seed=1)
    shutdown()
    return r.max_rel_grad_err, r.worst_param, r.loss_ref, r.loss_chunked


@pytest.mark.parametrize("case,tp,pp,sp,cp", [
    ("gqa2_tied", 1, 1, False, 1), ("gqa2_untied_sharded", 1, 1, False, 1),
    ("gqa2_tied", 1, 2, False, 1),
    # the other families, chunked (the 100-token sequence in 7 dependent chunks) at TP 1 and 2;
    # Qwen3's QK norms under sequence parallelism are their own modules (mcore/build.py); under
    # CP the scaled RoPE and the QK norms see zigzag shards of each chunk
    *[(case, tp, 1, False, 1) for case in FAMILY_CASES for tp in (1, 2)],
    ("qwen3_hd24", 2, 1, True, 1), ("llama3_scaled", 1, 1, False, 2),
    ("qwen3_hd24", 2, 1, True, 2), ("gqa2_untied_sharded", 1, 1, False, 2)])
def test_verify_against_transformers_float64(gloo, checkpoints, case, tp, pp, sp, cp):
    """ChunkFlow on megatron-core vs transformers' unchunked model of the checkpoint's family:
    float64 gradients (mapped back to HF names) within 1e-10, and the same loss."""
    for err, worst, loss_ref, loss_cf in gloo.run(_hf_verify, tp * pp * cp, checkpoints[case][0],
                                                       tp, pp, sp, cp, timeout=600):
        assert err <= 1e-10, (f"max relative grad error {err:.2e} at {worst}; "
                              f"loss {loss_ref} vs {loss_cf}")
        assert loss_cf == pytest.approx(loss_ref, rel=1e-12)


def _hf_verify_moe(paths, ep):
    """Every MoE family against transformers at EP `ep` (over DP), K 1 and 2: per family and K,
    (max relative gradient error, its parameter, the two losses, the gradients compared)."""
    from megatron_chunkflow.checks.hf_verify import run_hf_verify
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.mcore.dist import shutdown

    out = {}
    for name, path in paths.items():
        for k in (1, 2):
            r = run_hf_verify(str(path), [70, 6, 34, 100, 12, 64, 2, 16, 48],
                              ChunkFlowConfig(16, k, "torch"), ParallelConfig(ep=ep), seed=1)
            out[name, k] = (r.max_rel_grad_err, r.worst_param, r.loss_ref, r.loss_chunked,
                            [n for n, _ in r.param_errors])
    shutdown()
    return out


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_families_against_transformers_float64(gloo, checkpoints, ep):
    """Qwen3-MoE, Qwen2-MoE (its gated shared expert) and Mixtral against transformers'
    unchunked Qwen3MoeForCausalLM / Qwen2MoeForCausalLM / MixtralForCausalLM, the 100-token
    sequence in 7 dependent chunks: every gradient (the router's and each expert's, mapped back to
    the checkpoint's names; under EP 2 each rank's experts gathered) within 1e-12."""
    paths = {name: checkpoints[name][0] for name in MOE_CASES}
    for per_rank in gloo.run(_hf_verify_moe, ep, paths, ep, timeout=900):
        for (name, k), (err, worst, loss_ref, loss_cf, names) in per_rank.items():
            assert err <= 1e-12, f"{name} K {k}: max relative grad error {err:.2e} at {worst}"
            assert loss_cf == pytest.approx(loss_ref, rel=1e-12)
            experts = {n.split(".experts.")[1].split(".")[0] for n in names if ".experts." in n}
            assert experts == {"0", "1", "2", "3"}, name  # every expert compared
            assert any(n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))
                       for n in names), name


def test_verify_against_transformers_with_virtual_stages(gloo, checkpoints):
    """PP 2 x V 2 (one layer per model chunk, tied embeddings on model chunks 0 and 1 of different
    ranks): the interleaved plan's gradients, exported from every model chunk, are
    transformers' within 1e-10."""
    path = checkpoints["qwen2_4layers_tied"][0]
    for err, worst, loss_ref, loss_cf in gloo.run(_hf_verify, 2, path, 1, 2, False, 1, 2,
                                                       timeout=600):
        assert err <= 1e-10, f"max relative grad error {err:.2e} at {worst}"
        assert loss_cf == pytest.approx(loss_ref, rel=1e-12)


def test_reference_key_changes_when_the_checkpoint_is_rewritten(tmp_path):
    """The transformers reference is kept per (checkpoint, lengths, seed) in a long-lived process;
    a checkpoint rewritten in place (another size or time) is another key, so never a stale one."""
    import os

    from megatron_chunkflow.checks.hf_verify import _checkpoint_signature

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"0" * 8)
    first = _checkpoint_signature(str(tmp_path))
    assert _checkpoint_signature(str(tmp_path / ".." / tmp_path.name)) == first
    (tmp_path / "model.safetensors").write_bytes(b"1" * 9)
    assert _checkpoint_signature(str(tmp_path)) != first
    second = _checkpoint_signature(str(tmp_path))
    os.utime(tmp_path / "config.json", ns=(1, 1))
    assert _checkpoint_signature(str(tmp_path)) != second
