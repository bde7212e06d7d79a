"""Held-out evaluation, generation samples, best-checkpoint retention, reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_config, tiny_model

from leansft.core.batching.collate import collate_padded
from leansft.core.data.masking import IGNORE_INDEX, resolve_template, stop_token_ids
from leansft.core.inference.generation import generate
from leansft.core.inference.heldout_loss import evaluate
from leansft.core.io import checkpoint_files as ckpt
from leansft.core.model.attention import VARLEN, use_packed_attention, use_plain_attention
from leansft.recipe.train import train
from leansft.tools.cli import main


def _data(tmp_path, tok, n=12):
    from helpers import write_jsonl
    from test_dataset import build, rows

    return build(tok, tmp_path, [write_jsonl(tmp_path / "d.jsonl", rows(n))])[0]


def test_eval_loss_equals_padded_transformers_forward(tmp_path, load_tok, tiny_bpe_path):
    tok = load_tok(tiny_bpe_path)
    data = _data(tmp_path, tok)
    model = tiny_model("llama", vocab_size=len(tok))
    use_packed_attention(model, VARLEN)
    packed = evaluate(model, data, max_length=256, tokens_per_micro_batch=64)
    model.config._attn_implementation = "eager"
    batch = collate_padded(data, np.arange(len(data)), pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.labels[:, 1:].reshape(-1),
                                           ignore_index=IGNORE_INDEX, reduction="sum")
    n = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
    keep = batch.labels[:, 1:] != IGNORE_INDEX
    correct = int((logits[:, :-1].argmax(-1)[keep] == batch.labels[:, 1:][keep]).sum())
    assert packed["eval_targets"] == n
    assert packed["eval_loss"] == pytest.approx(float(ce) / n, rel=1e-5)
    # one example per micro-batch (unpacked) gives the same number
    use_packed_attention(model, VARLEN)
    single = evaluate(model, data, max_length=256, tokens_per_micro_batch=1)
    assert single["eval_loss"] == pytest.approx(packed["eval_loss"], rel=1e-5)
    assert packed["eval_token_accuracy"] == pytest.approx(correct / n)
    # a model training on padded batches (sorted/padded, or the fallback) keeps its padding-aware attention:
    # evaluated on padded batches, the same numbers
    use_plain_attention(model)
    padded = evaluate(model, data, max_length=256, tokens_per_micro_batch=300)
    assert padded["eval_targets"] == n and padded["eval_loss"] == pytest.approx(packed["eval_loss"], rel=1e-5)
    assert padded["eval_token_accuracy"] == pytest.approx(correct / n)


def test_stop_tokens_fall_back_to_eos_only_when_the_template_cannot_mark_turns(load_tok, tiny_bpe_path, monkeypatch):
    """A template leansft cannot mark turns in still generates, stopped by eos; any other failure is a bug and
    is raised, not turned into samples that run past the end of the turn."""
    from leansft.core.data import masking
    from leansft.core.errors import TemplateError

    tok = load_tok(tiny_bpe_path)
    template = resolve_template(tok, None)
    for error, raised in ((TemplateError("cannot mark the assistant turn"), False), (KeyError("input_ids"), True)):
        def fail(self, convs, err=error):
            raise err
        monkeypatch.setattr(masking.ChatEncoder, "encode", fail)
        if raised:
            with pytest.raises(KeyError):
                stop_token_ids(tok, template)
        else:
            assert stop_token_ids(tok, template) == sorted({tok.eos_token_id} - {None})


def test_sampling_reproducible_stops_at_end_of_turn_and_restores_train_mode(load_tok, tiny_bpe_path):
    tok = load_tok(tiny_bpe_path)
    template = resolve_template(tok, None)
    model = tiny_model("llama", vocab_size=len(tok), attention_dropout=0.1)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in stop_token_ids(tok, template)
    use_packed_attention(model, VARLEN)
    model.train()
    a = generate(model, tok, template, ["Hello there"], max_new_tokens=12, temperature=0.7, top_p=0.9, seed=3)
    b = generate(model, tok, template, ["Hello there"], max_new_tokens=12, temperature=0.7, top_p=0.9, seed=3)
    assert a == b
    assert model.training and all(m.training for m in model.modules())
    assert model.config._attn_implementation == VARLEN

    def favour_end_of_turn(_m, _i, logits):
        logits[..., im_end] += 1e4
        return logits

    model.lm_head.register_forward_hook(favour_end_of_turn)
    (short,) = generate(model, tok, template, ["Hello there"], max_new_tokens=12, temperature=0.0)
    assert short == ""  # stopped at <|im_end|> at once, the stop token not included


def _fake_checkpoints(folder: Path, losses: dict[int, float | None]) -> None:
    for step, loss in losses.items():
        p = folder / f"step-{step}"
        p.mkdir(parents=True)
        (p / "state.json").write_text(json.dumps({"step": step, "eval_loss": loss}))


def test_best_m_retention_keeps_lowest_eval_losses_plus_latest(tmp_path):
    _fake_checkpoints(tmp_path, {10: 2.0, 20: 1.5, 30: 1.7, 40: 1.2, 50: 1.9, 60: 1.8})
    kept = ckpt.prune(tmp_path, keep_last=1, keep_best=2)
    assert [p.name for p in kept] == ["step-20", "step-40", "step-60"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-20", "step-40", "step-60"]


@pytest.mark.slow
def test_early_stopping_and_report(tmp_path, tiny_run_assets):
    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=40", "training.learning_rate=0.5",
                     "data.eval_split=0.1", "eval.eval_every=2", "eval.early_stopping_patience=2",
                     "eval.samples_every=2", "eval.num_samples=1", "eval.max_new_tokens=4",
                     "training.max_grad_norm=null")
    train(cfg)
    run = Path(cfg.output_dir)
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] < 40  # a huge learning rate makes eval loss worse; patience 2 stops it
    assert (run / "samples.jsonl").exists()
    assert main(["report", str(run)]) == 0
    md = (run / "report.md").read_text()
    assert (run / "report.png").stat().st_size > 5000
    evals = [r for r in records if "eval_loss" in r]
    assert f"{evals[-1]['eval_loss']:.4f}" in md and "Last samples" in md and "learning_rate" in md


@pytest.mark.slow
def test_eval_and_generate_commands(tmp_path, tiny_run_assets, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", tiny_run_assets["model"], "--data", tiny_run_assets["data"], "--max-length", "128",
                 "--cache-dir", str(tmp_path / "c"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["eval_perplexity"] == pytest.approx(math.exp(result["eval_loss"])) and result["eval_targets"] > 0
    assert result["eval_precision"] == "fp32"
    # --precision bf16: the decoder under bf16 autocast (emulated where the CPU has no bf16 units), the loss near
    # fp32's but not the same computation
    assert main(["eval", tiny_run_assets["model"], "--data", tiny_run_assets["data"], "--max-length", "128",
                 "--cache-dir", str(tmp_path / "c"), "--json", str(out), "--precision", "bf16"]) == 0
    low = json.loads(out.read_text())
    assert low["eval_precision"] == "bf16 autocast" and low["eval_targets"] == result["eval_targets"]
    assert 0 < abs(low["eval_loss"] - result["eval_loss"]) < 1e-2 * result["eval_loss"]
    assert main(["generate", tiny_run_assets["model"], "--prompt", "Hi", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    assert "perplexity" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_and_generate_read_a_run_folder_as_export_does(tmp_path, tiny_run_assets, capsys):
    """`leansft eval RUN` and `generate RUN` read the run's newest checkpoint (LoRA merged, the run's template),
    like `export`: the same loss and answer as its exported final/ folder."""
    cfg = run_config(tmp_path, tiny_run_assets, "training.method=lora", "training.max_steps=2",
                     "checkpoint.export=true", "training.learning_rate=1e-2")
    train(cfg)
    run = Path(cfg.output_dir)
    results, answers = [], []
    for source in (run, run / "final"):
        out = tmp_path / "eval.json"
        assert main(["eval", str(source), "--data", tiny_run_assets["data"], "--max-length", "128",
                     "--cache-dir", str(tmp_path / "c"), "--json", str(out)]) == 0
        results.append(json.loads(out.read_text()))
        capsys.readouterr()
        assert main(["generate", str(source), "--prompt", "Hi", "--max-new-tokens", "4", "--temperature", "0"]) == 0
        answers.append(capsys.readouterr().out)
    assert results[0]["eval_loss"] == pytest.approx(results[1]["eval_loss"], rel=1e-5)
    assert results[0]["eval_targets"] == results[1]["eval_targets"] and answers[0] == answers[1]


def test_a_sample_prompt_on_the_console_starts_at_a_line_or_word():
    from leansft.recipe.evaluator import prompt_tail

    rendered = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\nHow would you generate random numbers between 1 and 10 in Java?<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert prompt_tail(rendered) == ("\u2026<|im_start|>user\nHow would you generate random numbers between 1 and 10 "
                                     "in Java?<|im_end|>\n<|im_start|>assistant")
    assert prompt_tail("word " * 50, 40) == "\u2026" + ("word " * 8).strip()  # no line near: from a word
    assert prompt_tail("x" * 200, 40) == "\u2026" + "x" * 40 and prompt_tail(" short\n") == "short"


def test_the_reports_lr_plot_draws_every_step_warm_up_included(tmp_path):
    """Logged every 10 steps, a 5-step warm-up is not in the records; the report's curve has it, and no curve is
    drawn where it would miss a logged rate."""
    import yaml

    from leansft.recipe.report import schedule_curve
    from leansft.recipe.schedule import lr_lambda

    training = {"schedule": "cosine", "warmup_steps": 5, "warmup_ratio": 0.0, "max_steps": 20, "learning_rate": 1e-3}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"training": training}))
    f = lr_lambda("cosine", 5, 20)
    logged = [{"step": s, "lr": 1e-3 * f(s - 1)} for s in (10, 20)]
    steps, rates = schedule_curve(tmp_path, logged)
    assert steps[:5] == [1, 2, 3, 4, 5] and rates[:5] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3])
    assert schedule_curve(tmp_path, [{"step": 10, "lr": 5e-4}]) is None
