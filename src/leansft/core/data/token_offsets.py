"""Token offsets without the tokenizer's offset tracking.

``encode_batch`` tracks every token's character offsets and builds its string; ``encode_batch_fast`` does
neither and is a fifth faster (Qwen2.5 and Gemma 3, 2-turn chats). In a BPE tokenizer whose tokens stand for fixed
text, the tokens partition the text's UTF-8 bytes and each token's byte length is its own, so where the
normaliser leaves the text's length as it is, a token's offsets follow from the running sum of the lengths before
it: in ASCII text they are its character offsets; elsewhere the tokenizer gives a token the characters its bytes
fall in (a character split across two tokens belongs to both). Two kinds qualify:
- byte-level BPE (GPT-2's ``ByteLevel``: Qwen, Llama 3, DeepSeek, gpt-oss): each character of a token is one byte;
- SentencePiece-style BPE whose normaliser only writes spaces as ``▁`` and prepends nothing (Gemma 3): a token is
  its text with ``▁`` for a space, a byte-fallback token ``<0xNN>`` one byte.

``TokenLengths`` holds those lengths where the tokenizer is one of them, its normaliser does nothing else but
Unicode normal forms (the text must already be in them), no post-processor trims offsets, and the offsets so found
equal the tokenizer's own on probes. No token is given more bytes than it may cover (an added token the model also
makes gets the shorter of its two lengths, the unknown token one byte), so where a text's lengths add up to its own
(``offsets``) each token has its own; a text whose do not goes through ``encode_batch``. Llama 2's and Mistral's
tokenizers (a ``▁`` prepended to the text) are neither kind and keep the tokenizer's offsets.
"""

from __future__ import annotations

import json
import re
import unicodedata

import numpy as np
from tokenizers import pre_tokenizers

_NORMAL_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}  # normalisers that leave a text already in their form as it is
_SPACE = "\u2581"  # SentencePiece's "▁"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token
# GPT-2's byte-level alphabet (one character per byte): a vocabulary string outside it (DeepSeek's special tokens
# sit in its vocabulary as plain text) is never made by the model from bytes
_BYTE_CHARS = frozenset(pre_tokenizers.ByteLevel.alphabet())
_UNSEEN = np.iinfo(np.int64).min  # a vocabulary token's length not looked up yet
_NO_TEXT = -(1 << 40)  # a token of no text (or no token): no text's lengths add up with it
CHECKED = 2  # texts of an encoder's first batch the offsets are checked on too (its special tokens among them)
PROBES = ("Hello world", "  two  spaces\n\nand\ttabs ", "x", "1234567 89.5%", "a-b_c/d\\e 'quoted' \"q\"",
          "line\r\nbreak", "   ", "\n", "MiXeD CaSe wordswordswords", "{\"json\": [1, 2]}",
          "Héllo wörld, 你好 🙂 👍🏽 ’quotes’ — dash", " 日本語のテキスト", "ß ﬁ € Ā 한국어 ř\u200b \x01")


def _state(component) -> dict:
    return json.loads(component.__getstate__()) if component is not None else {}


def _parts(state: dict, key: str) -> list[dict]:
    """A component and, for a ``Sequence``, the ones it holds."""
    return [state, *(p for sub in state.get(key, []) for p in _parts(sub, key))] if state else []


def _kind(backend) -> tuple[str, list[str]] | None:
    """``("bytes" | "spaces", the normal forms the normaliser applies)`` for a tokenizer whose offsets follow from
    its tokens' lengths, else None."""
    model = backend.model  # read by attribute: its state is the whole vocabulary
    if type(model).__name__ != "BPE" or model.continuing_subword_prefix or model.end_of_word_suffix:
        return None
    if any(p.get("trim_offsets") for p in _parts(_state(backend.post_processor), "processors")):
        return None
    norms = [n for n in _parts(_state(backend.normalizer), "normalizers") if n["type"] != "Sequence"]
    spaces = [n for n in norms if n == {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}]
    forms = [n["type"] for n in norms if n not in spaces]
    if any(f not in _NORMAL_FORMS for f in forms):
        return None
    pres = _parts(_state(backend.pre_tokenizer), "pretokenizers")
    levels = [p for p in pres if p.get("type") == "ByteLevel"]
    if levels and not spaces:
        return None if any(p.get("add_prefix_space") for p in levels) else ("bytes", forms)
    kept = all(p["type"] == "Sequence" or (p["type"] == "Split" and p.get("behavior") != "Removed") for p in pres)
    whole = model.token_to_id(_SPACE) is not None  # a space is never three fallback bytes of its "▁"
    return ("spaces", forms) if spaces and kept and whole and len(spaces) == 1 else None


class TokenLengths:
    """Each token's length in bytes, for a tokenizer whose offsets follow from it (else ``lengths`` is None;
    also for ``backend=None``: offsets always from the tokenizer). The added tokens' lengths are found at once, a
    vocabulary token's the first time a text holds it: a run meets a few thousand of a vocabulary's 150-260k
    tokens, and reading the whole vocabulary (``get_vocab``) took 0.1-0.25 s of CPU an encoder."""

    def __init__(self, backend=None) -> None:
        self.lengths: np.ndarray | None = None
        kind = _kind(backend) if backend is not None else None
        if kind is None:
            return
        self._forms = kind[1]
        self._model = backend.model
        self._fallback = backend.model.byte_fallback
        self._token_size = self._size if kind[0] == "spaces" else len  # a byte-level token's characters are its bytes
        added = backend.get_added_tokens_decoder()
        size = max(backend.get_vocab_size(with_added_tokens=False), max(added, default=-1) + 1)
        lengths = np.full(size, _UNSEEN, np.int64)
        for i, token in added.items():
            # matched on the text (or the normalised text), or made by the model from its vocabulary: the shorter,
            # so that no token is ever given more text than it covers (a text whose lengths add up then has each
            # token's own: one given less would leave the sum short)
            text = token.content.replace(_SPACE, " ") if token.normalized and kind[0] == "spaces" else token.content
            own = backend.model.id_to_token(i)
            made = own is not None and (kind[0] == "spaces" or set(own) <= _BYTE_CHARS)
            lengths[i] = min(len(text.encode()), self._token_size(own) if made else 1 << 40) or _NO_TEXT
        unknown = backend.model.unk_token
        if unknown and backend.model.token_to_id(unknown) is not None:  # stands for a character or more
            lengths[backend.model.token_to_id(unknown)] = 1
        self.lengths = lengths
        if not self.agree(backend, list(PROBES), strict=True):
            self.lengths = None

    def _of(self, ids: np.ndarray) -> np.ndarray:
        """``ids``' lengths, looking up the vocabulary tokens not met before (an id past the vocabulary: no text)."""
        if len(ids) and ids.max() >= len(self.lengths):
            self.lengths = np.concatenate([self.lengths, np.full(int(ids.max()) + 1 - len(self.lengths), _UNSEEN)])
        found = self.lengths[ids]
        unseen = found == _UNSEEN
        if unseen.any():
            for i in np.unique(ids[unseen]).tolist():
                token = self._model.id_to_token(i)
                self.lengths[i] = (self._token_size(token) or _NO_TEXT) if token is not None else _NO_TEXT
            found = self.lengths[ids]
        return found

    def _size(self, token: str) -> int:
        """The bytes a SentencePiece-style token stands for: ``▁`` a space, ``<0xNN>`` one byte."""
        return 1 if self._fallback and _BYTE_TOKEN.fullmatch(token) else len(token.replace(_SPACE, " ").encode())

    def offsets(self, ids: np.ndarray, text: str) -> np.ndarray | None:
        """The tokens' offsets in ``text``: for ASCII text where each ends ([n]; they partition it), else [n, 2]
        start and end characters; None where the text is not in the normaliser's forms or the lengths do not add
        up to its own."""
        ends = np.cumsum(self._of(ids))
        if text.isascii():
            return ends if (ends[-1] if len(ends) else 0) == len(text) else None
        raw = text.encode()
        if ends[-1] != len(raw) or not all(unicodedata.is_normalized(f, text) for f in self._forms):
            return None
        first = np.cumsum((np.frombuffer(raw, np.uint8) & 0xC0) != 0x80) - 1  # the character each byte is of
        return np.stack([first[np.concatenate(([0], ends[:-1]))], first[ends - 1] + 1], axis=1)

    def agree(self, backend, texts: list[str], strict: bool = False) -> bool:
        """Whether the offsets found from the lengths are the tokenizer's own on ``texts``; ``strict``: and each text
        in the normaliser's forms has them (the probes: plain text no token is short for)."""
        for text, enc in zip(texts, backend.encode_batch(texts, add_special_tokens=False)):
            ids = np.array(enc.ids, dtype=np.int64)
            if len(ids) and ids.min() < 0:
                return False
            found = self.offsets(ids, text)
            if found is None:
                if strict and all(unicodedata.is_normalized(f, text) for f in self._forms):
                    return False  # plain text whose lengths do not add up: not a tokenizer for this
                continue
            if [tuple(o) for o in enc.offsets] != [tuple(p) for p in as_pairs(found).tolist()]:
                return False
        return True


def as_pairs(offsets: np.ndarray) -> np.ndarray:
    """[n, 2] start and end characters, from either form ``TokenLengths.offsets`` returns."""
    if offsets.ndim == 2:
        return offsets
    return np.stack([np.concatenate(([0], offsets[:-1])), offsets], axis=1) if len(offsets) else np.zeros((0, 2), int)
