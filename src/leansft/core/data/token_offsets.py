"""Token offsets without the tokenizer's offset tracking.

``encode_batch`` tracks every token's character offsets and builds its string; ``encode_batch_fast`` does
neither and is a fifth faster (Qwen2.5, 2-turn chats). In a byte-level BPE tokenizer (GPT-2's ``ByteLevel``: each
character of a vocabulary token stands for one byte of the text) the tokens partition the text's UTF-8 bytes, and
each token's byte length is its own, so where the tokenizer's normaliser leaves the text as it is, a token's offsets
follow from the running sum of the lengths before it: in ASCII text they are its character offsets; elsewhere the
tokenizer gives a token the characters its bytes fall in (a character split across two tokens belongs to both).

``TokenLengths`` holds those lengths where that is so: a BPE model with a ``ByteLevel`` pre-tokenizer that prepends
no space, no normaliser but Unicode normal forms (the text must already be in them), no post-processor that trims
offsets, and the offsets so found equal to the tokenizer's own on probes. Each text's lengths must also add up to
the text's own (``offsets``); a text whose do not goes through ``encode_batch``.
"""

from __future__ import annotations

import json
import unicodedata

import numpy as np

_NORMAL_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}  # normalisers that leave a text already in their form as it is
CHECKED = 2  # texts of an encoder's first batch the offsets are checked on too (its special tokens among them)
PROBES = ("Hello world", "  two  spaces\n\nand\ttabs ", "x", "1234567 89.5%", "a-b_c/d\\e 'quoted' \"q\"",
          "line\r\nbreak", "   ", "\n", "MiXeD CaSe wordswordswords", "{\"json\": [1, 2]}",
          "Héllo wörld, 你好 🙂 👍🏽 ’quotes’ — dash", " 日本語のテキスト", "ß ﬁ € Ā 한국어 ř\u200b")


def _state(component) -> dict:
    return json.loads(component.__getstate__()) if component is not None else {}


def _parts(state: dict, key: str) -> list[dict]:
    """A component and, for a ``Sequence``, the ones it holds."""
    return [state, *(p for sub in state.get(key, []) for p in _parts(sub, key))] if state else []


def _normal_forms(backend) -> list[str] | None:
    """The Unicode normal forms the tokenizer's normaliser applies, or None where it does anything else (or where
    the tokenizer is not byte-level BPE, or pads, or trims offsets)."""
    model = backend.model  # read by attribute: its state is the whole vocabulary
    if type(model).__name__ != "BPE" or model.continuing_subword_prefix or model.end_of_word_suffix:
        return None
    forms = [n["type"] for n in _parts(_state(backend.normalizer), "normalizers") if n["type"] != "Sequence"]
    if any(f not in _NORMAL_FORMS for f in forms):
        return None
    levels = [p for p in _parts(_state(backend.pre_tokenizer), "pretokenizers") if p.get("type") == "ByteLevel"]
    if not levels or any(p.get("add_prefix_space") for p in levels):
        return None
    if any(p.get("trim_offsets") for p in _parts(_state(backend.post_processor), "processors")):
        return None
    return forms


def as_pairs(offsets: np.ndarray) -> np.ndarray:
    """[n, 2] start and end characters, from either form ``TokenLengths.offsets`` returns."""
    if offsets.ndim == 2:
        return offsets
    return np.stack([np.concatenate(([0], offsets[:-1])), offsets], axis=1) if len(offsets) else np.zeros((0, 2), int)


class TokenLengths:
    """Each token's length in bytes, for a tokenizer whose offsets follow from it (else ``lengths`` is None;
    also for ``backend=None``: offsets always from the tokenizer)."""

    def __init__(self, backend=None) -> None:
        self.lengths: np.ndarray | None = None
        forms = _normal_forms(backend) if backend is not None else None
        if forms is None:
            return
        self._forms = forms
        vocab = backend.get_vocab(with_added_tokens=True)  # a byte-level token's characters are its bytes
        lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
        lengths[np.fromiter(vocab.values(), np.int64, len(vocab))] = np.fromiter(map(len, vocab), np.int64, len(vocab))
        for i, token in backend.get_added_tokens_decoder().items():  # matched on the text itself
            lengths[i] = len(token.content.encode())
        lengths[lengths == 0] = -(1 << 40)  # a token of no text: no text's lengths add up with it
        self.lengths = lengths
        if not self.agree(backend, list(PROBES)):
            self.lengths = None

    def offsets(self, ids: np.ndarray, text: str) -> np.ndarray | None:
        """The tokens' offsets in ``text``: for ASCII text where each ends ([n]; they partition it), else [n, 2]
        start and end characters; None where the text is not in the normaliser's forms or the lengths do not add
        up to its own."""
        ends = np.cumsum(self.lengths[ids])
        if text.isascii():
            return ends if (ends[-1] if len(ends) else 0) == len(text) else None
        raw = text.encode()
        if ends[-1] != len(raw) or not all(unicodedata.is_normalized(f, text) for f in self._forms):
            return None
        first = np.cumsum((np.frombuffer(raw, np.uint8) & 0xC0) != 0x80) - 1  # the character each byte is of
        return np.stack([first[np.concatenate(([0], ends[:-1]))], first[ends - 1] + 1], axis=1)

    def agree(self, backend, texts: list[str]) -> bool:
        """Whether the offsets found from the lengths are the tokenizer's own on ``texts``."""
        for text, enc in zip(texts, backend.encode_batch(texts, add_special_tokens=False)):
            ids = np.array(enc.ids, dtype=np.int64)
            if len(ids) and (ids.max() >= len(self.lengths) or ids.min() < 0):
                return False
            found = self.offsets(ids, text)
            if found is None:
                if all(unicodedata.is_normalized(f, text) for f in self._forms):
                    return False  # a text in normal form whose lengths do not add up: not a tokenizer for this
                continue
            if [tuple(o) for o in enc.offsets] != [tuple(p) for p in as_pairs(found).tolist()]:
                return False
        return True
