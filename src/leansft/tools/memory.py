"""Peak-memory estimate of one training micro-batch, by part, from a model config alone.

The model is described by its transformers config (hidden size, layers, heads, vocab, MLP width).
Numbers are bytes. It is an estimate: allocator slack and framework buffers are not included.

It describes what ``leansft train`` runs: every weight in fp32 (but QLoRA's 4-bit linear layers, and LoRA's
frozen linear layers under bf16, stored in bf16: ``core/model/bf16_base.py``), and ``precision: bf16`` as autocast, so
fp32 gradients and AdamW moments with no master copy, plus the bf16 copies autocast makes of fp32 weights
(``weight_casts``) and the fp32 residual stream between layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from leansft.core.config import Method


def vision_tower_params(config) -> int:
    """Parameters of a vision model's tower and projector, counted on a model built on the meta device (no memory);
    0 for a text model. (An unsupported architecture is refused here as everywhere.)"""
    if getattr(config, "vision_config", None) is None:
        return 0
    import torch
    from transformers import AutoModelForImageTextToText

    from leansft.core.data.vision.family import vision_family

    family = vision_family(config)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for name, p in model.named_parameters() if family.part(name) != "language")


@dataclass
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    vision_params: int = 0  # a vision model's tower and projector (frozen by default: weights only)

    @classmethod
    def from_config(cls, config) -> ModelShape:
        cfg = config.get_text_config()  # a vision model: its language model
        heads = cfg.num_attention_heads
        return cls(
            hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            intermediate=getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
            vocab=cfg.vocab_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            vision_params=vision_tower_params(config),
        )

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def linear_params_per_layer(self) -> int:
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        return 2 * h * h + 2 * h * kv + 3 * h * i

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return embed + self.layers * (self.linear_params_per_layer + 2 * self.hidden) + self.hidden

    def lora_params(self, r: int) -> int:
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        per_layer = r * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 3)  # q,o ; k,v ; gate,up,down
        return self.layers * per_layer

    def activation_bytes_per_token_per_layer(self, act_bytes: int) -> int:
        """Tensors a decoder layer keeps for backward, per token (counted with saved-tensor hooks on a Llama
        layer): the two norms' inputs (the residual stream, fp32 under autocast too), then in ``act_bytes``
        the two normed inputs, q/k/v, the attention's output and o_proj's contiguous copy of it, and the MLP's
        gate/up/activation/product."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        return 4 * 2 * h + act_bytes * (5 * h + 2 * kv + 4 * i)


def estimate_memory(
    shape: ModelShape,
    tokens: int,
    *,
    method: Method = "full",
    precision: Literal["bf16", "fp32"] = "bf16",
    gradient_checkpointing: bool = False,
    chunked_loss: bool = True,
    chunk_size: int = 1024,
    lora_r: int = 16,
    bf16_base: bool = True,
    context_parallel: int = 1,
) -> dict:
    """Bytes by part, on one rank, for one micro-batch of ``tokens`` tokens, plus the dominant part. ``precision``
    bf16 is autocast (``training.precision`` bf16/auto on hardware with bf16 units). ``bf16_base``: LoRA under bf16
    holds its frozen linear weights in bf16 (``training.lora.bf16_base``; False where the run keeps them in fp32).
    ``context_parallel``: the row split over that many ranks, each holding its share's activations and logits."""
    full_tokens, tokens = tokens, -(-tokens // context_parallel)
    p = shape.params
    b = 2 if precision == "bf16" else 4  # activations' bytes
    linear = shape.layers * shape.linear_params_per_layer
    trainable = p if method == "full" else shape.lora_params(lora_r)
    weights = p * 4 + (trainable * 4 if method != "full" else 0)  # fp32, adapters apart
    quantised = {}
    if method == "qlora":  # the decoder's linear layers in NF4: 4 bits + an 8-bit constant per 64 weights, whose
        weights -= linear * 4  # own fp32 constants come one per 256 blocks
        quantised = {"weights_4bit": linear // 2, "quantisation_constants": int(linear / 64 + linear / 64 / 256 * 4)}
    casts = 0
    if precision == "bf16" and method == "full":  # autocast caches a trainable weight's cast for the whole step
        casts = 2 * (linear + shape.vocab * shape.hidden)
    elif precision == "bf16" and method == "lora" and bf16_base:  # stored as the bf16 values autocast would cast
        weights -= linear * 2
    elif precision == "bf16" and method == "lora":  # a frozen layer's cast is kept for its input gradient
        casts = 2 * (shape.linear_params_per_layer if gradient_checkpointing else linear)
    grads = trainable * 4
    optimizer = trainable * 8  # AdamW: two fp32 moments
    per_layer = shape.activation_bytes_per_token_per_layer(b)
    # under checkpointing: each layer's input (the fp32 residual stream), and one layer's inside at a time
    with_checkpointing = tokens * (shape.layers * shape.hidden * 4 + per_layer)
    without_checkpointing = tokens * shape.layers * per_layer
    activations = with_checkpointing if gradient_checkpointing else without_checkpointing
    logits_bf16 = tokens * shape.vocab * 2
    logits_fp32 = tokens * shape.vocab * 4
    # chunked: one chunk's fp32 logits and their gradient live at once; a model's own loss keeps the logits, an
    # fp32 log-softmax and, in backward, its gradient
    full_logits = tokens * shape.vocab * (b + 8)
    chunked_logits = min(tokens, chunk_size) * shape.vocab * 4 * 2
    logits = chunked_logits if chunked_loss else full_logits
    parts = {"weights": weights, **quantised, "weight_casts": casts, "gradients": grads, "optimizer": optimizer,
             "activations": activations, "logits": logits}
    if shape.vision_params:
        parts["vision_tower"] = shape.vision_params * 4  # fp32 weights, frozen (its activations are not kept)
    return {
        "params": p,
        "trainable_params": trainable,
        "tokens": full_tokens,
        "context_parallel": context_parallel,
        "parts": parts,
        "total": sum(parts.values()),
        "dominant": max(parts, key=parts.get),
        "activations_with_checkpointing": with_checkpointing,
        "activations_without_checkpointing": without_checkpointing,
        "logits_full_loss": full_logits,  # what a model's own (unchunked) loss holds, for comparison
        "logits_full_bf16": logits_bf16,
        "logits_full_fp32": logits_fp32,
        "logits_chunked": chunked_logits,
    }


def recommend_context_parallel(shape: ModelShape, tokens: int, budget: int, **kw) -> int | None:
    """The smallest context-parallel size (a power of two the attention heads divide, as the split needs) whose
    per-rank estimate fits in ``budget`` bytes; 1 where the row fits whole, None where no size does."""
    n = 1
    while shape.heads % n == 0:
        if estimate_memory(shape, tokens, context_parallel=n, **kw)["total"] <= budget:
            return n
        n *= 2
    return None

