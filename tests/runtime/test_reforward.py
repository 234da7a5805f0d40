"""Re-forwards that skip attention (runtime/reforward.py, --chunkflow-reforward-attention): on real
megatron-core under CP 2 and without CP (gloo, float64), what each mode keeps and moves, to the
byte.

Two long sequences at C = 16, K = 1: every chunk is a dependent one, all but each sequence's last
re-forwarded. Per rank, layer and chunk the ring receives (CP - 1) / CP x (prefix + chunk) tokens
of K and V in a forward, that again in the backward and the same of dK/dV (runtime/cp.py); a
re-forward that skips attention moves nothing.
"""

import pytest
import torch

pytestmark = pytest.mark.slow

C, LENGTHS = 16, [100, 37]


def _run(modes, backend, cp):
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.mcore.build import build_chunkflow_model
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.runtime.cp import Traffic
    from megatron_chunkflow.mcore.step import forward_backward
    from megatron_chunkflow.runtime.execute import plan_step
    from megatron_chunkflow.runtime.loss import make_forward_step

    shape = get_model_shape("tiny")
    parallel = ParallelConfig(cp=cp)
    job = init_distributed(parallel, 0)
    sequences = make_sequences(LENGTHS, shape.vocab_size, 0)
    out = {}
    for mode in modes:
        torch.manual_seed(0)
        cm = build_chunkflow_model(shape, torch.float64, job, attention_backend=backend)
        store = cm.store
        store.cp_traffic = Traffic()
        peaks = {"device": 0, "host": 0}
        keep = store.keep_attention

        def keep_and_sample(layer, kept, keep=keep, store=store, peaks=peaks):
            keep(layer, kept)
            peaks["device"] = max(peaks["device"], store._kept_bytes(host=False))
            peaks["host"] = max(peaks["host"], store.kept_host_bytes())

        store.keep_attention = keep_and_sample
        config = ChunkFlowConfig(C, 1, backend, reforward_attention=mode)
        step = plan_step(sequences, config, parallel, shape, job.ranks)
        forward_backward(job, cm, step, make_forward_step(job.groups.tp, exact_loss=True))
        chunks = {i: (m.prefix_len + m.num_tokens, i in step.plan.recomputed, m.local_tokens,
                      m.dependent) for i, m in step.metas.items()}
        ops = [(op.kind, op.chunk) for op in step.plan.stages[0]]
        grads = torch.cat([p.main_grad.flatten() for p in cm.model.parameters()]).clone()
        out[mode] = (store.cp_traffic.gathered, store.cp_traffic.reduce_scattered, peaks,
                     chunks, grads, store.is_empty(), ops)
    shutdown()
    return out


@pytest.mark.parametrize("backend, cp", [("torch", 2), ("cpu_flash", 2), ("torch", 1)])
def test_bytes_moved_and_kept_equal_the_formula(gloo, backend, cp):
    from megatron_chunkflow.core.models import get_model_shape

    shape = get_model_shape("tiny")
    layers, groups, heads = shape.num_layers, shape.num_query_groups, shape.num_attention_heads
    hn = shape.hidden_size // heads
    kv_token = 2 * groups * hn * 8  # K and V of one token, float64
    for per_rank in gloo.run(_run, cp, ("recompute", "keep", "offload"), backend, cp,
                             timeout=600):
        chunks, ops = per_rank["recompute"][3], per_rank["recompute"][6]
        assert all(dependent for *_, dependent in chunks.values())
        reforwarded = {i: c for i, c in chunks.items() if c[1]}
        assert len(reforwarded) == len(chunks) - len(LENGTHS)
        unit = layers * kv_token * (cp - 1) // cp
        forward = sum(keys for keys, *_ in chunks.values()) * unit
        refwd = sum(keys for keys, *_ in reforwarded.values()) * unit
        # kept from a re-forwarded chunk's F to its R (whose graph then holds it), per layer its
        # output and log-sum-exp, t x heads x (hn + 1) float64 on the rank
        kept, expected = 0, 0
        for kind, chunk in ops:
            if chunk in reforwarded and kind != "B":
                kept += (1 if kind == "F" else -1) * reforwarded[chunk][2]
                expected = max(expected, kept)
        expected *= layers * heads * (hn + 1) * 8
        assert expected > 0
        recompute_grads = per_rank["recompute"][4]
        for mode, (gathered, scattered, peaks, _, grads, empty, _) in per_rank.items():
            assert empty, mode
            # forward and backward of every chunk, the re-forward's forward unless kept
            assert gathered == 2 * forward + (refwd if mode == "recompute" else 0), mode
            assert scattered == forward, mode
            torch.testing.assert_close(grads, recompute_grads, rtol=1e-12, atol=1e-15)
            where = {"recompute": (0, 0), "keep": (expected, 0), "offload": (0, expected)}[mode]
            assert (peaks["device"], peaks["host"]) == where, mode
