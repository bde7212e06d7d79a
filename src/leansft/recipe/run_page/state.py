"""What the run page shows, read from run folders: one JSON-able dict per run, from the files a run writes as it
goes (metrics.jsonl, samples.jsonl, progress.json, data_report.json, config.yaml, checkpoints/*/state.json).

Only files directly inside a run folder (and its checkpoints' state.json) are read, each opened without following
a symbolic link: a link in a run folder (to /etc/passwd, say) reads as absent, so the page shows nothing outside
the folders it was given. Run folders are found by scanning; a request names a run by the name found here, never
by a path."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from leansft.core.io import checkpoint_files as ckpt
from leansft.recipe import suites

MAX_BYTES = 256 << 20  # a file larger is not read (a page for a run, not a file server; ~600k logged steps)
SAMPLES_KEPT = 200  # the newest samples sent; the step-0 ones ("before") always


def read_own(path: Path) -> str | None:
    """A regular file's text, not through a symbolic link (the link itself, or one in a checkpoint folder's place);
    None where it is absent, a link, not a regular file or too large."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EMLINK):
            return None
        raise
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            return None
        return fh.read().decode("utf-8", errors="replace")


def _none(_constant: str) -> None:
    """NaN and Infinity (a diverged loss) read as null: the page's JSON is strict JSON."""
    return None


def _jsonl(text: str | None) -> list[dict]:
    out = []
    for line in (text or "").splitlines():
        try:
            record = json.loads(line, parse_constant=_none)
        except ValueError:
            continue  # a line being written, or torn by a crash
        if isinstance(record, dict):
            out.append(record)
    return out


def _json(text: str | None) -> dict | None:
    try:
        value = json.loads(text, parse_constant=_none) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def is_run(folder: Path) -> bool:
    """A leansft run folder: a real directory (not a link) holding a metrics.jsonl or progress.json of its own."""
    return not folder.is_symlink() and folder.is_dir() and any(
        (folder / f).is_file() and not (folder / f).is_symlink() for f in ("metrics.jsonl", "progress.json"))


def find_runs(roots: list[Path]) -> dict[str, Path]:
    """name -> run folder, for each root that is a run, or the runs directly inside it (a sweep's folder)."""
    runs: dict[str, Path] = {}
    for root in roots:
        found = [root] if is_run(root) else sorted(p for p in root.iterdir() if is_run(p)) if root.is_dir() else []
        for run in found:
            name, n = run.name or str(run), 2
            while name in runs:
                name, n = f"{run.name}-{n}", n + 1
            runs[name] = run
    return runs


def checkpoints(run: Path) -> list[dict]:
    """Each complete checkpoint (``list_checkpoints``', holding its manifest) with its step and eval loss; the
    lowest eval loss marked best (as ``checkpoint.keep_best`` keeps it)."""
    folder = run / "checkpoints"
    if folder.is_symlink():
        return []
    found = []
    for path in ckpt.list_checkpoints(folder):  # oldest first
        if path.is_symlink() or not (path / ckpt.MANIFEST).is_file():
            continue
        state = _json(read_own(path / "state.json")) or {}
        found.append({"name": path.name, "step": int(path.name.removeprefix(ckpt.PREFIX)),
                      "eval_loss": state.get("eval_loss"), "world_size": state.get("world_size"), "best": False})
    scored = [c for c in found if isinstance(c["eval_loss"], (int, float))]
    if scored:
        min(scored, key=lambda c: c["eval_loss"])["best"] = True
    return found


_SUITES_SEEN: dict[str, tuple[tuple[int, int], list[dict]]] = {}  # suites.jsonl -> (its mtime and size, the rows)


def _before_after(run: Path) -> list[dict]:
    """The suites' before/after rows, worked out again only when suites.jsonl changed (it holds every item: tens of
    MB for MMLU, and the page asks every 2 s); a file not as a run writes it gives none (the page still draws)."""
    path = run / suites.RESULTS
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return []
    seen = _SUITES_SEEN.get(str(path))
    if seen is not None and seen[0] == (st.st_mtime_ns, st.st_size):
        return seen[1]
    records = _jsonl(read_own(path))
    try:
        rows = suites.before_after([r for r in records if isinstance(r, dict) and isinstance(r.get("items"), list)])
    except (KeyError, TypeError, ValueError, AttributeError):
        rows = []
    _SUITES_SEEN[str(path)] = ((st.st_mtime_ns, st.st_size), rows)
    return rows


def run_state(name: str, run: Path) -> dict:
    """Everything the page draws for one run. ``metrics``: every record of metrics.jsonl (training steps, eval
    results, the run's totals); ``samples``: the step-0 ones and the newest; ``suites``: each suite's score before
    and after with the change and its interval (``suites.before_after``, the items left out); the rest as the run
    wrote them."""
    samples = _jsonl(read_own(run / "samples.jsonl"))
    before = [s for s in samples if s.get("step") == 0]
    later = [s for s in samples if s.get("step") != 0][-SAMPLES_KEPT:]
    return {"name": name, "metrics": _jsonl(read_own(run / "metrics.jsonl")), "samples": before + later,
            "suites": _before_after(run),
            "progress": _json(read_own(run / "progress.json")),
            "data_report": _json(read_own(run / "data_report.json")),
            "config": read_own(run / "config.yaml"), "checkpoints": checkpoints(run)}
