"""Honest throughput numbers: real tokens/s, target tokens/s, padding share, MFU, peak memory."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch

# Dense bf16 peak FLOP/s by device name fragment (no sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12,
              "RTX 4090": 165e12, "A6000": 155e12, "V100": 125e12}


def device_peak_flops(device: torch.device, configured: float | None) -> float | None:
    if configured:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for frag, flops in PEAK_FLOPS.items():
            if frag in name:
                return flops
    return None


def step_flops(n_params: int, layers: int, hidden: int, real_tokens: int, attended_sq: float) -> float:
    """Training FLOPs: 6 x params x tokens for the matmuls, plus attention (QK^T and PV, causal half,
    forward + backward = 3x): 6 x layers x hidden x sum(L^2) over the blocks actually attended."""
    return 6.0 * n_params * real_tokens + 6.0 * layers * hidden * attended_sq


def attended_squares(batch) -> float:
    """Sum of L^2 over the blocks a batch really attends: each packed segment, or rows x width^2 padded."""
    cu = getattr(batch, "cu_seqlens", None)
    if cu is not None:
        return float((torch.diff(cu).double() ** 2).sum())
    rows, width = batch.input_ids.shape
    return float(rows * width * width)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # process peak RSS on Linux


class MetricsLog:
    """One JSON object per line in OUTPUT_DIR/metrics.jsonl (appended across resumes); TensorBoard optional."""

    def __init__(self, path: Path, enabled: bool = True, tensorboard: bool = False) -> None:
        self.path, self.enabled = path, enabled
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                from leansft.errors import ConfigError

                raise ConfigError("logging.tensorboard needs the tensorboard package (pip install tensorboard)",
                                  field="logging.tensorboard") from None
            self.tb = SummaryWriter(str(path.parent / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
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
