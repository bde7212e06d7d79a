"""Check `leansft export --to gguf` in llama.cpp itself: token ids and logits of tiny models against transformers.

A development check, not a test: it needs llama-cpp-python built on this machine, e.g.

    python -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python==0.3.36   # builds llama.cpp
    PYTHONPATH=$(echo /tmp/llvenv/lib/python3*/site-packages) .venv/bin/python scripts/check_gguf_in_llama_cpp.py

For each architecture a tiny random model (weights scaled up, so logits are far from zero) is exported at f32 and
run in llama.cpp (f32 KV cache) on a ~300-token text: the token ids must be the HF tokenizer's, and the table gives
the largest logit difference as a share of the largest logit.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers as tf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import build_tiny_bpe, offline_counter_dir  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. Hello! How can I help you today? What is the capital of "
        "France? Paris is the capital. Two plus two equals four, 1234 and 56. ") * 6
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)


def sentencepiece_folder(dest: Path) -> str:
    """Mistral 7B v0.1's SentencePiece model (Llama 2's kind, as Phi-3 uses), from mistral-common."""
    dest.mkdir(parents=True, exist_ok=True)
    data = Path(importlib.util.find_spec("mistral_common").origin).parent / "data"
    shutil.copy(data / "tokenizer.model.v1", dest / "tokenizer.model")
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return str(dest)


def main() -> None:
    from llama_cpp import Llama

    from leansft.recipe.export_run import export_source

    tmp = Path(tempfile.mkdtemp())
    bpe, sp = build_tiny_bpe(tmp / "bpe"), sentencepiece_folder(tmp / "sp")
    qwen = str(offline_counter_dir("qwen-2.5", tmp / "qwen"))
    cases = {
        "llama": (tf.LlamaConfig, bpe, {}),
        "llama3-rope": (tf.LlamaConfig, bpe, {"rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        "mistral": (tf.MistralConfig, bpe, {"sliding_window": None}),
        "qwen2": (tf.Qwen2Config, qwen, {"tie_word_embeddings": True}),
        "gemma3": (tf.Gemma3TextConfig, bpe, {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 32,
                                              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}),
        "phi3": (tf.Phi3Config, sp, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}),
    }
    print("| model | tokens | ids as HF | max logit diff / max logit |\n| --- | --- | --- | --- |")
    for name, (config, tokenizer_path, extra) in cases.items():
        tok = tf.AutoTokenizer.from_pretrained(tokenizer_path)
        if name == "phi3":  # Phi-3's own added tokens (llama.cpp looks <|endoftext|> up in a model named phi3)
            tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|user|>", "<|assistant|>",
                                                                  "<|end|>"]})
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config(vocab_size=len(tok), **TINY, **extra)).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(8)
        folder = tmp / name
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        if (Path(tokenizer_path) / "tokenizer.model").exists():
            shutil.copy(Path(tokenizer_path) / "tokenizer.model", folder)
        path = export_source(str(folder), "gguf", str(tmp / f"{name}.gguf"), "f32")
        ids = tok(TEXT, add_special_tokens=False)["input_ids"]
        llm = Llama(model_path=str(path), n_ctx=1024, logits_all=True, verbose=False, type_k=0, type_v=0,
                    n_threads=2)
        same_ids = llm.tokenize(TEXT.encode(), add_bos=False, special=False) == ids
        llm.eval(ids)
        ours = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].numpy()
        rel = float(np.abs(ours - ref).max() / np.abs(ref).max())
        print(f"| {name} | {len(ids)} | {same_ids} | {rel:.1e} |")


if __name__ == "__main__":
    main()
