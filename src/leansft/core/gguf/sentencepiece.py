"""A SentencePiece model rebuilt from a tokenizer.json, for llama.cpp's converter.

llama.cpp's converter writes a SentencePiece tokenizer (``tokenizer.ggml.model = "llama"``: pieces, scores and
types, merged by score as SentencePiece merges them) only from a ``tokenizer.model`` file. transformers 5 saves
tokenizer.json alone, and a model read from a GGUF never had one: without it the converter took Gemma's vocabulary
for byte-level BPE and named another model's pre-tokenizer, and Llama 2's for SentencePiece with every score -1000
(merged in no sensible order). A SentencePiece-style fast tokenizer (BPE with byte fallback over ``▁``-spaced text)
carries everything such a model holds, so the model is rebuilt from it:

- pieces: the vocabulary in id order, added tokens included (special ones CONTROL, others USER_DEFINED, as the
  converter types them), ``<0xNN>`` pieces BYTE, the unknown token UNKNOWN;
- scores: a merged piece scores minus the rank of the first merge that makes it, so merging the best-scoring pair
  (SentencePiece's and llama.cpp's rule) merges in tokenizer.json's order; pieces no merge makes score below every
  merge (added ones -1000, as the converter scores them);
- normaliser: no normalisation rule, spaces escaped as ``▁``, a dummy prefix where the tokenizer prepends one.

Whether the file the converter then writes tokenizes as the trained tokenizer is checked after it is written
(``core/gguf/write.py``), never assumed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # sentencepiece ModelProto.SentencePiece.Type
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def sentencepiece_style(tokenizer_json: dict) -> bool:
    """Whether a tokenizer.json is a SentencePiece BPE model in tokenizers' form: BPE with byte fallback whose
    decoder turns ``▁`` back into spaces."""
    model, decoder = tokenizer_json.get("model") or {}, tokenizer_json.get("decoder") or {}
    decoders = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    spaces = any(d.get("type") == "Metaspace" or (d.get("type") == "Replace" and d.get("content") == " "
                                                  and (d.get("pattern") or {}).get("String") == "▁") for d in decoders)
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and spaces


def space_prefix(tokenizer_json: dict) -> str:
    """Where the tokenizer puts a ``▁`` before text (SentencePiece's dummy prefix): ``always`` (a Prepend normaliser
    or Metaspace's ``always``: at the start and after every special token, as SentencePiece and llama.cpp do),
    ``first`` (Metaspace's ``first``: at the very start of the text only, unless it starts with a space; the form
    transformers 5 gives Llama 2 and Mistral tokenizers), or ``never``."""
    flat = []
    for p in (tokenizer_json.get("normalizer") or {}, tokenizer_json.get("pre_tokenizer") or {}):
        flat += p.get("normalizers") or p.get("pretokenizers") or [p]
    for p in flat:
        if p.get("type") == "Prepend" and p.get("prepend") == "▁":
            return "always"
        if p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never":
            return p.get("prepend_scheme", "always")
    return "never"


def _prepends(tokenizer_json: dict) -> bool:
    return space_prefix(tokenizer_json) != "never"


def _configured_unk(folder: Path) -> str | None:
    path = folder / "tokenizer_config.json"
    unk = json.loads(path.read_text(encoding="utf-8")).get("unk_token") if path.is_file() else None
    return unk.get("content") if isinstance(unk, dict) else unk


def rebuild(folder: Path, tj: dict) -> bytes | None:
    """A serialized SentencePiece model equivalent to ``folder``'s tokenizer.json (``tj``, read), or None where that
    is not a SentencePiece-style tokenizer."""
    if not sentencepiece_style(tj):
        return None
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = tj["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    for i, t in added.items():
        vocab.setdefault(t["content"], i)
    first_rank: dict[int, int] = {}
    for rank, merge in enumerate(model.get("merges", [])):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        made = vocab.get(left + right)
        if made is not None:
            first_rank.setdefault(made, rank)
    unk = model.get("unk_token") or _configured_unk(folder)  # transformers 5 may leave it off the model
    by_id = {i: piece for piece, i in vocab.items()}
    size = max(by_id) + 1
    proto = pb.ModelProto()
    floor = -float(len(model.get("merges", [])) + 1)  # below every merged piece
    for i in range(size):
        piece = proto.pieces.add()
        text = by_id.get(i)
        if text is None:  # a hole in the ids: an unused placeholder, as the converter pads
            piece.piece, piece.score, piece.type = f"[PAD{i}]", -10000.0, UNUSED
            continue
        piece.piece = text
        if text == unk:
            piece.type, piece.score = UNKNOWN, 0.0
        elif i in added:
            piece.type = CONTROL if added[i].get("special") else USER_DEFINED
            piece.score = -1000.0
        elif _BYTE_PIECE.fullmatch(text):
            piece.type, piece.score = BYTE, 0.0
        else:
            piece.type = NORMAL
            piece.score = -float(first_rank[i]) if i in first_rank else (0.0 if len(text) == 1 else floor)
    if not any(p.type == UNKNOWN for p in proto.pieces):
        return None  # SentencePiece needs an unknown piece; a tokenizer without one is not placed
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = size
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id = next(i for i, p in enumerate(proto.pieces) if p.type == UNKNOWN)
    for name in ("bos", "eos", "pad"):  # ids the model does not have: unset (-1)
        setattr(proto.trainer_spec, f"{name}_id", -1)
    spec = proto.normalizer_spec
    spec.name = "identity"
    spec.add_dummy_prefix = _prepends(tj)
    spec.remove_extra_whitespaces = False
    spec.escape_whitespaces = True
    return proto.SerializeToString()


def added_tokens_decoder(tj: dict) -> dict[str, dict]:
    """tokenizer.json's (``tj``) added tokens as tokenizer_config.json's ``added_tokens_decoder`` (id -> settings)."""
    return {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tj.get("added_tokens", [])}


class LlamaCppSentencePiece:
    """A GGUF's SentencePiece tokenizer (``tokenizer.ggml.model = "llama"``) tokenizing as llama.cpp's does, to check
    an export without llama.cpp: special and user-defined tokens cut out of the text first (longest first), then
    each stretch of text prefixed with a space where the file says ``add_space_prefix`` and the stretch opens the
    text or follows a special token, spaces escaped as ``▁``, and merged by the pieces' scores with byte fallback
    (SentencePiece's BPE, which llama.cpp's follows). ``fields``: the file's tokenizer metadata."""

    def __init__(self, fields: dict) -> None:
        from sentencepiece import SentencePieceProcessor
        from sentencepiece import sentencepiece_model_pb2 as pb

        tokens, scores, types = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
        unk = fields.get("tokenizer.ggml.unknown_token_id")
        proto = pb.ModelProto()
        for i, (text, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
            piece = proto.pieces.add()
            piece.piece, piece.score = text, float(score)
            # special and user-defined tokens are cut out before SentencePiece sees the text: never its output
            piece.type = UNKNOWN if i == unk else {NORMAL: NORMAL, UNKNOWN: UNKNOWN, BYTE: BYTE, UNUSED: UNUSED}.get(
                kind, CONTROL)
        proto.trainer_spec.model_type = pb.TrainerSpec.BPE
        proto.trainer_spec.vocab_size = len(tokens)
        proto.trainer_spec.byte_fallback = any(t == BYTE for t in types)
        proto.trainer_spec.unk_id = next(i for i, p in enumerate(proto.pieces) if p.type == UNKNOWN)
        for name in ("bos", "eos", "pad"):
            setattr(proto.trainer_spec, f"{name}_id", -1)
        proto.normalizer_spec.name = "identity"
        proto.normalizer_spec.add_dummy_prefix = False
        proto.normalizer_spec.remove_extra_whitespaces = False
        proto.normalizer_spec.escape_whitespaces = True
        self.sp = SentencePieceProcessor(model_proto=proto.SerializeToString())
        self.prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default for SPM
        self.special = sorted(((t, i) for i, (t, kind) in enumerate(zip(tokens, types))
                               if kind in (UNKNOWN, CONTROL, USER_DEFINED) and t), key=lambda ti: -len(ti[0]))

    def encode(self, text: str) -> list[int]:
        parts: list[str | int] = [text]
        for token, i in self.special:  # llama.cpp's partition: each special token, longest first, over what is text
            out: list[str | int] = []
            for part in parts:
                if not isinstance(part, str) or token not in part:
                    out.append(part)
                    continue
                pieces = part.split(token)
                for k, piece in enumerate(pieces):
                    if piece:
                        out.append(piece)
                    if k < len(pieces) - 1:
                        out.append(i)
            parts = out
        ids, after_special = [], True
        for part in parts:
            if isinstance(part, int):
                ids.append(part)
                after_special = True
                continue
            ids += self.sp.encode((" " if self.prefix and after_special else "") + part)
            after_special = False
        return ids
