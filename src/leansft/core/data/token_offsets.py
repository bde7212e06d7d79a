"""Token offsets of ASCII text without the tokenizer's offset tracking.

``encode_batch`` tracks every token's character offsets and builds its string; ``encode_batch_fast`` does
neither and is a fifth faster (Qwen2.5, 2-turn chats). For a byte-level BPE tokenizer (GPT-2's ``ByteLevel``:
each character of a vocabulary token stands for one byte of the text) on ASCII text, where one character is
one byte, the tokens partition the text and each token's length is its own, so a token's offsets are the running
sum of the lengths before it. ``TokenLengths`` holds those lengths where that is so: a BPE model with a ``ByteLevel``
pre-tokenizer that prepends no space, a normaliser that leaves ASCII as it is, no post-processor that trims
offsets, and the offsets so found equal to the tokenizer's own on probes. Each text's lengths must also add up to
the text's own (``ends``); a text whose do not, and any non-ASCII text, goes through ``encode_batch``.
"""

from __future__ import annotations

import json

import numpy as np

# normalisers that leave ASCII text as it is (unicode normal forms only touch non-ASCII characters)
_ASCII_SAFE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}
CHECKED = 2  # texts of an encoder's first batch the offsets are checked on too (its special tokens among them)
PROBES = ("Hello world", "  two  spaces\n\nand\ttabs ", "x", "1234567 89.5%", "a-b_c/d\\e 'quoted' \"q\"",
          "line\r\nbreak", "   ", "\n", "MiXeD CaSe wordswordswords", "{\"json\": [1, 2]}")


def _state(component) -> dict:
    return json.loads(component.__getstate__()) if component is not None else {}


def _parts(state: dict, key: str) -> list[dict]:
    """A component and, for a ``Sequence``, the ones it holds."""
    return [state, *(p for sub in state.get(key, []) for p in _parts(sub, key))] if state else []


def _byte_level(backend) -> bool:
    model = _state(backend.model)
    if model.get("type") != "BPE" or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return False
    norms = [n["type"] for n in _parts(_state(backend.normalizer), "normalizers")]
    if any(t != "Sequence" and t not in _ASCII_SAFE_NORMALIZERS for t in norms):
        return False
    pres = _parts(_state(backend.pre_tokenizer), "pretokenizers")
    levels = [p for p in pres if p.get("type") == "ByteLevel"]
    if not levels or any(p.get("add_prefix_space") for p in levels):
        return False
    posts = _parts(_state(backend.post_processor), "processors")
    return not any(p.get("trim_offsets") for p in posts)


class TokenLengths:
    """Each token's length in ASCII text, for a tokenizer where offsets follow from it (else ``lengths`` is None;
    also for ``backend=None``: offsets always from the tokenizer)."""

    def __init__(self, backend=None) -> None:
        self.lengths: np.ndarray | None = None
        if backend is None or not _byte_level(backend):
            return
        vocab = backend.get_vocab(with_added_tokens=True)
        lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
        lengths[np.fromiter(vocab.values(), np.int64, len(vocab))] = np.fromiter(map(len, vocab), np.int64, len(vocab))
        self.lengths = lengths
        if not self.agree(backend, list(PROBES)):
            self.lengths = None

    def ends(self, ids: np.ndarray, text: str) -> np.ndarray | None:
        """Where each token of ASCII ``text`` ends, or None where the lengths do not add up to the text's."""
        ends = np.cumsum(self.lengths[ids])
        return ends if (ends[-1] if len(ends) else 0) == len(text) else None

    def agree(self, backend, texts: list[str]) -> bool:
        """Whether the offsets found from the lengths are the tokenizer's own on ``texts`` (ASCII)."""
        for text, enc in zip(texts, backend.encode_batch(texts, add_special_tokens=False)):
            ids = np.array(enc.ids, dtype=np.int64)
            if len(ids) and (ids.max() >= len(self.lengths) or ids.min() < 0):
                return False
            ends = self.ends(ids, text)
            if ends is None or [tuple(o) for o in enc.offsets] != list(zip([0, *ends[:-1].tolist()], ends.tolist())):
                return False
        return True
