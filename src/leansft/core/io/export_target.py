"""Where an export may write: never over what leansft did not write, never over what it reads.

An export's OUT must be absent, an empty folder, or an earlier leansft export (a folder holding ``MARKER``, a GGUF
file whose metadata names leansft: ``core.gguf.write.exported_by_leansft``); anything else there needs
``--overwrite``. Whatever the flag, OUT may not be the current folder or one above it, hold a run's checkpoints,
or be, hold or sit inside what the export reads. The export itself is written beside OUT under a fresh temporary
name and renamed into place (``replace_with``), so a failure leaves OUT as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from leansft.core.errors import LeanSFTError
from leansft.core.gguf.write import exported_by_leansft

MARKER = ".leansft-export"  # a JSON file in every folder leansft exports: what wrote it, from what, when
_OVERWRITE = "pass --overwrite to replace it, or name a new OUT"


def check_out(out: str | Path, to: str, sources: Sequence[str | Path] = (), overwrite: bool = False) -> Path:
    """``out`` as an export of kind ``to`` (``hf``: a folder, ``gguf``: a file) may write it; else a one-line
    ``LeanSFTError`` saying why and what to do. ``sources``: the paths the export reads (a run, a checkpoint, a
    model folder or file)."""
    path = Path(out)
    if path.is_symlink():
        raise LeanSFTError("OUT is a symbolic link: name the folder or file itself", file=str(out))
    target = path.resolve()
    here = Path.cwd().resolve()
    if target == here or target in here.parents:
        raise LeanSFTError("OUT is the current folder or one above it: an export replaces OUT as a whole",
                           file=str(out), hint="name a new folder, e.g. ./exported")
    for src in sources:
        s = Path(src).resolve()
        if target == s or target in s.parents or s in target.parents:
            how = "is" if target == s else "holds" if target in s.parents else "is inside"
            raise LeanSFTError(f"OUT {how} what the export reads ({src})", file=str(out),
                               hint="write the export beside it, not into or over it")
    if not path.exists():
        return target
    if to == "gguf":
        if path.is_dir():
            raise LeanSFTError("OUT is a folder; a GGUF export writes one file", file=str(out),
                               hint="name a file, e.g. model.gguf")
        if not overwrite and not exported_by_leansft(path):
            raise LeanSFTError("OUT is a file leansft did not export", file=str(out), hint=_OVERWRITE)
        return target
    if not path.is_dir():
        raise LeanSFTError("OUT is a file; a Hugging Face export writes a folder", file=str(out),
                           hint="name a folder that does not exist yet")
    if (path / "checkpoints").is_dir() or (path / "state.json").is_file() or (path / "manifest.json").is_file():
        raise LeanSFTError("OUT holds a training run or checkpoint; an export never replaces one", file=str(out),
                           hint="name a new folder")
    if not overwrite and any(path.iterdir()) and not (path / MARKER).is_file():
        raise LeanSFTError("OUT is a folder leansft did not export and it is not empty", file=str(out),
                           hint=_OVERWRITE)
    return target


def marker(source: str | None) -> str:
    from leansft import __version__

    return json.dumps({"written_by": f"leansft {__version__}", "source": source,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


@contextlib.contextmanager
def fresh_folder(out: Path) -> Iterator[Path]:
    """A new empty folder beside ``out`` (a unique hidden name, created only for this caller), removed if the block
    fails; the block fills it and calls ``replace_with``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def fresh_file(out: Path) -> Path:
    """A new empty file beside ``out`` (a unique hidden name, created only for this caller)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    return Path(name)


def replace_with(tmp: Path, out: Path) -> None:
    """Put ``tmp`` (a folder or file written beside ``out``) in ``out``'s place. A folder already there is first
    moved aside under a fresh name, then removed: at no moment is OUT half-written."""
    if tmp.is_dir() and out.is_dir() and not out.is_symlink():
        aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        os.rename(out, aside)  # onto the empty folder just made: the name is this call's alone
        try:
            os.rename(tmp, out)
        except OSError:
            os.rename(aside, out)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return
    os.replace(tmp, out)
