"""SFTDataset: records from a source, tokenized in order, with the length and bad-record policies
of `chunkflow train` applied and counted (nothing is cut or skipped silently).

    ds = open_sft_dataset(None, load_tokenizer(None), seq_length=32768, max_samples=200)
    print(ds.report())
"""

from __future__ import annotations

from importlib import metadata

import numpy as np
import torch

from megatron_chunkflow.data.chat import BadRecord, encode_conversation, encode_text, encode_tokens
from megatron_chunkflow.data.sequence import TokenSequence
from megatron_chunkflow.data.sources import SHAREGPT_NAME, is_indexed_prefix, iter_records
from megatron_chunkflow.data.store import (
    IndexedSamples,
    LazyBatch,
    PackedSamples,
    document_id_ranges,
    map_indexed,
)
from megatron_chunkflow.data.tokenizer import Tokenizer

OVERLONG_POLICIES = ("error", "drop", "split")
NUM_BAD_EXAMPLES = 5  # bad-record locations kept for the report


class SFTDataset(torch.utils.data.Dataset):
    """Tokenized samples (TokenSequence, at most seq_length tokens each) and how they were made.

    stats: records (read), samples (kept), tokens (in kept samples), assistant_tokens (targets that
    count, i.e. the loss_mask sum), bad_records, bad_examples ("LOCATION: reason", the first few),
    dropped_overlong, split_overlong (records cut into pieces), split_no_target (pieces with no
    counted target, skipped), too_short (sequences of fewer than 2 tokens, skipped).
    """

    def __init__(self, store, stats: dict, description: str):
        self.store = store  # data/store.py: PackedSamples or IndexedSamples (memory-mapped)
        self.stats = stats
        self.description = description

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int) -> TokenSequence:
        return self.store[index]

    @property
    def lengths(self) -> list[int]:
        """Token count of every sample, in dataset order."""
        return self.store.lengths.tolist()

    @property
    def max_token_id(self) -> int:
        return self.store.max_token_id

    def batch(self, indices) -> LazyBatch:
        """The samples `indices` as a global batch whose ids are read when first used."""
        return LazyBatch(self.store, indices)

    def report(self) -> str:
        """A few lines for the run log: source, counts, and every skipped or cut kind of record."""
        s = self.stats
        lines = [f"data: {self.description}",
                 f"  {s['samples']} samples from {s['records']} records, {s['tokens']} tokens, "
                 f"{s['assistant_tokens']} loss tokens"]
        for key, what in (("bad_records", "bad records skipped"),
                          ("dropped_overlong", "overlong records dropped"),
                          ("split_overlong", "overlong records split"),
                          ("split_no_target", "split pieces without targets skipped"),
                          ("too_short", "sequences shorter than 2 tokens skipped")):
            if s[key]:
                lines.append(f"  {s[key]} {what}")
        lines += [f"    e.g. {example}" for example in s["bad_examples"]]
        return "\n".join(lines)


def open_sft_dataset(path: str | None, tokenizer: Tokenizer, *, seq_length: int,
                     overlong: str = "error", skip_bad_records: bool = False,
                     max_samples: int | None = None) -> SFTDataset:
    """Read `--data-path` (None: the embedded ShareGPT), tokenize records in order until
    `max_samples` samples are kept (only those records are read and tokenized), and apply
    `--overlong` to sequences longer than `--seq-length`: "error" raises, "drop" skips and counts,
    "split" cuts into consecutive pieces of at most seq_length tokens. A bad record raises
    ValueError "LOCATION: reason" unless `skip_bad_records`; the embedded ShareGPT always skips
    them (the shipped file holds some, e.g. empty conversations; the count is in stats)."""
    if seq_length < 2:
        raise ValueError(f"--seq-length must be >= 2 (one input and one target), got {seq_length}")
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"--overlong must be one of {', '.join(OVERLONG_POLICIES)}, "
                         f"got {overlong!r}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"--max-samples must be >= 1, got {max_samples}")
    skip_bad_records = skip_bad_records or path is None
    stats = dict(records=0, samples=0, tokens=0, assistant_tokens=0, bad_records=0,
                 bad_examples=[], dropped_overlong=0, split_overlong=0, split_no_target=0,
                 too_short=0)
    if path is not None and is_indexed_prefix(path):
        store = _open_indexed(path, tokenizer, seq_length, overlong, skip_bad_records,
                              max_samples, stats)
        return _dataset(path, store, stats, tokenizer)
    samples = PackedSamples()
    for _, location, record in iter_records(path):
        stats["records"] += 1
        try:
            sequences = encode_record_sequences(record, tokenizer)
        except BadRecord as e:
            _bad_record(f"{location}: {e}", skip_bad_records, stats)
            continue
        for i, seq in enumerate(sequences):
            where = location if len(sequences) == 1 else f"{location} (conversation {i + 1})"
            pieces = _length_policy(seq, where, seq_length, overlong, stats)
            for piece in pieces:
                if len(piece) < 2:
                    stats["too_short"] += 1
                elif len(pieces) > 1 and not piece.loss_mask.any():
                    stats["split_no_target"] += 1
                elif max_samples is None or len(samples) < max_samples:
                    samples.append(piece)
                    stats["tokens"] += len(piece)
                    stats["assistant_tokens"] += int(piece.loss_mask.sum())
        if max_samples is not None and len(samples) >= max_samples:
            break
    return _dataset(path, samples.finish(), stats, tokenizer)


def _dataset(path: str | None, store, stats: dict, tokenizer: Tokenizer) -> SFTDataset:
    stats["samples"] = len(store)
    where = "the embedded ShareGPT" if path is None else f"--data-path {path}"
    if not len(store):
        raise ValueError(f"{where}: no usable samples ({_dropped_summary(stats)})")
    description = default_data_description() if path is None else path
    return SFTDataset(store, stats, f"{description}; tokenizer {tokenizer.name}")


def _open_indexed(prefix: str, tokenizer: Tokenizer, seq_length: int, overlong: str,
                  skip_bad_records: bool, max_samples: int | None, stats: dict) -> IndexedSamples:
    """open_sft_dataset for a Megatron indexed dataset, from its index alone: the same policies,
    counts and messages as for records read one by one, but the ids stay memory-mapped (each
    document is one record, every target counts)."""
    ids, starts, lengths = map_indexed(prefix)
    low, top = document_id_ranges(ids, starts, lengths)
    is_bad = (top >= tokenizer.vocab_size) | (low < 0)
    pieces = []  # (first token, length)
    highest = -1  # of the ids kept
    for doc in range(len(lengths)):
        if max_samples is not None and len(pieces) >= max_samples:
            break
        stats["records"] += 1
        where, n = f"{prefix}:doc {doc}", int(lengths[doc])
        if is_bad[doc]:
            reason = (f"token ids span [{low[doc]}, {top[doc]}], outside the vocabulary of "
                      f"{tokenizer.name} (size {tokenizer.vocab_size})")
            _bad_record(f"{where}: {reason}", skip_bad_records, stats)
            continue
        for start, size in _indexed_pieces(n, where, seq_length, overlong, stats):
            if size < 2:
                stats["too_short"] += 1
            elif max_samples is None or len(pieces) < max_samples:
                first = int(starts[doc]) + start
                pieces.append((first, size))
                highest = max(highest, int(top[doc]) if size == n else
                              int(ids[first:first + size].max()))
                stats["tokens"] += size
                stats["assistant_tokens"] += size - 1
    kept = np.asarray(pieces, dtype=np.int64).reshape(-1, 2)
    return IndexedSamples(ids, kept[:, 0], kept[:, 1], highest)


def _bad_record(message: str, skip: bool, stats: dict) -> None:
    """A record that cannot be used ("LOCATION: reason"): stop, or count it and keep the first
    few examples (--skip-bad-records)."""
    if not skip:
        raise ValueError(f"{message} (use --skip-bad-records to skip such records)")
    stats["bad_records"] += 1
    if len(stats["bad_examples"]) < NUM_BAD_EXAMPLES:
        stats["bad_examples"].append(message)


def _indexed_pieces(n: int, where: str, seq_length: int, overlong: str, stats: dict):
    """`--overlong` on a document of n tokens, as (first token, length) pieces."""
    if n <= seq_length:
        return [(0, n)]
    _length_policy_overlong(n, where, seq_length, overlong, stats)
    if overlong == "drop":
        return []
    return [(a, min(seq_length, n - a)) for a in range(0, n, seq_length)]


def _length_policy(seq: TokenSequence, location: str, seq_length: int, overlong: str,
                   stats: dict) -> list[TokenSequence]:
    """`--overlong` on one sequence: itself when it fits, else raise ("error"), nothing ("drop",
    counted) or its pieces ("split", counted)."""
    if len(seq) <= seq_length:
        return [seq]
    _length_policy_overlong(len(seq), location, seq_length, overlong, stats)
    return [] if overlong == "drop" else split_sequence(seq, seq_length)


def _length_policy_overlong(n: int, location: str, seq_length: int, overlong: str,
                            stats: dict) -> None:
    """An overlong sequence of n tokens: raise ("error") or count it ("drop", "split")."""
    if overlong == "error":
        raise ValueError(
            f"{location}: {n} tokens, more than --seq-length {seq_length}; use "
            f"--overlong drop to skip such records or --overlong split to cut them into "
            f"pieces of at most {seq_length} tokens")
    stats["dropped_overlong" if overlong == "drop" else "split_overlong"] += 1


def encode_record_sequences(record, tokenizer: Tokenizer) -> list[TokenSequence]:
    """The sequences of one record: just encode_record's, except that a tokenizer with a chat
    template of its own (`encode_chat`: Megatron-LM's SFT tokenizer) renders the conversations,
    and may cut a record into several (Megatron's SFT records hold one conversation per system
    message), each its own sequence as in Megatron's packed samples."""
    if isinstance(record, BadRecord):
        raise record
    key = next((k for k in ("messages", "conversations") if k in record), None)
    if key is not None and tokenizer.encode_chat is not None:
        return tokenizer.encode_chat(record[key])
    return [encode_record(record, tokenizer)]


def encode_record(record, tokenizer: Tokenizer) -> TokenSequence:
    """TokenSequence of one record from `iter_records`: `messages` / `conversations` (ChatML,
    assistant-only loss), `text` (all targets) or `tokens` (pre-tokenized, all targets). A
    BadRecord from the reader is raised as is."""
    if isinstance(record, BadRecord):
        raise record
    if "messages" in record:
        return encode_conversation(record["messages"], tokenizer)
    if "conversations" in record:
        return encode_conversation(record["conversations"], tokenizer)
    if "text" in record:
        return encode_text(record["text"], tokenizer)
    return encode_tokens(record["tokens"], tokenizer)


def split_sequence(seq: TokenSequence, seq_length: int) -> list[TokenSequence]:
    """Consecutive, independent pieces of at most seq_length tokens that cover every token once.
    Each keeps the target-aligned mask, with its last position masked (its target is in the next
    piece, which the model sees separately)."""
    pieces = []
    for start in range(0, len(seq), seq_length):
        mask = seq.loss_mask[start:start + seq_length].clone()
        mask[-1] = 0
        pieces.append(TokenSequence(seq.tokens[start:start + seq_length].clone(), mask))
    return pieces


def default_data_description() -> str:
    """One line for run headers naming the embedded default data and how it is encoded."""
    try:
        version = metadata.version(SHAREGPT_NAME)
    except metadata.PackageNotFoundError:
        version = "not installed"
    return (f"ShareGPT V3 unfiltered cleaned split ({SHAREGPT_NAME} {version}, embedded), "
            "Qwen2.5 ChatML, loss on assistant turns")


def _dropped_summary(stats: dict) -> str:
    """Why nothing was kept, e.g. "3 records read: 2 bad records, 1 dropped_overlong"."""
    parts = [f"{stats[k]} {k.replace('_', ' ')}" for k in
             ("bad_records", "dropped_overlong", "split_no_target", "too_short") if stats[k]]
    first = f"; first: {stats['bad_examples'][0]}" if stats["bad_examples"] else ""
    return f"{stats['records']} records read" + (": " + ", ".join(parts) if parts else "") + first
