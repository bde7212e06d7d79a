"""Load a tokenizer from a folder, a tokenizer.json file, a .gguf file, or a Hub id."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from leansft.core.errors import ModelError
from leansft.core.gguf.read import faithful_gguf_tokenizer
from leansft.core.paths import HUB_HINT, hub_unreachable, resolve_package_path


def load_tokenizer(spec: str, trust_remote_code: bool = False):
    """Return a fast ``transformers`` tokenizer; any failure becomes a ``ModelError`` naming ``spec``.
    ``trust_remote_code`` is passed explicitly, so transformers never asks on stdin."""
    kw = {"trust_remote_code": trust_remote_code}

    spec = resolve_package_path(spec)
    path = Path(spec)
    try:
        if path.is_file() and path.suffix == ".gguf":
            tok = faithful_gguf_tokenizer(path, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                              **kw))
        elif path.is_file() and path.suffix == ".json":
            if (path.parent / "tokenizer_config.json").exists() and path.name == "tokenizer.json":
                tok = AutoTokenizer.from_pretrained(str(path.parent), local_files_only=True, **kw)
            else:
                tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
        elif path.is_dir():
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kw)
        elif path.exists():
            raise ModelError("not a tokenizer: expected a folder, a tokenizer.json or a .gguf file", file=spec)
        else:
            tok = AutoTokenizer.from_pretrained(spec, local_files_only=hub_unreachable(), **kw)
    except ModelError:
        raise
    except Exception as err:
        where = "local tokenizer" if path.exists() else "tokenizer (no local path of that name; tried the Hub)"
        raise ModelError(f"cannot load {where}: {type(err).__name__}: {str(err)[:300]}", file=spec,
                         hint=None if path.exists() else HUB_HINT) from None
    if not getattr(tok, "is_fast", False):
        raise ModelError("a fast (Rust) tokenizer is required for offsets and batched tokenisation", file=spec)
    tok.generation_eos_ids = _generation_eos_ids(path if path.is_dir() else path.parent)
    return tok


def _generation_eos_ids(folder: Path) -> list[int]:
    """The eos ids of the model's ``generation_config.json`` beside the tokenizer (what inference stops on)."""
    try:
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in ids if isinstance(i, int)]


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of everything that changes token ids: the backend JSON and the special tokens."""
    h = hashlib.sha256()
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    h.update(repr(sorted(tokenizer.special_tokens_map.items(), key=str)).encode())
    h.update(repr(getattr(tokenizer, "generation_eos_ids", None) or []).encode())
    return h.hexdigest()


def backend_copy(backend: Tokenizer) -> Tokenizer:
    """A copy of the Rust tokenizer ``backend``, without its truncation and padding, whose added tokens and
    special-token matching can change and leave ``backend`` as it is.

    ``Tokenizer.from_str(backend.to_str())`` builds the vocabulary again (1.3 s of CPU for Gemma 3's 262k tokens, 0.5 s
    for Qwen2.5's); the copy shares the model, normaliser, pre-tokenizer, post-processor and decoder (nothing here
    changes them) and adds the added tokens again, in id order. It is used where it holds the same added tokens
    under the same ids and flags and reads a text of all of them, and the probes, into the same ids and back into
    the same text; otherwise (added tokens whose ids leave gaps, say) the full copy is made."""
    copy = Tokenizer(backend.model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        if getattr(backend, part) is not None:
            setattr(copy, part, getattr(backend, part))
    added = backend.get_added_tokens_decoder()
    copy.add_tokens([added[i] for i in sorted(added)])
    copy.encode_special_tokens = backend.encode_special_tokens
    if not _reads_alike(backend, copy, added):
        copy = Tokenizer.from_str(backend.to_str())
        copy.no_truncation()
        copy.no_padding()
    return copy


def _reads_alike(backend: Tokenizer, copy: Tokenizer, added: dict) -> bool:
    """Same added tokens (ids and flags), and each of them in a text, and a mixed text, read into the same ids (the
    backend's padding left out; a text it truncates fails) and decoded into the same text, special tokens skipped
    or not."""
    def flags(tokens: dict) -> dict:
        return {i: (t.content, t.special, t.normalized, t.lstrip, t.rstrip, t.single_word) for i, t in tokens.items()}

    if flags(copy.get_added_tokens_decoder()) != flags(added) or \
            copy.get_vocab_size(with_added_tokens=True) != backend.get_vocab_size(with_added_tokens=True):
        return False
    texts = ["Hello world, 你好 🙂 <s> a\n\tb ▁x", *(f"a {t.content}b\n" for t in added.values())]
    ours = [e.ids for e in copy.encode_batch(texts, add_special_tokens=False)]
    theirs = [[i for i, m in zip(e.ids, e.attention_mask) if m]
              for e in backend.encode_batch(texts, add_special_tokens=False)]
    return ours == theirs and all(copy.decode_batch(ours, skip_special_tokens=skip) ==
                                  backend.decode_batch(ours, skip_special_tokens=skip) for skip in (False, True))


def pad_id(tokenizer) -> int:
    """The id padded batches fill with (never a target: labels there are -100)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
