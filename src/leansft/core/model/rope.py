"""Rotary embeddings whose frequencies depend on the sequence length, computed per example as if it ran alone.

transformers' ``longrope`` (Phi-3 128k, Phi-3.5, Phi-4-mini: short factors up to
``original_max_position_embeddings``, long factors beyond) and ``dynamic`` NTK scaling choose their frequencies
from ``max(position_ids) + 1`` of the whole call, dynamic also from the calls before it. In a packed or padded
batch that is the longest example's length, so an example batched with one longer than the switch point gets
other rotary angles than it has alone and at inference: silently other positions (a tiny Phi-3 with the switch
at 32 tokens: logits off by 6e-3 of their scale; the probe of verify-before-train is too short to see it).

``per_example_rope(model)`` wraps such a model's rotary modules. Inside ``batch_lengths(batch)`` (every leansft
forward, ``core/model/forward.py``) a wrapped module computes cos/sin once per group of examples that choose alike,
from the state a freshly loaded model has: longrope, the examples at or below the switch in one call and those
above it in another; dynamic, those at or below in one call and each longer length in its own. Outside it
(generation, the plain model in verify) the module runs as shipped. Other rotary types are left alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Iterator

import torch

from leansft.core.errors import ModelError

log = logging.getLogger("leansft")
_BATCH: contextvars.ContextVar = contextvars.ContextVar("leansft_rope_batch", default=None)


def length_dependent(rope_type: object) -> bool:
    """The rotary types whose frequencies transformers recomputes from the call's length (``dynamic_rope_update``)."""
    return isinstance(rope_type, str) and (rope_type == "longrope" or "dynamic" in rope_type)


def _rope_types(module) -> list[object]:
    rope_type = getattr(module, "rope_type", None)
    return list(rope_type.values()) if isinstance(rope_type, dict) else [rope_type]


def per_example_rope(model) -> int:
    """Wrap every rotary module of ``model`` with a length-dependent type (once per model); returns how many."""
    done = getattr(model, "_leansft_per_example_rope", None)
    if done is not None:
        return done
    n, kinds = 0, set()
    for module in model.modules():
        found = [t for t in _rope_types(module) if length_dependent(t)]
        if found and not hasattr(module, "_leansft_shipped_forward"):
            module._leansft_shipped_forward = module.forward
            module.forward = functools.partial(_forward, module)
            n, kinds = n + 1, kinds | set(found)
    if n:
        log.info("rotary embedding: %s, computed per example (its frequencies depend on the sequence length)",
                 ", ".join(sorted(kinds)))
    model._leansft_per_example_rope = n
    return n


@contextlib.contextmanager
def batch_lengths(batch) -> Iterator[None]:
    """Wrapped rotary modules called inside see ``batch`` (a ``PackedBatch`` or ``PaddedBatch``) and its examples."""
    token = _BATCH.set(batch)
    try:
        yield
    finally:
        _BATCH.reset(token)


def _lengths(batch, position_ids: torch.Tensor) -> tuple[list[int], bool]:
    """(example lengths, packed) of the batch in the forward, checked against the rotary call's positions."""
    if hasattr(batch, "cu_seqlens"):
        sizes = batch.host_segment_sizes() or torch.diff(batch.cu_seqlens).tolist()
        ok = position_ids.shape == (1, sum(sizes))
        out = (sizes, True)
    else:
        out = (batch.attention_mask.sum(1).tolist(), False)
        ok = position_ids.shape == batch.attention_mask.shape
    if not ok:
        raise ModelError(f"the rotary embedding was called with positions of shape {tuple(position_ids.shape)}, not "
                         "the batch's: its length-dependent frequencies cannot be computed per example")
    return out


def _group_key(module, rope_type: str, layer_type: str | None):
    """Length -> key; examples with equal keys get the same frequencies (a call holding them all is exact)."""
    try:
        if rope_type == "longrope":
            params = module.config.rope_parameters
            switch = int((params if layer_type is None else params[layer_type])["original_max_position_embeddings"])
            return lambda n: n > switch
        switch = int(module.original_max_seq_len)
        return lambda n: n if n > switch else 0
    except (AttributeError, KeyError, TypeError, ValueError):
        return lambda n: n  # the switch not found: one call per distinct length is exact for any rule


def _fresh(module, rope_type: str, layer_type: str | None) -> None:
    """The dynamic state of a freshly loaded model (longrope keeps none: it picks its frequencies every call)."""
    if "dynamic" not in rope_type:
        return
    prefix = "" if layer_type is None else f"{layer_type}_"
    original = getattr(module, f"{prefix}original_inv_freq", None)
    if original is None or not hasattr(module, "original_max_seq_len"):
        return
    module.register_buffer(f"{prefix}inv_freq", original.clone(), persistent=False)
    setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)


def _forward(module, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None, **kwargs):
    shipped = module._leansft_shipped_forward
    if layer_type is not None:
        kwargs["layer_type"] = layer_type
    rope_type = module.rope_type if layer_type is None else module.rope_type[layer_type]
    batch = _BATCH.get()
    if batch is None or not length_dependent(rope_type):
        return shipped(x, position_ids, **kwargs)

    def fresh_call(positions: torch.Tensor):
        _fresh(module, rope_type, layer_type)
        return shipped(x, positions, **kwargs)

    lengths, packed = _lengths(batch, position_ids)
    key = _group_key(module, rope_type, layer_type)
    groups: dict[object, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(key(n), []).append(i)
    try:
        if len(groups) == 1:  # every example chooses alike: one call over the whole batch
            return fresh_call(position_ids)
        return (_packed if packed else _padded)(fresh_call, position_ids, lengths, list(groups.values()))
    finally:
        _fresh(module, rope_type, layer_type)  # what runs next (generation, the plain model) starts fresh too


def _packed(call, position_ids: torch.Tensor, lengths: list[int], groups: list[list[int]]):
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    pieces: list = [None] * len(lengths)
    for members in groups:
        cos, sin = call(torch.cat([position_ids[:, starts[i]: starts[i + 1]] for i in members], dim=1))
        sizes = [lengths[i] for i in members]
        for i, c, s in zip(members, cos.split(sizes, dim=1), sin.split(sizes, dim=1)):
            pieces[i] = (c, s)
    return torch.cat([p[0] for p in pieces], dim=1), torch.cat([p[1] for p in pieces], dim=1)


def _padded(call, position_ids: torch.Tensor, lengths: list[int], groups: list[list[int]]):
    cos_out = sin_out = None
    for members in groups:
        width = max(lengths[i] for i in members)
        rows = torch.as_tensor(members, device=position_ids.device)
        cos, sin = call(position_ids[rows, :width])
        if cos_out is None:  # padding keeps zeros: its rotated queries and keys are masked out or never read
            cos_out = cos.new_zeros((*position_ids.shape, cos.shape[-1]))
            sin_out = sin.new_zeros((*position_ids.shape, sin.shape[-1]))
        cos_out[rows, :width] = cos
        sin_out[rows, :width] = sin
    return cos_out, sin_out
