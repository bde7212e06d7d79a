"""Writes the package-level import graph of leansft into docs/design.md (between the import-graph markers), as a
Mermaid flowchart: ``python docs/import_graph.py``. tests/test_layers.py checks that the committed graph is the
code's. Edges into core.config and core.errors, which every folder may use, are left out to keep it legible."""

from __future__ import annotations

from pathlib import Path

DESIGN = Path(__file__).with_name("design.md")
START, END = "<!-- import-graph:start -->", "<!-- import-graph:end -->"
BASE = {"leansft.core.config", "leansft.core.errors"}


def package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[1:2] == ["core"] and len(parts) > 2 else ".".join(parts[:2])


def edges() -> list[tuple[str, str]]:
    import grimp

    graph = grimp.build_graph("leansft")
    found = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = package(module), package(imported)
            if a != b and b not in BASE and a != "leansft" and b != "leansft":
                found.add((a, b))
    return sorted(found)


def mermaid() -> str:
    name = lambda m: m.removeprefix("leansft.").replace(".", "_")  # noqa: E731
    label = lambda m: m.removeprefix("leansft.")  # noqa: E731
    lines = ["```mermaid", "flowchart TD"]
    lines += [f"    {name(a)}[{label(a)}] --> {name(b)}[{label(b)}]" for a, b in edges()]
    return "\n".join(lines + ["```"])


if __name__ == "__main__":
    text = DESIGN.read_text()
    DESIGN.write_text(text[: text.index(START) + len(START)] + "\n" + mermaid() + "\n" + text[text.index(END):])
