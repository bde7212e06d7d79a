"""Write a model as one GGUF file for llama.cpp / Ollama, with the ``gguf`` package's writer.

Supported: Llama, Mistral (llama.cpp's ``llama`` architecture, named so transformers reads it back as
Mistral) and Qwen2, with a byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``): what transformers
can read back with ``from_pretrained(..., gguf_file=...)``, which the tests do. Others are refused. As
llama.cpp's converter does, the q/k projections of the ``llama`` architecture are permuted for its rotary
layout, norms stay float32, and a tied output layer is not written twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import numpy as np
import torch

from leansft.core.config import GGUFDType
from leansft.core.errors import LeanSFTError

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
DTYPES = get_args(GGUFDType)


def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k (its convert_hf_to_gguf ``permute``)."""
    n = n_head_kv if n_head_kv != n_head else n_head
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_vocab(tokenizer) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, token types, merges) of a byte-level BPE tokenizer, or a clear refusal."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise LeanSFTError("GGUF export supports byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM style); "
                           f"this one is {model.get('type')}", hint="export a Hugging Face folder (--to hf) instead")
    size = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = set(tokenizer.all_special_ids)
    added = {i for i, t in tokenizer.added_tokens_decoder.items()}
    types = [3 if i in special else 4 if i in added else 1 for i in range(size)]  # control, user-defined, normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def export_gguf(model, tokenizer, chat_template: str | None, path: Path, dtype: str = "f16") -> Path:
    """Write ``model`` (a transformers causal LM, LoRA already merged) and ``tokenizer`` to ``path``."""
    import gguf  # the optional [gguf] extra

    cfg = model.config
    arch = ARCHITECTURES.get(cfg.model_type)
    if arch is None:
        raise LeanSFTError(f"GGUF export supports {', '.join(sorted(ARCHITECTURES))}, not '{cfg.model_type}'",
                           hint="export a Hugging Face folder (--to hf) and convert it with llama.cpp")
    if dtype not in DTYPES:
        raise LeanSFTError(f"unknown GGUF dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    tokens, types, merges = _tokenizer_vocab(tokenizer)
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(f"{cfg.model_type} (leansft)" if cfg.model_type != "mistral" else "mistral (leansft)")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    writer.add_file_type(file_type)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, tid in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                      ("pad", tokenizer.pad_token_id), ("unk", tokenizer.unk_token_id)):
        if tid is not None:
            getattr(writer, f"add_{name}_token_id" if name != "unk" else "add_unk_token_id")(tid)
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    if chat_template:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2,
                                     cfg.num_hidden_layers)
    state = model.state_dict()
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for hf_name, tensor in state.items():
        if tied and hf_name == "lm_head.weight":
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise LeanSFTError(f"GGUF export: no GGUF name for tensor '{hf_name}'")
        data = tensor.detach().to(torch.float32).cpu().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = _permute(data, n_head, n_head)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = _permute(data, n_head, n_kv)
        if data.ndim == 1 or dtype == "f32":
            writer.add_tensor(name, data.astype(np.float32))
        elif dtype == "f16":
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
