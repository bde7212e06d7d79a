"""OUTPUT_DIR/metrics.jsonl: one JSON object per logged step, appended across resumes; each record also
goes to the configured experiment trackers."""

from __future__ import annotations

import json
import os
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
