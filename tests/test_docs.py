"""The docs: the site builds strict (a broken link or a missing snippet fails), the README stays a short page
for users, and no link leaves the repository except to a public site."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def test_the_docs_build_strict(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists() and shutil.which("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install '.[docs]')")
    proc = subprocess.run([str(mkdocs if mkdocs.exists() else "mkdocs"), "build", "--strict", "-d", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "cpu" / "index.html").exists()


def test_the_readme_is_short_and_its_links_stay_in_the_repository():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "pip install" in text and text.startswith("# leansft\n\n```bash\nmake demo")
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith(("https://", "http://")):
            continue
        assert (ROOT / target.split("#")[0]).exists(), target


def test_doc_pages_link_only_within_the_docs_or_to_public_sites():
    for page in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)]+)\)", page.read_text()):
            assert target.startswith(("https://", "http://")) or (page.parent / target.split("#")[0]).exists(), \
                (page.name, target)


def test_the_design_page_names_every_module_folder():
    """docs/design.md's layer map names each folder of the package (a core folder by its path under core/)."""
    text = (ROOT / "docs" / "design.md").read_text()
    package = ROOT / "src" / "leansft"
    folders = [f.relative_to(package) for f in sorted(package.rglob("*")) if f.is_dir() and f.name != "__pycache__"]
    folders = [f for f in folders if f.parts[0] != "_vendor" or len(f.parts) == 1]  # vendored code: its own map
    named = [str(f.relative_to("core") if f.parts[0] == "core" and len(f.parts) > 1 else f) + "/" for f in folders]
    missing = [n for n in named if n not in text]
    assert not missing, f"docs/design.md does not name {missing}"
