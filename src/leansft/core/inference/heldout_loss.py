"""Held-out loss, perplexity and token accuracy over target tokens, token-weighted, no grad.

Uses the same masking, packing and varlen attention as training; logits are made chunk by chunk. A model
training on padded batches (``sorted``/``padded``, or the fallback for a model that cannot pack) has its
padding-aware attention: it is evaluated on length-sorted padded batches.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch

from leansft.core.batching.collate import collate_padded, collate_rows
from leansft.core.batching.packing import bfd, micro_batches
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.model.attention import PACKED_SAFE
from leansft.core.model.forward import hidden_states
from leansft.core.model.head import read_output_head
from leansft.core.model.loss import select_targets
from leansft.core.progress import track


@torch.no_grad()
def eval_stats(model, hidden, labels, chunk_size: int) -> tuple[float, int, int]:
    """(summed loss, targets, correct argmax predictions) of one batch, the output layer as the model has it."""
    head = read_output_head(model)
    h, t = select_targets(hidden, labels)
    total, correct = 0.0, 0
    for s in range(0, len(t), chunk_size):
        logits = head.logits(model, h[s : s + chunk_size])
        tt = t[s : s + chunk_size]
        total += float(torch.nn.functional.cross_entropy(logits, tt, reduction="sum"))
        correct += int((logits.argmax(-1) == tt).sum())
    return total, int(len(t)), correct


@torch.no_grad()
def evaluate(model, data: TokenizedDataset, max_length: int, tokens_per_micro_batch: int, chunk_size: int = 1024,
             device: torch.device | None = None, autocast_dtype: torch.dtype | None = None,
             sharded_module=None) -> dict:
    """Token-weighted mean loss over all target tokens of ``data`` (packed with varlen attention where the model
    has it, else padded).

    ``sharded_module``: the FSDP-wrapped loss module; its forward gathers the shards, so the loss goes
    through it (every rank takes part) and token accuracy is not computed."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    loss, n, correct = 0.0, 0, 0
    batches = _batches(model, data, max_length, max(tokens_per_micro_batch, max_length))
    try:
        for make in track(batches, len(batches), "eval batches", lambda: f"loss {loss / max(n, 1):.4f}"):
            batch = make().to(device)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                if sharded_module is not None:
                    part, k, c = float(sharded_module(batch)), batch.target_tokens, 0
                else:
                    hidden = hidden_states(model, batch)
            if sharded_module is None:
                part, k, c = eval_stats(model, hidden, batch.labels, chunk_size)
            loss, n, correct = loss + part, n + k, correct + c
    finally:
        model.train(was_training)
    mean = loss / max(n, 1)
    accuracy = None if sharded_module is not None else correct / max(n, 1)
    return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 50)), "eval_token_accuracy": accuracy,
            "eval_targets": n}


def _batches(model, data: TokenizedDataset, max_length: int, budget: int) -> list[Callable[[], object]]:
    """Micro-batches of at most ``budget`` tokens, each made when called: packed rows, or padded ones
    (length-sorted) for a model without a packed attention (any pad id serves: padding is masked out of attention
    and loss). A list, so that progress knows how many."""
    lengths = np.minimum(data.lengths, max_length)
    if model.config._attn_implementation in PACKED_SAFE:
        plan = bfd(lengths, max_length)
        return [functools.partial(collate_rows, data, plan, rows) for rows in micro_batches(plan, budget)]
    groups, group = [], []
    for i in np.argsort(lengths, kind="stable").tolist():  # ascending: the newest example is the widest
        if group and (len(group) + 1) * int(lengths[i]) > budget:
            groups.append(group)
            group = []
        group.append(i)
    if group:
        groups.append(group)
    return [functools.partial(collate_padded, data, np.asarray(g), 0, max_length) for g in groups]
