"""OUTPUT_DIR/metrics.jsonl: one JSON object per logged step, appended across resumes; TensorBoard optional."""

from __future__ import annotations

import json
import os
from pathlib import Path

from leansft.core.errors import ConfigError


class MetricsLog:
    def __init__(self, path: Path, enabled: bool = True, tensorboard: bool = False) -> None:
        self.path, self.enabled = path, enabled
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("logging.tensorboard needs the tensorboard package (pip install tensorboard)",
                                  field="logging.tensorboard") from None
            self.tb = SummaryWriter(str(path.parent / "tensorboard"))

    def write(self, record: dict | None) -> None:
        if not self.enabled or record is None:
            return
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])
            self.tb.flush()

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
