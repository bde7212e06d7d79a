"""One JSON object per measurement, appended to the GPU check's results file as each part ends.

The file is ``$LEANSFT_RESULTS``, else ``$OUT/results.jsonl`` (the device tool's output folder), else
``runs/results.jsonl``. Every object names its ``part``, the ``device`` (the GPU's name, or "CPU") and the
``torch`` version; the rest is the part's own (benchmarks/README.md lists the fields).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def results_path() -> Path:
    if os.environ.get("LEANSFT_RESULTS"):
        return Path(os.environ["LEANSFT_RESULTS"])
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "results.jsonl"
    return Path("runs") / "results.jsonl"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def emit(part: str, **fields) -> dict:
    """Append one measurement (and print it, so a reply's tail shows it too)."""
    import torch

    row = {"part": part, "device": device_name(), "torch": torch.__version__,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields}
    path = results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print("RESULT " + json.dumps(row), flush=True)
    return row


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
