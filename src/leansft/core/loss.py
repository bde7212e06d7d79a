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

import torch

from leansft.core import onednn_linear
from leansft.core.data.masking import IGNORE_INDEX
from leansft.core.errors import ConfigError
from leansft.core.tied_embedding import accumulate_grad


def _cpu_bf16_autocast(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16)


@functools.cache
def onednn_bf16_mode_engages() -> bool:
    """Whether oneDNN's bf16 mode for fp32 matmuls (``mkldnn.matmul.fp32_precision = "bf16"``) really multiplies
    in bf16 on this CPU: with AMX it does; with AVX512-BF16 alone (a Zen 4 EPYC) it keeps fp32 products. Probed
    once: bf16-rounded inputs leave a relative error near 1e-3, fp32 products near 1e-7."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 128, generator=g)
    with torch.autocast("cpu", enabled=False), _bf16_mode():  # asked from inside the run's autocast
        got = a @ b
    exact = a.double() @ b.double()
    return float((got.double() - exact).norm() / exact.norm()) > 1e-4


@contextlib.contextmanager
def _bf16_mode():
    flag = torch.backends.mkldnn.matmul
    was = flag.fp32_precision
    flag.fp32_precision = "bf16"
    try:
        yield
    finally:
        flag.fp32_precision = was


def _head_matmul_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Under CPU bf16 autocast the head's three matmuls (logits, hidden and weight gradients) take bf16
    inputs with fp32 accumulation and fp32 output (oneDNN, AMX: 2-3x the fp32 rate), as autocast runs every
    other linear layer of the model; logits, softmax statistics and the loss stay fp32. Where oneDNN does not
    engage its bf16 mode (AVX512-BF16 without AMX, e.g. Zen 4) the logits stay fp32 products and the two gradient
    products take bf16 inputs instead (``gradient_dtype``). Elsewhere: unchanged."""
    return _bf16_mode() if _cpu_bf16_autocast(device) else contextlib.nullcontext()


def gradient_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype of the head's two gradient products (hidden-state and weight gradients); None: as the logits'.
    bf16 under CPU bf16 autocast on a CPU that multiplies bf16 in hardware where oneDNN's bf16 mode does not engage
    (AVX512-BF16 without AMX): bf16 inputs and bf16 results, as autocast computes every other layer's gradients;
    the logits, and so the loss, stay fp32 products. Costs a bf16 copy of the weight and of one chunk's gradient
    (SmolLM2: 57 + 100 MB at chunks of 1,024). Measured on a Zen 4 EPYC: the head's forward and backward
    ~20% shorter at the fair workload's and SmolLM2's shapes; whole bf16 steps, paired
    (``benchmarks/pair_step.py --switch bf16-head-grads``), 8% shorter on the fair workload; on SmolLM2's no
    change resolved from that machine's noise."""
    if not _cpu_bf16_autocast(device) or not torch.cpu._is_avx512_bf16_supported():
        return None
    return None if onednn_bf16_mode_engages() else torch.bfloat16


class _ChunkedLinearCE(torch.autograd.Function):
    """logits = softcap(scale * (h @ W^T + b)); cross-entropy summed; gradients made chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size: int, scale: float, softcap: float | None,
                token_weights=None, weight_grad_in_place: bool = False, grad_dtype: torch.dtype | None = None):
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        # The first chunk writes the weight and bias gradients, later ones add to them: no zero-filled
        # [vocab, hidden] buffer (a full pass over the largest matrix of the model) before the first.
        grad_w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.empty(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        w = weight
        fp32 = hidden.dtype == torch.float32 and w.dtype == torch.float32
        # Logits and hidden-state gradient through oneDNN where its fp32 products beat MKL's
        # (``core/onednn_linear.py``; the weight gradient stays with MKL). Elsewhere one logits buffer serves every
        # chunk: on the CPU a fresh [chunk, vocab] tensor per op costs page faults comparable to the arithmetic
        # (oneDNN returns a fresh tensor and still wins). Softmax statistics are computed in the logits in place.
        dnn = onednn_linear.applies(hidden, w, None)
        grad_dtype = grad_dtype if need_h or need_w else None  # no products to make (evaluation)
        w_low = w.to(grad_dtype) if grad_dtype is not None and need_h else None  # once, not per chunk
        g_buf = torch.empty((min(chunk_size, hidden.shape[0]), w.shape[0]), dtype=grad_dtype,
                            device=hidden.device) if grad_dtype is not None else None  # one for every chunk, too
        buf = torch.empty((min(chunk_size, hidden.shape[0]), w.shape[0]), dtype=torch.float32,
                          device=hidden.device) if fp32 and not dnn else None
        for s in range(0, hidden.shape[0], chunk_size):
            h = hidden[s : s + chunk_size]
            t = targets[s : s + chunk_size]
            if dnn:
                logits = onednn_linear.mm_t(h, w)
            else:
                logits = torch.mm(h, w.t(), out=buf[: len(h)]) if fp32 else (h @ w.t()).float()
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
            lse = (sums.log() + peak).squeeze(-1)
            tw = None if token_weights is None else token_weights[s : s + chunk_size]
            token_loss = lse - picked
            total += (token_loss if tw is None else token_loss * tw).sum()
            if need_h or need_w or need_b:
                g = logits.div_(sums)  # the softmax, still in the logits' buffer
                g[rows, t] -= 1.0
                if tw is not None:
                    g *= tw[:, None]
                if softcap is not None:
                    g *= 1.0 - capped * capped
                if scale != 1.0:
                    g *= scale
                g_low = g_buf[: len(g)].copy_(g) if g_buf is not None else None  # after the fp32 "- 1"
                if need_h and g_low is not None:  # bf16 result, into fp32 rows
                    grad_h[s : s + chunk_size] = torch.mm(g_low, w_low)
                elif need_h and dnn:
                    grad_h[s : s + chunk_size] = onednn_linear.mm_t(g, w.t())
                elif need_h and fp32:  # into its rows; an out= matmul is outside autocast (fp32 out, see above)
                    torch.mm(g, w, out=grad_h[s : s + chunk_size])
                elif need_h:
                    grad_h[s : s + chunk_size] = (g.to(w.dtype) @ w).to(hidden.dtype)
                if need_w and g_low is not None:
                    part = torch.mm(g_low.t(), h.to(grad_dtype))
                    if s == 0:
                        grad_w.copy_(part)
                    else:
                        grad_w += part
                elif need_w:
                    if s == 0:
                        torch.mm(g.t(), h.float(), out=grad_w)
                    else:
                        grad_w.addmm_(g.t(), h.float())
                if need_b:
                    if s == 0:
                        torch.sum(g, 0, out=grad_b)
                    else:
                        grad_b += g.sum(0)
            del logits
        ctx.save_for_backward(*(x for x in (grad_h, grad_w, grad_b) if x is not None))
        ctx.has = (need_h, need_w, need_b)
        ctx.param = weight if weight_grad_in_place and need_w else None  # ``core/tied_embedding.py``
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
        if ctx.param is not None:  # into weight.grad directly; the tied embedding's sparse rows are added there
            accumulate_grad(ctx.param, grads[1])
            grads[1] = None
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
    token_weights: torch.Tensor | None = None, weight_grad_in_place: bool = False,
    target_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """(summed cross-entropy over target tokens, number of target tokens). ``labels`` are unshifted;
    ``token_weights`` (aligned with them) scale each target's loss and gradient. ``weight_grad_in_place``:
    the weight's gradient goes into ``weight.grad`` directly, not through autograd (``core/tied_embedding.py``).
    ``target_index``: the target positions found on the host (``select_targets``).

    Logits are ``softcap(scale * (hidden @ weight^T + bias))``, the output layer as the model applies it
    (``leansft.core.head``)."""
    h, t = select_targets(hidden, labels, target_index)
    tw = target_weights(labels, token_weights, target_index)
    if t.numel() == 0:
        return hidden.sum() * 0.0, 0
    if not torch.is_grad_enabled():  # evaluation: no gradient buffers (the weight may still require grad)
        h, weight = h.detach(), weight.detach()
        bias = bias.detach() if bias is not None else None
    with _head_matmul_precision(hidden.device):  # the Function's forward computes the gradients too
        loss = _ChunkedLinearCE.apply(h, weight, bias, t, chunk_size, scale, softcap, tw, weight_grad_in_place,
                                      gradient_dtype(hidden.device))
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


def liger_loss(hidden, weight, labels, target_index: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Liger Kernel's fused linear cross-entropy (CUDA), summed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        raise ConfigError("training.loss_backend 'liger' needs the liger-kernel package (pip install liger-kernel)",
                          field="training.loss_backend") from None
    if not hidden.is_cuda:
        raise ConfigError("training.loss_backend 'liger' runs on CUDA only", field="training.loss_backend")
    h, t = select_targets(hidden, labels, target_index)
    return LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, h, t), int(t.numel())


def normalise(loss_sum: torch.Tensor, step_targets: float, world_size: int = 1) -> torch.Tensor:
    """Scale a micro-batch's summed loss so that the step's gradient is the token mean over the whole step.

    ``step_targets`` is the target-token count of the whole optimizer step (all micro-batches, all ranks),
    or the sum of the targets' loss weights where messages carry fractional weights.
    DDP/FSDP average gradients over ranks; multiplying by ``world_size`` undoes that division.
    """
    return loss_sum * (world_size / (step_targets or 1.0))
