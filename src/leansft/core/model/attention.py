"""Varlen attention for packed rows, registered with transformers' AttentionInterface.

A packed micro-batch is one flat sequence of several examples with ``cu_seqlens`` boundaries. Each
example must attend only to itself: no cross-example pairs computed, no L x L mask materialised.

Backends:
- ``flash_attention_2`` (transformers' own, flash-attn's varlen kernel) when flash-attn imports and the
  device is CUDA; it reads the same ``cu_seq_lens_*`` kwargs;
- ``leansft_torch_varlen``: PyTorch's own varlen flash kernel (``torch.nn.attention.varlen``) on CUDA
  when flash-attn is not installed: one launch for the whole packed sequence;
- ``leansft_sdpa_varlen``: PyTorch SDPA run per example segment (causal inside the segment), the CPU's;
- ``leansft_flex`` (``attention: flex``): flex_attention with a block-diagonal causal mask, one
  compiled kernel for the whole sequence on CUDA (eager, slow but exact, on the CPU).
No mask function is registered for ``leansft_sdpa_varlen``, so transformers builds no mask at all.
The varlen function refuses to run without segment boundaries rather than silently mixing examples.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import itertools
import logging

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
from transformers import AttentionInterface

from leansft.core.errors import ConfigError, ModelError
from leansft.core.host_read import HostRead
from leansft.core.paths import private_compile_cache

log = logging.getLogger("leansft")
VARLEN = "leansft_sdpa_varlen"
FLEX = "leansft_flex"
TORCH_VARLEN = "leansft_torch_varlen"
CONTEXT_PARALLEL = "leansft_context_parallel"  # one of the above across a context group (core/model/context_parallel)
PACKED_SAFE = {VARLEN, FLEX, TORCH_VARLEN, CONTEXT_PARALLEL, "flash_attention_2", "flash_attention_3"}
HALF_ONLY = {TORCH_VARLEN, "flash_attention_2", "flash_attention_3"}  # kernels that compute in bf16/fp16 only
_PLAIN = "_leansft_plain_attention"
# Segments up to this length attend in fp32 on the CPU when the run is bf16/fp16: the CPU's bf16 flash kernel is
# slower there. Where it turns faster depends on the CPU (SmolLM2's 9 x 64 heads, fwd+bwd): with AMX, bf16 2.06 ms
# vs fp32 1.02 at 128 tokens, 3.16 vs 3.02 at 256, 5.58 vs 6.33 at 384; with AVX512-BF16 and no AMX (Zen 4), 6.03
# vs 4.47 at 256, 11.86 vs 9.73 at 384, 18.64 vs 18.51 at 512, 26.99 vs 34.51 at 768. A property of the CPU, not
# a timing taken at start-up, so a run (and its resume) takes the same path on the same machine every time.
CPU_HALF_SEGMENT_MAX_AMX = 256
CPU_HALF_SEGMENT_MAX_OTHER = 512


@functools.cache
def cpu_half_segment_max() -> int:
    """The longest segment that attends in fp32 under CPU bf16/fp16 on this machine."""
    return CPU_HALF_SEGMENT_MAX_AMX if torch.cpu._is_amx_tile_supported() else CPU_HALF_SEGMENT_MAX_OTHER


def _cpu_half_dtype(*xs: torch.Tensor) -> torch.dtype | None:
    """The bf16/fp16 dtype SDPA would run and return in on the CPU here (CPU autocast's, or a half input's);
    None where it runs in fp32 or not on the CPU."""
    if xs[0].device.type != "cpu":
        return None
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return next((x.dtype for x in xs if x.dtype in (torch.bfloat16, torch.float16)), None)


def _segment_attention(q, k, v, scaling, dropout, softcap, window, sinks=None) -> torch.Tensor:
    """Causal attention of one segment. q: [1, H, L, D]; k, v: [1, Hkv, L, D]; ``sinks``: [H] logits of an
    attention sink (gpt-oss), a virtual key every query attends to with no value."""
    n_rep = q.shape[1] // k.shape[1]
    if softcap is None and sinks is None and (window is None or q.shape[2] <= window):
        half = _cpu_half_dtype(q, k, v) if q.shape[2] <= cpu_half_segment_max() else None
        if half is not None:
            # The CPU's flash kernel is 2-3x slower in bf16 than in fp32 on short segments (its backward
            # above all); fp32 there is faster and more precise. Autocast would cast the inputs back.
            with torch.autocast("cpu", enabled=False):
                out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scaling,
                                                     dropout_p=dropout, enable_gqa=n_rep > 1)
            return out.to(half)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout,
                                              enable_gqa=n_rep > 1)
    # Soft-capped (Gemma 2), with sinks (gpt-oss) or longer than a sliding window: explicit scores for
    # this segment only.
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    L = q.shape[2]
    i = torch.arange(L, device=q.device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # the sink's logit joins each row's softmax, then is dropped
        sink = sinks.reshape(1, -1, 1, 1).expand(1, -1, L, 1).to(scores.dtype)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


# The lengths of the micro-batch now running, read on the host by ``PackedBatch.to`` and handed over by
# ``packed_forward``: every layer needs them, and reading ``cu`` back from a CUDA device would make the host wait
# for it once per layer. They serve that very boundaries tensor only (``core.host_read.HostRead``), else it is read.
_RUNNING: dict[str, HostRead | None] = {"sizes": None}


def remember_segment_sizes(sizes: HostRead | None) -> None:
    _RUNNING["sizes"] = sizes


def segment_sizes(cu: torch.Tensor) -> list[int]:
    held = _RUNNING["sizes"]
    sizes = held.get(cu) if held is not None else None
    return sizes if sizes is not None else torch.diff(cu).tolist()


_CHUNK = "_leansft_chunk"  # each attention module's chunk size (or None), set once by ``use_packed_attention``


def _chunk_of(module) -> int | None:
    cfg = getattr(module, "config", None)
    types, idx = getattr(cfg, "layer_types", None), getattr(module, "layer_idx", None)
    if not types or idx is None or idx >= len(types) or types[idx] != "chunked_attention":
        return None
    return int(cfg.attention_chunk_size)


def chunk_size(module) -> int | None:
    """Llama 4's chunked-attention layers attend within chunks of ``attention_chunk_size`` tokens counted from the
    sequence's start (transformers' chunked mask, which the packed backends do not get); None for other layers.
    Read from the attribute ``use_packed_attention`` set, not from ``layer_idx``: compiled layers would guard on each
    layer's own index and recompile for every layer (past dynamo's limit, the rest ran eagerly)."""
    marked = getattr(module, _CHUNK, ...)
    return _chunk_of(module) if marked is ... else marked


def mark_chunks(model) -> None:
    """Give every attention module its chunk size (``chunk_size``), the same None on all of them but Llama 4's
    chunked layers."""
    for m in model.modules():
        if hasattr(m, "layer_idx") and getattr(m, "config", None) is not None:
            setattr(m, _CHUNK, _chunk_of(m))


def layer_sizes(module, sizes: list[int]) -> list[int]:
    """The segments this layer attends within: each example, cut into its chunks on a chunked-attention layer
    (causal attention inside each chunk is exactly the chunked mask of the example alone)."""
    chunk = chunk_size(module)
    return sizes if chunk is None else _cut(sizes, chunk)


def _cut(sizes: list[int], chunk: int) -> list[int]:
    if max(sizes, default=0) <= chunk:
        return sizes
    return [c for n in sizes for c in [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])]


@torch.compiler.disable  # host-side boundaries: eager between compiled layer regions (``core/model/compile.py``)
def sdpa_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: q [B, H, T, D] -> out [B, T, H, D], per-example causal."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ModelError(
            "packed attention called without cu_seq_lens: the examples in this sequence would attend to each "
            "other", hint="run packed batches through leansft.core.model.attention.packed_forward (use_cache=False)",
        )
    if query.shape[0] != 1:
        raise ModelError(f"packed batches are one flat sequence; got batch size {query.shape[0]}")
    dropout = dropout if module.training else 0.0
    softcap = kwargs.get("softcap")
    window = kwargs.get("sliding_window")
    sinks = kwargs.get("s_aux")
    sizes = layer_sizes(module, segment_sizes(cu))
    # torch.split, not slicing: the backward of a slice writes into a zeroed full-length gradient per
    # segment (O(segments x T) fills and adds); split's backward concatenates the segment gradients once.
    pieces = zip(*(x.split(sizes, dim=2) for x in (query, key, value)))
    outs = [_segment_attention(q, k, v, scaling, dropout, softcap, window, sinks)
            for (q, k, v), n in zip(pieces, sizes) if n > 0]
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


def torch_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """PyTorch's own varlen kernel (``torch.nn.attention.varlen``, flash attention inside torch; CUDA,
    bf16/fp16): one launch for the whole packed sequence, causal inside each ``cu_seq_lens`` segment."""
    from torch.nn.attention.varlen import varlen_attn

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ModelError("packed attention called without cu_seq_lens: the examples would attend to each other")
    if query.shape[0] != 1:
        raise ModelError(f"packed batches are one flat sequence; got batch size {query.shape[0]}")
    if dropout and module.training:
        raise ModelError("attention 'torch_varlen' has no attention dropout; use sdpa_varlen")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ModelError("attention 'torch_varlen' has no logit soft-capping or attention sinks; use sdpa_varlen")
    window = kwargs.get("sliding_window")
    half = query.dtype if query.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    q, k, v = (x[0].transpose(0, 1).to(half) for x in (query, key, value))  # [T, H, D]
    gqa = {}
    if q.shape[1] != k.shape[1]:  # grouped key/value heads: query head h reads key/value head h // n_rep
        if _GQA["mode"] == "flag":
            gqa["enable_gqa"] = True
        elif _GQA["mode"] == "repeat":  # a kernel that takes no fewer key/value heads: repeated as repeat_kv does
            n_rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    max_len = int(kwargs.get("max_length_q") or int(torch.diff(cu).max()))
    if chunk_size(module) is not None:  # a chunked layer: the chunks' boundaries (a small host-to-device copy)
        sizes = layer_sizes(module, segment_sizes(cu))
        cu = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int32, device=query.device)
        max_len = max(sizes)
    out = varlen_attn(q, k, v, cu.to(torch.int32), cu.to(torch.int32), max_len, max_len, scale=scaling,
                      window_size=(window - 1 if window else -1, 0), **gqa)
    return out.to(query.dtype)[None], None


_FLEX_CACHE: dict = {}


def _flex_kernel(device: torch.device):
    if device.type != "cuda":
        return flex_attention  # eager reference implementation: correct, not fast
    if "kernel" not in _FLEX_CACHE:
        private_compile_cache()
        _FLEX_CACHE["kernel"] = torch.compile(flex_attention, dynamic=True)
    return _FLEX_CACHE["kernel"]


def _block_mask(cu: torch.Tensor, total: int, window: int | None, device: torch.device, chunk: int | None = None):
    """Block-diagonal causal mask from the boundaries (cut into chunks on a chunked-attention layer), built once
    per micro-batch and layer kind (the layers of a kind share it)."""
    sizes = segment_sizes(cu)
    key = (tuple(sizes), window, chunk, str(device))
    masks = _FLEX_CACHE.setdefault("masks", {})
    if key not in masks:
        pieces = sizes if chunk is None else _cut(sizes, chunk)
        lengths = torch.diff(cu).to(device) if pieces is sizes else torch.tensor(pieces, device=device)
        doc = torch.repeat_interleave(torch.arange(len(pieces), device=device), lengths,
                                      output_size=total)  # its size given: the host need not read it back

        def mask_mod(b, h, q, k):
            keep = (doc[q] == doc[k]) & (q >= k)
            return keep & (q - k < window) if window is not None else keep

        if len(masks) >= 4:  # another micro-batch: the masks of the last one are done with
            masks.clear()
        masks[key] = create_block_mask(mask_mod, 1, 1, total, total, device=device,
                                       BLOCK_SIZE=128 if device.type == "cuda" else 16)
    return masks[key]


@torch.compiler.disable  # the block mask is built from host-side boundaries; the kernel is compiled apart
def flex_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """flex_attention with a block-diagonal causal mask: one kernel for the whole packed sequence."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ModelError("packed attention called without cu_seq_lens: the examples would attend to each other")
    if dropout and module.training:
        raise ModelError("attention 'flex' does not support attention dropout; use sdpa_varlen")
    softcap = kwargs.get("softcap")
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q, k):
            return softcap * torch.tanh(score / softcap)
    mask = _block_mask(cu, query.shape[2], kwargs.get("sliding_window"), query.device, chunk_size(module))
    sinks = kwargs.get("s_aux")
    out = _flex_kernel(query.device)(query, key, value, block_mask=mask, score_mod=score_mod, scale=scaling,
                                     enable_gqa=query.shape[1] != key.shape[1],
                                     return_aux=AuxRequest(lse=True) if sinks is not None else None)
    if sinks is not None:  # softmax over [scores, sink] = softmax over scores x sigmoid(lse - sink)
        out, lse = out[0], out[1].lse
        out = out * torch.sigmoid(lse - sinks.reshape(1, -1, 1).to(lse.dtype)).unsqueeze(-1).to(out.dtype)
    return out.transpose(1, 2).contiguous(), None


# How torch's varlen kernel gets grouped key/value heads: "flag" (``enable_gqa``, torch 2.13), "native" (as they are:
# flash attention groups them itself where the wrapper passes them on), or "repeat" (repeated to the query heads).
# Decided once, eagerly, by ``gqa_mode`` (compiled code reads it as a constant).
_GQA = {"mode": "repeat"}


def gqa_mode(device: torch.device) -> str:
    """How this torch's ``varlen_attn`` takes fewer key/value heads than query heads on ``device``: its
    ``enable_gqa`` flag where it has one; else a probe (forward and backward of a small case, against the heads
    repeated) decides whether it takes them as they are; else they are repeated (6-7x the key/value bytes at
    Qwen2.5's 14/2 and 12/2 heads)."""
    if "enable_gqa" in _torch_varlen_options():
        return "flag"
    if device.type != "cuda" or not _has_torch_varlen():
        return "repeat"
    return "native" if _takes_grouped_heads(device) else "repeat"


@functools.cache
def _takes_grouped_heads(device: torch.device) -> bool:
    from torch.nn.attention.varlen import varlen_attn

    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(24, 4, 64, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(24, 2, 64, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))
    cu = torch.tensor([0, 10, 24], device=device, dtype=torch.int32)
    try:
        grouped = varlen_attn(q, k, v, cu, cu, 14, 14, window_size=(-1, 0))
        grouped.float().square().sum().backward()
        dq = q.grad.clone()
        q.grad = None
        full = varlen_attn(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), cu, cu, 14, 14,
                           window_size=(-1, 0))
        full.float().square().sum().backward()
    except (RuntimeError, ValueError, TypeError):
        return False
    return bool(torch.allclose(grouped, full, atol=2e-2) and torch.allclose(dq, q.grad, atol=5e-2))


def register() -> None:
    AttentionInterface.register(VARLEN, sdpa_varlen_attention)
    AttentionInterface.register(FLEX, flex_varlen_attention)
    AttentionInterface.register(TORCH_VARLEN, torch_varlen_attention)


@functools.cache
def _torch_varlen_options() -> frozenset[str]:
    """The keyword arguments this torch's ``varlen_attn`` takes (2.10: ``is_causal``; 2.11: ``scale`` and
    ``window_size``; 2.13: also ``enable_gqa``); empty without the module."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return frozenset()
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _has_torch_varlen() -> bool:
    """A ``varlen_attn`` that takes what ``torch_varlen_attention`` passes (causal through ``window_size``, and
    the model's ``scale``): torch 2.11 on; an older one's kernel is not used (per-segment SDPA instead)."""
    return {"scale", "window_size"} <= _torch_varlen_options()


def choose_backend(device: torch.device, requested: str = "auto", training: bool = True, half: bool = True) -> str:
    """The packed-attention implementation for this device, or a clear error if the request can't run.

    auto: where the run computes in bf16 on CUDA (``half``), flash-attn's varlen kernel if installed, else
    PyTorch's own varlen kernel (torch 2.11 on; an older torch gets per-segment SDPA); otherwise per-segment
    SDPA (the CPU, and fp32 runs: exact in fp32)."""
    register()
    has_flash = importlib.util.find_spec("flash_attn") is not None
    has_torch_varlen = _has_torch_varlen()
    if requested == "torch_varlen" and not has_torch_varlen:
        raise ConfigError(f"attention 'torch_varlen' needs torch.nn.attention.varlen's varlen_attn with scale and "
                          f"window_size (torch 2.11 or later), which torch {torch.__version__} does not have",
                          field="training.attention", hint="use attention: auto or sdpa_varlen")
    if requested in ("flash",) and not (has_flash and device.type == "cuda"):
        raise ModelError("attention 'flash' needs the flash-attn package and a CUDA device",
                         field="training.attention", hint="pip install flash-attn, or use attention: auto")
    if requested == "torch_varlen" and device.type != "cuda":
        raise ConfigError("attention 'torch_varlen' needs a CUDA device (it is flash attention inside torch)",
                          field="training.attention", hint="use attention: auto (sdpa_varlen) on the CPU")
    if requested in ("flash", "torch_varlen") and not half:
        raise ConfigError(f"attention '{requested}' computes in bf16/fp16 only, and this run is fp32",
                          field="training.attention", hint="use precision: auto or bf16, or attention: auto")
    if requested == "flex":
        if training and device.type != "cuda":
            raise ConfigError("attention 'flex' cannot train on the CPU (flex_attention has no CPU backward)",
                              field="training.attention", hint="use attention: auto (sdpa_varlen) on the CPU")
        return FLEX
    if requested == "sdpa_varlen" or device.type != "cuda" or not half:
        return VARLEN
    if requested == "flash" or (requested == "auto" and has_flash):
        return "flash_attention_2"
    return TORCH_VARLEN if has_torch_varlen else VARLEN


def set_attention(model, impl: str) -> None:
    """Point every attention module of ``model`` (sub-configs included) at implementation ``impl``. A vision
    tower keeps its own (sdpa): it separates its images itself, and packing concerns the language model."""
    vision = getattr(model.config, "vision_config", None)
    tower = vision._attn_implementation if vision is not None else None
    model.config._attn_implementation = impl  # a composite config passes it on to its sub-configs
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and cfg is not model.config and cfg is not vision and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = impl
    if vision is not None:
        vision._attn_implementation = tower


def use_packed_attention(model, backend: str) -> None:
    """Register leansft's backends, point ``model`` at ``backend`` and log what is really used. The
    implementation the model came with is remembered for ``plain_attention``."""
    register()
    if not hasattr(model, _PLAIN):
        impl = model.config._attn_implementation
        setattr(model, _PLAIN, impl if impl not in PACKED_SAFE else "sdpa")
    if backend.startswith("flash_attention") and "chunked_attention" in (getattr(model.config, "layer_types", None)
                                                                           or ()):
        backend = TORCH_VARLEN if _has_torch_varlen() else VARLEN  # flash takes one set of boundaries for all layers
        log.info("chunked-attention layers need their own boundaries: %s instead of flash-attn", backend)
    mark_chunks(model)
    set_attention(model, backend)
    extra = ""
    if backend == TORCH_VARLEN:
        _GQA["mode"] = gqa_mode(next(model.parameters()).device)
        extra = f" (grouped key/value heads: {_GQA['mode']})"
    log.info("packed attention backend: %s%s", backend, extra)


def use_plain_attention(model) -> None:
    """Back to the model's own (padding-aware) attention implementation, e.g. for padded batches."""
    set_attention(model, getattr(model, _PLAIN, "sdpa"))
    log.info("attention: %s (the model's own, for padded batches)", model.config._attn_implementation)


@contextlib.contextmanager
def plain_attention(model):
    """The model's own attention implementation (the plain Hugging Face forward, padding-aware and
    cache-capable) for the duration of the block: references, generation."""
    impl = model.config._attn_implementation
    set_attention(model, getattr(model, _PLAIN, impl if impl not in PACKED_SAFE else "sdpa"))
    try:
        yield
    finally:
        set_attention(model, impl)


def decoder_of(model):
    """The module that turns input ids into final hidden states (the causal LM minus its output layer)."""
    decoder = model.get_decoder()
    if decoder is model or getattr(decoder, "get_output_embeddings", lambda: None)() is not None:
        inner = getattr(decoder, "model", None)  # e.g. Llama 4: get_decoder() returns the CausalLM itself
        if inner is None:
            raise ModelError(f"cannot find the decoder of {type(model).__name__} (get_decoder() returns a model "
                             "with an output layer)")
        decoder = inner
    return decoder


def packed_forward(model, batch, use_cache: bool = False) -> torch.Tensor:
    """Final hidden states [1, T, H] of a packed batch, via the model's decoder (no logits)."""
    impl = model.config._attn_implementation
    if impl not in PACKED_SAFE:
        raise ModelError(
            f"attention implementation '{impl}' would let packed examples attend to each other",
            hint="call leansft.core.model.attention.use_packed_attention(model, choose_backend(device)) first",
        )
    if use_cache:
        raise ModelError("use_cache=True bypasses packed-sequence handling; packed forwards run without a cache")
    remember_segment_sizes(batch.segment_sizes)
    out = decoder_of(model)(
        input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
        cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens,
        max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen,
    )
    return out.last_hidden_state
