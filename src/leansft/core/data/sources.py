"""Read raw rows from a data source: jsonl, json, parquet, csv, a local HF dataset folder, or a Hub name.

Rows come out as ``(row_number, dict)`` with 1-based row numbers, so errors can name them.
For .jsonl the row number is the line number.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from leansft.core.errors import DataError

LOCAL_SUFFIXES = {".jsonl", ".json", ".parquet", ".csv"}


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"invalid JSON: {err.msg} (column {err.colno})", file=str(path), row=lineno) from None
            if not isinstance(row, dict):
                raise DataError(f"expected a JSON object, got {type(row).__name__}", file=str(path), row=lineno)
            yield lineno, row


def _read_json(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
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
    with path.open("r", encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None:
            raise DataError("empty CSV file (no header row)", file=str(path))
        for i, row in enumerate(reader, start=1):
            if None in row:
                raise DataError("more values than header columns", file=str(path), row=i)
            yield i, dict(row)


def _read_parquet(path: Path) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for a bad file
        raise DataError(f"cannot read parquet: {err}", file=str(path)) from None
    for i, row in enumerate(table.to_pylist(), start=1):
        yield i, row


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


def read_rows(path: str, split: str = "train") -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(row_number, row)`` from a file, a local dataset folder, or a Hub dataset name."""
    p = Path(path)
    suffix = p.suffix.lower()
    if p.is_file():
        readers = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}
        if suffix not in readers:
            raise DataError(
                f"unknown data file type '{suffix}'", file=path, hint="use .jsonl, .json, .parquet, .csv or a dataset folder"
            )
        yield from readers[suffix](p)
        return
    if suffix in LOCAL_SUFFIXES:
        raise DataError("file not found", file=path)
    yield from _read_hf(path, split)


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
