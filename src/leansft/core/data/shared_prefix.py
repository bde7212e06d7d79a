"""Tokenise once the text many rendered conversations start with.

Most datasets render to texts that open alike: a template's default system turn (Qwen2.5 writes "You are Qwen,
created by Alibaba Cloud..." into every conversation without a system message; Llama 3 its knowledge-date turn)
or a dataset's one system prompt. Tokenising that opening again for each conversation is a sixth of the
tokenizer's work on short chats. A fast tokenizer splits its input at added tokens before it normalises or
pre-tokenises anything, so the text on either side of a special token is tokenised alone: the tokens of
``P + rest``, where ``P`` ends with such a token, are the tokens of ``P`` followed by those of ``rest``.

``SharedPrefixes`` learns the openings that many texts of a batch share (cut after a special token), tokenises
each once and hands out the longest one a text starts with. It cuts only where that identity holds: at special
tokens the tokenizer matches on the raw text, that strip nothing around them and overlap no other added token;
after a token whose following text tokenises as alone on probes (a letter, spaces, a newline, a word-start mark);
and with each opening checked on texts of the batch (the whole text's tokens against the opening's and the
rest's). A tokenizer that marks the first piece of a text (SentencePiece ``Metaspace`` with ``prepend_scheme:
first``) fails the probes and is never cut; any failure turns the cache off for the encoder.
"""

from __future__ import annotations

import re

import numpy as np

CUTS = 6  # cut candidates per text: after each of its first special tokens (a template's first turn or two)
MAX_PREFIXES = 16  # openings kept per encoder (per preparation worker)
MIN_CHARS = 64  # shorter openings save less of the tokenizer's work than splitting the text costs
SAMPLES = 4  # texts of a batch whose openings are looked for in the others (evenly spaced)
CHECKED = 2  # texts each learned prefix is checked on (the whole text tokenised against prefix + rest)


def _splitters(tokenizer) -> list[str]:
    """The special tokens a cut may follow: added tokens the tokenizer matches on the raw text (not normalised)
    without stripping spaces around them or asking for word boundaries, and that no other added token overlaps
    (a longer token holding one, or one ending inside it), so that each occurrence in a text is a split point."""
    added = [t for t in tokenizer.added_tokens_decoder.values() if t.content]
    contents = [t.content for t in added]
    out = []
    for t in added:
        s = t.content
        if not t.special or t.normalized or t.lstrip or t.rstrip or t.single_word:
            continue
        if not any(_overlap(s, o) for o in contents):
            out.append(s)
    return out


def _overlap(s: str, o: str) -> bool:
    """Whether added token ``o`` could match across an occurrence of ``s``: holding it, or ending inside it."""
    if o == s:
        return False
    if s in o:
        return True
    i = o.find(s[0], 1)
    while i != -1:
        if s.startswith(o[i:]):
            return True
        i = o.find(s[0], i + 1)
    return False


PROBES = ("x", "X", " x", "  x", "\nx", "\n", "\t", "1", "é", "\u2581x", "日本", ".")  # what may follow a cut


def _independent(backend, splitters: list[str]) -> bool:
    """Whether the text after each special token tokenises as it does alone (the identity the cut relies on),
    on probes that start as a template's next text may: a letter, spaces, a newline, a digit, a word-start mark.
    A tokenizer that marks the first piece of a text (``prepend_scheme: first``) fails on ``x``."""
    texts = [s + p for s in splitters for p in PROBES]
    wholes = backend.encode_batch(texts, add_special_tokens=False)
    heads = {s: backend.encode(s, add_special_tokens=False).ids for s in splitters}
    rests = {p: backend.encode(p, add_special_tokens=False).ids for p in PROBES}
    return all(w.ids == heads[s] + rests[p] for w, (s, p) in zip(wholes, ((s, p) for s in splitters for p in PROBES)))


class SharedPrefixes:
    """Openings shared by many texts, tokenised once (see the module's docstring for why this is exact)."""

    def __init__(self, tokenizer, backend) -> None:
        self._tokenizer, self._backend = tokenizer, backend
        self._pattern: re.Pattern | None = None  # the splitters, found at the first batch (not for every encoder)
        self._known: list[tuple[str, object, np.ndarray]] = []  # (prefix, its encoding, its ids), longest first
        self._independent: dict[str, bool] = {}  # splitter -> whether text after it tokenises as alone (probed)
        self.enabled = True

    def _cuts(self, text: str) -> list[tuple[str, str]]:
        """The openings of ``text`` that end right after one of its first ``CUTS`` special tokens, shortest first,
        each with that token."""
        found = [(m.end(), m.group()) for _, m in zip(range(CUTS), self._pattern.finditer(text))]
        return [(text[:e], s) for e, s in found if e < len(text)]

    def learn(self, texts: list[str]) -> None:
        """Keep the openings (of ``MIN_CHARS`` or more) that at least a quarter of ``texts`` share, sampled from
        ``SAMPLES`` texts, each once it is checked on probes and on texts that have it."""
        if not self.enabled or len(self._known) >= MAX_PREFIXES or len(texts) < 4:
            return
        if self._pattern is None:
            splitters = sorted(_splitters(self._tokenizer), key=len, reverse=True)
            if not splitters:
                self.enabled = False
                return
            self._pattern = re.compile("|".join(map(re.escape, splitters)))
        known = {p for p, _, _ in self._known}
        for sample in dict.fromkeys(texts[k * len(texts) // SAMPLES] for k in range(SAMPLES)):
            for cut, splitter in self._cuts(sample):
                if cut in known:
                    continue  # a longer one may be shared too
                having = [t for t in texts if t.startswith(cut)]
                if len(having) * 4 < len(texts):
                    break  # nor is any longer one
                if len(cut) < MIN_CHARS:
                    continue
                if splitter not in self._independent:
                    self._independent[splitter] = _independent(self._backend, [splitter])
                enc = self._checked(cut, having[:CHECKED]) if self._independent[splitter] else None
                if enc is None:
                    self.enabled = False  # this tokenizer's text after a special token depends on what came before
                    self._known.clear()
                    return
                self._known.append((cut, enc, np.array(enc.ids, dtype=np.int32)))
                self._known.sort(key=lambda k: -len(k[0]))
                known.add(cut)
                if len(self._known) >= MAX_PREFIXES:
                    return

    def _checked(self, prefix: str, texts: list[str]):
        """The prefix's encoding where the tokens of each whole text are the prefix's followed by the rest's, else
        None."""
        head = self._backend.encode(prefix, add_special_tokens=False)
        rests = self._backend.encode_batch([t[len(prefix):] for t in texts], add_special_tokens=False)
        wholes = self._backend.encode_batch(texts, add_special_tokens=False)
        return head if all(w.ids == head.ids + r.ids for w, r in zip(wholes, rests)) else None

    def find(self, text: str) -> tuple[str, object, np.ndarray] | None:
        """The longest known opening ``text`` starts with (and goes on after), or None."""
        for known in self._known:
            if len(text) > len(known[0]) and text.startswith(known[0]):
                return known
        return None
