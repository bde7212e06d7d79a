"""OUTPUT_DIR/metrics.jsonl: one JSON object per logged step, appended across resumes; TensorBoard optional."""

from __future__ import annotations

import json
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
        if not (self.enabled and self.path.exists()):
            return
        keep = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= step]
        self.path.write_text("".join(k + "\n" for k in keep))
