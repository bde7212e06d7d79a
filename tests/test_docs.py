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
