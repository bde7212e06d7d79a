"""Write a model as one GGUF file for llama.cpp / Ollama, with the ``gguf`` package's writer.

Supported: Llama, Mistral (llama.cpp's ``llama`` architecture, named so transformers reads it back as
Mistral) and Qwen2, with a byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``). Written as llama.cpp's
own converter (``convert_hf_to_gguf``) writes them, since llama.cpp is who reads the file: its pre-tokenizer
name (llama.cpp splits text with a default regex without it), the vocabulary padded to the embedding's rows,
token types, special tokens and merges read by the ``gguf`` package's ``SpecialVocab`` as the converter
reads them, the rotary scaling (Llama 3's per-frequency factors as a ``rope_freqs`` tensor, linear and YaRN
as metadata; other kinds refused), q/k weights and biases permuted for the ``llama`` rotary layout, norms in
float32, a tied output layer written once. A sliding window (Mistral v0.1) llama.cpp does not apply to these
graphs is stated as the context length, with a warning. Others are refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

import numpy as np
import torch

from leansft.core.config import GGUFDType
from leansft.core.errors import LeanSFTError
from leansft.core.gguf.pretokenizers import CHKTXT, PRE_TOKENIZERS

log = logging.getLogger("leansft")

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
DTYPES = get_args(GGUFDType)
# Token texts llama.cpp ends generation on whatever the file says (llama-vocab.cpp's EOG list); it also stops on
# the file's eos, eot and eom ids. Any other stop token must be one of those ids or llama.cpp generates past it.
LLAMA_CPP_EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                                 "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
                                 "<end_of_utterance>"})
# GPT-2's own pre-tokenizer (its regex, no prefix space): llama.cpp's ``gpt-2`` for a vocabulary it has no hash of
_GPT2_PRE = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k (its convert_hf_to_gguf ``permute``)."""
    n = n_head_kv if n_head_kv != n_head else n_head
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _pre_tokenizer_spec(tokenizer) -> dict:
    """The tokenizer's pre-tokenizer as its JSON settings (without serialising the whole vocabulary)."""
    pre = tokenizer.backend_tokenizer.pre_tokenizer
    return json.loads(pre.__getstate__()) if pre is not None else {}


def pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for how this tokenizer splits text before BPE: by the hash its converter computes,
    or ``gpt-2`` for GPT-2's own settings; otherwise refused (llama.cpp would split prompts with a default
    regex, not the one the model was trained with)."""
    digest = hashlib.sha256(str(tokenizer.encode(CHKTXT)).encode()).hexdigest()
    if digest in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[digest]
    pre = _pre_tokenizer_spec(tokenizer)
    if tokenizer.backend_tokenizer.normalizer is None and all(pre.get(k) == v for k, v in _GPT2_PRE.items()):
        return "gpt-2"
    raise LeanSFTError("GGUF export: llama.cpp does not know this tokenizer's pre-tokenizer (its converter's hash "
                       f"{digest[:12]}... is not in its table), so it would split text differently from training",
                       hint="export a Hugging Face folder (--to hf) and convert it with a llama.cpp whose "
                            "convert_hf_to_gguf.py knows this tokenizer")


def _looks_special(token: str) -> bool:
    """Added tokens llama.cpp's converter makes control tokens although the tokenizer does not mark them."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _tokenizer_vocab(tokenizer, n_vocab: int) -> tuple[list[str], list[int]]:
    """(tokens by id, token types) of a byte-level BPE tokenizer over the embedding's ``n_vocab`` rows, as
    llama.cpp's converter lists them (ids without a token become unused ``[PADi]``), or a clear refusal."""
    import gguf

    kind = type(tokenizer.backend_tokenizer.model).__name__
    if kind != "BPE" or "ByteLevel" not in json.dumps(_pre_tokenizer_spec(tokenizer)):
        raise LeanSFTError("GGUF export supports byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM style); "
                           f"this one is {kind}", hint="export a Hugging Face folder (--to hf) instead")
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= n_vocab:
        raise LeanSFTError(f"GGUF export: the tokenizer has ids up to {max(vocab.values())} but the model embeds "
                           f"{n_vocab} tokens")
    by_id = {i: t for t, i in vocab.items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if token in added:
            if not decoder[i].normalized:  # llama.cpp takes added tokens pre-normalised
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            types.append(gguf.TokenType.CONTROL if decoder[i].special or _looks_special(token)
                         else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def _special_vocab(model, tokenizer, n_vocab: int):
    """Merges and special token ids as the ``gguf`` package reads them from a model folder; whether BOS/EOS
    are added to a prompt as this tokenizer does it (absent, llama.cpp adds a BOS for BPE vocabularies)."""
    import gguf

    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        model.config.save_pretrained(folder)
        special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    plain, added = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a")
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and added[:1] == [tokenizer.bos_token_id] \
        and plain[:1] != added[:1]
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and added[-1:] == [tokenizer.eos_token_id] \
        and plain[-1:] != added[-1:]
    return special


def _add_generation_stops(writer, special, tokenizer, stop_ids) -> None:
    """Make every stop token a stop in llama.cpp and Ollama. llama.cpp stops on eos, eot, eom and texts it knows:
    the others (a template's own end-of-turn token) become the free eot/eom ids, refused where more are left
    than those two slots. Ollama's engines stop on eos and the ``eos_token_ids`` list its converter writes."""
    named = {special.special_token_ids.get(k) for k in ("eos", "eot", "eom")}
    missing = [i for i in stop_ids if i not in named and tokenizer.convert_ids_to_tokens(i) not in LLAMA_CPP_EOG_TEXTS]
    free = [k for k in ("eot", "eom") if k not in special.special_token_ids]
    if len(missing) > len(free):
        raise LeanSFTError(f"GGUF export: llama.cpp would not stop generating at the stop tokens "
                           f"{tokenizer.convert_ids_to_tokens(missing)} (a GGUF names at most an eot and an eom "
                           "token besides eos)", hint="export a Hugging Face folder (--to hf) instead")
    for kind, i in zip(free, missing):
        getattr(writer, f"add_{kind}_token_id")(i)
    if set(stop_ids) - {special.special_token_ids.get("eos")}:
        writer.add_array("tokenizer.ggml.eos_token_ids", sorted(int(i) for i in stop_ids))


def llama3_rope_factors(base: float, head_dim: int, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """Llama 3's rotary scaling as llama.cpp stores it: the divisor of each default frequency (its converter's
    ``rope_freqs``)."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
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


def _rope_scaling(cfg, head_dim: int) -> tuple[dict, np.ndarray | None]:
    """(metadata, ``rope_freqs`` factors or None) for the model's rotary scaling, as llama.cpp's converter
    writes it; kinds llama.cpp's ``llama``/``qwen2`` graphs do not apply are refused."""
    params = getattr(cfg, "rope_parameters", None) or {}
    kind = (params.get("rope_type") or "default").lower()
    if kind == "default":
        return {}, None
    if kind == "linear":
        return {"type": "linear", "factor": params["factor"]}, None
    if kind == "yarn":
        return {"type": "yarn", "factor": params["factor"],
                "original_context": params["original_max_position_embeddings"],
                **{k: params[k] for k in ("extrapolation_factor", "beta_fast", "beta_slow") if params.get(k) is not None},
                **({"attention_factor": params["attention_factor"]} if params.get("attention_factor") is not None
                   else {})}, None
    if kind == "llama3":  # per-frequency divisors, llama.cpp's ``rope_freqs``
        return {}, llama3_rope_factors(float(params.get("rope_theta", 10000.0)), head_dim, params.get("factor", 8.0),
                                       params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0),
                                       params.get("original_max_position_embeddings", 8192))
    raise LeanSFTError(f"GGUF export: rotary scaling '{kind}' is not one llama.cpp applies to {cfg.model_type}",
                       hint="export a Hugging Face folder (--to hf) instead")


def context_length(cfg) -> int:
    """The context the GGUF states: the model's, or its sliding window where one applies within it. llama.cpp's
    ``llama``/``qwen2`` graphs attend to every earlier token (they read no window), so past the window the file
    is another model; up to it, the same. Stated that way, llama.cpp warns when a prompt goes past it."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None  # Qwen2 without use_sliding_window: every layer attends to everything
    if window and window < cfg.max_position_embeddings:
        log.warning("GGUF export: llama.cpp runs %s without its %d-token sliding window, so the file is this model up "
                    "to %d tokens; its context length says %d (not %d)", cfg.model_type, window, window, window,
                    cfg.max_position_embeddings)
        return int(window)
    return int(cfg.max_position_embeddings)


def export_gguf(model, tokenizer, chat_template: str | None, path: Path, dtype: str = "f16",
                stop_ids: Sequence[int] = ()) -> Path:
    """Write ``model`` (a transformers causal LM, LoRA already merged) and ``tokenizer`` to ``path``;
    ``stop_ids``: the tokens generation stops at (``generation.stop_token_ids``), all made llama.cpp's stops
    (eot/eom ids) and Ollama's (its converter's ``tokenizer.ggml.eos_token_ids`` list)."""
    import gguf  # the optional [gguf] extra

    cfg = model.config
    arch = ARCHITECTURES.get(cfg.model_type)
    if arch is None:
        raise LeanSFTError(f"GGUF export supports {', '.join(sorted(ARCHITECTURES))}, not '{cfg.model_type}'",
                           hint="export a Hugging Face folder (--to hf) and convert it with llama.cpp")
    if dtype not in DTYPES:
        raise LeanSFTError(f"unknown GGUF dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    n_vocab = model.get_input_embeddings().weight.shape[0]
    tokens, types = _tokenizer_vocab(tokenizer, n_vocab)
    pre = pre_tokenizer(tokenizer)
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    if arch == "qwen2" and head_dim * n_head != cfg.hidden_size:  # llama.cpp's qwen2 tensors are hidden x hidden
        raise LeanSFTError(f"GGUF export: llama.cpp's qwen2 graph needs a head size of hidden/heads "
                           f"({cfg.hidden_size // n_head}), this model's is {head_dim}: llama.cpp would not load it",
                           hint="export a Hugging Face folder (--to hf) instead")
    scaling, rope_freqs = _rope_scaling(cfg, head_dim)
    special = _special_vocab(model, tokenizer, n_vocab)
    special.chat_template = chat_template  # the template the run trained with, not necessarily the tokenizer's
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(f"{cfg.model_type} (leansft)" if cfg.model_type != "mistral" else "mistral (leansft)")
    writer.add_context_length(context_length(cfg))
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    if scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling["type"]))
        writer.add_rope_scaling_factor(scaling["factor"])
        if scaling["type"] == "yarn":
            writer.add_rope_scaling_orig_ctx_len(scaling["original_context"])
            for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                             ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                             ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                             ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
                if key in scaling:
                    add(scaling[key])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(n_vocab)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    writer.add_file_type(file_type)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special.add_to_gguf(writer, quiet=True)
    _add_generation_stops(writer, special, tokenizer, stop_ids)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2,
                                     cfg.num_hidden_layers)
    if rope_freqs is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_freqs)
    state = model.state_dict()
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for hf_name, tensor in state.items():
        if tied and hf_name == "lm_head.weight":
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise LeanSFTError(f"GGUF export: no GGUF name for tensor '{hf_name}'")
        data = tensor.detach().to(torch.float32).cpu().numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _permute(data, n_head, n_head)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _permute(data, n_head, n_kv)
        if data.ndim == 1 or dtype == "f32":
            writer.add_tensor(name, data.astype(np.float32))
        elif dtype == "f16":
            if np.abs(data).max() > np.finfo(np.float16).max:  # would be written as inf
                raise LeanSFTError(f"GGUF export: '{hf_name}' has values past float16's range (65504)",
                                   hint="export with --dtype bf16 or f32")
            writer.add_tensor(name, data.astype(np.float16))
        else:
            bf16 = torch.from_numpy(data).to(torch.bfloat16).view(torch.int16).numpy()
            writer.add_tensor(name, bf16, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path
