"""float64 exactness of ChunkFlow against unchunked stock Megatron (PP = 1), on CPU with gloo.

    python -m pytest tests/checks/test_exact.py -q

Each layout runs over several steps whose chunk counts differ (real GPTModel, DDP, Megatron's
forward_backward_no_pipelining as the reference; see checks/verify.py); the tests then assert on
the results. Layouts of one process-group shape (world, TP, PP, CP, virtual stages) run as one
call of the session's long-lived gloo job, on one set of Megatron's groups, against one
reference per model and batch (run_verify memoizes it). The models are the tiny presets with two
layers, or one per model chunk where a pipeline has more (tests/models.py).
"""

import pytest
import torch

from tests.models import tiny

pytestmark = pytest.mark.slow

# C 32: sequences of 2-4 chunks (a chunk's op count, not its width, sets a CPU test's time)
C = 32
MIXED = [70, 5, 33, 100, 12, 64, 1, 16, 48, 9]  # 3 and 4 chunks, C + 1, 2C, 1 token, ...
STANDALONE = [5, 9, 16, 3, 11]
DEPENDENT = [100, 37, 65]  # every sequence longer than C: 4, 2 and 3 chunks
SINGLE_CHUNK = [5, 7]  # one standalone chunk: fewer chunks than stages
# at C = 128 under CP 2 (core/cp_place.py): a chunk whose first segment is split while the
# others stay whole on one rank, one rank padded; a chunk held whole (no CP attention); a
# chunk split whole; under TP 2 x CP 2 with sequence parallelism the same kinds
HYBRID = [42, 9, 25, 29, 31, 19, 58, 12, 11, 100]
STEPS = [MIXED, STANDALONE, DEPENDENT, SINGLE_CHUNK]

# PP = 1, one process: name -> (model, steps, K, dtype, backend, fully masked sequences[, recompute])
SINGLE = {
    "recompute_full": ("tiny", [MIXED], 1, torch.float64, "torch", (), "full"),
    "recompute_selective": ("tiny", [MIXED], 2, torch.float64, "torch", (), "selective"),
    "recompute_mlp_layernorm": ("tiny", [MIXED], 1, torch.float64, "auto", (),
                                "selective:mlp+layernorm"),
    "recompute_block": ("tiny", [MIXED, DEPENDENT], 2, torch.float64, "auto", (), "block:1"),
    "k1": ("tiny", STEPS, 1, torch.float64, "torch", ()),
    "k2": ("tiny", [MIXED, DEPENDENT], 2, torch.float64, "torch", ()),
    "k_ge_n": ("tiny", [MIXED], 8, torch.float64, "torch", ()),
    "untied_embeddings": ("tiny-untied", [MIXED], 1, torch.float64, "torch", ()),
    "masked_sequences": ("tiny", [MIXED], 1, torch.float64, "torch", (3, 1)),
    "sdpa_backend": ("tiny", [MIXED], 1, torch.float64, "sdpa", ()),
    "auto_backend": ("tiny", [MIXED, DEPENDENT], 2, torch.float64, "auto", ()),  # cpu_flash
    "float32": ("tiny", [MIXED], 1, torch.float32, "torch", ()),
    # the other families' switches: Qwen3's QK norm and head dim, Llama 3's scaled RoPE
    "qwen3_k2_cpu_flash": ("tiny-qwen3", [MIXED, DEPENDENT], 2, torch.float64, "auto", ()),
    "llama3_k1": ("tiny-llama3", STEPS, 1, torch.float64, "torch", ()),
    # re-forwards that skip attention (REFORWARD: --chunkflow-reforward-attention)
    "keep_k1": ("tiny", STEPS, 1, torch.float64, "torch", ()),
    "offload_k2_cpu_flash": ("tiny", [MIXED, DEPENDENT], 2, torch.float64, "auto", ()),
    "keep_selective": ("tiny", [MIXED, DEPENDENT], 1, torch.float64, "torch", (), "selective"),
    "keep_full_recompute": ("tiny", [MIXED, DEPENDENT], 2, torch.float64, "auto", (), "full"),
    # the loss in token pieces (LOSS_PIECE: --chunkflow-loss-piece), pieces that cut chunks
    "pieced_loss_k2": ("tiny", [MIXED, DEPENDENT], 2, torch.float64, "torch", ()),
    "pieced_loss_untied_full_recompute": ("tiny-untied", [MIXED], 1, torch.float64, "auto", (),
                                          "full"),
    # HybridModel (mcore/hybrid.py; megatron-core 0.18 on), every step kind, a recompute, Qwen3
    "hybrid_k1": ("tiny", STEPS, 1, torch.float64, "torch", ()),
    "hybrid_k2_block_recompute": ("tiny", [MIXED, DEPENDENT], 2, torch.float64, "auto", (),
                                  "block:1"),
    "hybrid_qwen3_selective": ("tiny-qwen3", [MIXED, DEPENDENT], 2, torch.float64, "auto", (),
                               "selective"),
}
# several processes: name -> (world, TP, PP, sequence parallel, K values, steps[, CP, recompute,
# backend])
LAYOUTS = {
    "tp2": (2, 2, 1, False, (2,), [MIXED]),
    "tp2_sequence_parallel": (2, 2, 1, True, (1,), [MIXED]),
    "dp2": (2, 1, 1, False, (1,), [MIXED, DEPENDENT]),
    "pp2": (2, 1, 2, False, (1, 2), STEPS),
    "pp4": (4, 1, 4, False, (1, 2), [MIXED, SINGLE_CHUNK, DEPENDENT]),
    "tp2_pp2": (4, 2, 2, True, (2,), [MIXED, STANDALONE]),
    "dp2_pp2": (4, 1, 2, False, (1,), [MIXED, DEPENDENT]),
    # context parallelism: zigzag shards, sharded K/V state, ring attention (runtime/cp.py)
    "cp2": (2, 1, 1, False, (1, 2), STEPS, 2),
    "cp2_cpu_flash_recompute": (2, 1, 1, False, (2,), [MIXED], 2, "selective", "auto"),
    "cp2_full_recompute": (2, 1, 1, False, (1,), [MIXED], 2, "full"),
    "cp2_pp2": (4, 1, 2, False, (1, 2), [MIXED, DEPENDENT], 2),
    "tp2_cp2_sequence_parallel": (4, 2, 1, True, (1, 2), [MIXED, DEPENDENT], 2),
    "cp2_dp2": (4, 1, 1, False, (1,), [MIXED, DEPENDENT], 2),
    "qwen3_tp2_cp2_sequence_parallel": (4, 2, 1, True, (1, 2), [MIXED, DEPENDENT], 2),
    "llama3_cp2_pp2": (4, 1, 2, False, (1, 2), [MIXED, DEPENDENT], 2),
    # virtual pipeline stages (the interleaved plan, one layer per model chunk): every step kind
    "pp2_vpp2": (2, 1, 2, False, (1, 2), STEPS),
    "pp2_vpp2_full_recompute": (2, 1, 2, False, (2,), [MIXED], 1, "full"),
    "tp2_pp2_vpp2_sequence_parallel": (4, 2, 2, True, (1, 2), [MIXED, DEPENDENT]),
    "cp2_pp2_vpp2": (4, 1, 2, False, (1, 2), [MIXED, DEPENDENT], 2),
    # replicated K/V state under CP (--chunkflow-cp-kv replicated): a chunk gathers only its own
    # K/V, the relay runs on whole chunks; the backward from the log-sum-exp and (sdpa) recomputed
    "cp2_replicated": (2, 1, 1, False, (1, 2), STEPS, 2),
    "cp2_replicated_sdpa": (2, 1, 1, False, (2,), [MIXED, DEPENDENT], 2, "none", "sdpa"),
    "cp4_replicated": (4, 1, 1, False, (1, 2), [MIXED, DEPENDENT], 4),
    "tp2_cp2_sequence_parallel_replicated": (4, 2, 1, True, (1, 2), [MIXED, DEPENDENT], 2),
    "cp2_pp2_replicated": (4, 1, 2, False, (1,), [MIXED, DEPENDENT], 2),
    # sharded state runs the ring attention by default; the gather-first path
    # (--chunkflow-cp-attention gather) and the ring at CP 4
    "cp2_gather": (2, 1, 1, False, (1, 2), [MIXED, DEPENDENT], 2),
    "cp4": (4, 1, 1, False, (1,), [MIXED, DEPENDENT], 4),
    # hybrid placement (the default) where it places segments: C = 128 (HYBRID_CHUNK)
    "cp2_hybrid": (2, 1, 1, False, (1, 2), [HYBRID, MIXED], 2),
    "tp2_cp2_sequence_parallel_hybrid": (4, 2, 1, True, (1,), [HYBRID], 2),
    "cp2_pp2_hybrid": (4, 1, 2, False, (1,), [HYBRID], 2),
    "cp2_split": (2, 1, 1, False, (1,), [HYBRID], 2),  # --chunkflow-cp-placement split
    # re-forwards that skip attention (REFORWARD)
    "pp2_keep": (2, 1, 2, False, (1, 2), [MIXED, DEPENDENT]),
    "cp2_keep": (2, 1, 1, False, (1, 2), [MIXED, DEPENDENT], 2),
    "cp2_pp2_keep": (4, 1, 2, False, (1, 2), [MIXED, DEPENDENT], 2),
    "tp2_cp2_sequence_parallel_offload": (4, 2, 1, True, (1, 2), [MIXED, DEPENDENT], 2),
    "cp2_keep_gather": (2, 1, 1, False, (1,), [DEPENDENT], 2),
    "cp2_keep_replicated": (2, 1, 1, False, (2,), [MIXED, DEPENDENT], 2),
    "cp2_full_recompute_keep": (2, 1, 1, False, (1,), [DEPENDENT], 2, "full"),
    "pp2_vpp2_keep": (2, 1, 2, False, (1, 2), [MIXED, DEPENDENT]),
    # the loss in token pieces, vocabulary-parallel under TP, on the last stage under PP
    "tp2_pieced_loss": (2, 2, 1, False, (1,), [MIXED, DEPENDENT]),
    "tp2_sequence_parallel_pieced_loss": (2, 2, 1, True, (2,), [MIXED]),
    "pp2_pieced_loss": (2, 1, 2, False, (1, 2), [MIXED, DEPENDENT]),
    "cp2_pieced_loss": (2, 1, 1, False, (1,), [MIXED, DEPENDENT], 2),
    # HybridModel: pipeline stages (and virtual stages) as segments of its layer pattern
    "hybrid_pp2": (2, 1, 2, False, (1, 2), STEPS),
    "hybrid_tp2_pp2_sequence_parallel": (4, 2, 2, True, (2,), [MIXED, STANDALONE]),
    "hybrid_pp2_vpp2": (2, 1, 2, False, (1, 2), [MIXED, DEPENDENT]),
    "hybrid_qwen3_tp2_cp2_sequence_parallel": (4, 2, 1, True, (1, 2), [MIXED, DEPENDENT], 2),
    "hybrid_cp2_pp2_full_recompute": (4, 1, 2, False, (1,), [MIXED, DEPENDENT], 2, "full"),
}
HYBRID_CHUNK = ("cp2_hybrid", "tp2_cp2_sequence_parallel_hybrid", "cp2_pp2_hybrid", "cp2_split")
REFORWARD = {"keep_k1": "keep", "offload_k2_cpu_flash": "offload", "keep_selective": "keep",
             "keep_full_recompute": "keep", "pp2_keep": "keep", "cp2_keep": "keep",
             "cp2_pp2_keep": "keep", "tp2_cp2_sequence_parallel_offload": "offload",
             "cp2_keep_gather": "keep", "cp2_keep_replicated": "keep",
             "cp2_full_recompute_keep": "keep", "pp2_vpp2_keep": "keep"}
LOSS_PIECE = {"pieced_loss_k2": 7, "pieced_loss_untied_full_recompute": 5, "tp2_pieced_loss": 7,
              "tp2_sequence_parallel_pieced_loss": 3, "pp2_pieced_loss": 7, "cp2_pieced_loss": 5}
MODELS = {"qwen3_tp2_cp2_sequence_parallel": "tiny-qwen3", "llama3_cp2_pp2": "tiny-llama3",
          "hybrid_qwen3_tp2_cp2_sequence_parallel": "tiny-qwen3"}
VIRTUAL = {"pp2_vpp2": 2, "pp2_vpp2_full_recompute": 2, "tp2_pp2_vpp2_sequence_parallel": 2,
           "cp2_pp2_vpp2": 2, "pp2_vpp2_keep": 2,
           "hybrid_pp2_vpp2": 2}  # virtual stages per pipeline rank
BOUND = {torch.float64: 1e-10, torch.float32: 1e-4}
MEDIUM = ("pp2", "cp2", "pp2_vpp2")  # `make test-medium`'s share of the layouts


def model_class(name: str) -> str:
    return "hybrid" if name.startswith("hybrid_") else "gpt"


def _release_marks(name: str, release: bool) -> list:
    """HybridModel's cases skip where megatron-core has none; `release`: the exactness core CI runs
    on its second megatron-core release (`make test-release`, the marker `release`)."""
    from megatron_chunkflow import compat

    marks = [pytest.mark.release] if release else []
    if model_class(name) == "hybrid" and not compat.has_hybrid_model():
        marks.append(pytest.mark.skip(reason=f"megatron-core {compat.version_text()} has no "
                                             "HybridModel (0.18 added it)"))
    return marks


def _summary(results):
    return [(r.max_rel_grad_err, r.worst_param, r.loss_ref, r.loss_chunked, r.num_chunks)
            for r in results]


def _run_single(names):
    from megatron_chunkflow.checks.verify import run_verify
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.mcore.dist import shutdown

    out = {}
    for name in names:
        model, steps, k, dtype, backend, masked, *recompute = SINGLE[name]
        parallel = ParallelConfig(recompute=recompute[0] if recompute else "none")
        config = ChunkFlowConfig(C, k, backend, loss_piece=LOSS_PIECE.get(name, 0),
                                 reforward_attention=REFORWARD.get(name, "recompute"))
        out[name] = _summary(run_verify(tiny(model), steps, config, parallel, dtype,
                                        seed=1, fully_masked=masked,
                                        model_class=model_class(name)))
    shutdown()
    return out


def _group(name) -> tuple:
    """The process-group shape a layout runs on: (world, TP, PP, CP, virtual stages)."""
    world, tp, pp, _, _, _, *extra = LAYOUTS[name]
    return world, tp, pp, extra[0] if extra else 1, VIRTUAL.get(name, 1)


GROUPS: dict[tuple, list[str]] = {}
for _name in LAYOUTS:
    GROUPS.setdefault(_group(_name), []).append(_name)


def _run_group(names):
    """Every layout of one process-group shape, in one call: {name: its results}, with the
    virtual stages of the process groups it ran on (Job.from_megatron refuses groups of another
    shape)."""
    from megatron_chunkflow.config import ParallelConfig
    from megatron_chunkflow.mcore.dist import shutdown
    from megatron_chunkflow.mcore.job import Job

    out = {}
    for name in names:
        out[name] = _run_layout(name)
        _, tp, pp, cp, vpp = _group(name)
        ran = Job.from_megatron(ParallelConfig(tp=tp, pp=pp, cp=cp, vpp=vpp))
        out[name]["virtual"] = ran.parallel.vpp
    shutdown()
    return out


def _run_layout(name):
    from megatron_chunkflow.checks.verify import run_verify
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig

    _, tp, pp, sp, ks, steps, *extra = LAYOUTS[name]
    cp, recompute, backend = (*extra, *(1, "none", "torch")[len(extra):])
    parallel = ParallelConfig(tp=tp, pp=pp, cp=cp, sequence_parallel=sp, recompute=recompute,
                              vpp=VIRTUAL.get(name, 1))
    shape = tiny(MODELS.get(name, "tiny"), stages=pp * VIRTUAL.get(name, 1))
    cp_kv = "replicated" if name.endswith(("_replicated", "_replicated_sdpa")) else "sharded"
    cp_attention = "gather" if name.endswith("_gather") else "ring"
    placement = "split" if name.endswith("_split") else "hybrid"
    configs = [ChunkFlowConfig(128 if name in HYBRID_CHUNK else C, k, backend, cp_kv=cp_kv,
                               cp_attention=cp_attention, cp_placement=placement,
                               reforward_attention=REFORWARD.get(name, "recompute"),
                               loss_piece=LOSS_PIECE.get(name, 0)) for k in ks]
    results = run_verify(shape, steps, configs, parallel, seed=2, model_class=model_class(name))
    return {k: _summary(rows) for k, rows in zip(ks, results)}


def _check(name, rows, bound):
    for step, (err, worst, loss_ref, loss_cf, _) in enumerate(rows):
        assert err <= bound, f"{name} step {step}: max relative grad error {err:.2e} at {worst}"
        assert loss_cf == pytest.approx(loss_ref, rel=bound, abs=bound)
        assert loss_ref > 0


def _selected(request, test: str) -> set[str]:
    """The `name` parameters of `test` this session runs (a group, or the single-process set, runs
    only what was selected: `make test-release` takes the release-marked share)."""
    return {item.callspec.params["name"] for item in request.session.items
            if getattr(item, "originalname", None) == test and hasattr(item, "callspec")
            and not item.get_closest_marker("skip")}


@pytest.fixture(scope="module")
def single_results(gloo, request):
    names = [n for n in SINGLE if n in _selected(request, "test_exact_pp1_single_process")]
    return gloo.run(_run_single, 1, names or ["k1"], timeout=600)[0]


# the single-process share of the exactness core on CI's second megatron-core release
RELEASE_SINGLE = ("k1", "k2", "recompute_full", "recompute_selective", "keep_k1",
                  "pieced_loss_k2", "qwen3_k2_cpu_flash", "llama3_k1", "untied_embeddings")


@pytest.mark.medium
@pytest.mark.parametrize("name", [pytest.param(n, marks=_release_marks(
    n, n in RELEASE_SINGLE or model_class(n) == "hybrid")) for n in SINGLE])
def test_exact_pp1_single_process(single_results, name):
    _check(name, single_results[name], BOUND[SINGLE[name][3]])


@pytest.mark.release
def test_chunk_count_changes_between_steps(single_results):
    counts = [num_chunks for *_, num_chunks in single_results["k1"]]
    assert len(set(counts)) == len(counts) and min(counts) == 1


_GROUP_RESULTS: dict[tuple, object] = {}  # a group's per-rank results, or what it raised


# every process-group shape once (its first layout), and HybridModel's: the exactness core that CI
# also runs on its second megatron-core release
RELEASE_LAYOUTS = {names[0] for names in GROUPS.values()} | \
    {n for n in LAYOUTS if model_class(n) == "hybrid"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[
    *([pytest.mark.medium] if n in MEDIUM else []), *_release_marks(n, n in RELEASE_LAYOUTS)])
    for n in LAYOUTS])
def test_exact_layout(gloo, request, name):
    group = _group(name)
    if group not in _GROUP_RESULTS:  # the first layout of a group runs what is selected of it
        selected = _selected(request, "test_exact_layout")
        names = [n for n in GROUPS[group] if n in selected]
        try:
            _GROUP_RESULTS[group] = gloo.run(_run_group, group[0], names, timeout=1800)
        except Exception as e:  # noqa: BLE001  every layout of the group reports it
            _GROUP_RESULTS[group] = e
    if isinstance(_GROUP_RESULTS[group], Exception):
        raise _GROUP_RESULTS[group]
    for per_rank in _GROUP_RESULTS[group]:
        rows = dict(per_rank[name])
        assert rows.pop("virtual") == VIRTUAL.get(name, 1)
        for k, steps in rows.items():
            _check(f"{name} K={k}", steps, 1e-10)
