"""The pieced cross entropy (runtime/pieced_loss.py) against the whole one, in float64, on one
process: awkward piece sizes, padded vocabulary rows, a vocabulary block of one row. Under TP,
PP and CP, and inside Megatron's model, tests/checks/test_exact.py checks it.

    python -m pytest tests/runtime/test_pieced_loss.py -q
"""

import pytest
import torch

from megatron_chunkflow.runtime.pieced_loss import PiecedCrossEntropy


def _whole(hidden, weight, labels, vocab_size):
    logits = hidden @ weight.t()
    if vocab_size is not None:
        logits = logits.masked_fill(torch.arange(weight.size(0)) >= vocab_size, float("-inf"))
    return -torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("tokens, rows, piece, vocab_size", [
    (37, 50, 7, None),  # pieces that do not divide the tokens
    (37, 50, 1, 45),  # one token per piece (one vocabulary row per backward block), padded rows
    (8, 64, 100, 61),  # one piece holding everything
])
def test_pieced_equals_whole_in_float64(tokens, rows, piece, vocab_size):
    gen = torch.Generator().manual_seed(tokens + rows)
    h = torch.randn(tokens, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(rows, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab_size or rows, (tokens,), generator=gen)
    scale = torch.rand(tokens, dtype=torch.float64, generator=gen)  # per-token loss weights
    pieced = PiecedCrossEntropy.apply(h, w, labels, piece, None, vocab_size)
    grads = torch.autograd.grad((pieced * scale).sum(), (h, w))
    whole = _whole(h, w, labels, vocab_size)
    expected = torch.autograd.grad((whole * scale).sum(), (h, w))
    torch.testing.assert_close(pieced, whole, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
