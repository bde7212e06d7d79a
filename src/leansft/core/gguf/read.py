"""What transformers' GGUF reader leaves out of a model, put back or refused before the model is converted.

transformers builds the config from a GGUF's metadata and reads its tensors, but (gpt-oss aside) it ignores
the rotary scaling llama.cpp's converter writes: Llama 3.1-3.3's per-frequency ``rope_freqs`` tensor and the
``rope.scaling.*`` keys of linear and YaRN scaling. It also drops tensors its config has no place for, such
as the q/k/v biases of a ``llama`` model. Either way the converted model computes other logits than the
model in the file (a Llama 3.2 GGUF: 17% of the logits' scale at 300 tokens), silently. And it builds a
byte-level tokenizer with GPT-2's split wherever it does not know the file's ``tokenizer.ggml.pre`` name
(SmolLM2's digit splitting among them): other token ids than the model's own tokenizer gives. A Gemma 3 file
is read with transformers' default query scale (256, where llama.cpp uses the head size) and without the rotary
scaling of its full-attention layers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from tokenizers import pre_tokenizers

from leansft.core.errors import ModelError
from leansft.core.gguf.metadata import read_header, tensor_data

# llama.cpp pre-tokenizer names transformers' GGUF reader does not map (it splits as GPT-2 then), as the
# models' own tokenizers split: SmolLM's digits one by one, then GPT-2's regex
PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
}
# Llama 3.1-3.3's own settings besides ``factor``: the only ones rope_freqs is matched against
LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# llama.cpp's YaRN keys -> transformers' rope parameters
YARN_KEYS = {"yarn_attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def llama3_rope_factors(base: float, head_dim: int, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """Llama 3's rotary scaling as llama.cpp stores it: the divisor of each default frequency (its converter's
    ``rope_freqs``)."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _rope_parameters(fields: dict, names: set[str], arch: str, base: float, head_dim: int, file: str) -> dict | None:
    """transformers' rope parameters for the scaling in the file; None when it has none."""
    if "rope_freqs.weight" in names:
        freqs = fields["rope_freqs.weight"]
        factor = float(freqs.max())
        if not np.allclose(llama3_rope_factors(base, head_dim, factor, LLAMA3["low_freq_factor"],
                                               LLAMA3["high_freq_factor"], LLAMA3["original_max_position_embeddings"]),
                           freqs, rtol=1e-5):
            raise ModelError("the GGUF's rope_freqs (per-frequency rotary scaling) are not Llama 3's, which is all "
                             "leansft can put back (transformers does not read them)", file=file,
                             hint="train from the model's Hugging Face folder instead")
        return {"rope_type": "llama3", "rope_theta": base, "factor": factor, **LLAMA3}
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = fields.get(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": base, "factor": float(factor)}
    if kind == "yarn" and fields.get(f"{arch}.rope.scaling.yarn_ext_factor", 1.0) == 1.0:
        return {"rope_type": "yarn", "rope_theta": base, "factor": float(factor),
                "original_max_position_embeddings": int(fields[f"{arch}.rope.scaling.original_context_length"]),
                **{hf: float(fields[f"{arch}.rope.scaling.{key}"]) for key, hf in YARN_KEYS.items()
                   if f"{arch}.rope.scaling.{key}" in fields}}
    raise ModelError(f"the GGUF's rotary scaling '{kind}' is not read by transformers and leansft cannot put it back",
                     file=file, hint="train from the model's Hugging Face folder instead")


def _read(path: Path) -> tuple[dict, set[str]]:
    """(metadata but the vocabulary lists, plus the ``rope_freqs`` tensor; tensor names) of a GGUF file."""
    fields, tensors = read_header(path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        fields.pop(key, None)
    if "rope_freqs.weight" in tensors:
        data = tensor_data(path, tensors["rope_freqs.weight"])
        if data is None:  # a quantised type: gguf's reader dequantises it
            import gguf

            reader = gguf.GGUFReader(str(path))
            data = next(np.asarray(t.data, dtype=np.float32) for t in reader.tensors if t.name == "rope_freqs.weight")
        fields["rope_freqs.weight"] = data
    return fields, set(tensors)


def _split_as_named(tokenizer, fields: dict, file: str) -> None:
    """Give a byte-level tokenizer transformers built from a GGUF the pre-tokenizer the file names, where
    transformers fell back to GPT-2's split (it maps only some of llama.cpp's names); refuse names leansft
    cannot map either."""
    pre = fields.get("tokenizer.ggml.pre")
    if fields.get("tokenizer.ggml.model") != "gpt2" or pre in (None, "default", "gpt-2"):
        return  # GPT-2's split is the file's own, or the file names none (older converters)
    if not isinstance(tokenizer.backend_tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel):
        return  # transformers set the split this name stands for itself
    if pre not in PRE_TOKENIZERS:
        raise ModelError(f"transformers builds this GGUF's tokenizer without its pre-tokenizer '{pre}': it would "
                         "split text differently from the model's own tokenizer", file=file,
                         hint="train from the model's Hugging Face folder (or pass its tokenizer as tokenizer:)")
    tokenizer.backend_tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()


def faithful_gguf_tokenizer(path: Path, tokenizer):
    """``tokenizer`` (transformers' from the GGUF at ``path``) with the pre-tokenizer the file names."""
    fields, _ = _read(path)
    _split_as_named(tokenizer, fields, str(path))
    return tokenizer


def complete_from_gguf(path: Path, model, tokenizer) -> None:
    """Set on ``model.config`` (as transformers read it from the GGUF at ``path``) the rotary scaling it
    missed (Gemma 3: on its full-attention layers, as llama.cpp applies it) and Gemma 3's query scale, before the
    model is rebuilt from that config, and on ``tokenizer`` the pre-tokenizer the file names; refuse a file with
    tensors the model dropped."""
    fields, names = _read(path)
    _split_as_named(tokenizer, fields, str(path))
    biases = sorted(n for n in names if n.endswith(".bias"))
    taken = [n for n, _ in model.named_parameters() if n.endswith("bias")]
    if len(biases) > len(taken):
        raise ModelError(f"transformers reads {len(taken)} of the GGUF's {len(biases)} bias tensors (e.g. "
                         f"{biases[0]}): the converted model would lack them", file=str(path),
                         hint="train from the model's Hugging Face folder instead")
    cfg, arch = model.config, fields.get("general.architecture")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "gemma3":  # llama.cpp's query scale (its gemma3 graph reads no key for it); transformers assumes 256
        cfg.query_pre_attn_scalar = cfg.hidden_size // cfg.num_attention_heads if cfg.num_hidden_layers == 62 \
            else head_dim
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    per_type = bool(params) and set(params) <= {"full_attention", "sliding_attention"}
    own = params.get("full_attention", {}) if per_type else params  # Gemma 3: llama.cpp scales the global layers only
    if (own.get("rope_type") or "default") != "default":  # transformers read the scaling itself (gpt-oss)
        return
    found = _rope_parameters(fields, names, arch, float(own.get("rope_theta", 10000.0)), head_dim, str(path))
    if found is not None:
        cfg.rope_parameters = {**params, "full_attention": {**own, **found}} if per_type else {**params, **found}


def byte_level_tokenizer(fields: dict):
    """The byte-level BPE tokenizer a GGUF's metadata describes (``tokenizer.ggml.model = "gpt2"``), built as
    transformers' GGUF reader builds it (its vocabulary, merges, special and user-defined tokens, and the split
    llama.cpp's pre-tokenizer name stands for, from transformers' table or leansft's) but from metadata already read
    (``metadata.read_metadata``): transformers' own reading of a 151k vocabulary takes ~15 s. A name neither table
    maps is a ``ModelError``. Encodes with ``encode(text).ids``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens, types = fields["tokenizer.ggml.tokens"], fields.get("tokenizer.ggml.token_type") or []
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab, merges))
    pre = fields.get("tokenizer.ggml.pre")
    if pre in GGUF_PRE_TOKENIZER_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in PRE_TOKENIZERS:
        tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    elif pre in (None, "default", "gpt-2"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise ModelError(f"no split is known here for llama.cpp's pre-tokenizer '{pre}'")
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
                            if kind == 3 and set(t) <= alphabet])  # transformers' rule: others are mislabels
    tok.add_tokens([AddedToken(t, normalized=False) for t, kind in zip(tokens, types) if kind == 4])
    return tok
