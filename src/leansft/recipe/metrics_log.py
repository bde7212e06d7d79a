"""OUTPUT_DIR/metrics.jsonl: one JSON object per logged step, appended across resumes; each record also
goes to the configured experiment trackers."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from leansft.recipe.trackers import Trackers


class MetricsLog:
    def __init__(self, path: Path, enabled: bool = True, trackers: Trackers | None = None) -> None:
        self.path, self.enabled, self.trackers = path, enabled, trackers

    def write(self, record: dict | None) -> None:
        if not self.enabled or record is None:
            return
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.trackers is not None:
            self.trackers.log(record)

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint (they will be logged again)."""
        if self.enabled:
            truncate_jsonl(self.path, step)


def read_jsonl(path: Path) -> list[dict]:
    """Records of a jsonl log (a torn line from a crash is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep the records of ``path`` up to ``step``; a torn line (a crash mid-write) is dropped."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)


class ProgressFile:
    """OUTPUT_DIR/progress.json: where the run stands (step of total, ranks, time since start), replaced whole at
    each logged step; the run page's progress bar and time left (``leansft report --serve``)."""

    def __init__(self, path: Path, enabled: bool, total_steps: int, world_size: int, first_step: int) -> None:
        self.path, self.enabled, self.started = path, enabled, time.perf_counter()
        self.fixed = {"total_steps": total_steps, "world_size": world_size, "first_step": first_step}

    def write(self, step: int, wall_s: float, finished: bool = False, stopped: bool = False) -> None:
        if not self.enabled:
            return
        record = {"step": step, **self.fixed, "wall_s": round(wall_s, 3),
                  "since_start_s": round(time.perf_counter() - self.started, 3), "finished": finished,
                  "stopped": stopped, "updated": time.time()}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, self.path)
