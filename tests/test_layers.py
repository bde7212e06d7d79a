"""The three layers hold: the import-linter contracts in pyproject.toml (tools > recipe > core, no cycles)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "3 kept, 0 broken" in proc.stdout


def test_every_core_folder_and_module_has_its_place_in_the_core_contract():
    """A new folder or top-level module of core/ must be placed in the one-way order (pyproject.toml), or the
    contract would not see it import upward."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    core = next(c for c in contracts if c["name"].startswith("core:"))
    named = {m.strip().removeprefix("leansft.core.") for layer in core["layers"] for m in layer.split(":")}
    src = ROOT / "src" / "leansft" / "core"
    present = {p.name for p in src.iterdir() if (p / "__init__.py").exists()}
    present |= {p.stem for p in src.glob("*.py") if p.stem != "__init__"}
    assert present == named, (present - named, named - present)


def test_the_import_graph_in_the_design_doc_is_the_codes():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    text = import_graph.DESIGN.read_text()
    block = text[text.index(import_graph.START) + len(import_graph.START):text.index(import_graph.END)].strip()
    assert block == import_graph.mermaid(), "docs/design.md import graph is stale: run `python docs/import_graph.py`"
