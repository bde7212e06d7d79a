"""Fewer memory passes for the layers most decoder models share: RMSNorm, the rotary embedding, plain LoRA.

Why: eager PyTorch runs a layer op by op, and on the CPU every elementwise op is a pass over
[tokens, width] memory (a write to memory not touched for a while is dear on the VMs measured). Llama's
RMSNorm is ~3 passes forward and ~9 backward under autograd, the rotary embedding's ``rotate_half`` a
negation, a concatenation and three more ops, and peft's LoRA adds ``base + B(A(x)) * scale`` as three
full-width tensors forward and as many backward. Here each is one autograd Function with the backward
written out: the same values up to fp32 rounding (tests compare against the plain modules), 12-18% of a
SmolLM2 LoRA step and 5-7% of the small Qwen2's on the dev CPU (benchmarks/results/cpu-step-and-trl.md).

Only code known to compute exactly this is replaced: an RMSNorm whose ``forward`` is Llama's, an
``apply_rotary_pos_emb``/``rotate_half`` pair that is Llama's (compared by syntax tree, so the many copies
transformers ships match and Gemma's ``1 + weight`` norm or a partial rotary do not), and a peft
``lora.Linear`` over an ``nn.Linear`` with one adapter, no dropout, no DoRA-like variant and no bias on B.
Anything else at call time (an fp16/bf16 weight, a rotary table that takes gradients, adapters merged or
disabled, several active) runs the original code, as does anything torch.compile traces (the rotary
function is replaced module-wide, and compiled layers fuse these ops anyway). ``as_shipped()`` runs the
original code in a block: verify-before-train's reference is the plain model.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import sys
import textwrap
import types
import weakref

import torch

from leansft.core.model.as_shipped import is_as_shipped
from leansft.core.model.loading import adapters_take_input_as_is

log = logging.getLogger("leansft")

_REPLACED_ROTARY: set[str] = set()  # transformers modules whose apply_rotary_pos_emb is _rotary


class _RMSNorm(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2) + eps))`` in fp32; forward as Llama's ops, backward in closed form:
    dx = r * (g w - xhat * mean(g w xhat)), dw = sum over tokens of g xhat."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        xhat = x * r
        ctx.save_for_backward(xhat, r, weight)
        return weight * xhat

    @staticmethod
    def backward(ctx, g):
        xhat, r, weight = ctx.saved_tensors
        buf = g * xhat
        gw = buf.sum(tuple(range(g.dim() - 1))) if ctx.needs_input_grad[1] else None
        gx = None
        if ctx.needs_input_grad[0]:
            gxhat = g * weight
            dot = torch.mul(gxhat, xhat, out=buf).mean(-1, keepdim=True)
            gx = gxhat.addcmul_(xhat, dot, value=-1).mul_(r)
        return gx, gw, None


class _Rotary(torch.autograd.Function):
    """``q * cos + rotate_half(q) * sin`` with rotate_half(q) = [-q2, q1]: the product with cos, then each
    half's rotated term added in place; backward g * cos + [(g sin)2, -(g sin)1] the same way."""

    @staticmethod
    def forward(ctx, q, cos, sin):
        h = q.shape[-1] // 2
        out = q * cos
        out[..., :h].addcmul_(q[..., h:], sin[..., :h], value=-1)
        out[..., h:].addcmul_(q[..., :h], sin[..., h:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        h = g.shape[-1] // 2
        gq = g * cos
        gq[..., :h].addcmul_(g[..., h:], sin[..., h:])
        gq[..., h:].addcmul_(g[..., :h], sin[..., :h], value=-1)
        return gq, None, None


class _LoraLinear(torch.autograd.Function):
    """``x W^T + bias + scale * (x A^T) B^T`` in ``dtype`` (autocast's, else the input's): the adapter's
    product added into the base output by one addmm; backward three small and two large matmuls."""

    @staticmethod
    def forward(ctx, x, w, bias, lora_a, lora_b, scale: float):
        """``w``: the frozen base weight already in the compute dtype, which ``x`` and the adapters take."""
        dtype = w.dtype
        x2 = _cast_input(x, dtype).reshape(-1, x.shape[-1])
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        xa = torch.mm(x2, a.t())
        out = torch.mm(x2, w.t()) if bias is None else torch.addmm(bias.to(dtype), x2, w.t())
        out.addmm_(xa, b.t(), alpha=scale)
        ctx.save_for_backward(x2, xa, w, a, b)
        ctx.scale, ctx.x_shape = scale, x.shape
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x2, xa, w, a, b = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1]).to(x2.dtype)
        g_xa = torch.mm(g2, b).mul_(ctx.scale)
        ga = torch.mm(g_xa.t(), x2) if ctx.needs_input_grad[3] else None
        # (xa^T g2)^T, not g2^T xa: the BLAS runs this skinny product ~2x faster with the long side last
        gb = torch.mm(xa.t(), g2).t().mul_(ctx.scale) if ctx.needs_input_grad[4] else None
        gx = torch.mm(g2, w).addmm_(g_xa, a).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        return gx, None, None, ga, gb, None


# Under autocast the layers that read one input (q/k/v, gate/up) cast it once and save one copy between them.
_LAST_CAST: list = [None, -1, None, None]  # weak reference to the input, its version, the dtype, the cast


def _cast_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype == dtype:
        return x
    ref, version, held_dtype, cast = _LAST_CAST
    if ref is not None and ref() is x and version == x._version and held_dtype == dtype:
        return cast
    cast = x.to(dtype)
    _LAST_CAST[:] = [weakref.ref(x), x._version, dtype, cast]
    return cast


# LoRA layers whose frozen base weight keeps its autocast copy between steps (``fuse_layers``): every step
# would cast it again (most of the 3.6% these two caches save in a SmolLM2 LoRA bf16 step) and hold every
# layer's copy until its backward anyway, so the peak is unchanged. Not under gradient checkpointing, where
# only one layer's copy lives at a time. Recast when the weight's version or storage changes; a write through
# ``.data`` changes neither (peft's merge, handled in ``_lora_forward``).
_KEEP_WEIGHT_CAST: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_WEIGHT_CASTS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def _frozen_weight(module, dtype: torch.dtype) -> torch.Tensor | None:
    """The base weight of ``module`` cast to ``dtype`` as last time, while it is frozen and unchanged."""
    w = module.base_layer.weight
    if w.dtype == dtype:  # nothing to cast (``core/model/bf16_base.py`` may have stored the weight in bf16 since)
        _WEIGHT_CASTS.pop(module, None)
        return None
    if module not in _KEEP_WEIGHT_CAST or w.requires_grad or type(w) is not torch.nn.Parameter:
        return None
    key = (dtype, w._version, w.data_ptr())
    held = _WEIGHT_CASTS.get(module)
    if held is None or held[0] != key:
        held = (key, w.detach().to(dtype))
        _WEIGHT_CASTS[module] = held
    return held[1]


def _as_shipped() -> bool:
    """Run the original code: inside ``as_shipped()`` (``core/model/as_shipped.py``), or while torch.compile traces (it fuses these itself)."""
    return is_as_shipped() or torch.compiler.is_compiling()


def _rms_norm_forward(module, x):
    w = module.weight
    if _as_shipped() or x.dtype != torch.float32 or w.dtype != torch.float32:
        return type(module).forward(module, x)
    return _RMSNorm.apply(x, w, module.variance_epsilon)


def _rotary(original, q, k, cos, sin, unsqueeze_dim=1):
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    if (_as_shipped() or c.requires_grad or s.requires_grad or q.shape[-1] % 2 or c.shape != s.shape
            or torch.broadcast_shapes(q.shape, c.shape) != q.shape
            or torch.broadcast_shapes(k.shape, c.shape) != k.shape):
        return original(q, k, cos, sin, unsqueeze_dim)
    return _Rotary.apply(q, c, s), _Rotary.apply(k, c, s)


def _lora_forward(module, x, *args, **kwargs):
    name = module.active_adapters[0] if len(module.active_adapters) == 1 else None
    base = module.base_layer
    if (_as_shipped() or args or kwargs or name is None or module.merged or module.disable_adapters
            or name not in module.lora_A or name in module.lora_variant or base.weight.requires_grad
            or (base.bias is not None and base.bias.requires_grad)):  # the Function trains the adapters only
        if module.merged:  # peft merges through ``.data``, which no version counter sees: cast afresh later
            _WEIGHT_CASTS.pop(module, None)
        return type(module).forward(module, x, *args, **kwargs)
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    w = _frozen_weight(module, dtype)
    return _LoraLinear.apply(x, base.weight.to(dtype) if w is None else w, base.bias, module.lora_A[name].weight,
                             module.lora_B[name].weight, module.scaling[name])


@functools.cache
def _shape(fn) -> str:
    """The syntax tree of ``fn`` without its name, decorators and docstring: equal for textual copies."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return ""
    if not isinstance(tree, ast.FunctionDef):
        return ""
    tree.name, tree.decorator_list = "_", []
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(getattr(tree.body[0], "value", None),
                                                                       ast.Constant):
        tree.body = tree.body[1:]
    return ast.dump(tree)


def _llama():
    from transformers.models.llama import modeling_llama

    return modeling_llama


def is_llama_rms_norm(module) -> bool:
    forward = getattr(type(module), "forward", None)
    return (isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(module, "variance_epsilon")
            and forward is not None and _shape(forward) == _shape(_llama().LlamaRMSNorm.forward))


def _unfused(fn):
    return fn.args[0] if isinstance(fn, functools.partial) and fn.func is _rotary else fn


def has_llama_rotary(modeling: types.ModuleType) -> bool:
    apply, rotate = getattr(modeling, "apply_rotary_pos_emb", None), getattr(modeling, "rotate_half", None)
    llama = _llama()
    return (callable(apply) and callable(rotate)
            and _shape(_unfused(apply)) == _shape(_unfused(llama.apply_rotary_pos_emb))
            and _shape(rotate) == _shape(llama.rotate_half))


def is_plain_lora_linear(module) -> bool:
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:
        return False
    return (type(module) is LoraLinear and type(module.base_layer) is torch.nn.Linear
            and not getattr(module, "fan_in_fan_out", False) and adapters_take_input_as_is(module)
            and all(b.bias is None for b in module.lora_B.values()))


def fuse_layers(model, keep_weight_casts: bool = True) -> dict[str, int]:
    """Replace the recognised layers of ``model`` in place (parameters and state-dict keys unchanged);
    returns how many of each kind. The rotary function is replaced in its transformers module, for every
    model of that architecture in the process (the replacement computes the same values).
    ``keep_weight_casts``: frozen LoRA base weights keep their autocast copy between steps (False under
    gradient checkpointing)."""
    counts = {"rms_norm": 0, "rotary": 0, "lora_linear": 0}
    modelings = set()
    for m in model.modules():
        modelings.add(type(m).__module__)
        if is_llama_rms_norm(m):
            m.forward = types.MethodType(_rms_norm_forward, m)
            counts["rms_norm"] += 1
        elif is_plain_lora_linear(m):
            m.forward = types.MethodType(_lora_forward, m)
            if keep_weight_casts:
                _KEEP_WEIGHT_CAST.add(m)
            counts["lora_linear"] += 1
    for name in sorted(modelings):
        modeling = sys.modules.get(name)
        if modeling is None or not name.startswith("transformers.models."):
            continue
        if has_llama_rotary(modeling):
            modeling.apply_rotary_pos_emb = functools.partial(_rotary, _unfused(modeling.apply_rotary_pos_emb))
            _REPLACED_ROTARY.add(name)
            counts["rotary"] += 1
    log.info("fused layers: %s", ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none recognised")
    return counts


def restore_rotary() -> None:
    """transformers' own rotary functions again wherever ``fuse_layers`` replaced them: a run with
    ``fused_layers: false`` in a process where an earlier model was fused runs the code as shipped."""
    for name in _REPLACED_ROTARY:
        modeling = sys.modules[name]
        modeling.apply_rotary_pos_emb = _unfused(modeling.apply_rotary_pos_emb)
    _REPLACED_ROTARY.clear()
