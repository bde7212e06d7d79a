"""Before step 1, on the real model: does the path the run relies on match the plain Hugging Face model?

Two short segments of real tokens go through the very forward the run will use (packed: one flat
sequence with boundaries; padded: right-padded rows with an attention mask) and through the plain
model alone, one segment at a time, with its own attention implementation. Checked:

- logits: each segment's logits in the run's forward equal its logits alone (a packed segment that
  sees the other one, through attention that ignores the boundaries or a convolution/state that
  carries over, fails here);
- loss: the chunked loss (output layer as the model applies it) equals the model's own loss;
- far in the row: the first segment again at the end of a packed micro-batch of ``row_tokens`` tokens,
  the furthest any example sits in a row (Llama 4 scales the queries of its layers without rotary
  embeddings by the token's index in the row, not its ``position_ids``: beyond 8,192 tokens a packed
  example would differ from itself alone, which two short segments at the start never show).

The check costs one forward per segment and path, in fp32 without autocast (bf16 autocast for kernels
that only compute in bf16, and for a base held in bf16 (``core/model/bf16_base.py``), with tolerances to match),
and runs in eval mode.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from leansft.core.batching.collate import PackedBatch, PaddedBatch
from leansft.core.config import PACKED_STRATEGIES
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.data.masking import IGNORE_INDEX
from leansft.core.data.vision.family import trains_images, vision_family
from leansft.core.errors import ModelError
from leansft.core.model.as_shipped import as_shipped
from leansft.core.model.attention import HALF_ONLY, PACKED_SAFE, plain_attention
from leansft.core.model.bf16_base import holds_bf16_base
from leansft.core.model.compile import eager
from leansft.core.model.forward import hidden_states, loss_of
from leansft.core.model.head import OutputHead, read_output_head
from leansft.core.model.loss import PLAIN, HeadPrecision

log = logging.getLogger("leansft")

SEGMENTS = (24, 16)  # tokens of the two probe segments
LOGIT_TOL = 1e-4  # relative to the largest reference logit (fp32)
LOSS_TOL = 1e-4  # relative
# Kernels that compute only in bf16 (flash-attn, torch's varlen) are checked under bf16 autocast against the
# fp32 reference: bf16 rounding stays well inside these, while a segment that sees another is off by O(1).
HALF_LOGIT_TOL, HALF_LOSS_TOL = 5e-2, 1e-2


@dataclass
class PathCheck:
    path: str  # "packed" | "padded"
    logits_ok: bool
    loss_ok: bool
    reason: str = ""
    numbers: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.logits_ok and self.loss_ok


@dataclass
class Verification:
    architecture: str
    head: OutputHead
    checks: dict[str, PathCheck] = field(default_factory=dict)

    def ok(self, path: str) -> bool:
        return self.head.exact and path in self.checks and self.checks[path].ok

    def summary(self) -> str:
        parts = [f"{c.path}: {'exact' if c.ok else 'FAILS'} ({_numbers(c)}{'; ' + c.reason if c.reason else ''})"
                 for c in self.checks.values()]
        if not self.head.exact:
            parts.append(f"output layer: {self.head.reason}")
        return f"{self.architecture}: " + "; ".join(parts)


def _numbers(c: PathCheck) -> str:
    return ", ".join(f"{k} {v:.1e}" for k, v in c.numbers.items()) or "no numbers"


def architecture(model) -> str:
    cfg = getattr(model, "config", None)
    return f"{type(model).__name__} ({getattr(cfg, 'model_type', '?')})"


def probe_segments(data: TokenizedDataset | None, vocab_size: int) -> list[np.ndarray]:
    """Two short segments of real tokens (the first two examples, cut), or fixed ids without data."""
    out = []
    for i, n in enumerate(SEGMENTS):
        if data is not None and len(data) > 0:
            ids = np.asarray(data.example(i % len(data))[0][:n], dtype=np.int64)
            if len(ids) >= 2:
                out.append(ids)
                continue
        out.append((np.arange(n, dtype=np.int64) * 7 + 3 * i + 1) % vocab_size)
    return out


def check_vocabulary(model, data: TokenizedDataset) -> None:
    """Every token id of the data has a row in the model's embedding, or a clear error."""
    rows = model.get_input_embeddings().weight.shape[0]
    top = data.max_token_id
    if top >= rows:
        raise ModelError(
            f"the data has token id {top} but the model's embedding has {rows} rows: the tokenizer does not "
            "belong to this model", hint="use the model's own tokenizer (drop `tokenizer:`), or resize the "
            "model's embeddings to the tokenizer first")


# names of learned absolute position tables (GPT-2, GPT-Neo and GPT-BigCode ``wpe``, OPT and BioGPT
# ``embed_positions``, GPT-1 ``positions_embed``)
_POSITION_TABLES = ("wpe", "embed_positions", "positions_embed", "position_embeddings", "position_embedding")
# fixed tables precomputed once as buffers (CTRL's sinusoidal ``pos_encoding``, GPT-J's and CodeGen's rotary
# ``embed_positions``), one row a position
_POSITION_BUFFERS = ("pos_encoding", "embed_positions")


def position_capacity(model) -> int | None:
    """How many positions a model with a fixed-size position table (learned, or precomputed for n_positions)
    can embed; None for rotary, ALiBi or sinusoidal positions computed for any length. A vision tower's table
    (its patches') is not the text's."""
    config = getattr(model, "config", None)
    family = vision_family(config) if config is not None and trains_images(config) else None
    text = (lambda name: family.part(name) == "language") if family is not None else (lambda name: True)
    sizes = [m.num_embeddings - int(getattr(m, "offset", 0)) for name, m in model.named_modules()
             if isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES and text(name)]
    sizes += [b.shape[0] for name, b in model.named_buffers()
              if name.rsplit(".", 1)[-1] in _POSITION_BUFFERS and b.dim() == 2 and text(name)]
    return min(sizes) if sizes else None


def check_position_table(model, longest: int) -> None:
    """Examples of ``longest`` tokens fit the model's learned position table, or a clear error before step 1
    (past the table, the embedding lookup fails mid-run: an IndexError on the CPU, a device assert on CUDA)."""
    capacity = position_capacity(model)
    if capacity is not None and longest > capacity:
        raise ModelError(f"the data has examples of {longest} tokens but {architecture(model)} has position "
                         f"embeddings for {capacity} positions only", hint=f"set data.max_length to {capacity} or less")
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if capacity is None and isinstance(context, int) and longest > context:  # runs, as the plain model would
        log.warning("the data has examples of %d tokens, longer than %s's context of %d positions "
                    "(max_position_embeddings): positions past it were never pretrained; set data.max_length to "
                    "%d to stay within, or extend the context (rope scaling) on purpose", longest,
                    architecture(model), context, context)


@torch.no_grad()
def _reference(model, segments: list[np.ndarray], device) -> list[tuple[torch.Tensor, float]]:
    """(logits, summed loss) of each segment alone through the plain model and its own loss."""
    out = []
    with plain_attention(model), eager(), as_shipped():  # the plain model: compiled/fused layers run as shipped
        for seg in segments:
            ids = torch.as_tensor(seg, device=device)[None]
            res = model(input_ids=ids, labels=ids, use_cache=False)
            out.append((res.logits[0].float(), float(res.loss) * (len(seg) - 1)))
    return out


def _packed_batch(segments: list[np.ndarray], device) -> PackedBatch:
    lens = [len(s) for s in segments]
    cu = np.concatenate([[0], np.cumsum(lens)])
    ids = torch.as_tensor(np.concatenate(segments))[None]
    labels = ids.clone()
    labels[0, cu[:-1]] = IGNORE_INDEX
    pos = torch.as_tensor(np.concatenate([np.arange(n) for n in lens]))[None]
    return PackedBatch(ids, labels, pos, torch.as_tensor(cu, dtype=torch.int32), max(lens),
                       np.arange(len(lens)), np.zeros(len(lens), np.int64)).to(device)


def _padded_batch(segments: list[np.ndarray], pad: int, device) -> PaddedBatch:
    width = max(len(s) for s in segments)
    ids = torch.full((len(segments), width), pad, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(segments):
        ids[r, : len(s)] = torch.as_tensor(s)
        labels[r, 1 : len(s)] = torch.as_tensor(s[1:])
        mask[r, : len(s)] = 1
    pos = torch.arange(width)[None].expand(len(segments), -1).clone()
    return PaddedBatch(ids, labels, mask, pos, np.arange(len(segments))).to(device)


@torch.no_grad()
def _check(path: str, model, refs, batch, rows_of, logit_tol: float = LOGIT_TOL,
           loss_tol: float = LOSS_TOL, precision: HeadPrecision = PLAIN) -> PathCheck:
    head = read_output_head(model)
    try:
        hidden = hidden_states(model, batch)
        loss = float(loss_of(model, batch, hidden, chunk_size=64, precision=precision)[0])
    except Exception as err:  # noqa: BLE001 - any failure of the run's path is a failed check, with its reason
        return PathCheck(path, False, False, f"{type(err).__name__}: {str(err)[:200]}")
    logit_diff, scale = 0.0, 1.0
    for (ref_logits, _), rows in zip(refs, rows_of(hidden)):
        ours = head.logits(model, rows)
        logit_diff = max(logit_diff, float((ours - ref_logits).abs().max()))
        scale = max(scale, float(ref_logits.abs().max()))
    ref_loss = sum(r[1] for r in refs)
    loss_diff = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
    numbers = {"max_logit_diff": logit_diff / scale, "loss_rel_diff": loss_diff}
    logits_ok, loss_ok = logit_diff <= logit_tol * scale, loss_diff <= loss_tol
    reasons = [] if logits_ok else ["logits differ from the model run on each example alone"
                                    + (" (examples see each other)" if path == "packed" else "")]
    if not loss_ok:
        reasons.append("the loss differs from the model's own loss" + (
            ", which adds the router's load-balancing loss (config.json output_router_logits: true; leansft trains "
            "the language-model loss only: set it false to train this model)"
            if getattr(model.config, "output_router_logits", False) else ""))
    return PathCheck(path, logits_ok, loss_ok, "; ".join(reasons), numbers)


@torch.no_grad()
def _check_far(model, segments: list[np.ndarray], ref_logits: torch.Tensor, row_tokens: int, max_length: int,
               check: PathCheck, tol: float) -> None:
    """The first segment after filler examples, ending at the last token of a full micro-batch: its logits must
    still be its logits alone (``check`` fails with the reason otherwise)."""
    first = segments[0]
    filler = np.resize(np.concatenate(segments), row_tokens - len(first))
    pieces = np.split(filler, range(max_length, len(filler), max_length))  # examples of at most max_length tokens
    device = ref_logits.device
    try:
        hidden = hidden_states(model, _packed_batch([*pieces, first], device))
        ours = read_output_head(model).logits(model, hidden[0, len(filler):])
    except Exception as err:  # noqa: BLE001 - as in _check: a failure of the run's path is a failed check
        check.logits_ok = False
        check.reason = f"a full micro-batch of {row_tokens} tokens fails: {type(err).__name__}: {str(err)[:200]}"
        return
    scale = max(1.0, float(ref_logits.abs().max()))
    diff = float((ours - ref_logits).abs().max()) / scale
    check.numbers["far_logit_diff"] = diff
    if diff > tol:
        check.logits_ok = False
        check.reason = (f"a segment ending at token {row_tokens} of a packed micro-batch differs from it alone: the "
                        "model reads the token's index in the row, not its position_ids")


def verify_model(model, segments: list[np.ndarray], paths: tuple[str, ...] = ("packed", "padded"),
                 pad_id: int = 0, row_tokens: int = 0, max_length: int | None = None,
                 precision: HeadPrecision = PLAIN) -> Verification:
    """Check each of ``paths`` against the plain model (see the module docstring). ``packed`` needs the
    model's attention set to a packed backend (``use_packed_attention``); ``row_tokens``: the packed
    micro-batch size (the far-in-the-row check runs where it exceeds the two segments), filled with examples of
    at most ``max_length`` tokens (default: ``row_tokens``); ``precision``: the run's head policy (its loss is
    checked with it; bf16 products with the bf16 tolerances)."""
    device = next(model.parameters()).device
    low_base = holds_bf16_base(model)  # bf16 linear weights: every forward under bf16 autocast, as the run's
    low_head = precision.matmul_dtype is not None or precision.grad_dtype is not None
    tols = (HALF_LOGIT_TOL, HALF_LOSS_TOL) if low_base or low_head else ()
    was = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                torch.autocast(device.type, dtype=torch.bfloat16, enabled=low_base):
            head = read_output_head(model)
            result = Verification(architecture(model), head)
            refs = _reference(model, segments, device)
            lens = [len(s) for s in segments]
            starts = np.concatenate([[0], np.cumsum(lens)])
            if "packed" in paths:
                if model.config._attn_implementation not in PACKED_SAFE:
                    result.checks["packed"] = PathCheck("packed", False, False, "no packed attention backend is set")
                else:
                    half = low_base or model.config._attn_implementation in HALF_ONLY
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
                        result.checks["packed"] = _check(
                            "packed", model, refs, _packed_batch(segments, device),
                            lambda h: [h[0, a:b] for a, b in zip(starts[:-1], starts[1:])],
                            *((HALF_LOGIT_TOL, HALF_LOSS_TOL) if half or low_head else (LOGIT_TOL, LOSS_TOL)),
                            precision=precision)
                        if row_tokens > starts[-1] and result.checks["packed"].ok:
                            _check_far(model, segments, refs[0][0], row_tokens, max_length or row_tokens,
                                       result.checks["packed"], HALF_LOGIT_TOL if half else LOGIT_TOL)
            if "padded" in paths:  # the fallback's path, checked eagerly (compiled layers: packed only)
                with plain_attention(model), eager():
                    result.checks["padded"] = _check(
                        "padded", model, refs, _padded_batch(segments, pad_id, device),
                        lambda h: [h[r, :n] for r, n in enumerate(lens)], *(tols or (LOGIT_TOL, LOSS_TOL)),
                        precision=precision)
    finally:
        model.train(was)
    return result


def choose_strategy(v: Verification, strategy: str, policy: str) -> str:
    """The batching strategy to train with: the configured one when its path is exact; ``sorted``
    (unpacked, padded, exact) when the packed path is not and ``policy`` is ``fallback``; else an error
    naming the architecture and what to do."""
    packed = strategy in PACKED_STRATEGIES
    if v.ok("packed" if packed else "padded"):
        return strategy
    if packed and v.ok("padded") and policy == "fallback":
        return "sorted"
    if not v.head.exact:
        hint = "leansft's chunked loss cannot reproduce this model's output layer; this architecture is not supported"
    elif packed and v.ok("padded"):
        hint = "use batching.strategy: sorted (unpacked, exact), or training.verify: fallback to switch automatically"
    else:
        hint = "neither packed nor padded batches match the plain model for this architecture; it is not supported"
    return _refuse(v, "packed" if packed else "padded", hint)


def _refuse(v: Verification, path: str, hint: str):
    raise ModelError(f"{v.architecture} cannot train exactly with {path} batches: {v.summary()}", hint=hint)

