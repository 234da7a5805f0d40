"""Activation memory follows the chunk size, and halves per rank under CP 2 (checks/memory.py
through `chunkflow verify --memory`, in the tests' gloo jobs).

    python -m pytest tests/checks/test_memory.py -q

Bad `chunkflow verify` input is tests/cli/test_verify.py's; the memory bound per pipeline stage is
tests/runtime/test_pipeline.py's.
"""

import json

import pytest

from megatron_chunkflow.core.models import get_model_shape

pytestmark = pytest.mark.slow

C = 64


@pytest.mark.parametrize("k", [1, 2])
def test_memory_flat_in_length(gloo, k):
    """C fixed, L from 4C to 16C: activations other than K/V-sized terms stay flat (< 1.25x),
    unchunked grows >= 3x, and the K/V state is the documented formula's, exactly, whatever K."""
    lengths = f"{4 * C},{15 * C + 40},{16 * C}"  # the middle one's last chunk is short
    code, out, err = gloo.cli(1, "verify", "--memory", "--lengths", lengths, "--chunk-size", C,
                              "--chunkflow-k", k, "--json")
    assert code == 0, err[-3000:]
    rows = json.loads(out)["rows"]
    first, last = rows[0], rows[-1]
    assert last["chunked_bytes"] / first["chunked_bytes"] < 1.25
    assert last["unchunked_bytes"] / first["unchunked_bytes"] >= 3
    for row in rows:
        assert row["state_bytes"] == row["state_formula_bytes"]
        assert row["chunked_bytes"] < row["unchunked_bytes"]


def test_memory_cp2_halves_bytes_per_rank(gloo):
    """`verify --memory --cp 2` on a 2-process job: per rank the K/V state exactly halves, and
    activation plus state is at most 0.55 of CP 1's; the collectives move what runtime/cp.py says:
    per layer and chunk j (prefix j C), (CP - 1)/CP of [prefix ++ chunk] K/V, reduce-scattered
    once and gathered once per forward (K = 1: chunks but the last run forward twice) and again in
    the backward. (Exactness at CP 2 is tests/checks/test_exact.py's.)"""
    c, length = 256, 2000  # the last chunk's 208 tokens are a multiple of 2 x CP
    code, out, err = gloo.cli(2, "verify", "--cp", 2, "--json", "--memory", "--chunk-size", c,
                              "--lengths", length)
    assert code == 0, err[-3000:]
    (row,) = json.loads(out)["rows"]
    assert row["cp2_state_bytes"] * 2 == row["cp1_state_bytes"]  # sharded K/V and accumulators
    assert row["ratio"] <= 0.55, row
    shape = get_model_shape("tiny")
    kv_bytes = 2 * shape.num_query_groups * shape.head_dim * 8 * shape.num_layers  # K, V, fp64
    n = -(-length // c)
    gathered = [j * c + min(c, length - j * c) for j in range(n)]  # [prefix ++ chunk] tokens
    received = [t * kv_bytes // 2 for t in gathered]  # (CP - 1) / CP at CP 2
    assert row["cp_reduce_scattered_bytes"] == sum(received)
    assert row["cp_gathered_bytes"] == sum(3 * r for r in received[:-1]) + 2 * received[-1]


def test_memory_cp2_replicated_state(gloo):
    """`--chunkflow-cp-kv replicated` at CP 2: every rank keeps the whole sequence's K/V state
    (exactly CP 1's bytes), and a chunk's collectives move its own K/V only: per layer and chunk
    (CP - 1)/CP of the chunk's K/V gathered once per forward (K = 1: twice for every chunk but the
    last), never again in the backward, and its gradient reduce-scattered once."""
    c, length = 256, 2000
    code, out, err = gloo.cli(2, "verify", "--cp", 2, "--json", "--memory", "--chunk-size", c,
                              "--lengths", length, "--chunkflow-cp-kv", "replicated")
    assert code == 0, err[-3000:]
    (row,) = json.loads(out)["rows"]
    assert row["cp2_state_bytes"] == row["cp1_state_bytes"]
    shape = get_model_shape("tiny")
    kv_bytes = 2 * shape.num_query_groups * shape.head_dim * 8 * shape.num_layers  # K, V, fp64
    n = -(-length // c)
    own = [min(c, length - j * c) for j in range(n)]
    received = [t * kv_bytes // 2 for t in own]  # (CP - 1) / CP at CP 2
    assert row["cp_reduce_scattered_bytes"] == sum(received)
    assert row["cp_gathered_bytes"] == sum(2 * r for r in received[:-1]) + received[-1]


def test_memory_follows_the_recompute_option(gloo):
    """`verify --memory --recompute full`: each chunk keeps only its layers' inputs, so fewer bytes are held than without recompute; the JSON names the option."""
    rows = {}
    for option in ("none", "full"):
        code, out, err = gloo.cli(1, "verify", "--memory", "--lengths", 4 * C, "--chunk-size", C,
                                  "--recompute", option, "--json")
        assert code == 0, err[-3000:]
        result = json.loads(out)
        assert result.get("recompute", "none") == option
        (rows[option],) = result["rows"]
    assert rows["full"]["chunked_bytes"] < rows["none"]["chunked_bytes"]
