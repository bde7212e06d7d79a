"""Real tokens/s of one training step (forward + backward) on the same tiny model and lognormal data:
padded batches vs. transformers' own sdpa packed path (position_ids only) vs. leansft's varlen path.

    .venv/bin/python benchmarks/bench_attention.py [--examples 256] [--steps 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import transformers as tf

from leansft.core.batching.collate import collate_padded, collate_rows
from leansft.core.batching.packing import bfd, micro_batches, padded
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.model.attention import VARLEN, packed_forward, use_packed_attention
from leansft.core.model.loss import chunked_loss
from leansft.tools.stats import lognormal_lengths


def synthetic(n: int, seed: int = 0) -> TokenizedDataset:
    lengths = lognormal_lengths(n, 200, 0.8, 1024, seed)
    rng = np.random.default_rng(seed)
    off = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(0, 4096, off[-1]).astype(np.int32)
    return TokenizedDataset.from_arrays(ids, ids.copy(), off)


def model():
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=4096, max_position_embeddings=2048)
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()


def timed(fn, batches) -> tuple[float, int]:
    fn(batches[0])  # warm-up
    t0, tokens = time.perf_counter(), 0
    for b in batches:
        tokens += fn(b)
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=256)
    ap.add_argument("--tokens-per-micro-batch", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = synthetic(args.examples)
    m = model()
    w = m.get_output_embeddings().weight
    plan = bfd(data.lengths, 1024)
    packed = [collate_rows(data, plan, g) for g in micro_batches(plan, args.tokens_per_micro_batch)]
    per_batch = max(1, args.tokens_per_micro_batch // int(np.percentile(data.lengths, 99)))
    pplan = padded(data.lengths, 1024, per_batch, seed=0)
    pad = [collate_padded(data, pplan.row(i)[0], 0) for i in range(pplan.num_rows)]

    def step_padded(b):
        out = m.model(input_ids=b.input_ids, attention_mask=b.attention_mask)
        loss, _ = chunked_loss(out.last_hidden_state, w, b.labels.masked_fill(b.attention_mask == 0, -100))
        loss.backward()
        return b.real_tokens

    def step_hf_packed(b):
        m.config._attn_implementation = "sdpa"
        out = m.model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False)
        loss, _ = chunked_loss(out.last_hidden_state, w, b.labels)
        loss.backward()
        return b.real_tokens

    def step_varlen(b):
        use_packed_attention(m, VARLEN)
        loss, _ = chunked_loss(packed_forward(m, b), w, b.labels)
        loss.backward()
        return b.real_tokens

    rows = [("padded (sdpa, attention mask)", step_padded, pad),
            ("transformers sdpa packed (position_ids)", step_hf_packed, packed),
            ("leansft varlen (per-example sdpa)", step_varlen, packed)]
    results = {}
    print(f"{args.examples} examples, {int(data.lengths.sum()):,} real tokens; tiny Qwen2 (4 layers, 256 wide), CPU fp32")
    for name, fn, batches in rows:
        dt, tokens = timed(fn, batches)
        results[name] = tokens / dt
        print(f"{name:42s} {tokens / dt:10,.0f} real tokens/s")
    base = results[rows[0][0]]
    for name, _, _ in rows[1:]:
        print(f"ratio {name} / padded: {results[name] / base:.2f}")
    print(f"ratio varlen / transformers packed: {results[rows[2][0]] / results[rows[1][0]]:.2f}")


if __name__ == "__main__":
    main()
