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
    assert "2 kept, 0 broken" in proc.stdout
