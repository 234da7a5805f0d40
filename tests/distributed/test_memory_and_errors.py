"""Activation memory follows the chunk size; bad settings stop with a clear error."""

import json
import subprocess
import sys

import pytest

C = 64


def run_cli(*argv, check=True):
    proc = subprocess.run([sys.executable, "-m", "megatron_chunkflow", *argv],
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr[-3000:])
    return proc


def test_memory_flat_in_length():
    """K=1, C fixed, L from 4C to 16C: activations other than K/V-sized terms stay flat (< 1.25x),
    unchunked grows >= 3x, and the K/V-sized bytes match the documented formula within 10%."""
    proc = run_cli("verify", "--memory", "--lengths", f"{4 * C},{8 * C},{16 * C}",
                   "--chunk-size", str(C), "--chunkflow-k", "1", "--json")
    rows = json.loads(proc.stdout)["rows"]
    first, last = rows[0], rows[-1]
    assert last["chunked_bytes"] / first["chunked_bytes"] < 1.25
    assert last["unchunked_bytes"] / first["unchunked_bytes"] >= 3
    for row in rows:
        assert row["state_bytes"] == pytest.approx(row["state_formula_bytes"], rel=0.10)
        assert row["chunked_bytes"] < row["unchunked_bytes"]


@pytest.mark.parametrize("argv,message", [
    (["--chunkflow-k", "0"], "--chunkflow-k must be >= 1"),
    (["--chunk-size", "0"], "--chunk-size must be >= 1"),
    (["--tp", "3"], "--tensor-model-parallel-size (--tp) 3 does not divide"),
    (["--tp", "2", "--sequence-parallel", "--chunk-size", "15"],
     "--chunk-size 15 is not a multiple of the tensor-parallel size 2"),
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size (--tp) > 1"),
    (["--model-config", "/nonexistent.json"], "no such file"),
])
def test_verify_bad_input_exits_2(argv, message):
    proc = run_cli("verify", *argv, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_model_config_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 64,\n "num_layers": }')
    proc = run_cli("verify", "--model-config", str(bad), check=False)
    assert proc.returncode == 2 and f"{bad}:2" in proc.stderr
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    proc = run_cli("verify", "--model-config", str(partial), check=False)
    assert proc.returncode == 2 and "missing ffn_hidden_size" in proc.stderr


def test_unsupported_megatron_settings_are_refused():
    """Context parallelism and fused RoPE would give wrong results: apply_chunkflow refuses them."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_chunkflow.runtime.model import _check_config

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, apply_rope_fusion=False)
    with pytest.raises(ValueError, match="context parallelism .* not supported with ChunkFlow yet"):
        _check_config(TransformerConfig(**{**base, "context_parallel_size": 2}))
    fused = TransformerConfig(**base)
    fused.apply_rope_fusion = True  # as Megatron-LM sets it by default on GPU machines
    with pytest.raises(ValueError, match="--no-rope-fusion"):
        _check_config(fused)
    _check_config(TransformerConfig(**base))
