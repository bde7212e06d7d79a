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
    assert "4 kept, 0 broken" in proc.stdout


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


VENDOR = ROOT / "src" / "leansft" / "_vendor" / "llama_cpp"


def test_the_vendored_converter_is_fenced_and_as_the_vendor_script_wrote_it():
    """llama.cpp's converter runs no model folder's code (every ``from_pretrained`` says ``trust_remote_code=False``,
    where transformers would otherwise ask on stdin), leaves ``sys.path`` alone and reads no vocabulary relative to
    it; and every file is the one scripts/vendor_llama_cpp.py wrote (SHA256SUMS): no hand edit slips in."""
    import ast
    import hashlib

    unsafe, path_use = [], []
    for f in sorted(VENDOR.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "from_pretrained":
                said = {k.arg: k.value for k in node.keywords}
                if not (isinstance(said.get("trust_remote_code"), ast.Constant)
                        and said["trust_remote_code"].value is False):
                    unsafe.append(f"{f.name}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node.value) == "sys":
                path_use.append(f"{f.name}:{node.lineno}")
    assert not unsafe, unsafe
    assert not path_use, path_use
    listed = dict(line.split("  ", 1)[::-1] for line in (VENDOR / "SHA256SUMS").read_text().splitlines())
    present = {f.relative_to(VENDOR).as_posix() for f in VENDOR.rglob("*")
               if f.is_file() and f.name != "SHA256SUMS" and "__pycache__" not in f.parts}
    assert present == set(listed), (present ^ set(listed))
    changed = [n for n, h in listed.items() if hashlib.sha256((VENDOR / n).read_bytes()).hexdigest() != h]
    assert not changed, f"edited by hand (regenerate with scripts/vendor_llama_cpp.py): {changed}"


def test_importing_the_converter_changes_nothing_outside_it():
    """Importing llama.cpp's converter leaves sys.path as it was (it used to insert its own folder)."""
    probe = ("import sys\nbefore = list(sys.path)\nimport leansft._vendor.llama_cpp.conversion.base\n"
             "import leansft._vendor.llama_cpp.gguf.gguf_reader\nprint(sys.path == before)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert r.stdout.strip() == "True", r.stderr[-2000:]
