"""fp32 linear layers through oneDNN on CPUs where PyTorch's default matmul library leaves AVX-512 unused.

Why: on the CPU PyTorch multiplies fp32 matrices with MKL, which takes its AVX-512 kernels on Intel CPUs
only; on an AMD CPU with AVX-512 (Zen 4) it runs its AVX2 code, while oneDNN (also inside PyTorch) uses
the AVX-512 units. Measured on a Zen 4 EPYC at SmolLM2's shapes: x W^T and g W 14-36% faster, and a SmolLM2
full fine-tuning step 6-26% shorter (benchmarks/README.md). The weight gradient g^T x stays with MKL
(oneDNN was not faster there). The loss head (``core/loss.py``) takes the same rule for its logits and
hidden-state gradient (the head's forward and backward 19% faster, paired, at SmolLM2's and the fair workload's
shapes). On Intel CPUs and on AVX2-only CPUs nothing changes (on an AVX2 EPYC the same swap gained nothing in
the step).

Same products, other summation order: results differ from MKL's in the last bits, as two BLAS libraries
do; verify-before-train compares the run's forward and loss with the plain model (MKL) as always.

Where leansft has MKL take its AVX-512 kernels after all (``core/mkl_kernels.py``, the model commands' default on
these CPUs) this module stands aside: MKL's products are then as fast or faster (oneDNN's routing took 1.01-1.12x
the time of MKL alone in paired same-batch steps).
"""

from __future__ import annotations

import functools

import torch

from leansft.core import mkl_kernels
from leansft.core.cpuinfo import cpu_vendor


@functools.cache
def mkl_runs_avx2() -> bool:
    """True on a CPU with AVX-512 not made by Intel, where oneDNN is built in: MKL left to its own choice runs its
    AVX2 code there while oneDNN uses AVX-512 (a property of the machine)."""
    if (not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise")
            or not torch.backends.cpu.get_cpu_capability().startswith("AVX512")):
        return False
    return cpu_vendor() not in ("GenuineIntel", "")


def onednn_pays() -> bool:
    """Whether fp32 products go through oneDNN: where MKL runs AVX2 code, unless this process loaded the shim that
    gives MKL its AVX-512 kernels (``core/mkl_kernels.py``; fixed before torch loads)."""
    return mkl_runs_avx2() and not mkl_kernels.loaded()


def mm_t(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ w^T + bias`` by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(a, w, bias, "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """``x W^T + b`` in fp32: forward and input gradient by oneDNN, weight gradient by MKL."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return mm_t(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        x2, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = mm_t(g2, weight.t()).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        gw = torch.mm(g2.t(), x2) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether this call goes through oneDNN: on a machine where it pays, and ``eligible``."""
    return onednn_pays() and eligible(x, weight, bias)


def eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """fp32 on the CPU outside autocast, plain tensors, rows to multiply (sharded or quantised weights, and
    autocast's bf16 path, keep the original code)."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.numel() > 0
            and not torch.is_autocast_enabled("cpu") and type(weight.data) is torch.Tensor
            and (bias is None or (bias.dtype == torch.float32 and type(bias.data) is torch.Tensor)))
