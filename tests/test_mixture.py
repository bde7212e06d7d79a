"""Sources mixed by share (data.mix.mode: interleave): each source's share of the target tokens or examples as
asked, the same mix from the same seed, a run killed and resumed training the uninterrupted run's losses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import losses, run_config, three_sources, train_crashing_after

from leansft.core.config import load_config
from leansft.core.data.dataset import build_dataset
from leansft.core.data.masking import resolve_template

@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[str]:
    """Three sources of other sizes and answer lengths: 3,000 short answers, 500 long ones, 200 in between."""
    return three_sources(tmp_path_factory.mktemp("mix"))


def _mix(sources, *options):
    """The three sources at 0.5 / 0.3 / 0.2, prepared once into a cache beside them for every test here."""
    spec = ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in zip(sources, (0.5, 0.3, 0.2), strict=True))
    return load_config(None, ["model=m", f"data.sources=[{spec}]", "data.mix.mode=interleave",
                              f"data.cache_dir={Path(sources[0]).parent / 'cache'}", *options]).data


@pytest.mark.parametrize("by", ["tokens", "examples"])
@pytest.mark.parametrize("stop", ["all_exhausted", "first_exhausted"])
def test_each_source_gets_its_share(sources, load_tok, qwen25_path, by, stop, caplog):
    tok = load_tok(qwen25_path)
    cfg = _mix(sources, f"data.mix.by={by}", f"data.mix.stop={stop}")
    data, report = build_dataset(cfg, tok, resolve_template(tok, None), seed=0)
    part, targets = data.source, data.target_counts
    amount = np.bincount(part, weights=targets if by == "tokens" else None, minlength=3)
    assert np.abs(amount / amount.sum() - [0.5, 0.3, 0.2]).max() < 0.01  # measured on the mix itself
    assert [s["share_got"] for s in report.sources] == pytest.approx([0.5, 0.3, 0.2], abs=0.01)
    seen = [s["times_seen"] for s in report.sources]
    if stop == "all_exhausted":  # every example at least once; the source that sizes the mix exactly once
        assert min(seen) == 1.0 and all(x >= 1 for x in seen)
        assert "in the mix" in caplog.text  # source c repeated more than data.mix.warn_repeats times
    else:  # none repeated; the source that sizes the mix whole
        assert max(seen) == 1.0 and len(data) == len(np.unique(data.index))
    again, _ = build_dataset(cfg, tok, resolve_template(tok, None), seed=0)
    assert again.fingerprint() == data.fingerprint()  # the same seed, the same mix (on any rank)
    other, _ = build_dataset(cfg, tok, resolve_template(tok, None), seed=1)
    assert other.fingerprint() != data.fingerprint()


def test_a_source_left_empty_by_cleaning_is_named(sources, load_tok, qwen25_path):
    from leansft.core.errors import DataError

    tok = load_tok(qwen25_path)
    cfg = _mix(sources, "data.clean.min_tokens=60")  # a's and c's answers are shorter
    with pytest.raises(DataError, match=r"a.jsonl: no example left after cleaning, so its share"):
        build_dataset(cfg, tok, resolve_template(tok, None), seed=0)


@pytest.mark.slow
def test_a_mixed_run_killed_and_resumed_trains_the_uninterrupted_losses(tmp_path, tiny_run_assets, monkeypatch):
    """Two copies of the alpaca rows as two sources at 3:1, by examples: the data report says what each gave, and a
    crash after step 4 resumed from step 3 logs the uninterrupted run's losses."""
    other = tmp_path / "other.jsonl"
    rows = [json.loads(line) for line in Path(tiny_run_assets["data"]).read_text().splitlines()][:40]
    other.write_text("".join(json.dumps({**r, "instruction": "Briefly: " + r["instruction"]}) + "\n" for r in rows))
    mix = (f"data.sources=[{{path: {tiny_run_assets['data']}, weight: 3}}, {{path: {other}, weight: 1}}]",
           "data.mix.mode=interleave", "data.mix.by=examples", "training.max_steps=6")
    full = run_config(tmp_path / "a", tiny_run_assets, *mix)
    from leansft.recipe.train import train

    train(full)
    report = json.loads((Path(full.output_dir) / "data_report.json").read_text())
    assert [s["share_got"] for s in report["sources"]] == pytest.approx([0.75, 0.25], abs=0.01)
    cut = run_config(tmp_path / "b", tiny_run_assets, *mix, "checkpoint.save_every=3")
    train_crashing_after(monkeypatch, cut, 4)
    train(cut, resume="auto")
    assert losses(Path(cut.output_dir)) == losses(Path(full.output_dir))


def test_plan_reads_a_configs_mix_and_says_what_each_source_gives(sources, qwen25_path, tmp_path, capsys):
    from leansft.tools.cli import main

    config = tmp_path / "run.yaml"
    spec = ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in zip(sources, (0.5, 0.3, 0.2), strict=True))
    config.write_text(f"model: {qwen25_path}\ndata:\n  sources: [{spec}]\n  mix: {{mode: interleave, by: examples}}\n"
                      f"  cache_dir: {Path(sources[0]).parent / 'cache'}\n")
    assert main(["plan", "--config", str(config), "--json", str(tmp_path / "plan.json")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "a.jsonl: 50.0% of the mix's examples (asked 50.0%), 3,000 examples" in said
    assert "c.jsonl: 20.0% of the mix's examples (asked 20.0%), 1,200 examples" in said  # each of 200 six times
    assert "each example 6 times on average" in said
    shares = [s["share_got"] for s in json.loads((tmp_path / "plan.json").read_text())["preparation"]["sources"]]
    assert shares == pytest.approx([0.5, 0.3, 0.2], abs=0.001)
    assert main(["plan", "--config", str(config), "--data", sources[0]]) == 2  # one or the other


def test_stop_steps_on_cached_sources_is_the_all_exhausted_mix(sources, load_tok, qwen25_path):
    """(A run repeats the mix as long as it goes; streaming sources repeat themselves instead: test_streaming.)"""
    tok = load_tok(qwen25_path)
    steps, _ = build_dataset(_mix(sources, "data.mix.stop=steps"), tok, resolve_template(tok, None), seed=0)
    whole, _ = build_dataset(_mix(sources, "data.mix.stop=all_exhausted"), tok, resolve_template(tok, None), seed=0)
    assert steps.fingerprint() == whole.fingerprint()
