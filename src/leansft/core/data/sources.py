"""Read raw rows from a data source: jsonl, json, parquet, csv, a local HF dataset folder, or a Hub name.

Rows come out as ``(row_number, dict)`` with 1-based row numbers, so errors can name them.
For .jsonl the row number is the line number. Every reader streams (jsonl line by line, parquet by
record batch, csv by line, datasets row by row) except a JSON array file, which is parsed whole.
``read_raw_rows`` leaves jsonl lines unparsed, so parsing can run in the preparation workers.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from leansft.core.errors import DataError

LOCAL_SUFFIXES = {".jsonl", ".json", ".parquet", ".csv"}


def _not_utf8(path: Path, err: UnicodeDecodeError, offset: int, row: int | None) -> DataError:
    return DataError(f"not UTF-8 text: byte 0x{err.object[err.start]:02x} at byte offset {offset + err.start}",
                     file=str(path), row=row, hint="re-encode the file as UTF-8")


def _jsonl_from(path: Path, offset: int = 0, line: int = 0) -> Iterator[tuple[int, str, int]]:
    """``(line number, decoded non-blank line, its byte offset)`` from byte ``offset`` (the start of line ``line +
    1``) on; decoded one by one so a bad byte names its line and offset."""
    with path.open("rb") as fh:
        fh.seek(offset)
        for raw in fh:
            line += 1
            try:
                text = raw.decode("utf-8-sig" if offset == 0 else "utf-8")
            except UnicodeDecodeError as err:
                raise _not_utf8(path, err, offset, line) from None
            if text.strip():
                yield line, text, offset
            offset += len(raw)


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    for number, text, _ in _jsonl_from(path):
        yield number, text


def parse_row(raw: str | dict, file: str, number: int) -> dict:
    """A row from ``read_raw_rows``: a jsonl line parsed (errors name file and line), a dict as it is."""
    if isinstance(raw, dict):
        return raw
    try:
        row = json.loads(raw)
    except json.JSONDecodeError as err:
        raise DataError(f"invalid JSON: {err.msg} (column {err.colno})", file=file, row=number) from None
    if not isinstance(row, dict):
        raise DataError(f"expected a JSON object, got {type(row).__name__}", file=file, row=number)
    return row


def _read_text(path: Path) -> str:
    """The whole file as UTF-8 text (a byte-order mark dropped), or an error naming the line and offset."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err, 0, raw.count(b"\n", 0, err.start) + 1) from None


def _read_json(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as err:
        raise DataError(f"invalid JSON: {err.msg} (line {err.lineno}, column {err.colno})", file=str(path)) from None
    if isinstance(data, dict):
        # {"data": [...]} or {"train": [...]} is common; accept one list-valued key.
        lists = [k for k, v in data.items() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError("expected a JSON array of objects (or an object with one list of rows)", file=str(path))
        data = data[lists[0]]
    if not isinstance(data, list):
        raise DataError(f"expected a JSON array of objects, got {type(data).__name__}", file=str(path))
    for i, row in enumerate(data, start=1):
        if not isinstance(row, dict):
            raise DataError(f"expected a JSON object, got {type(row).__name__}", file=str(path), row=i)
        yield i, row


def _read_csv(path: Path) -> Iterator[tuple[int, dict]]:
    """A header row, then rows of exactly as many fields. Parsed strictly: an unclosed quote or a ragged
    row is an error naming its line, never rows silently merged. Rows are numbered from 1 after the header."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as fh:
            yield from _csv_rows(path, csv.reader(fh, strict=True))
    except UnicodeDecodeError:
        _read_text(path)  # raises the error naming the line and byte offset
        raise


def _csv_rows(path: Path, reader) -> Iterator[tuple[int, dict]]:
    """Rows numbered from 1 after the header; a record that does not parse is named by the line it starts on
    (where an unclosed quote opened), not the line where the reader gave up."""
    row, start = 0, 1
    try:
        header = next(reader, None)
        if header is None:
            raise DataError("empty CSV file (no header row)", file=str(path))
        start = reader.line_num + 1
        for row, fields in enumerate(reader, start=1):
            if len(fields) != len(header):
                raise DataError(f"{len(fields)} fields where the header has {len(header)} (line {reader.line_num})",
                                file=str(path), row=row, hint="check for an unescaped quote or a missing separator")
            yield row, dict(zip(header, fields))
            start = reader.line_num + 1
    except csv.Error as err:
        raise DataError(f"CSV does not parse: the record starting at line {start} does not end ({err} at line "
                        f"{reader.line_num})", file=str(path), row=row + 1 if start > 1 else None,
                        hint=f"a quoted field opened on line {start} is never closed: close or escape the quote "
                             "(\"\" inside a quoted field)") from None


def _parquet_from(path: Path, start: int = 0) -> Iterator[tuple[int, dict, int]]:
    """``(row number, row, row index)`` from row index ``start`` on, reading from the row group that holds it."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
        first = bisect.bisect_right(list(itertools.accumulate(sizes)), start)
        at = sum(sizes[:first])
        for batch in pf.iter_batches(batch_size=4096, row_groups=list(range(first, len(sizes)))):
            for row in batch.to_pylist():
                if at >= start:
                    yield at + 1, row, at
                at += 1
    except Exception as err:  # pyarrow raises several types for a bad file
        raise DataError(f"cannot read parquet: {err}", file=str(path)) from None


def _read_parquet(path: Path) -> Iterator[tuple[int, dict]]:
    for number, row, _ in _parquet_from(path):
        yield number, row


def _saved_dataset_from(path: Path, split: str, start: int) -> Iterator[tuple[int, dict, int]]:
    """A saved dataset folder's ``(row number, row, row index)`` from row index ``start`` on (memory-mapped)."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"split '{split}' not found; available: {sorted(ds)}", file=str(path))
        ds = ds[split]
    for first in range(start, len(ds), 1024):
        batch = ds[first : first + 1024]
        for k in range(len(next(iter(batch.values()), []))):
            yield first + k + 1, {name: values[k] for name, values in batch.items()}, first + k


def _kind(path: Path) -> str:
    return "dataset" if path.is_dir() else path.suffix.lower()


def seeks_by(path: Path) -> str:
    """How ``raw_rows_from`` finds a place in ``path``."""
    return {".jsonl": "byte offset", ".parquet": "row", "dataset": "row"}.get(_kind(path), "reading up to the row")


def raw_rows_from(path: Path, offset: int, line: int, split: str = "train") -> Iterator[tuple[int, str | dict, int]]:
    """``read_raw_rows`` of one local file or saved dataset folder from a place in it: ``(row number, raw row,
    where the row starts)``, ``where`` a byte offset in a .jsonl file (``line``: the row number before it), a row
    index elsewhere. A .csv or .json file is read from its start again up to the row."""
    kind = _kind(path)
    if kind == ".jsonl":
        yield from _jsonl_from(path, offset, line)
    elif kind == ".parquet":
        yield from _parquet_from(path, offset)
    elif kind == "dataset":
        yield from _saved_dataset_from(path, split, offset)
    else:
        for number, raw in read_raw_rows(str(path), split):
            if number > offset:
                yield number, raw, number - 1


def _read_hf(path_or_name: str, split: str) -> Iterator[tuple[int, dict]]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a core dependency
        raise DataError("the 'datasets' package is needed for Hugging Face datasets", file=path_or_name) from None
    path = Path(path_or_name)
    try:
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(path_or_name, split=split)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"split '{split}' not found; available: {sorted(ds)}", file=path_or_name)
            ds = ds[split]
    except DataError:
        raise
    except Exception as err:
        where = "local dataset folder" if path.exists() else "Hugging Face Hub dataset (no local file of that name)"
        raise DataError(f"cannot load {where}: {type(err).__name__}: {err}", file=path_or_name) from None
    for i, row in enumerate(ds, start=1):
        yield i, dict(row)


def read_raw_rows(path: str, split: str = "train") -> Iterator[tuple[int, str | dict[str, Any]]]:
    """Like ``read_rows``, but jsonl lines come unparsed (``parse_row`` parses them)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if p.is_file():
        readers = {".jsonl": _jsonl_lines, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}
        if suffix not in readers:
            raise DataError(f"unknown data file type '{suffix}'", file=path,
                            hint="use .jsonl, .json, .parquet, .csv or a dataset folder")
        yield from readers[suffix](p)
        return
    if suffix in LOCAL_SUFFIXES:
        where = "" if Path(path).is_absolute() else (
            f" (looked for {Path(path).resolve()}; a relative path in a config file is read next to that file first, "
            "then from the working directory)")
        raise DataError("file not found" + where, file=path)
    yield from _read_hf(path, split)


def jsonl_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of a JSON-lines file whatever its name's suffix (blank lines skipped; a bad byte, bad
    JSON or a line that is no object is a DataError naming file and line)."""
    if not Path(path).is_file():
        raise DataError("file not found", file=str(path))
    for number, raw in _jsonl_lines(Path(path)):
        yield number, parse_row(raw, str(path), number)


def read_rows(path: str, split: str = "train") -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(row_number, row)`` from a file, a local dataset folder, or a Hub dataset name."""
    for number, raw in read_raw_rows(path, split):
        yield number, parse_row(raw, path, number)


def fingerprint(path: str) -> str:
    """Content hash of a local file or folder (name for a Hub dataset): the cache key's data part."""
    p = Path(path)
    h = hashlib.sha256()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.is_file() else []
    if not files:
        h.update(b"hub:" + path.encode())
    for f in files:
        h.update(str(f.relative_to(p) if p.is_dir() else f.name).encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
