"""The LoRA and SpaCO command lines end to end: memory with LoRA, verify's JSON, train's labels.

    python -m pytest tests/cli/test_lora_sparse_runs.py -q
"""

import json

import pytest

pytestmark = pytest.mark.slow

C = 64
SMALL = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
         "num_query_groups": 2, "vocab_size": 128, "tie_embeddings": True}


def run_cli(gloo, *argv):
    """`chunkflow ARGV` in the tests' world-of-one job: (its JSON, its stderr)."""
    code, out, err = gloo.cli(1, *argv)
    assert code == 0, err[-3000:]
    return json.loads(out), err


def test_memory_with_lora_follows_the_chunk_size(gloo):
    """One process training LoRA adapters, K=1, L = 4C, 8C, 16C: activation bytes are the same
    at every length (set by C), unchunked grows >= 3x, the K/V state matches its formula."""
    out, _ = run_cli(gloo, "verify", "--memory", "--lora-rank", "8", "--lengths",
                     f"{4 * C},{8 * C},{16 * C}", "--chunk-size", str(C), "--chunkflow-k", "1", "--json")
    assert out["lora"] == {"rank": 8, "alpha": 16.0, "targets": ["qkv", "proj", "fc1", "fc2"]}
    rows = out["rows"]
    assert len({row["chunked_bytes"] for row in rows}) == 1
    assert rows[-1]["unchunked_bytes"] / rows[0]["unchunked_bytes"] >= 3
    for row in rows:
        assert row["state_bytes"] == pytest.approx(row["state_formula_bytes"], rel=0.10)
        assert row["chunked_bytes"] < row["unchunked_bytes"] / 3


@pytest.fixture
def small_model(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("48\n20\n9\n5\n")
    return ["--model-config", str(path), "--lengths-file", str(lengths), "--chunk-size", "16"]


def test_verify_lora_json(gloo, small_model):
    out, _ = run_cli(gloo, "verify", *small_model, "--lora-rank", "4", "--json")
    assert out["passed"] and out["max_rel_grad_err"] <= 1e-10
    assert out["lora"]["rank"] == 4 and ".lora_" in out["worst_param"]


def test_verify_sparse_json_is_labelled_approximate(gloo, small_model):
    out, text = run_cli(gloo, "verify", *small_model, "--chunkflow-sparse-backward", "1",
                        "--draws", "8", "--json")
    assert out["approximate"] is True and out["passed"]
    sparse = out["sparse"]
    assert {"t", "draws", "rel_err_of_mean", "expected_rel_err"} <= set(sparse)
    assert sparse["t"] == 1 and sparse["draws"] == 8
    assert 0 < sparse["rel_err_of_mean"] <= 4 * sparse["expected_rel_err"]
    assert [row["draws"] for row in sparse["curve"]] == [1, 4, 8]
    assert out["loss_sparse"] == pytest.approx(out["loss_ref"], rel=1e-12)
    assert any(line.startswith("APPROXIMATE (SpaCO)") for line in text.splitlines())


def test_train_labels_every_sparse_record(gloo, tmp_path):
    model = tmp_path / "small.json"
    model.write_text(json.dumps({**SMALL, "vocab_size": 151936}))  # the Qwen2.5 tokenizer's ids
    log = tmp_path / "steps.jsonl"
    out, text = run_cli(gloo, "train", "--model-config", str(model), "--train-iters", "2",
                        "--lr-warmup-iters", "0", "--global-batch-size", "2", "--max-samples", "8",
                        "--chunk-size", "64", "--seq-length", "4096", "--lora-rank", "4",
                        "--chunkflow-sparse-backward", "2", "--json", "--log-json", str(log))
    assert out["approximate"] is True and out["sparse_backward"] == 2 and out["lora"]["rank"] == 4
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    for record in rows + out["steps"]:
        assert record["approximate"] is True and record["sparse_backward"] == 2
        assert 0 <= record["backward_chunks"] <= record["dependent_chunks"]
    assert "SpaCO sparse backward, APPROXIMATE" in text
    assert text.count("| APPROXIMATE (SpaCO T=2)") == 2 and "(APPROXIMATE gradients" in text


def test_log_json_rows_carry_every_metric_and_the_rate_each_step_applied(gloo, tmp_path):
    """--log-json rows hold what the --json summary's steps hold (grad_norm, loss_tokens
    included), and `lr` is the rate the step applied: Megatron-LM's warm-up, step 1 at 0. A global
    batch larger than the data set is warned about."""
    model = tmp_path / "small.json"
    model.write_text(json.dumps({**SMALL, "vocab_size": 151936}))
    log = tmp_path / "steps.jsonl"
    data = tmp_path / "chats.jsonl"  # two short conversations: the rows, not the tokens, matter
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Name {n} colours of the sea at dawn."},
        {"role": "assistant", "content": "Grey, silver, rose and pale gold. " * n}]}) + "\n"
        for n in (2, 5)))
    out, text = run_cli(gloo, "train", "--model-config", str(model), "--train-iters", "4",
                        "--lr-warmup-iters", "2", "--lr", "0.003", "--min-lr", "0.0003",
                        "--global-batch-size", "3", "--data-path", str(data), "--chunk-size",
                        "16", "--seq-length", "256", "--json", "--log-json", str(log))
    assert "warning: --global-batch-size 3 is larger than the data set (2 samples)" in text
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row, step in zip(rows, out["steps"]):
        assert {"loss", "loss_tokens", "grad_norm", "lr", "step_s", "tokens"} <= set(row)
        assert row["loss"] == step["loss"] and row["grad_norm"] == step["grad_norm"]
        assert row["loss_tokens"] == step["loss_tokens"] > 0 and row["grad_norm"] > 0
    assert [r["lr"] for r in rows[:3]] == pytest.approx([0.0, 0.0015, 0.003])
    assert 0.0003 < rows[3]["lr"] < 0.003  # cosine decay after the warm-up
