"""``leansft datasets [REGISTRY]``: the data sets a registry (datasets.yaml) names, with their formats and sizes."""

from __future__ import annotations

from pathlib import Path

from leansft.core.config import load_registry


def _rows(path: Path) -> int | None:
    """Rows of a local file where they come cheaply: jsonl and csv lines, a json array's length (up to 200 MB),
    parquet's own count; else None."""
    if path.suffix == ".json" and path.stat().st_size <= 200e6:
        import json

        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            return None
        return len(value) if isinstance(value, list) else None
    if path.suffix == ".jsonl":
        with path.open("rb") as fh:
            return sum(1 for line in fh if line.strip())
    if path.suffix == ".csv":
        with path.open("rb") as fh:
            return max(sum(1 for line in fh if line.strip()) - 1, 0)  # the header row
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_metadata(path).num_rows
    return None


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def describe(registry: Path) -> list[dict]:
    """One line per entry: name, format, split, path, where it is (file, folder, or not here: a Hub name), bytes,
    rows (where cheap), description."""
    out = []
    for name, (source, description) in load_registry(registry).items():
        path = Path(source.path)
        here = path.exists()
        out.append({"name": name, "format": source.format, "split": source.split, "path": source.path,
                    "weight": source.weight, "where": ("folder" if path.is_dir() else "file") if here else "not here",
                    "bytes": _size(path) if here else None, "rows": _rows(path) if path.is_file() else None,
                    "description": description})
    return out


def print_registry(registry: Path) -> int:
    from rich.table import Table

    from leansft.core.progress import console

    table = Table(title=str(registry))
    for column in ("name", "format", "rows", "size", "path", "description"):
        table.add_column(column, justify="right" if column in ("rows", "size") else "left")
    for d in describe(registry):
        size = f"{d['bytes'] / 1e6:,.1f} MB" if d["bytes"] is not None else "-"
        where = d["path"] if d["where"] != "not here" else f"{d['path']} (not here: a Hub name?)"
        table.add_row(d["name"], d["format"], f"{d['rows']:,}" if d["rows"] is not None else "-", size, where,
                      d["description"])
    console().print(table)
    return 0
