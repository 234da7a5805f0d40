"""Record sources (JSONL, JSON arrays, directories, Parquet, Megatron indexed datasets) read
through open_sft_dataset, and the bad-record errors that name FILE:LINE.

    python -m pytest tests/data/test_sources.py -q
"""

import json

import numpy as np
import pytest
import torch

from megatron_chunkflow.data import encode_conversation, load_tokenizer, open_sft_dataset

CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
SHAREGPT = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def write_jsonl(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_jsonl_record_kinds(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [CHAT, SHAREGPT, "", {"text": "plain words"}])
    ds = open_sft_dataset(path, tok, seq_length=4096)
    assert len(ds) == 3 and ds.stats["records"] == 3
    assert torch.equal(ds[0].tokens, ds[1].tokens)  # ChatML and ShareGPT spellings agree
    assert ds[2].tokens.tolist() == tok.encode("plain words") + [tok.eod_id]
    assert ds[2].loss_mask.sum() == len(ds[2]) - 1
    assert ds.lengths == [len(s) for s in ds]
    assert ds.stats["assistant_tokens"] == int(sum(s.loss_mask.sum() for s in ds))
    assert ds.stats["tokens"] == sum(ds.lengths)


@pytest.mark.parametrize("bad_line, reason", [
    ('{"messages": [', "malformed JSON"),
    ('{"prompt": "x"}', "record has none of messages, conversations, text"),
    ('{"messages": []}', "empty conversation"),
    ("[1, 2]", "record is a list"),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path, tok, bad_line, reason):
    path = write_jsonl(tmp_path / "d.jsonl", [CHAT, CHAT, bad_line, CHAT])
    with pytest.raises(ValueError, match=rf"d\.jsonl:3: {reason}.*--skip-bad-records"):
        open_sft_dataset(path, tok, seq_length=4096)


def test_skip_bad_records_counts_and_keeps_examples(tmp_path, tok):
    lines = [CHAT, "{oops", {"messages": []}, CHAT, {"text": 7}] + ["nope"] * 6
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    ds = open_sft_dataset(path, tok, seq_length=4096, skip_bad_records=True)
    assert len(ds) == 2
    assert ds.stats["bad_records"] == 9 and ds.stats["records"] == 11
    assert len(ds.stats["bad_examples"]) == 5
    assert ds.stats["bad_examples"][0].split("d.jsonl:")[1].startswith("2: malformed JSON (")
    assert "9 bad records skipped" in ds.report()


def test_empty_dataset_names_path(tmp_path, tok):
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match=r"empty\.jsonl: no usable samples \(0 records read\)"):
        open_sft_dataset(empty, tok, seq_length=4096)
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{", {"messages": []}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: no usable samples.*2 bad records"):
        open_sft_dataset(bad, tok, seq_length=4096, skip_bad_records=True)
    with pytest.raises(ValueError, match=r"--data-path .*missing: no such file"):
        open_sft_dataset(str(tmp_path / "missing"), tok, seq_length=4096)


def test_too_short_sequences_are_skipped_and_counted(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": ""}, CHAT])  # "" -> [eod]: no target
    ds = open_sft_dataset(path, tok, seq_length=4096)
    assert len(ds) == 1 and ds.stats["too_short"] == 1


def test_max_samples_stops_reading(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [CHAT] * 5 + ["{broken"])
    ds = open_sft_dataset(path, tok, seq_length=4096, max_samples=5)
    assert len(ds) == 5 and ds.stats["records"] == 5  # the broken line is never read


def test_json_array_and_directory(tmp_path, tok):
    (tmp_path / "b.json").write_text(json.dumps([SHAREGPT, CHAT], indent=2))
    write_jsonl(tmp_path / "a.jsonl", [{"text": "first"}])
    (tmp_path / "notes.txt").write_text("ignored")
    ds = open_sft_dataset(str(tmp_path), tok, seq_length=4096)
    assert len(ds) == 3
    assert ds[0].tokens.tolist() == tok.encode("first") + [tok.eod_id]  # a.jsonl sorts first


def test_json_array_bad_element_names_index(tmp_path, tok):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([CHAT, {"conversations": [{"from": "gpt", "value": 3}]}]))
    with pytest.raises(ValueError, match=r"arr\.json:\[1\]: message 0 \(assistant\) content is"):
        open_sft_dataset(str(path), tok, seq_length=4096)
    path.write_text(json.dumps([CHAT, CHAT])[:-30])  # cut mid-record
    with pytest.raises(ValueError, match=r"arr\.json:\[1\]: the file ends inside this element"):
        open_sft_dataset(str(path), tok, seq_length=4096)


def test_json_array_not_utf8_names_the_file(tmp_path, tok):
    path = tmp_path / "arr.json"
    path.write_bytes(b'[{"text": "caf\xe9"}]')  # Latin-1, not UTF-8
    with pytest.raises(ValueError, match=r"--data-path .*arr\.json: not UTF-8 text .* at byte 14"):
        open_sft_dataset(str(path), tok, seq_length=4096)


def test_indexed_dataset_round_trip(tmp_path, tok):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = [tok.encode("the first document, longer") + [tok.eod_id], [7, 8, 9, 10, 11], [42, 43]]
    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in docs:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    ds = open_sft_dataset(prefix, tok, seq_length=4096)
    assert [s.tokens.tolist() for s in ds] == docs
    assert all(s.loss_mask.tolist() == [1.0] * (len(s) - 1) + [0.0] for s in ds)
    ds = open_sft_dataset(prefix, tok, seq_length=4, overlong="drop")
    assert ds.stats["dropped_overlong"] == 2 and len(ds) == 1


def test_indexed_dataset_foreign_vocabulary(tmp_path, tok):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "foreign")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    builder.add_item(torch.tensor([1, 200_000]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    with pytest.raises(ValueError, match=r"foreign:doc 0: token ids span .* outside the vocab"):
        open_sft_dataset(prefix, tok, seq_length=4096)


def test_parquet(tmp_path, tok):
    pa = pytest.importorskip("pyarrow", reason="the 'parquet' extra (pyarrow) is absent")
    import pyarrow.parquet as pq

    rows = [CHAT["messages"], None, [{"role": "user", "content": "no answer"}]]
    pq.write_table(pa.table({"messages": rows, "other": [1, 2, 3]}), tmp_path / "m.parquet")
    with pytest.raises(ValueError, match=r"m\.parquet:row 1: null messages"):
        open_sft_dataset(str(tmp_path / "m.parquet"), tok, seq_length=4096)
    ds = open_sft_dataset(str(tmp_path / "m.parquet"), tok, seq_length=4096,
                          skip_bad_records=True)
    assert len(ds) == 1 and ds.stats["bad_records"] == 2
    assert torch.equal(ds[0].tokens, encode_conversation(CHAT["messages"], tok).tokens)
    assert ds.stats["bad_examples"][1].endswith("m.parquet:row 2: no assistant message")

    pq.write_table(pa.table({"text": ["a b c", "d"]}), tmp_path / "t.parquet")
    assert len(open_sft_dataset(str(tmp_path / "t.parquet"), tok, seq_length=4096)) == 2
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p\.parquet: Parquet file has none of the columns"):
        open_sft_dataset(str(tmp_path / "p.parquet"), tok, seq_length=4096)


def _indexed(prefix, docs):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in docs:
        for part in doc:  # several sequences in one document: read as one sequence
            builder.add_item(torch.tensor(part, dtype=torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("kwargs", [dict(seq_length=4096), dict(seq_length=7, overlong="split"),
                                    dict(seq_length=7, overlong="drop"),
                                    dict(seq_length=4096, max_samples=3),
                                    dict(seq_length=5, overlong="split", max_samples=4)])
def test_indexed_dataset_is_memory_mapped_and_reads_as_records_do(tmp_path, tok, kwargs,
                                                                  monkeypatch):
    """An indexed dataset is planned from its index and read on use (memory-mapped); its samples,
    masks and counts equal those of reading its documents as records, tokens in memory (the
    path every other source takes), under every --overlong policy and --max-samples."""
    import megatron_chunkflow.data.dataset as dataset_module
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron_chunkflow.data.store import IndexedSamples

    g = np.random.default_rng(0)
    docs = [[g.integers(0, 1000, n).tolist() for n in parts] for parts in
            ([12], [3, 4], [1], [], [20], [2], [6, 0, 9], [5])]
    docs.append([[5, 200_000, 6]])  # outside the vocabulary: a bad record, skipped and counted
    prefix = str(tmp_path / "corpus")
    _indexed(prefix, docs)
    mapped = open_sft_dataset(prefix, tok, skip_bad_records=True, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(dataset_module, "is_indexed_prefix", lambda path: False)
        kept = open_sft_dataset(prefix, tok, skip_bad_records=True, **kwargs)
    assert isinstance(mapped.store, IndexedSamples)
    assert mapped.lengths == kept.lengths
    assert [(mapped[i].tokens.tolist(), mapped[i].loss_mask.tolist()) for i in range(len(kept))] \
        == [(kept[i].tokens.tolist(), kept[i].loss_mask.tolist()) for i in range(len(kept))]
    assert mapped[0].tokens.dtype == kept[0].tokens.dtype == torch.int64
    assert mapped.stats == kept.stats
    if "max_samples" not in kwargs:
        assert mapped.stats["bad_records"] == 1
        assert mapped.stats["bad_examples"] == [
            f"{prefix}:doc 8: token ids span [5, 200000], outside the vocabulary of "
            f"{tok.name} (size {tok.vocab_size})"]
        assert mapped.max_token_id == kept.max_token_id < tok.vocab_size


def test_a_rank_reads_only_the_sequences_of_its_chunks(tmp_path, tok):
    """Every rank plans the whole global batch from its lengths; a DP rank reads the ids of the
    sequences in its own chunks, never the whole batch."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.runtime.execute import plan_step
    from megatron_chunkflow.runtime.ranks import Ranks

    g = np.random.default_rng(1)
    prefix = str(tmp_path / "corpus")
    _indexed(prefix, [[g.integers(0, 1000, n).tolist()] for n in (30, 7, 90, 12, 64, 5, 40, 21)])
    ds = open_sft_dataset(prefix, tok, seq_length=128)
    read = []
    for rank in range(2):
        batch = ds.batch(range(len(ds)))
        step = plan_step(batch, ChunkFlowConfig(32, 1), ParallelConfig(dp=2),
                         get_model_shape("tiny"), Ranks(dp=2, dp_rank=rank))
        mine = {seg.seq_id for c in step.batch.chunks if c.dp_rank == rank for seg in c.segments}
        assert batch.num_read == len(mine) < len(ds)
        read.append(mine)
    assert read[0] | read[1] == set(range(len(ds))) and not read[0] & read[1]


def test_broken_json_array_is_refused_even_when_skipping_bad_records(tmp_path, tok):
    """A syntax error at element 8 of 40: the 32 after it cannot be located, so the file is
    refused (naming the element and saying nothing of it is used), not read as "8 records"."""
    records = [json.dumps(CHAT)] * 40
    records[8] = '{"messages": [}'
    path = tmp_path / "arr.json"
    path.write_text("[" + ",\n".join(records) + "]")
    with pytest.raises(ValueError, match=r"arr\.json:\[8\]: malformed JSON .*the rest of .*"
                                         r"cannot be read, so no record of it is used"):
        open_sft_dataset(str(path), tok, seq_length=4096, skip_bad_records=True)


def test_a_damaged_indexed_dataset_is_named(tmp_path, tok):
    """A garbage or truncated .idx and a truncated .bin: named with the file and what is wrong,
    before Megatron's reader asserts or fails to map it."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in ([5, 6, 7, 8], [9, 10, 11]):
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    idx, binary = tmp_path / "corpus.idx", tmp_path / "corpus.bin"
    good_idx, good_bin = idx.read_bytes(), binary.read_bytes()
    for idx_bytes, bin_bytes, message in (
            (b"garbage" * 20, good_bin, r"corpus\.idx: not a Megatron indexed-dataset index"),
            (good_idx[:40], good_bin, r"corpus\.idx: 40 bytes, its header promises 2 sequences"),
            (good_idx, good_bin[:20], r"corpus\.bin has 20 bytes, its index points up to byte 28")):
        idx.write_bytes(idx_bytes)
        binary.write_bytes(bin_bytes)
        with pytest.raises(ValueError, match=r"--data-path .*corpus: .*" + message):
            open_sft_dataset(prefix, tok, seq_length=4096)
