"""The loss head's matmuls under CPU bf16 autocast (``cpu.bf16_head``): bf16 inputs, fp32 logits and loss.

Under CPU bf16 autocast every linear layer multiplies bf16 inputs with fp32 accumulation, but the chunked loss
(``core/model/loss.py``) makes its three products (logits, hidden and weight gradients) from fp32 inputs. With
this policy they take bf16 inputs too: through oneDNN's bf16 mode for fp32 matmuls where it engages (AMX: 2-3x the
fp32 rate), and where it does not (AVX512-BF16 without AMX, e.g. Zen 4) the logits stay fp32 products and the two
gradient products take bf16 inputs and give bf16 results. Measured on a Zen 4 EPYC: the head's forward and
backward ~20% shorter at the fair workload's and SmolLM2's shapes, whole bf16 steps 8% shorter on the fair
workload. Logits, softmax statistics and the loss stay fp32 either way.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from leansft.core.model.loss import PLAIN, HeadPrecision


@contextlib.contextmanager
def _bf16_mode():
    flag = torch.backends.mkldnn.matmul
    was = flag.fp32_precision
    flag.fp32_precision = "bf16"
    try:
        yield
    finally:
        flag.fp32_precision = was


def _under_bf16_autocast() -> contextlib.AbstractContextManager:
    """oneDNN's bf16 mode while CPU bf16 autocast is on (asked at call time: evaluation may run without it)."""
    on = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    return _bf16_mode() if on else contextlib.nullcontext()


@functools.cache
def onednn_bf16_mode_engages() -> bool:
    """Whether oneDNN's bf16 mode for fp32 matmuls really multiplies in bf16 on this CPU: with AMX it does; with
    AVX512-BF16 alone it keeps fp32 products. Probed once: bf16-rounded inputs leave a relative error near 1e-3,
    fp32 products near 1e-7."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 128, generator=g)
    with torch.autocast("cpu", enabled=False), _bf16_mode():
        got = a @ b
    exact = a.double() @ b.double()
    return float((got.double() - exact).norm() / exact.norm()) > 1e-4


def bf16_head(device: torch.device, amp: torch.dtype | None) -> HeadPrecision:
    """The policy for a run on ``device`` under autocast ``amp``: plain except on a CPU under bf16 autocast."""
    if device.type != "cpu" or amp != torch.bfloat16:
        return PLAIN
    if onednn_bf16_mode_engages() or not torch.cpu._is_avx512_bf16_supported():
        return HeadPrecision(context=_under_bf16_autocast)
    return HeadPrecision(context=_under_bf16_autocast, grad_dtype=torch.bfloat16)
