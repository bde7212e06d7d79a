"""Run under torchrun by tests/test_context_parallel.py: on every context-parallel rank, each tiny model's loss and
gradients from its share of a packed row, summed over the group, against the same row in one process (computed on
each rank too); and the live activation memory of one forward+backward with and without the split. Prints one
JSON line per model on rank 0."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as tdist
import transformers as tf

from leansft.core.batching.collate import PackedBatch
from leansft.core.batching.context_shard import context_shard
from leansft.core.data.masking import IGNORE_INDEX
from leansft.core.metrics.memtrack import TensorMemoryTracker
from leansft.core.model.attention import VARLEN, use_packed_attention
from leansft.core.model.context_parallel import check_supported, use_context_parallel
from leansft.core.model.forward import LossModule

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
MODELS = {
    "llama": lambda: tf.LlamaConfig(**TINY),
    "qwen2": lambda: tf.Qwen2Config(**TINY, tie_word_embeddings=True),
    "gemma3": lambda: tf.Gemma3TextConfig(**{**TINY, "num_key_value_heads": 1}, head_dim=16, sliding_window=8,
                                          layer_types=["sliding_attention", "full_attention"]),
}


def row(lengths: list[int], seed: int = 0) -> PackedBatch:
    """One packed row of examples of these lengths (the first token of each without a label)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(0, 512, (1, total), generator=g)
    labels = ids.clone()
    labels[torch.rand(1, total, generator=g) < 0.3] = IGNORE_INDEX
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    labels[0, cu[:-1].long()] = IGNORE_INDEX
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return PackedBatch(ids, labels, positions, cu, max(lengths), np.arange(len(lengths)), np.zeros(len(lengths)))


def main() -> None:
    tdist.init_process_group("gloo")
    rank, size = tdist.get_rank(), tdist.get_world_size()
    group = tdist.new_group(list(range(size)))
    batch = row([70, 181, 9, 123])  # 383 tokens: examples across share boundaries, padding on the last share
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(make(), dtype=torch.float32)
        use_packed_attention(model, VARLEN)
        module = LossModule(model, chunk_size=64)
        with TensorMemoryTracker(exclude=list(model.parameters())) as whole_mem:  # the activations a forward keeps
            whole = module(batch)
        whole.backward()
        ref = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        check_supported(model, size)
        use_context_parallel(model, group, size, rank)
        share = context_shard(batch, rank, size)
        with TensorMemoryTracker(exclude=list(model.parameters())) as share_mem:
            part = module(share)
        part.backward()
        loss = part.detach().clone()
        tdist.all_reduce(loss)
        grad_diff = 0.0
        for n, p in model.named_parameters():
            g = p.grad.clone()
            tdist.all_reduce(g)
            grad_diff = max(grad_diff, float((g - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)))
        tokens = torch.tensor([share.real_tokens, share.target_tokens])
        tdist.all_reduce(tokens)
        if rank == 0:
            print(json.dumps({"model": name, "loss": float(loss), "whole_loss": float(whole), "grad_rel": grad_diff,
                              "tokens": tokens.tolist(), "whole_tokens": [batch.real_tokens, batch.target_tokens],
                              "peak_share": share_mem.peak, "peak_whole": whole_mem.peak}), flush=True)
    tdist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
