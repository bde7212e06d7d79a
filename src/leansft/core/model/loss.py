"""Response-only cross-entropy from hidden states, chunked so the full logits never exist.

``chunked_loss`` returns ``(sum of token losses, number of target tokens)``; averaging happens in
one place only, the training step, over all micro-batches and ranks (``normalise``).

The gradient is computed inside the chunk loop of the forward pass (as fused-linear-CE kernels do):
for each chunk, logits -> softmax - one-hot -> grad of hidden states and accumulated grad of the
lm_head weight; the chunk's logits are then freed. Backward only scales the stored gradients. Peak
extra memory is one chunk's fp32 logits (plus the weight gradient that training needs anyway).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from leansft.core.data.masking import IGNORE_INDEX
from leansft.core.errors import ConfigError


@dataclass(frozen=True)
class HeadPrecision:
    """How the head's matmuls run, where a device wants other than the plain rule (fp32 logits from the ambient
    autocast's product, gradient products in fp32 for fp32 inputs, else in the weight's dtype). ``context``: entered
    around the whole loss; ``grad_dtype``: the dtype of the two gradient products (None: the plain rule);
    ``matmul_dtype``: all three products take their inputs in this dtype and give fp32 results (tensor cores:
    bf16 in, fp32 accumulated and out; ``TENSOR_CORES``). The CPU's opt-in bf16 policy is in
    ``core/cpu/bf16_head.py``."""

    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    grad_dtype: torch.dtype | None = None
    matmul_dtype: torch.dtype | None = None


PLAIN = HeadPrecision()
# CUDA under bf16 autocast: the head's three products (logits, hidden-state and weight gradients) on the tensor
# cores, bf16 inputs with fp32 accumulation and fp32 results; log-sum-exp, the loss and the weight gradient's sum
# over chunks stay fp32. With fp32 master weights the hidden states and the weight arrive fp32, and the plain rule
# multiplied them in true fp32 off the tensor cores: about half of a 0.5B model's step at a 151k vocabulary.
TENSOR_CORES = HeadPrecision(matmul_dtype=torch.bfloat16)


def head_precision_for(device: torch.device, amp: torch.dtype | None) -> HeadPrecision:
    """The head's policy on ``device`` under autocast ``amp`` by default: ``TENSOR_CORES`` on CUDA under bf16
    autocast, else ``PLAIN`` (an fp32 run stays fp32; the CPU keeps its plain products unless ``cpu.bf16_head``)."""
    return TENSOR_CORES if device.type == "cuda" and amp == torch.bfloat16 else PLAIN


@functools.cache
def _fp32_out_products(device_type: str) -> bool:
    """Whether this torch multiplies low-precision inputs into fp32 results on ``device_type`` (``mm`` with
    ``out_dtype``: cuBLAS on CUDA); the CPU has no such kernel, where ``_mm32`` computes the same values from the
    rounded inputs."""
    if device_type != "cuda":
        return False
    try:
        a = torch.ones(16, 16, device=device_type, dtype=torch.bfloat16)
        c = torch.zeros(16, 16, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of low-precision inputs as an fp32 result, accumulated in fp32 (what tensor cores do); off CUDA
    the same values from the inputs upcast (a product of two bf16 numbers is exact in fp32)."""
    if _fp32_out_products(a.device.type):
        return torch.mm(a, b, out_dtype=torch.float32)
    if a.device.type == "cuda":  # an older torch: bf16 result, then fp32
        return torch.mm(a, b).float()
    return torch.mm(a.float(), b.float())


def _addmm32_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``c += a @ b`` with ``c`` fp32 and ``a``, ``b`` low precision, accumulated in fp32 in place."""
    if _fp32_out_products(a.device.type):
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
    else:
        c.add_(_mm32(a, b))


class _ChunkedLinearCE(torch.autograd.Function):
    """logits = softcap(scale * (h @ W^T + b)); cross-entropy summed; gradients made chunk by chunk.

    For each chunk: logits, their log-sum-exp and the picked target's logit give the token losses; the logits'
    buffer then becomes d(loss)/d(logits) = softmax - one-hot (times the token weights and the softcap/scale
    chain rule), which makes the chunk's hidden-state gradient and is added into the weight and bias gradients.
    Backward only scales the stored gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size: int, scale: float, softcap: float | None,
                token_weights=None, grad_dtype: torch.dtype | None = None, matmul_dtype: torch.dtype | None = None):
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        # The first chunk writes the weight and bias gradients, later ones add to them: no zero-filled
        # [vocab, hidden] buffer (a full pass over the largest matrix of the model) before the first.
        grad_w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.empty(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        low = matmul_dtype  # every product from inputs in this dtype, fp32 results (``TENSOR_CORES``)
        w_low = weight.to(low) if low is not None else (
            weight.to(grad_dtype) if grad_dtype is not None and need_h else None)  # once, not per chunk
        # fp32 inputs: fp32 products (an ``out=`` product is outside autocast) into one logits buffer for every
        # chunk; otherwise the ambient autocast's product, made fp32.
        fp32 = low is None and hidden.dtype == torch.float32 and weight.dtype == torch.float32
        buf = torch.empty((min(chunk_size, hidden.shape[0]), weight.shape[0]), device=hidden.device) if fp32 else None
        for s in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[s : s + chunk_size], targets[s : s + chunk_size]
            h_low = h.to(low) if low is not None else None
            if low is not None:
                logits = _mm32(h_low, w_low.t())
            else:
                logits = torch.mm(h, weight.t(), out=buf[: len(h)]) if fp32 else (h @ weight.t()).float()
            if bias is not None:
                logits += bias.float()
            if scale != 1.0:
                logits *= scale
            if softcap is not None:
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            rows = torch.arange(len(t), device=t.device)
            picked = logits[rows, t]
            peak = logits.amax(dim=-1, keepdim=True)
            sums = logits.sub_(peak).exp_().sum(dim=-1, keepdim=True)  # exp(logits - max), in place
            token_loss = (sums.log() + peak).squeeze(-1) - picked
            tw = None if token_weights is None else token_weights[s : s + chunk_size]
            total += (token_loss if tw is None else token_loss * tw).sum()
            if not (need_h or need_w or need_b):
                continue
            g = logits.div_(sums)  # the softmax, still in the logits' buffer
            g[rows, t] -= 1.0
            if tw is not None:
                g *= tw[:, None]
            if softcap is not None:
                g *= 1.0 - capped * capped
            if scale != 1.0:
                g *= scale
            if low is not None:  # both gradient products from one low-precision copy of the chunk's gradient
                g_low = g.to(low)
                if need_h:
                    grad_h[s : s + chunk_size] = _mm32(g_low, w_low)
                if need_w and s == 0:
                    grad_w.copy_(_mm32(g_low.t(), h_low))
                elif need_w:
                    _addmm32_(grad_w, g_low.t(), h_low)
            else:
                if need_h and grad_dtype is not None:
                    grad_h[s : s + chunk_size] = torch.mm(g.to(grad_dtype), w_low)
                elif need_h and fp32:
                    torch.mm(g, weight, out=grad_h[s : s + chunk_size])
                elif need_h:
                    grad_h[s : s + chunk_size] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_w and grad_dtype is not None:  # bf16 product, added into the fp32 gradient
                    part = torch.mm(g.t().to(grad_dtype), h.to(grad_dtype))
                    grad_w.copy_(part) if s == 0 else grad_w.add_(part)
                elif need_w and s == 0:  # fp32, straight into the gradient (outside autocast)
                    torch.mm(g.t(), h.float(), out=grad_w)
                elif need_w:
                    grad_w.addmm_(g.t(), h.float())
            if need_b:
                torch.sum(g, 0, out=grad_b) if s == 0 else grad_b.add_(g.sum(0))
        ctx.save_for_backward(*(x for x in (grad_h, grad_w, grad_b) if x is not None))
        ctx.has = (need_h, need_w, need_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        grads = []
        # In place: the stored gradients are used once (no double backward through this loss).
        for need, dtype in zip(ctx.has, ctx.dtypes):
            g = saved.pop(0) if need else None
            grads.append(g.mul_(grad_out.to(g.dtype)).to(dtype) if need else None)
        return (*grads, None, None, None, None, None, None, None)


def select_targets(hidden: torch.Tensor, labels: torch.Tensor,
                   index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift by one and keep only positions whose next-token label is set: ([N, H], [N]). ``index``: those
    positions, found on the host beforehand (``batch.host_target_index()``); without it a boolean mask finds them,
    whose data-dependent size makes the host wait for the device (CUDA)."""
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    t = labels[:, 1:].reshape(-1)
    if index is not None:
        return h.index_select(0, index), t.index_select(0, index)
    keep = t != IGNORE_INDEX
    return h[keep], t[keep]


def target_weights(labels: torch.Tensor, weights: torch.Tensor | None,
                   index: torch.Tensor | None = None) -> torch.Tensor | None:
    """The loss weights of the positions ``select_targets`` keeps, in its order (None: all 1)."""
    if weights is None:
        return None
    w = weights[:, 1:].reshape(-1)
    return (w.index_select(0, index) if index is not None else w[labels[:, 1:].reshape(-1) != IGNORE_INDEX]).float()


def chunked_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024,
    softcap: float | None = None, bias: torch.Tensor | None = None, scale: float = 1.0,
    token_weights: torch.Tensor | None = None, target_index: torch.Tensor | None = None,
    precision: HeadPrecision = PLAIN,
) -> tuple[torch.Tensor, int]:
    """(summed cross-entropy over target tokens, number of target tokens). ``labels`` are unshifted;
    ``token_weights`` (aligned with them) scale each target's loss and gradient; ``target_index``: the target
    positions found on the host (``select_targets``); ``precision``: the head's matmul policy (``HeadPrecision``).

    Logits are ``softcap(scale * (hidden @ weight^T + bias))``, the output layer as the model applies it
    (``leansft.core.model.head``)."""
    h, t = select_targets(hidden, labels, target_index)
    tw = target_weights(labels, token_weights, target_index)
    if t.numel() == 0:
        return hidden.sum() * 0.0, 0
    if not torch.is_grad_enabled():  # evaluation: no gradient buffers (the weight may still require grad)
        h, weight = h.detach(), weight.detach()
        bias = bias.detach() if bias is not None else None
    amp_off = (torch.autocast(hidden.device.type, enabled=False) if precision.matmul_dtype is not None
               else contextlib.nullcontext())  # its products say their dtypes themselves
    with precision.context(), amp_off:  # the Function's forward computes the gradients too
        loss = _ChunkedLinearCE.apply(h, weight, bias, t, chunk_size, scale, softcap, tw, precision.grad_dtype,
                                      precision.matmul_dtype)
    return loss, int(t.numel())


def full_logits_loss(hidden, weight, labels, softcap: float | None = None, bias=None,
                     scale: float = 1.0, token_weights=None) -> tuple[torch.Tensor, int]:
    """Reference: the plain full-logits cross-entropy (what a model's own loss computes), summed."""
    h, t = select_targets(hidden, labels)
    tw = target_weights(labels, token_weights)
    logits = (h @ weight.t()).float()
    if bias is not None:
        logits = logits + bias.float()
    logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if tw is not None:
        return (torch.nn.functional.cross_entropy(logits, t, reduction="none") * tw).sum(), int(t.numel())
    return torch.nn.functional.cross_entropy(logits, t, reduction="sum"), int(t.numel())


def liger_loss(hidden, weight, labels, target_index: torch.Tensor | None = None,
               low: torch.dtype | None = None) -> tuple[torch.Tensor, int]:
    """Liger Kernel's fused linear cross-entropy (CUDA), summed. ``low``: the hidden states and the weight in this
    dtype first (bf16 under bf16 autocast, as a bf16 model hands them to Liger: its products take the dtype of its
    inputs)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        raise ConfigError("training.loss_backend 'liger' needs the liger-kernel package (pip install liger-kernel)",
                          field="training.loss_backend") from None
    if not hidden.is_cuda:
        raise ConfigError("training.loss_backend 'liger' runs on CUDA only", field="training.loss_backend")
    h, t = select_targets(hidden, labels, target_index)
    if low is not None:
        h, weight = h.to(low), weight.to(low)
    return LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, h, t).float(), int(t.numel())


def normalise(loss_sum: torch.Tensor, step_targets: float | torch.Tensor, world_size: int = 1) -> torch.Tensor:
    """Scale a micro-batch's summed loss so that the step's gradient is the token mean over the whole step.

    ``step_targets`` is the target-token count of the whole optimizer step (all micro-batches, all ranks),
    or the sum of the targets' loss weights where messages carry fractional weights: a number, or a device
    scalar (summed over ranks there, never read by the host). A step without targets divides by 1.
    DDP/FSDP average gradients over ranks; multiplying by ``world_size`` undoes that division.
    """
    return loss_sum * (world_size / nonzero(step_targets))


def nonzero(count: float | torch.Tensor) -> float | torch.Tensor:
    """``count``, or 1 where it is 0 (a step whose tokens carry no loss), without reading a device value."""
    if torch.is_tensor(count):
        return torch.where(count == 0, torch.ones_like(count), count)
    return count or 1.0
