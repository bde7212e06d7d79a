"""Check `leansft export --to gguf` in llama.cpp itself: token ids and logits of tiny models against transformers.

A development check, not a test: it needs llama-cpp-python built on this machine, e.g.

    python -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python==0.3.36   # builds llama.cpp
    PYTHONPATH=$(echo /tmp/llvenv/lib/python3*/site-packages) .venv/bin/python scripts/check_gguf_in_llama_cpp.py

For each architecture a tiny random model (weights scaled up, so logits are far from zero) is exported at f32 and
run in llama.cpp (f32 KV cache) on a ~300-token text: the token ids must be the HF tokenizer's, and the table gives
the largest logit difference as a share of the largest logit. Then the same for SentencePiece tokenizers saved as
tokenizer.json alone (the export rebuilds their tokenizer.model): Llama 2's conventions with the Mistral template,
Gemma's with the Gemma template, and Gemma 3's own 262k tokenizer where the npm cache has it; their ids are compared
on the export's probe texts alone and inside the chat template (``leansft.core.gguf.write.probe_texts``), tokenized
by llama.cpp with special tokens parsed.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers as tf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import build_tiny_bpe, build_tiny_sentencepiece, offline_counter_dir, prepend_style_tokenizer  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. Hello! How can I help you today? What is the capital of "
        "France? Paris is the capital. Two plus two equals four, 1234 and 56. ") * 6
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)


def main() -> None:
    from llama_cpp import Llama

    from leansft.recipe.export_run import export_source

    tmp = Path(tempfile.mkdtemp())
    bpe = build_tiny_bpe(tmp / "bpe")
    sp = prepend_style_tokenizer(build_tiny_sentencepiece(tmp / "spm", "llama"), tmp / "sp")  # Phi-3's form
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
    sentencepiece(tmp, Llama, export_source)


def sentencepiece(tmp: Path, Llama, export_source) -> None:
    from leansft.core.gguf.write import PROBE_TEXTS, probe_texts

    gemma3 = Path.home() / ".cache" / "leansft-test-assets" / "tokenizer-gemma3"
    gemma = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32}
    folders = {"llama (SentencePiece, Metaspace first)":
               (tf.LlamaConfig, build_tiny_sentencepiece(tmp / "spl", "llama"), {}),
               "gemma3 (SentencePiece, Gemma's)": (tf.Gemma3TextConfig, build_tiny_sentencepiece(tmp / "spg", "gemma"),
                                                   gemma)}
    if (gemma3 / "tokenizer.json").exists():
        folders["gemma3 (Gemma 3's own tokenizer)"] = (tf.Gemma3TextConfig, str(gemma3), gemma)
    print("\n| tokenizer | add_space_prefix | probe texts alone: ids as HF | inside the template: ids as HF |")
    print("| --- | --- | --- | --- |")
    for i, (name, (config, tokenizer_path, extra)) in enumerate(folders.items()):
        tok = tf.AutoTokenizer.from_pretrained(tokenizer_path)
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config(vocab_size=len(tok), **TINY, **extra)).eval()
        folder = tmp / f"sp{i}"
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        path = export_source(str(folder), "gguf", str(tmp / f"sp{i}.gguf"), "f32")
        llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
        prefix = llm.metadata.get("tokenizer.ggml.add_space_prefix")

        def same(texts: list[str]) -> str:
            ok = [llm.tokenize(t.encode(), add_bos=False, special=True) == tok(t, add_special_tokens=False)["input_ids"]
                  for t in texts]
            return f"{sum(ok)}/{len(ok)}"

        templated = [t for t in probe_texts(tok, raw_texts=False) if t not in PROBE_TEXTS]
        print(f"| {name} | {prefix} | {same(list(PROBE_TEXTS))} | {same(templated)} |")


if __name__ == "__main__":
    main()
