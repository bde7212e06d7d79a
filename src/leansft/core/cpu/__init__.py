"""CPU-only speed-ups: opt-in through the config's ``cpu:`` section, off by default, never used on an accelerator.

This package is the one door: nothing else in ``leansft.core`` imports it (an import-linter contract), and the
recipe opens it with ``switch_on`` when it builds the model and ``head_precision`` when it builds the loss. Each
computes the same values as the plain path to fp32 rounding (tests compare them); they were measured on the
development hosts' CPUs (benchmarks/results/cpu-step-and-trl.md), where they save 5-18% of a step. ``malloc``
(glibc tunables) runs before torch loads, from ``leansft.__main__``. docs/cpu.md says what each does and when it pays.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the functions that use it: ``leansft.__main__`` imports ``cpu.malloc`` first
    import torch

    from leansft.core.config import CPUConfig
    from leansft.core.model.loss import HeadPrecision

log = logging.getLogger("leansft")


def switch_on(model, cfg: CPUConfig, device: torch.device, *, compiled: bool, gradient_checkpointing: bool) -> None:
    """The layer-level speed-ups ``cfg`` asks for on a CPU run (none on an accelerator, none under compile, which
    fuses these ops itself). Always restores transformers' rotary function where an earlier model in this process
    replaced it."""
    from leansft.core.cpu.fused_layers import fuse_layers, restore_rotary

    if cfg.fused_layers and device.type == "cpu" and not compiled:
        fuse_layers(model, keep_weight_casts=not gradient_checkpointing)
        return
    restore_rotary()
    if cfg.fused_layers and device.type != "cpu":
        log.info("cpu.fused_layers is for CPU runs: this run is on %s and runs the layers as shipped", device.type)


def head_precision(cfg: CPUConfig, device: torch.device, amp: torch.dtype | None) -> HeadPrecision:
    """The loss head's matmul policy: the CPU bf16 one where ``cpu.bf16_head`` asks for it, else the plain one."""
    from leansft.core.model.loss import PLAIN

    if not cfg.bf16_head or device.type != "cpu":
        return PLAIN
    from leansft.core.cpu.bf16_head import bf16_head

    return bf16_head(device, amp)
