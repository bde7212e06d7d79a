"""`leansft doctor`: each check passes on a correct set-up and fails on a deliberately broken one."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import run_config, tiny_bloom

from leansft.core.model import attention as attn_mod
from leansft.tools import doctor
from leansft.tools.cli import main

pytestmark = pytest.mark.slow  # each test runs doctor on a real model and data


def statuses(cfg) -> dict[str, str]:
    return {c.name: c.status for c in doctor.run_checks(cfg)}


def test_all_checks_pass_on_a_correct_setup(tmp_path, tiny_run_assets, monkeypatch):
    cfg = run_config(tmp_path, tiny_run_assets, "data.max_length=4096", "batching.tokens_per_micro_batch=4096")
    checks = {c.name: c for c in doctor.run_checks(cfg)}
    got = {name: c.status for name, c in checks.items()}
    assert set(got) == {"template", "truncation", "isolation", "loss", "positions", "normalisation", "memory",
                        "throughput"}
    assert all(s == "PASS" for s in got.values()), got
    # the stop tokens the loss ends with, and how often each ended a turn
    assert "stop tokens (template 'tokenizer'): <|im_end|>" in checks["template"].message
    assert "ended by <|im_end|> x" in checks["template"].message


def test_mixing_attention_fails_isolation(tmp_path, tiny_run_assets, monkeypatch):
    def mixing(module, q, k, v, mask, scaling=None, dropout=0.0, **kw):  # causal over the whole row
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    monkeypatch.setattr(attn_mod, "sdpa_varlen_attention", mixing)
    cfg = run_config(tmp_path, tiny_run_assets, "data.max_length=4096", "batching.tokens_per_micro_batch=4096",
                     "training.verify=skip")  # the safety check bypassed: doctor must still see it
    checks = {c.name: c for c in doctor.run_checks(cfg)}
    assert checks["isolation"].status == "FAIL"
    assert checks["isolation"].numbers["max_logit_diff"] > 1e-3
    assert "examples see each other" in checks["isolation"].message and checks["isolation"].fix
    # with the default safety net, the same model trains unpacked instead: doctor says so
    cfg = run_config(tmp_path, tiny_run_assets, "data.max_length=4096", "batching.tokens_per_micro_batch=4096")
    checks = {c.name: c for c in doctor.run_checks(cfg)}
    assert checks["isolation"].status == "WARN" and "falls back to sorted" in checks["isolation"].message


def test_template_without_findable_assistant_turns_fails(tmp_path, tiny_run_assets):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}Assistant:{% endif %}")
    cfg = run_config(tmp_path, tiny_run_assets, f"data.template={broken}")
    checks = doctor.run_checks(cfg)
    assert checks[0].name == "template" and checks[0].status == "FAIL"
    assert "cannot be trained exactly" in checks[0].message and checks[0].fix


def test_end_of_turn_masked_like_a_pad_token_fails(tmp_path, tiny_run_assets, monkeypatch):
    from leansft.core.data.masking import ChatEncoder

    real = ChatEncoder._labels

    def pad_masking(self, tokens, *a):  # the classic bug: labels[ids == pad_id] = -100 with pad == eos
        encoded, seams = real(self, tokens, *a)
        encoded[1][tokens.ids == self.tok.pad_token_id] = -100  # (input_ids, labels)
        return encoded, seams

    monkeypatch.setattr(ChatEncoder, "_labels", pad_masking)
    cfg = run_config(tmp_path, tiny_run_assets, "data.max_length=4096", "batching.tokens_per_micro_batch=4096")
    checks = {c.name: c for c in doctor.run_checks(cfg)}
    assert checks["template"].status == "FAIL"
    assert "pad token == eos" in checks["template"].message


def test_max_length_that_truncates_most_examples_fails(tmp_path, tiny_run_assets):
    got = statuses(run_config(tmp_path, tiny_run_assets, "data.max_length=48", "batching.tokens_per_micro_batch=96"))
    assert got["truncation"] == "FAIL"


def test_positions_that_do_not_restart_fail(tmp_path, tiny_run_assets, monkeypatch):
    from leansft.core.batching import collate

    real = collate.collate_packed

    def no_restart(*a, **k):
        b = real(*a, **k)
        b.position_ids = torch.arange(b.input_ids.shape[1])[None]
        return b

    monkeypatch.setattr(collate, "collate_packed", no_restart)
    got = statuses(run_config(tmp_path, tiny_run_assets, "data.max_length=4096", "batching.tokens_per_micro_batch=4096"))
    assert got["positions"] == "FAIL"


def test_per_micro_batch_mean_loss_fails_normalisation(tmp_path, tiny_run_assets, monkeypatch):
    from leansft.core.model import forward as step_mod

    real = step_mod.LossModule.forward

    def mean_loss(self, batch):  # the classic bug: each micro-batch averaged over its own tokens
        return real(self, batch) / max(batch.target_tokens, 1) * 100

    monkeypatch.setattr(step_mod.LossModule, "forward", mean_loss)
    got = statuses(run_config(tmp_path, tiny_run_assets, "data.max_length=4096", "batching.tokens_per_micro_batch=4096"))
    assert got["normalisation"] == "FAIL"


def test_cli_exit_codes_and_json(tmp_path, tiny_run_assets):
    import yaml

    cfg = run_config(tmp_path, tiny_run_assets, "data.max_length=48", "batching.tokens_per_micro_batch=96")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = tmp_path / "doctor.json"
    assert main(["doctor", str(path), "--json", str(out)]) == 1
    results = json.loads(out.read_text())
    assert {r["name"]: r["status"] for r in results}["truncation"] == "FAIL"
    assert main(["train", str(path), "--doctor"]) == 1  # refuses to train
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert results[-1]["numbers"]["real_tokens_per_s"] > 0


def test_tokenizer_larger_than_the_model_fails_without_a_traceback(tmp_path, tiny_run_assets, qwen25_path):
    cfg = run_config(tmp_path, tiny_run_assets, f"tokenizer={qwen25_path}")
    checks = {c.name: c for c in doctor.run_checks(cfg)}
    assert checks["vocabulary"].status == "FAIL" and "tokenizer does not belong" in checks["vocabulary"].message


def test_bloom_packed_fails_isolation_when_the_safety_check_is_bypassed(tmp_path, tiny_run_assets, tiny_bpe_path):
    bloom = tiny_bloom(tmp_path / "bloom", tiny_bpe_path)
    cfg = run_config(tmp_path, tiny_run_assets, f"model={bloom}", "training.verify=skip")
    checks = {c.name: c for c in doctor.run_checks(cfg)}
    assert checks["isolation"].status == "FAIL" and checks["isolation"].numbers["architecture"].startswith("Bloom")
    sorted_cfg = run_config(tmp_path, tiny_run_assets, f"model={bloom}", "batching.strategy=sorted")
    checks = {c.name: c for c in doctor.run_checks(sorted_cfg)}
    assert checks["isolation"].status == "PASS" and checks["loss"].status == "PASS"


def test_template_check_counts_tool_calls_per_source_and_fails_when_tools_are_lost(tmp_path, tiny_run_assets):
    from helpers import trl_template
    from test_tools import GLAIVE

    cfg = run_config(tmp_path, tiny_run_assets, f"data.sources=[{GLAIVE}]", f"data.template={trl_template('qwen2_5')}",
                     "data.max_length=1024", "batching.tokens_per_micro_batch=2048")
    template = doctor.run_checks(cfg)[0]
    assert template.name == "template" and template.status == "PASS", template.message
    stats = template.numbers["sources"][GLAIVE]
    assert stats["tool_call_turns"] > 0 and stats["tool_results"] > 0
    assert "with tool calls" in template.message
    # plain ChatML (the tiny tokenizer's own template) drops the tools: FAIL, naming the tools
    checks = doctor.run_checks(run_config(tmp_path, tiny_run_assets, f"data.sources=[{GLAIVE}]"))
    assert checks[0].status == "FAIL" and "does not render the tool definitions" in checks[0].message


@pytest.mark.parametrize("model_type", ["gptj", "falcon", "bloom", "mamba", "llama"])
def test_doctor_judges_the_path_train_takes(tmp_path, tiny_run_assets, model_type):
    """Where train falls back to sorted (unpacked) batches, doctor checks positions, normalisation, memory and
    throughput on those batches too: the same verdict as train's pre-flight check, and no FAIL (or crash)
    from a path the run will not use."""
    import warnings

    import transformers as tf
    from test_architectures import ARCHITECTURES, SMALL

    from leansft.core.data.prepare import prepare_data
    from leansft.recipe.builders import build_model, verified_strategy

    tok = tf.AutoTokenizer.from_pretrained(tiny_run_assets["model"])
    kw = {k: v for k, v in {**SMALL, **ARCHITECTURES[model_type]}.items() if v is not None}
    kw.update(vocab_size=len(tok), max_position_embeddings=1024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(model_type, **kw))
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    length = 96 if model_type == "mamba" else 256  # mamba's CPU scan steps token by token, backward too
    cfg = run_config(tmp_path, {**tiny_run_assets, "model": str(folder)}, f"data.max_length={length}",
                     f"batching.tokens_per_micro_batch={length}")
    checks = {c.name: c for c in doctor.run_checks(cfg)}
    failed = {n: c.message for n, c in checks.items() if c.status == "FAIL" and n != "truncation"}  # data, not path
    assert not failed, failed
    prep = prepare_data(cfg.data, str(folder), holdout=False)
    strategy = verified_strategy(cfg, build_model(cfg, torch.device("cpu"), True, str(folder))[0], prep.train,
                                 tok.pad_token_id)
    assert (checks["isolation"].status == "WARN") == (strategy == "sorted")
    assert ("padded batches" in checks["positions"].message) == (strategy == "sorted")


def test_examples_past_a_fixed_position_table_fail_the_positions_check(tmp_path, tiny_run_assets):
    """GPT-J's rotary table is precomputed for n_positions: doctor names the max_length that fits under
    "positions" (and stops there: the model cannot embed this data)."""
    import warnings

    import transformers as tf
    from test_architectures import ARCHITECTURES, SMALL

    tok = tf.AutoTokenizer.from_pretrained(tiny_run_assets["model"])
    kw = {**SMALL, **ARCHITECTURES["gptj"], "vocab_size": len(tok), "max_position_embeddings": 64}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model("gptj", **kw))
    folder = tmp_path / "gptj"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    checks = doctor.run_checks(run_config(tmp_path, {**tiny_run_assets, "model": str(folder)}))
    assert checks[-1].name == "positions" and checks[-1].status == "FAIL"
    assert "positions only" in checks[-1].message and "data.max_length to 64" in checks[-1].fix
