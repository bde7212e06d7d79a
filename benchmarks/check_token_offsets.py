"""Offsets from token lengths (core/data/token_offsets.py) against the tokenizer's own, on random text.

For every tokenizer.json under the test asset cache (``~/.cache/leansft-test-assets``: the real tokenizers the zoo
tests fetch) and any given on the command line: random texts of emoji, CJK, combining accents, curly quotes, runs
of spaces and the tokenizer's own added tokens; each text whose lengths add up must have exactly the offsets
``encode_batch`` gives. Prints, per tokenizer, whether the path is taken, the texts that differ (must be 0) and
those that fall back to the tokenizer's offsets (text its normaliser would change).

    .venv/bin/python benchmarks/check_token_offsets.py [--texts 20000] [path/to/tokenizer.json ...]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from leansft.core.data.token_offsets import TokenLengths, as_pairs

ALPHABET = [*"abc XYZ 123 \n\t.,!?'\"", "é", "ü", "你", "好", "🙂", "👍🏽", "ß", "ﬁ", "e\u0301", "—", "’", "€", "日本",
            "Ā", "\u200b", "한", "ñ", "ř", "  ", "\r\n", "\u00a0", "１２", "Ⅻ"]


def check(path: Path, n: int) -> tuple[bool, int, int]:
    """(path taken, texts whose offsets differ, texts that fall back)."""
    tok = Tokenizer.from_file(str(path))
    lengths = TokenLengths(tok)
    if lengths.lengths is None:
        return False, 0, 0
    rng = random.Random(1)
    alphabet = ALPHABET + [t.content for t in tok.get_added_tokens_decoder().values()][:6]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]
    differ = fallback = 0
    for text, enc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
        found = lengths.offsets(np.array(enc.ids), text)
        if found is None:
            fallback += 1
        elif as_pairs(found).tolist() != [list(o) for o in enc.offsets]:
            differ += 1
    return True, differ, fallback


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", type=int, default=20_000)
    ap.add_argument("paths", nargs="*", type=Path)
    args = ap.parse_args()
    paths = sorted(Path.home().glob(".cache/leansft-test-assets/*/tokenizer.json")) + args.paths
    print("| tokenizer | offsets from lengths | texts that differ | texts that fall back |")
    print("| --- | --- | ---: | ---: |")
    for path in paths:
        taken, differ, fallback = check(path, args.texts)
        print(f"| {path.parent.name} | {'yes' if taken else 'no'} | {differ} | {fallback} of {args.texts:,} |")


if __name__ == "__main__":
    main()
