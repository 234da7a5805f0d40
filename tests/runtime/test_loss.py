"""Cross entropy over Megatron's padded vocabulary: the padded rows are left out of the softmax at
every TP size, on both loss paths (float64 exact, and Megatron's fp32 vocab-parallel one)."""

import pytest
import torch

from megatron_chunkflow.config import ParallelConfig

VOCAB, PADDED, TOKENS = 300, 512, 23  # padded_vocab_size(300, tp) is 384 at TP 1, 512 at TP 2


def _losses(tp: int, dtype_name: str):
    """Per-token losses and the logits' gradient on this TP rank's shard, with padded rows holding
    large logits (so that leaving them in would show)."""
    import torch.distributed as dist

    from megatron_chunkflow.mcore.dist import init_distributed
    from megatron_chunkflow.runtime.loss import token_loss_sum

    job = init_distributed(ParallelConfig(tp=tp))
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(1, TOKENS, PADDED, generator=g, dtype=torch.float64)
    full[..., VOCAB:] = 5.0
    labels = torch.randint(0, VOCAB, (1, TOKENS), generator=g)
    labels[0, :4] = torch.tensor([0, VOCAB - 1, 255, 256])  # both sides of TP 2's shard edge
    mask = torch.ones(1, TOKENS)
    rank = job.ranks.tp_rank
    local = full.chunk(tp, dim=-1)[rank].to(dtype).requires_grad_()
    logits = local * 1  # a non-leaf, as the output layer's
    group = job.groups.tp
    loss, count, _ = token_loss_sum(labels, mask, logits, tp_group=group,
                                    exact=dtype == torch.float64, vocab_size=VOCAB)
    loss.backward()
    grads = [torch.empty_like(local.grad) for _ in range(tp)]
    dist.all_gather(grads, local.grad.contiguous(), group=group)
    return float(loss), int(count), torch.cat(grads, dim=-1).double().tolist()  # no shared memory


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.medium)])
def test_padded_rows_are_out_of_the_softmax(gloo, tp, dtype):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(1, TOKENS, PADDED, generator=g, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (1, TOKENS), generator=g)
    labels[0, :4] = torch.tensor([0, VOCAB - 1, 255, 256])
    real = full[..., :VOCAB].clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(real[0], labels[0], reduction="sum")
    expected.backward()
    loss, count, grad = gloo.run(_losses, tp, tp, dtype, timeout=120)[0]
    grad = torch.tensor(grad, dtype=torch.float64)
    tol = 1e-12 if dtype == "float64" else 1e-5
    assert count == TOKENS
    assert loss == pytest.approx(float(expected), rel=tol)
    assert torch.equal(grad[..., VOCAB:], torch.zeros_like(grad[..., VOCAB:]))
    assert torch.allclose(grad[..., :VOCAB], real.grad, rtol=0, atol=tol)


def test_chunk_inputs_follow_the_model_to_its_device():
    """Plans are built on the host; forward_step moves a chunk's inputs to the model's device
    (meta here: no GPU needed to see every tensor move); the packed-sequence offsets stay on the
    host, where chunk attention reads them."""
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.data.synthetic import make_sequences
    from megatron_chunkflow.runtime.execute import plan_step

    step = plan_step(make_sequences([40, 100, 7], 1000, seed=0), ChunkFlowConfig(32, 1),
                     ParallelConfig(), get_model_shape("tiny"))
    for inp in step.inputs.values():
        moved = inp.to("meta")
        params = moved.packed_seq_params
        tensors = [moved.tokens, moved.labels, moved.loss_mask, moved.position_ids]
        assert all(t.device.type == "meta" for t in tensors)
        assert params.cu_seqlens_q.device.type == params.cu_seqlens_kv.device.type == "cpu"
        assert moved.tokens.shape == inp.tokens.shape and inp.tokens.device.type == "cpu"
