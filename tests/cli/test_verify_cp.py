"""`chunkflow verify --cp 2` under torchrun (2 processes, gloo): exactness against unchunked
megatron-core, and --memory's per-rank bytes against CP = 1 at the same chunk size."""

import json
import os
import subprocess
import sys

import pytest

from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.mcore.dist import free_port

pytestmark = pytest.mark.slow


def _verify(tmp_path, *argv):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), "-m", "megatron_chunkflow", "verify", "--cp", "2",
           "--json", *argv]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_verify_cp2_is_exact(tmp_path):
    result = _verify(tmp_path, "--chunk-size", "128", "--chunkflow-k", "2")
    assert result["cp"] == 2 and result["dp"] == 1 and result["passed"]
    assert result["max_rel_grad_err"] <= 1e-10
    assert result["steps"][0]["num_chunks"] > 1


def test_verify_memory_cp2_halves_bytes_per_rank(tmp_path):
    """Per rank at CP 2: the K/V state exactly halves, activation plus state at most 0.55 of
    CP 1's; the collectives move what runtime/cp.py says: per layer and chunk j (prefix j C),
    (CP - 1)/CP of [prefix ++ chunk] K/V, reduce-scattered once and gathered once per forward
    (K = 1: chunks but the last run forward twice) and again in the backward."""
    c, length = 256, 2000  # the last chunk's 208 tokens are a multiple of 2 x CP
    result = _verify(tmp_path, "--memory", "--chunk-size", str(c), "--lengths", str(length))
    (row,) = result["rows"]
    assert row["cp2_state_bytes"] * 2 == row["cp1_state_bytes"]  # sharded K/V and accumulators
    assert row["ratio"] <= 0.55, row
    shape = get_model_shape("tiny")
    kv_bytes = 2 * shape.num_query_groups * shape.head_dim * 8 * shape.num_layers  # K, V, fp64
    n = -(-length // c)
    gathered = [j * c + min(c, length - j * c) for j in range(n)]  # [prefix ++ chunk] tokens
    received = [t * kv_bytes // 2 for t in gathered]  # (CP - 1) / CP at CP 2
    assert row["cp_reduce_scattered_bytes"] == sum(received)
    assert row["cp_gathered_bytes"] == sum(3 * r for r in received[:-1]) + 2 * received[-1]
