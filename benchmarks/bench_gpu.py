"""GPU throughput: Qwen2.5-0.5B- and 1.5B-shaped random models, packed micro-batches of 4k and 16k tokens,
bf16, with and without compiled decoder layers.

Prints real tokens/s, peak memory, MFU and the warm-up time (compilation included) for leansft's packed
path (varlen attention as ``attention: auto`` picks it, chunked loss, fused AdamW), and the same model
on padded batches of the same data for the ratio. Full fine-tuning.

    python benchmarks/bench_gpu.py [--steps 10] [--tokens 4096,16384] [--shapes 0.5B,1.5B] [--compile false,true]

``--device cpu --shapes tiny`` runs the same script in miniature on the CPU (a test does), so that a GPU lent
for minutes does not find it broken by a change elsewhere.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import transformers as tf

from leansft.core.batching.collate import collate_padded, collate_rows, micro_batches
from leansft.core.batching.packing import bfd, padded
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.metrics.flops import attended_squares, device_peak_flops, step_flops, token_flops
from leansft.core.model.attention import choose_backend, use_packed_attention
from leansft.core.model.compile import compile_layers
from leansft.core.model.forward import LossModule
from leansft.tools.stats import lognormal_lengths


def synthetic(n: int, vocab: int) -> TokenizedDataset:
    lengths = lognormal_lengths(n, 450, 0.9, 4096, seed=0)
    off = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.random.default_rng(0).integers(0, vocab, off[-1]).astype(np.int32)
    return TokenizedDataset.from_arrays(ids, ids.copy(), off)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(model, batches, steps, device, params, peak) -> dict:
    module = LossModule(model, chunk_size=4096)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    cfg = model.config
    t0 = time.perf_counter()
    for b in batches[:2]:  # warm-up (and compilation, when the layers are compiled)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            (module(b.to(device)) / max(b.target_tokens, 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    warm = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens, flops = 0, 0.0
    t0 = time.perf_counter()
    for b in batches[2 : 2 + steps]:
        b = b.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            (module(b) / max(b.target_tokens, 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += b.real_tokens
        flops += step_flops(params[0], cfg.num_hidden_layers, cfg.hidden_size, b.real_tokens, attended_squares(b),
                            params[1], b.target_tokens)
    sync(device)
    dt = time.perf_counter() - t0
    peak_gb = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else float("nan")
    return {"tok_s": tokens / dt, "peak_gb": peak_gb,
            "mfu": (flops / dt) / peak if peak else float("nan"), "warm_s": warm}


SHAPES = {  # Qwen2.5-0.5B and -1.5B shapes, random weights; tiny: the CPU miniature
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--shapes", default="0.5B,1.5B")
    ap.add_argument("--compile", default="false,true")
    ap.add_argument("--device", default="cuda", help="cpu: the script in miniature (--shapes tiny), no figures")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    assert device.type != "cuda" or torch.cuda.is_available(), "needs a CUDA device"
    peak = device_peak_flops(device, None)
    backend = choose_backend(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name} | bf16 autocast, fused AdamW, chunked loss, packed attention {backend}")
    print("| model | tokens/micro-batch | batches | compile | real tok/s | peak GB | MFU | first 2 steps s |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for shape in args.shapes.split(","):
        cfg = tf.Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, tie_word_embeddings=True)
        data = synthetic(6000, cfg.vocab_size)
        plan = bfd(data.lengths, 4096)
        for comp in args.compile.split(","):
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device).train()
            if comp == "true":
                compile_layers(model)
            use_packed_attention(model, backend)
            params = token_flops(model)
            for n in map(int, args.tokens.split(",")):
                packed = [collate_rows(data, plan, g) for g in micro_batches(plan, n)][: args.steps + 2]
                r = run(model, packed, args.steps, device, params, peak)
                print(f"| {shape} | {n} | packed | {comp} | {r['tok_s']:,.0f} | {r['peak_gb']:.1f} | "
                      f"{r['mfu']:.1%} | {r['warm_s']:.1f} |", flush=True)
            if comp == "false":  # the padded picture once per shape: same data, rows of 4,096, eager
                use_packed_attention(model, "sdpa")
                per = max(1, int(args.tokens.split(",")[-1]) // 4096)
                pplan = padded(data.lengths, 4096, per, seed=0)
                pad = [collate_padded(data, pplan.row(i)[0], 0) for i in range(args.steps + 2)]
                r = run(model, pad, args.steps, device, params, peak)
                print(f"| {shape} | {per * 4096} | padded | false | {r['tok_s']:,.0f} | {r['peak_gb']:.1f} | "
                      f"{r['mfu']:.1%} | {r['warm_s']:.1f} |", flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
