"""A benchmark's work folder, emptied at each start only where the benchmark made it: a folder of the same name that
a user keeps (LEANSFT_BENCH_WORK pointing at their own files) is refused, never deleted."""

from __future__ import annotations

import shutil
from pathlib import Path

MARK = ".leansft-bench"  # written into every work folder a benchmark makes


def fresh(folder: Path) -> Path:
    """``folder`` empty and marked as the benchmark's: a marked one from an earlier run is removed first."""
    if folder.exists() or folder.is_symlink():
        if folder.is_symlink() or not (folder / MARK).is_file():
            raise SystemExit(f"{folder} exists and a benchmark did not make it: set LEANSFT_BENCH_WORK to another "
                             "folder (nothing was deleted)")
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / MARK).write_text("made by a leansft benchmark; removed by the next run of it\n")
    return folder
