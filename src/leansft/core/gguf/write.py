"""Convert a Hugging Face model folder into one GGUF file for llama.cpp / Ollama, with llama.cpp's own converter.

The converter is llama.cpp's ``convert_hf_to_gguf`` code, vendored at a pinned revision (``leansft._vendor.llama_cpp``,
see its README.md) and run in this process: the ~100 architectures it converts, each as llama.cpp reads it (tensor
names and layouts, rotary scaling, sliding windows, the pre-tokenizer's name). Around it leansft adds:

- a byte-level BPE tokenizer that splits text as GPT-2 does (no normalizer, GPT-2's ByteLevel settings) is named
  ``gpt-2`` where the converter's table of vocabularies does not know it (one trained from scratch, say); any other
  tokenizer it does not know is refused, as the converter refuses it (llama.cpp would split prompts otherwise);
- the chat template's stop tokens: llama.cpp ends generation at the file's eos, eot and eom ids and at texts it
  knows, so a template that closes turns with another token gets it as eot (or eom), and more stops than fit are
  refused; Ollama's engines read the ``tokenizer.ggml.eos_token_ids`` list;
- a sliding window the file does not state (llama.cpp's ``llama``/``qwen2`` graphs attend to every earlier token:
  a Mistral v0.1 with a 16-token window gave the HF logits up to token 16 and 16% off after it) becomes the context
  length the file states, with a warning: up to it, the file is the model;
- a Gemma 3 that llama.cpp's gemma3 graph would compute otherwise is refused: a ``query_pre_attn_scalar`` other
  than the head size (hidden/heads at 62 layers, the 27B), or ``layer_types`` other than five sliding-window
  layers, then one of full attention (llama.cpp reads neither from the file);
- one line, not a traceback, where the converter does not cover the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import get_args

import torch

from leansft.core.config import GGUFDType
from leansft.core.errors import LeanSFTError, ModelError
from leansft.core.paths import plain_file_mode

log = logging.getLogger("leansft")

DTYPES = get_args(GGUFDType)
CONVERTER = "llama.cpp's converter (as vendored in llama-cpp-python 0.3.36)"
# Token texts llama.cpp ends generation on whatever the file says (llama-vocab.cpp's EOG list); it also stops on
# the file's eos, eot and eom ids. Any other stop token must be one of those ids or llama.cpp generates past it.
LLAMA_CPP_EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                                 "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
                                 "<end_of_utterance>"})
GGUF_MARKER_KEY = "leansft.export"  # what wrote the file, from what: llama.cpp ignores keys it does not use
# GPT-2's own pre-tokenizer (its regex, no prefix space): llama.cpp's ``gpt-2``
_GPT2_PRE = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


@contextlib.contextmanager
def _quiet(level: int = logging.ERROR) -> Iterator[None]:
    """The converter logs a line per tensor and token setting (INFO) and a banner before refusing a tokenizer
    (WARNING): kept off leansft's console while it runs."""
    loggers = [logging.getLogger(name) for name in ("hf-to-gguf", "leansft._vendor")]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, was in zip(loggers, before, strict=True):
            lg.setLevel(was)


def splits_as_gpt2(tokenizer) -> bool:
    """Whether ``tokenizer`` splits text before BPE exactly as GPT-2 does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or backend.pre_tokenizer is None:
        return False
    pre = json.loads(backend.pre_tokenizer.__getstate__())
    return all(pre.get(k) == v for k, v in _GPT2_PRE.items())


def _model_class(folder: Path):
    """The converter's class for the folder's architecture, knowing GPT-2's own pre-tokenizer by its settings."""
    from leansft._vendor.llama_cpp.conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    hparams = ModelBase.load_hparams(folder, False)
    arch = get_model_architecture(hparams, ModelType.TEXT)
    try:
        base = get_model_class(arch)
    except NotImplementedError:
        raise LeanSFTError(f"GGUF export: {CONVERTER} does not convert {arch}",
                           hint="export a Hugging Face folder (--to hf) and convert it with a newer llama.cpp's "
                                "convert_hf_to_gguf.py") from None

    class Converter(base):  # the converter's own class, one method wrapped
        model_arch = base.model_arch

        def get_vocab_base_pre(self, tokenizer) -> str:
            try:
                with _quiet(logging.CRITICAL):
                    return super().get_vocab_base_pre(tokenizer)
            except NotImplementedError:
                if splits_as_gpt2(tokenizer):
                    return "gpt-2"
                raise LeanSFTError(f"GGUF export: {CONVERTER} does not know this tokenizer's pre-tokenizer (the "
                                   "hash of its token ids is not in its table), so llama.cpp would split text "
                                   "differently from training",
                                   hint="export a Hugging Face folder (--to hf) and convert it with a llama.cpp whose "
                                        "convert_hf_to_gguf.py knows this tokenizer") from None

    return Converter


def convert(folder: Path, path: Path, dtype: str = "f16", stop_ids: Sequence[int] = (),
            source: str | None = None) -> Path:
    """Write ``folder`` (a Hugging Face model folder) as the GGUF file ``path``: into a fresh temporary file beside
    it, renamed into place once whole. Tensors in ``dtype`` (f32, f16, bf16 or q8_0; norms and other small tensors
    f32, as the converter decides); ``stop_ids``: the token ids generation must stop at (``stop_token_ids``);
    ``source``: what was exported, recorded in the file's ``GGUF_MARKER_KEY``. ``folder`` gains a tokenizer.model
    and added-token types where it lacks them (``_give_sentencepiece_model``): pass a folder leansft wrote itself
    (``export_source`` passes its own temporary export), never a user's."""
    from leansft._vendor.llama_cpp import gguf

    if dtype not in DTYPES:
        raise LeanSFTError(f"unknown GGUF dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
    config = json.loads((folder / "config.json").read_text())
    _check_gemma3(config)
    tokenizer_json = folder / "tokenizer.json"  # read once (Gemma 3's is 33 MB of JSON, half a second to read)
    tj = json.loads(tokenizer_json.read_text(encoding="utf-8")) if tokenizer_json.is_file() else None
    _give_sentencepiece_model(folder, tj)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp.gguf")  # this call's own
    os.close(fd)
    tmp = Path(name)
    try:
        with _quiet(), torch.inference_mode():
            model = _model_class(folder)(folder, ftype, tmp, model_name=path.stem)
            model.prepare_tensors()
            model.prepare_metadata(vocab_only=False)
            _add_generation_stops(model.gguf_writer, stop_ids)
            _state_sliding_window(model.gguf_writer, config)
            prefix = _state_space_prefix(model.gguf_writer, folder, tj)
            model.gguf_writer.add_string(GGUF_MARKER_KEY, _marker(source))
            model.gguf_writer.write_header_to_file(path=tmp)
            model.gguf_writer.write_kv_data_to_file()
            model.gguf_writer.write_tensors_to_file(progress=False)
            model.gguf_writer.close()
        check_tokenizer(tmp, folder, raw_texts=prefix != "first")
        os.chmod(tmp, plain_file_mode())  # mkstemp's 0600 would keep a server running as another user out
        os.replace(tmp, path)
    except LeanSFTError:
        raise
    except Exception as err:  # noqa: BLE001 - the converter's refusals (a missing tokenizer.model...): one line
        raise LeanSFTError(f"GGUF export: {CONVERTER} stopped: {type(err).__name__}: {str(err)[:300]}",
                           file=str(folder), hint="export a Hugging Face folder (--to hf) instead") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _give_sentencepiece_model(folder: Path, tj: dict | None) -> None:
    """A ``tokenizer.model`` where the folder's tokenizer is SentencePiece-style and has none (transformers 5 saves
    tokenizer.json alone; a model read from a GGUF never had one): llama.cpp's converter writes a SentencePiece
    tokenizer only from that file, and took such a vocabulary for byte-level BPE without it
    (``core/gguf/sentencepiece.py``). And the added tokens' types where tokenizer_config.json has none: the
    converter reads them from its ``added_tokens_decoder``, which transformers 5 no longer writes, so a user-defined
    token (matched whole, like a <start_of_turn> its tokenizer does not call special) became an ordinary piece,
    cut into pieces by llama.cpp."""
    from leansft.core.gguf.sentencepiece import added_tokens_decoder, rebuild

    if tj is None:  # no tokenizer.json
        return
    if not (folder / "tokenizer.model").is_file():
        model = rebuild(folder, tj)
        if model is not None:
            (folder / "tokenizer.model").write_bytes(model)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if (folder / "tokenizer.model").is_file() and not config.get("added_tokens_decoder"):
        config["added_tokens_decoder"] = added_tokens_decoder(tj)
        config_file.write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")


def _state_space_prefix(writer, folder: Path, tj: dict | None) -> str | None:
    """A SentencePiece file's ``add_space_prefix`` as the trained tokenizer prefixes text (``space_prefix``):
    llama.cpp prefixes a ``▁`` at the start and after every special token where it is true (its default when the
    key is missing, which the converter leaves for Llama's family). A tokenizer that prefixes only the very start
    of the text (``first``) and has a chat template gets false: inside the template, after a special token, it adds
    none, and llama.cpp then tokenizes templated prompts as training did (a prompt with no special token before it
    would get no ``▁``); without a template its prompts are plain text, which true serves. Returns ``first`` where
    the choice serves templated prompts only (their check is then the templated one), else the prefix kind."""
    from leansft.core.gguf.sentencepiece import space_prefix

    kv = writer.kv_data[0]
    if "tokenizer.ggml.model" not in kv or kv["tokenizer.ggml.model"].value != "llama" or tj is None:
        return None
    found = space_prefix(tj)
    if found == "first" and not _has_chat_template(folder):
        found = "always"
    key = "tokenizer.ggml.add_space_prefix"
    if key in kv:
        kv[key] = dataclasses.replace(kv[key], value=found == "always")
    else:
        writer.add_add_space_prefix(found == "always")
    return found


def _has_chat_template(folder: Path) -> bool:
    config, jinja = folder / "tokenizer_config.json", folder / "chat_template.jinja"
    return (jinja.is_file() and bool(jinja.read_text(encoding="utf-8").strip())) or (
        config.is_file() and bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template")))


# Texts every export is checked on (with the chat template's rendering of a conversation): what tokenizers split
# differently when their pre-tokenizer, normaliser or merges differ.
PROBE_TEXTS = (
    "Hello world! How are you today?", "line one\nline two\n\n\nfour newlines\n\n\n\n",
    "  two leading spaces, then    four, and a trailing one ", "\ttab\t\tseparated\t\t\tcolumns\t",
    "digits 0 7 42 123 1234 12345 3.14159 -17 1,000,000 2026-12-05", "emoji 🤖🚀👍🏽 ❤️ 🇫🇷",
    "日本語のテキストと中文文本，한국어 텍스트", "naïve café déjà vu Ærøskøbing Łódź straße",
    "def f(x):\n    return [i ** 2 for i in range(x) if i % 3 == 0]  # squares\n",
    "{\"key\": [1, 2, {\"nested\": null}], 'quote': \"it's\"}", "MiXeD CaSe, UPPER, lower; punctuation!?...",
)


def check_tokenizer(file: Path, folder: Path, raw_texts: bool = True) -> None:
    """The GGUF ``file``'s tokenizer must give the trained tokenizer's (``folder``'s) token ids on ``PROBE_TEXTS``
    rendered by its chat template inside a conversation (a user turn, an assistant turn, special tokens included)
    and, with ``raw_texts``, on the texts alone; else a refusal naming the first text that differs (the caller
    removes the file). A SentencePiece file is read as llama.cpp reads it (``LlamaCppSentencePiece``); a byte-level
    one as transformers' GGUF reader builds it (``read.byte_level_tokenizer``: the split llama.cpp's pre-tokenizer
    name stands for)."""
    from transformers import AutoTokenizer

    from leansft.core.gguf.metadata import read_metadata
    from leansft.core.gguf.read import byte_level_tokenizer
    from leansft.core.gguf.sentencepiece import LlamaCppSentencePiece

    trained = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    hint = "export a Hugging Face folder (--to hf) and convert it with a llama.cpp that places this tokenizer"
    fields = read_metadata(file, "tokenizer.ggml.")  # read back from the file just written
    try:
        if fields.get("tokenizer.ggml.model") == "llama":
            encode = LlamaCppSentencePiece(fields).encode
        elif fields.get("tokenizer.ggml.model") == "gpt2":
            encode = lambda text, tok=byte_level_tokenizer(fields): tok.encode(text).ids  # noqa: E731
        else:
            raise ModelError(f"leansft cannot check a '{fields.get('tokenizer.ggml.model')}' tokenizer")
    except Exception as err:  # noqa: BLE001 - a tokenizer leansft cannot read back is one it cannot confirm
        raise LeanSFTError(f"GGUF export: the written file's tokenizer cannot be read back to confirm it: "
                           f"{type(err).__name__}: {str(err)[:300]}", hint=hint) from None
    for text in probe_texts(trained, raw_texts):
        want = trained(text, add_special_tokens=False)["input_ids"]
        got = encode(text)
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise LeanSFTError(f"GGUF export: the written file's tokenizer gives other token ids than the trained "
                               f"tokenizer on {text[:60]!r} (from token {at}: {got[at:at + 4]} instead of "
                               f"{want[at:at + 4]}); the file is not written", hint=hint)


def probe_texts(tokenizer, raw_texts: bool = True) -> list[str]:
    """``PROBE_TEXTS`` (with ``raw_texts``) and each rendered by the tokenizer's chat template inside a conversation."""
    texts = list(PROBE_TEXTS) if raw_texts or not tokenizer.chat_template else []
    if not tokenizer.chat_template:
        return texts
    for probe in PROBE_TEXTS:
        chat = [{"role": "user", "content": probe}, {"role": "assistant", "content": probe},
                {"role": "user", "content": "And " + probe}]
        try:
            texts.append(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
        except Exception:  # noqa: BLE001 - a template that refuses such a conversation: the texts alone, then
            return list(PROBE_TEXTS)
    return texts


def _marker(source: str | None) -> str:
    from leansft import __version__

    return json.dumps({"written_by": f"leansft {__version__}", "source": source})


def exported_by_leansft(path: Path) -> bool:
    """Whether ``path`` is a GGUF file leansft exported (its metadata holds ``GGUF_MARKER_KEY``)."""
    try:
        from leansft.core.gguf.metadata import read_metadata

        return GGUF_MARKER_KEY in read_metadata(path, GGUF_MARKER_KEY)
    except Exception:  # noqa: BLE001 - not a GGUF file, or a damaged one: not an export of leansft's
        return False


def _add_generation_stops(writer, stop_ids: Sequence[int]) -> None:
    """Make every stop token a stop in llama.cpp and Ollama. llama.cpp stops on eos, eot, eom and texts it knows:
    the others (a template's own end-of-turn token) become the free eot/eom ids, refused where more are left
    than those two slots. Ollama's engines stop on eos and the ``eos_token_ids`` list its converter writes."""
    kv = {k: v.value for k, v in writer.kv_data[0].items()}
    tokens = [t.decode("utf-8", "replace") if isinstance(t, bytes) else t for t in kv.get("tokenizer.ggml.tokens") or []]
    text = lambda i: tokens[i] if i < len(tokens) else None  # noqa: E731
    named = {kv.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")}
    missing = [i for i in stop_ids if i not in named and text(i) not in LLAMA_CPP_EOG_TEXTS]
    free = [k for k in ("eot", "eom") if f"tokenizer.ggml.{k}_token_id" not in kv]
    if len(missing) > len(free):
        raise LeanSFTError(f"GGUF export: llama.cpp would not stop generating at the stop tokens "
                           f"{[text(i) for i in missing]} (a GGUF names at most an eot and an eom token besides eos)",
                           hint="export a Hugging Face folder (--to hf) instead")
    for kind, i in zip(free, missing, strict=False):
        getattr(writer, f"add_{kind}_token_id")(i)
    if set(stop_ids) - {kv.get("tokenizer.ggml.eos_token_id")} and "tokenizer.ggml.eos_token_ids" not in kv:
        writer.add_array("tokenizer.ggml.eos_token_ids", sorted(int(i) for i in stop_ids))


def _state_sliding_window(writer, config: dict) -> None:
    """A sliding window inside the model's context that the file does not state becomes its context length."""
    kv = writer.kv_data[0]
    arch = kv["general.architecture"].value
    window, context = config.get("sliding_window"), kv.get(f"{arch}.context_length")
    if "sliding_attention" not in config.get("layer_types", ["sliding_attention"]):
        window = None  # Qwen2 without use_sliding_window: every layer attends to everything
    if not window or context is None or window >= context.value or f"{arch}.attention.sliding_window" in kv:
        return
    log.warning("GGUF export: llama.cpp runs %s without its %d-token sliding window, so the file is this model up to "
                "%d tokens; its context length says %d (not %d)", config.get("model_type"), window, window, window,
                context.value)
    kv[f"{arch}.context_length"] = dataclasses.replace(context, value=int(window))


def _check_gemma3(config: dict) -> None:
    """What llama.cpp's gemma3 graph assumes and reads from no key: queries scaled by 1/sqrt(head size), or
    1/sqrt(hidden/heads) for 62 layers (the 27B); every sixth layer of full attention, the others sliding."""
    if config.get("model_type") not in ("gemma3", "gemma3_text"):
        return
    text = config.get("text_config", config)
    layers, hidden, heads = text.get("num_hidden_layers"), text.get("hidden_size"), text.get("num_attention_heads")
    used = hidden // heads if layers == 62 else text.get("head_dim", 256)
    scalar = text.get("query_pre_attn_scalar", 256)
    if scalar != used:
        raise LeanSFTError(f"GGUF export: llama.cpp scales this Gemma 3's queries by 1/sqrt({used}), the model by "
                           f"1/sqrt(query_pre_attn_scalar={scalar}): llama.cpp would compute other logits",
                           hint="export a Hugging Face folder (--to hf) instead")
    pattern = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    if text.get("sliding_window") and text.get("layer_types", pattern) != pattern:
        raise LeanSFTError("GGUF export: llama.cpp gives Gemma 3 full attention in every sixth layer and a sliding "
                           f"window in the others, this model {text['layer_types']}: llama.cpp would compute other "
                           "logits", hint="export a Hugging Face folder (--to hf) instead")
