"""LoRA's frozen base under bf16 autocast, stored as the bf16 values its matmuls use anyway.

Why: autocast casts an fp32 weight to bf16 for every matmul, so a frozen base held in fp32 costs 4 bytes a
parameter plus 2 for the bf16 copy each layer keeps until its backward: 6 in all, where 2 compute the same
thing. Stored in bf16 the decoder's linear layers take 2 (Llama-3-8B LoRA: their 28 GB in fp32 and 14 GB of
casts become 14 GB), and the matmuls see the very same bf16 values.

Exact or left alone: the run's own forward on a probe batch is computed before and after the change and must
be bitwise equal (a model that casts its activations to a layer's weight dtype, or uses a weight outside
autocast, would differ), else the fp32 weights are put back. Only frozen ``nn.Linear`` weights inside the
decoder layers change (the embedding, the norms and the output layer are not all autocast's to cast). The
export merges the adapters into the base as loaded from the model, in fp32, not into the bf16 copy.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from leansft.core.model.attention import decoder_of

log = logging.getLogger("leansft")

_BF16_BASE: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models whose base is stored in bf16


def _decoder_linears(model, layers: slice = slice(None)) -> list[torch.nn.Linear]:
    """The ``nn.Linear`` modules of the decoder layers (``layers``: which of them)."""
    stack = getattr(decoder_of(model), "layers", None) or []
    return [m for layer in list(stack)[layers] for m in layer.modules() if type(m) is torch.nn.Linear]


def frozen_linears(model) -> list[torch.nn.Linear]:
    """The decoder layers' ``nn.Linear`` modules with a frozen fp32 weight (LoRA's base layers among them)."""
    return [m for m in _decoder_linears(model) if not m.weight.requires_grad and m.weight.dtype == torch.float32]


def _recast(modules: list[torch.nn.Linear], dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Give each module a frozen copy of its weight in ``dtype``; returns the weights they had (``_put_back``)."""
    held = [m.weight for m in modules]
    for m in modules:
        m.weight = torch.nn.Parameter(m.weight.detach().to(dtype), requires_grad=False)
    return held


def _put_back(modules: list[torch.nn.Linear], weights: list[torch.nn.Parameter]) -> None:
    for m, w in zip(modules, weights, strict=True):
        m.weight = w


def store_base_in_bf16(model, probe: Callable[[], torch.Tensor]) -> int:
    """Store the frozen linear weights of ``model`` in bf16 if ``probe()`` (the run's forward under its bf16
    autocast) gives bitwise the same result after as before; returns how many layers changed (0: none)."""
    modules = frozen_linears(model)
    if not modules:
        return 0
    was_training = model.training
    model.eval()  # no dropout: the two probes must see the same computation
    try:
        with torch.no_grad():
            before = probe()
            fp32 = _recast(modules, torch.bfloat16)
            same = torch.equal(before, probe())
    finally:
        model.train(was_training)
    if not same:
        _put_back(modules, fp32)
        log.warning("frozen base kept in fp32: this model's forward under bf16 autocast changes when its linear "
                    "weights are stored in bf16 (it uses a weight's dtype or a weight outside autocast)")
        return 0
    _BF16_BASE.add(model)
    n = sum(m.weight.numel() for m in modules)
    log.info("frozen base: %d linear layers stored in bf16, the values autocast multiplies with (%.2f GB; %.2f in "
             "fp32 plus their casts before)", len(modules), n * 2 / 1e9, n * 6 / 1e9)
    return len(modules)


def holds_bf16_base(model) -> bool:
    """Whether ``store_base_in_bf16`` changed ``model`` (its export then merges into the fp32 base as loaded)."""
    return model in _BF16_BASE


def saved_in_bf16(path: str) -> bool:
    """Whether the model folder's weights are saved in bf16 (its config.json's ``dtype``/``torch_dtype``): read
    in bf16 and upcast, its other weights then hold bitwise what an fp32 load gives."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (cfg.get("dtype") or cfg.get("torch_dtype")) == "bfloat16"


def load_base_in_bf16(model) -> int:
    """``model`` (LoRA applied) was read in bf16: every parameter and floating buffer back in fp32 except the
    frozen linear weights of its decoder layers; returns how many stay bf16. The base is then held as
    ``store_base_in_bf16`` would hold it, and ``confirm_bf16_base`` checks it before step 1."""
    keep = {id(m.weight) for m in _decoder_linears(model) if not m.weight.requires_grad}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in keep and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != torch.float32:
                    module._buffers[name] = b.float()
    _BF16_BASE.add(model)
    return len(keep)


def confirm_bf16_base(model, probe: Callable[[], torch.Tensor]) -> int:
    """For a base read in bf16: the run's forward (``probe()``) with the first decoder layer's frozen linear weights
    as fp32 (the values an fp32 load holds) and as bf16 must be bitwise the same, as ``store_base_in_bf16`` asks of
    the whole model. Else every decoder linear weight is upcast to fp32 (a warning). Returns how many linear
    layers stay in bf16 (0: upcast)."""
    first = [m for m in _decoder_linears(model, slice(0, 1)) if m.weight.dtype == torch.bfloat16]
    if not first:
        return 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            low = _recast(first, torch.float32)
            before = probe()
            _put_back(first, low)
            same = torch.equal(before, probe())
    finally:
        model.train(was_training)
    if not same:
        _recast([m for m in _decoder_linears(model) if m.weight.dtype == torch.bfloat16], torch.float32)
        _BF16_BASE.discard(model)
        log.warning("frozen base upcast to fp32: this model's forward under bf16 autocast changes when its linear "
                    "weights are held in bf16 (it uses a weight's dtype or a weight outside autocast)")
        return 0
    return sum(m.weight.dtype == torch.bfloat16 for m in _decoder_linears(model))
