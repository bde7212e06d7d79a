"""GPU throughput: a Qwen2.5-0.5B-shaped random model on 16k-token packed micro-batches in bf16.

Prints real tokens/s, peak memory and MFU for leansft's packed path (varlen attention, chunked loss,
fused AdamW), and the same model on padded batches of the same data for the ratio.

    python benchmarks/bench_gpu.py [--steps 20] [--tokens 16384]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import transformers as tf

from leansft.core.attention import choose_backend, use_packed_attention
from leansft.core.collate import collate_padded, collate_rows, micro_batches
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.flops import attended_squares, device_peak_flops, flop_params, step_flops
from leansft.core.forward import LossModule
from leansft.core.packing import bfd, padded
from leansft.tools.stats import lognormal_lengths


def synthetic(n: int, vocab: int) -> TokenizedDataset:
    lengths = lognormal_lengths(n, 450, 0.9, 4096, seed=0)
    off = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.random.default_rng(0).integers(0, vocab, off[-1]).astype(np.int32)
    return TokenizedDataset.from_arrays(ids, ids.copy(), off)


def run(model, batches, steps, device, params, peak) -> dict:
    module = LossModule(model, chunk_size=4096)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    cfg = model.config
    for b in batches[:2]:  # warm-up
        with torch.autocast("cuda", dtype=torch.bfloat16):
            (module(b.to(device)) / max(b.target_tokens, 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    tokens, flops = 0, 0.0
    t0 = time.perf_counter()
    for b in batches[2 : 2 + steps]:
        b = b.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            (module(b) / max(b.target_tokens, 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += b.real_tokens
        flops += step_flops(params[0], cfg.num_hidden_layers, cfg.hidden_size, b.real_tokens, attended_squares(b),
                            params[1], b.target_tokens)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"tok_s": tokens / dt, "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
            "mfu": (flops / dt) / peak if peak else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    device = torch.device("cuda")
    cfg = tf.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device).train()
    params = flop_params(model)
    peak = device_peak_flops(device, None)
    data = synthetic(6000, cfg.vocab_size)
    backend = choose_backend(device)
    use_packed_attention(model, backend)
    plan = bfd(data.lengths, 4096)
    packed = [collate_rows(data, plan, g) for g in micro_batches(plan, args.tokens)][: args.steps + 2]
    res = {"packed": run(model, packed, args.steps, device, params, peak)}
    use_packed_attention(model, "sdpa")
    per = max(1, args.tokens // 4096)
    pplan = padded(data.lengths, 4096, per, seed=0)
    pad = [collate_padded(data, pplan.row(i)[0], 0) for i in range(args.steps + 2)]
    res["padded"] = run(model, pad, args.steps, device, params, peak)
    print(f"{torch.cuda.get_device_name()} | Qwen2.5-0.5B shape, bf16 autocast, {args.tokens}-token micro-batches, "
          f"attention {backend}")
    print(f"{'':8s} {'real tok/s':>12s} {'peak GB':>8s} {'MFU':>7s}")
    for k, r in res.items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(f"{k:8s} {r['tok_s']:12,.0f} {r['peak_gb']:8.1f} {mfu:>7s}")
    print(f"packed/padded real tokens/s: {res['packed']['tok_s'] / res['padded']['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
