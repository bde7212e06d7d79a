"""Context parallelism (DeepSpeed-Ulysses): a packed row split along the sequence over the ranks of a group.

Every rank of a context group holds an equal, contiguous share of the row's tokens (``core/batching/context_shard``)
and runs the whole model on it: embeddings, norms, MLPs, rotary embeddings (from the row's own position ids) and
the loss are token by token. Attention is the one place tokens meet: around it two all-to-alls turn the sequence
share into a head share (every token of the row, ``heads / N`` of the heads) and back, and the same varlen kernel
as without the split runs in between with the row's global ``cu_seqlens``: packing, sliding windows, Llama 4's
chunks, soft-capping and every backend keep working, and no rank waits on another (each attends for ``1 / N`` of
the heads over the whole row). Key/value heads fewer than N are repeated to N when N is a multiple of them.

What it refuses (``check_supported``), before step 1: head counts the split cannot divide, layers that mix the
sequence otherwise than by attention, rotary embeddings whose frequencies depend on an example's length, and
randomness drawn per token (attention and LoRA dropout, NEFTune) that would differ from one process's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from transformers import AttentionInterface

from leansft.core.errors import ConfigError
from leansft.core.model.attention import CONTEXT_PARALLEL, set_attention

_GROUP = "_leansft_context"  # on every attention module: its ``ContextGroup``
ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}


@dataclass(frozen=True)
class ContextGroup:
    group: object  # the process group of this rank's context ranks
    size: int
    rank: int  # this rank's place in the group (its share of the row)
    inner: str  # the attention implementation that runs on the gathered row


class _AllToAll(torch.autograd.Function):
    """Scatter ``x`` along ``scatter`` over the group and gather what the others send along ``gather``; the
    gradient goes back the other way (the same exchange with the two dimensions swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter, gather)
        return _exchange(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter, gather = ctx.dims
        return _exchange(grad.contiguous(), ctx.group, gather, scatter), None, None, None


def _exchange(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    n = tdist.get_world_size(group)
    parts = [p.contiguous() for p in x.chunk(n, dim=scatter)]
    out = [torch.empty_like(parts[0]) for _ in range(n)]
    tdist.all_to_all(out, parts, group=group)
    return torch.cat(out, dim=gather)


def _repeat_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """Key/value heads repeated to a multiple of ``n`` (each rank gets the head its queries use)."""
    heads = x.shape[1]
    return x if heads % n == 0 else x.repeat_interleave(n // heads, dim=1)


def context_parallel_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function: q [1, H, T/N, D] of this rank's tokens -> out [1, T/N, H, D], attending
    over the whole row through ``ContextGroup.inner``."""
    cg: ContextGroup = getattr(module, _GROUP)
    n = cg.size
    q = _AllToAll.apply(query, cg.group, 1, 2)  # [1, H/N, T, D]: every token, this rank's heads
    k = _AllToAll.apply(_repeat_heads(key, n), cg.group, 1, 2)
    v = _AllToAll.apply(_repeat_heads(value, n), cg.group, 1, 2)
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # a per-head parameter (gpt-oss): this rank's heads'
        per = sinks.shape[0] // n
        kwargs["s_aux"] = sinks[cg.rank * per:(cg.rank + 1) * per]
    out, _ = AttentionInterface()[cg.inner](module, q, k, v, attention_mask, **kwargs)  # [1, T, H/N, D]
    return _AllToAll.apply(out, cg.group, 1, 2), None  # [1, T/N, H, D]: this rank's tokens, every head


def attention_modules(model) -> list[torch.nn.Module]:
    """The modules transformers calls an attention function from (they carry ``layer_idx`` and a config)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and getattr(m, "config", None) is not None
            and (hasattr(m, "q_proj") or hasattr(m, "qkv_proj") or hasattr(m, "query_key_value"))]


def check_supported(model, size: int, lora_dropout: float = 0.0, neftune: bool = False) -> None:
    """Refuse, in one line naming the cause, what the split would compute otherwise than one process does."""
    cfg = model.config
    where = "distributed.context_parallel"
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if not heads or heads % size:
        raise ConfigError(f"context_parallel {size} does not divide the model's {heads} attention heads", field=where,
                          hint="use a context-parallel size that divides the number of attention heads")
    if kv % size and size % kv:
        raise ConfigError(f"context_parallel {size} neither divides the model's {kv} key/value heads nor is a "
                          "multiple of them (they could not be repeated evenly)", field=where)
    kinds = set(getattr(cfg, "layer_types", None) or ()) - ATTENTION_LAYERS
    modules = attention_modules(model)
    if kinds or len(modules) < getattr(cfg, "num_hidden_layers", 0):
        what = ", ".join(sorted(kinds)) or f"{getattr(cfg, 'num_hidden_layers', 0) - len(modules)} layers"
        raise ConfigError(f"{type(model).__name__} mixes the sequence otherwise than by attention ({what}): context "
                          "parallelism splits attention only", field=where)
    if getattr(model, "_leansft_per_example_rope", 0):
        raise ConfigError("this model's rotary embedding depends on each example's length (longrope, dynamic): not "
                          "split under context parallelism yet", field=where)
    if getattr(cfg, "attention_dropout", 0.0) or lora_dropout or neftune:
        raise ConfigError("attention dropout, LoRA dropout and NEFTune draw random numbers per token, which a split "
                          "row would draw otherwise than one process", field=where,
                          hint="set them to 0 (training.lora.dropout, training.neftune_noise_alpha) with "
                               "context parallelism")


def use_context_parallel(model, group, size: int, rank: int) -> None:
    """Every attention module of ``model`` attends across its context group, through the implementation it has
    now (``use_packed_attention``'s choice)."""
    inner = model.config._attn_implementation
    AttentionInterface.register(CONTEXT_PARALLEL, context_parallel_attention)
    for m in attention_modules(model):
        setattr(m, _GROUP, ContextGroup(group, size, rank, inner))
    set_attention(model, CONTEXT_PARALLEL)


@contextlib.contextmanager
def whole_rows(model):
    """Attention on whole rows (the implementation inside the split) for the duration of the block: held-out
    evaluation, where every rank evaluates rows of its own."""
    impl = model.config._attn_implementation
    modules = attention_modules(model)
    if impl != CONTEXT_PARALLEL or not modules:
        yield
        return
    set_attention(model, getattr(modules[0], _GROUP).inner)
    try:
        yield
    finally:
        set_attention(model, impl)
