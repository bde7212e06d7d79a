"""The tokens at which a model stops generating an assistant turn: where each turn's loss ends.

Declared stops come first: the tokenizer's eos and the model's ``generation_config.json`` eos ids (what
inference stops on). A template often closes turns with another token (Llama-3's ``<|eot_id|>`` where
the base tokenizer's eos is ``<|end_of_text|>``; Gemma's ``<end_of_turn>``), so where no declared stop
occurs in a turn, the fallback is the special token the template itself writes right after an answer
(found by rendering a probe conversation) and the well-known end-of-turn tokens the vocabulary has.
``<|end|>`` is deliberately not a well-known stop: gpt-oss writes it inside a turn (after its thinking).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Tokens that, in every vocabulary that has them, only ever end an assistant turn.
KNOWN_STOPS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|return|>", "<|call|>", "<｜end▁of▁sentence｜>",
    "<|END_OF_TURN_TOKEN|>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<turn|>", "<|assistant_end|>",
    "<|role_end|>", "<|eot|>", "<|eom|>", "<|end_of_msg|>", "<eos>",
)
_PROBE = "Probe answer 7"


def _pattern(tokens: tuple[str, ...]) -> re.Pattern | None:
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True)))) if tokens else None


@dataclass(frozen=True)
class StopTokens:
    declared: tuple[str, ...]  # eos of the tokenizer and of the generation config
    fallback: tuple[str, ...]  # what the template writes after an answer; well-known end-of-turn tokens

    def __post_init__(self) -> None:
        object.__setattr__(self, "_declared", _pattern(self.declared))
        object.__setattr__(self, "_fallback", _pattern(self.fallback))

    def find(self, text: str, start: int, end: int) -> re.Match | None:
        """The first declared stop in ``text[start:end]``; else the first fallback stop; else None."""
        for pattern in (self._declared, self._fallback):
            hit = pattern.search(text, start, end) if pattern is not None else None
            if hit is not None:
                return hit
        return None

    def match_at(self, text: str, pos: int) -> re.Match | None:
        """A stop token starting exactly at ``pos`` (declared first)."""
        for pattern in (self._declared, self._fallback):
            hit = pattern.match(text, pos) if pattern is not None else None
            if hit is not None:
                return hit
        return None

    def describe(self) -> str:
        extra = [t for t in self.fallback if t not in self.declared]
        return ", ".join(self.declared) + (f" (else {', '.join(extra)})" if extra else "")


def declared_stops(tokenizer) -> tuple[str, ...]:
    """The tokenizer's eos token and the generation config's eos ids (``load_tokenizer`` reads them)."""
    ids = list(getattr(tokenizer, "generation_eos_ids", None) or [])
    out = [tokenizer.eos_token] if tokenizer.eos_token else []
    out += [tokenizer.convert_ids_to_tokens(i) for i in ids if 0 <= i < len(tokenizer)]
    return tuple(dict.fromkeys(t for t in out if t))


def find_stops(tokenizer, render, special: set[int]) -> StopTokens:
    """``render(messages)`` renders a conversation without the generation prompt (raising where the template
    refuses it). The probe's closing token is the first special token after the answer; where the template
    leaves the last turn open (GLM: the model stops on the next turn's ``<|user|>``), the one after the answer
    when another user message follows."""
    found: list[str] = []
    user = {"role": "user", "content": "Probe question?"}
    for chat in ([user, {"role": "assistant", "content": _PROBE}],
                 [user, {"role": "assistant", "content": _PROBE}, {"role": "user", "content": "And?"}]):
        try:
            text = render(chat)
        except Exception:
            continue
        at = text.find(_PROBE)
        if at < 0:
            continue
        after = tokenizer.backend_tokenizer.encode(text[at + len(_PROBE):], add_special_tokens=False)
        first = next((t for i, t in zip(after.ids, after.tokens) if i in special), None)
        if first is not None:
            found.append(first)
            break
    known = [t for t in KNOWN_STOPS if tokenizer.backend_tokenizer.token_to_id(t) is not None]
    return StopTokens(declared_stops(tokenizer), tuple(dict.fromkeys(found + known)))
