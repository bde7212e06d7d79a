"""Preparation: cleaning counts, weights, truncation, and the on-disk cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import write_jsonl

from leansft.core.config import CleanConfig, DataConfig
from leansft.core.data import masking as template_mod
from leansft.core.data.dataset import build_dataset
from leansft.core.data.masking import IGNORE_INDEX, resolve_template
from leansft.core.errors import DataError, TemplateError


def rows(n, prefix="Q"):
    return [{"messages": [{"role": "user", "content": f"{prefix}{i} question"},
                          {"role": "assistant", "content": f"Answer number {i}."}]} for i in range(n)]


@pytest.fixture
def tok(load_tok, tiny_bpe_path):
    return load_tok(tiny_bpe_path)


def build(tok, tmp_path, sources, **kw):
    cfg = DataConfig(sources=sources, cache_dir=str(tmp_path / "cache"), **kw)
    return build_dataset(cfg, tok, resolve_template(tok, cfg.template))


def test_cache_hit_skips_tokenisation_and_keys_on_template(tmp_path, tok, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", rows(5))
    first, rep1 = build(tok, tmp_path, [path])
    assert rep1.sources[0]["cache"] == "miss"

    def boom(*a, **k):
        raise AssertionError("re-tokenised")

    monkeypatch.setattr(template_mod.ChatEncoder, "encode", boom)
    second, rep2 = build(tok, tmp_path, [path])
    assert rep2.sources[0]["cache"] == "hit"
    assert all(np.array_equal(a, b) for a, b in zip(first.flat(), second.flat()))
    with pytest.raises(AssertionError, match="re-tokenised"):  # another template is another key
        build(tok, tmp_path, [path], template="llama3")
    with pytest.raises(AssertionError, match="re-tokenised"):  # so is another file content
        write_jsonl(tmp_path / "d.jsonl", rows(6))
        build(tok, tmp_path, [path])


def test_tokenizer_change_invalidates_cache(tmp_path, load_tok, tiny_bpe_path, qwen25_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(3))
    _, a = build(load_tok(tiny_bpe_path), tmp_path, [path])
    _, b = build(load_tok(qwen25_path), tmp_path, [path])
    assert (a.sources[0]["cache"], b.sources[0]["cache"]) == ("miss", "miss")


def test_sources_of_one_preparation_fingerprint_the_tokenizer_once(tmp_path, tok, monkeypatch):
    """The tokenizer is serialised and hashed once for all sources of a preparation (each source's cache key holds
    it), not once per source; each source still keys on it."""
    from leansft.core.data import dataset

    calls = []
    monkeypatch.setattr(dataset, "tokenizer_fingerprint", lambda t: calls.append(t) or "fp")
    paths = [write_jsonl(tmp_path / f"{n}.jsonl", rows(2, prefix=n)) for n in "abc"]
    _, rep = build(tok, tmp_path, paths)
    assert calls == [tok] and [s["cache"] for s in rep.sources] == ["miss"] * 3
    monkeypatch.setattr(dataset, "tokenizer_fingerprint", lambda t: "another tokenizer")
    _, rep = build(tok, tmp_path, paths)
    assert [s["cache"] for s in rep.sources] == ["miss"] * 3


def test_dedupe_weights_and_no_assistant(tmp_path, tok):
    data = rows(4) + [rows(1)[0]] + [{"messages": [{"role": "user", "content": "alone"}]}]
    data[4]["messages"][0]["content"] = "  q0   QUESTION "  # same text after normalisation
    a = write_jsonl(tmp_path / "a.jsonl", data)
    b = write_jsonl(tmp_path / "b.jsonl", rows(2, prefix="B"))
    ds, rep = build(tok, tmp_path, [{"path": a}, {"path": b, "weight": 2.0}])
    assert rep.sources[0]["no_assistant"] == 1
    assert rep.duplicates_removed == 1
    assert len(ds) == 4 + 4  # weight 2 repeats b's two rows on purpose
    _, rep = build(tok, tmp_path, [{"path": a}], clean=CleanConfig(dedupe=False))
    assert rep.examples == 5


def test_truncation_and_length_filters(tmp_path, tok):
    long = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "word " * 200}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows(3) + long)
    ds, rep = build(tok, tmp_path, [path], max_length=64)
    assert rep.truncated == 1 and ds.lengths.max() == 64
    ds, rep = build(tok, tmp_path, [path], max_length=64, truncation="drop")
    assert rep.dropped_over_length == 1 and len(ds) == 3
    ds, rep = build(tok, tmp_path, [path], max_length=1024, clean=CleanConfig(max_tokens=100))
    assert rep.too_long == 1
    ds, rep = build(tok, tmp_path, [path], max_length=1024, clean=CleanConfig(min_tokens=100))
    assert rep.too_short == 3


def test_pii_scrub(tmp_path, tok):
    row = {"messages": [{"role": "user", "content": "mail me at jane.doe@example.com or call +1 415-555-0132"},
                        {"role": "assistant", "content": "card 4111 1111 1111 1111 from 192.168.1.20"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    ds, rep = build(tok, tmp_path, [path], clean=CleanConfig(pii_scrub=True))
    text = tok.decode(ds.flat()[0])
    for secret in ("jane.doe", "555-0132", "4111", "192.168"):
        assert secret not in text
    assert rep.sources[0]["pii_replaced"] == {"email": 1, "phone": 1, "card": 1, "ip": 1}
    assert "[EMAIL]" in text and "[CREDIT_CARD]" in text


def test_bad_rows_error_or_skip(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", rows(2) + [{"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(DataError) as err:
        build(tok, tmp_path, [path])
    assert (err.value.row, err.value.field) == (3, "messages[0].role") and "d.jsonl" in str(err.value)
    ds, rep = build(tok, tmp_path, [path], on_bad_row="skip")
    assert len(ds) == 2 and rep.sources[0]["bad_rows"] == 1
    broken = tmp_path / "broken.jsonl"  # a line that is not JSON at all is a bad row too
    broken.write_text(Path(path).read_text().replace("\n", '\n{"messages": [oops\n', 1))
    ds, rep = build(tok, tmp_path, [str(broken)], on_bad_row="skip")
    assert len(ds) == 2 and rep.sources[0]["bad_rows"] == 2 and "row 2" in rep.sources[0]["bad_row_examples"][0]


def test_columns_map_a_table_to_a_format(tmp_path, tok):
    csv = tmp_path / "qa.csv"
    csv.write_text("question,answer\nWhat is two plus two?,Four.\nCapital of France?,Paris.\n")
    src = {"path": str(csv), "format": "prompt_completion", "columns": {"prompt": "question", "completion": "answer"}}
    ds, rep = build(tok, tmp_path, [src])
    assert len(ds) == 2 and "Paris." in tok.decode(ds.example(1)[0])
    with pytest.raises(DataError, match="no column 'answr'.*question, answer"):
        build(tok, tmp_path, [{**src, "columns": {"prompt": "question", "completion": "answr"}}])


def test_rows_of_another_format_say_which_they_look_like(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", rows(2))
    with pytest.raises(DataError) as err:
        build(tok, tmp_path, [{"path": path, "format": "alpaca"}])
    assert err.value.hint == "the rows look like 'messages', not 'alpaca': use format messages (or auto)"


def test_nothing_left_names_the_setting_and_the_number_to_use(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", rows(4))
    with pytest.raises(DataError) as err:
        build(tok, tmp_path, [path], max_length=4)
    text = str(err.value)
    assert "no examples left: 4 read; removed 4 without a target token once cut at data.max_length 4" in text
    assert err.value.field == "data.max_length" and "raise data.max_length to about" in text
    with pytest.raises(DataError, match="4 shorter than data.clean.min_tokens 500") as err:
        build(tok, tmp_path, [path], clean=CleanConfig(min_tokens=500))
    assert "relax data.clean" in str(err.value)


def test_rows_the_template_refuses_are_skipped_when_asked(tmp_path, tok, caplog):
    """A conversation the encoder refuses (a stop token inside an answer; thinking the template does not
    render) stops preparation, or with on_bad_row: skip is left out, counted, and warned about on every load
    (the cache too); nothing of it enters the template counts."""
    stop = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "a <|im_end|> b"}]},
            {"messages": [{"role": "user", "content": "T"}, {"role": "assistant", "content": "t",
                                                              "reasoning_content": "hmm"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows(2) + stop + rows(1, "R"))
    with pytest.raises(TemplateError, match="inside its content") as err:
        build(tok, tmp_path, [path])
    assert err.value.row == 3 and "d.jsonl" in str(err.value)
    for _ in range(2):  # prepared, then from the cache
        caplog.clear()
        ds, rep = build(tok, tmp_path, [path], on_bad_row="skip")
        assert len(ds) == 3 and sorted(ds.rows.tolist()) == [1, 2, 5] and rep.sources[0]["bad_rows"] == 2
        assert rep.sources[0]["template"]["assistant_turns"] == 3
        assert "2 rows skipped (data.on_bad_row: skip), e.g. " in caplog.text and "row 3" in caplog.text


def test_labels_first_token_never_counts(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "all tokens train"}])
    ds, _ = build(tok, tmp_path, [path])
    assert ds.target_counts[0] == ds.lengths[0] - 1
    assert (ds.flat()[1] != IGNORE_INDEX).all()


def test_held_out_conversations_never_enter_training(tmp_path, tok):
    """A source weighted 2.0 holds each example twice: the split is by conversation, so no copy of a held-out
    example is trained on, and each is evaluated once. Without copies the split is the plain permutation."""
    from leansft.core.data.prepare import split_eval

    path = write_jsonl(tmp_path / "d.jsonl", rows(40))
    once, _ = build(tok, tmp_path, [path])
    twice, _ = build(tok, tmp_path, [{"path": path, "weight": 2.0}])
    assert len(twice) == 2 * len(once) == 80
    train, held = split_eval(twice, 0.25, seed=0)
    assert len(held) == 10 and len(train) == 60
    assert not set(held.index) & set(train.index) and len(set(held.index)) == len(held)
    assert not set(held.hashes) & set(train.hashes)
    train1, held1 = split_eval(once, 0.25, seed=0)
    perm = np.random.default_rng(17).permutation(40)
    assert held1.index.tolist() == sorted(perm[:10].tolist()) and len(train1) == 30


def test_an_eval_file_that_repeats_training_conversations_is_warned_about(tmp_path, tok, caplog):
    from leansft.core.data.prepare import prepare_data

    train_path = write_jsonl(tmp_path / "train.jsonl", rows(10))
    eval_path = write_jsonl(tmp_path / "eval.jsonl", rows(3)[1:] + rows(2, "E"))
    cfg = DataConfig(sources=[train_path], eval_file=eval_path, cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg, tok.name_or_path)
    assert len(data.eval) == 4
    assert f"2 of 4 examples of eval_file {eval_path} are also in the training data" in caplog.text


def test_the_run_says_what_it_trains_on_and_what_cutting_loses(tmp_path, tok, caplog):
    from leansft.core.data.prepare import prepare_data
    from leansft.recipe.train import log_data

    long_answer = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "word " * 60}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows(9) + rows(1) + long_answer)
    cfg = DataConfig(sources=[path], cache_dir=str(tmp_path / "cache"), max_length=40, eval_split=0.2)
    data = prepare_data(cfg, tok.name_or_path)
    assert data.summary() == "8 training examples, 2 held out; 1 duplicates removed; 1 cut at max_length"
    whole = int(data.train.store.targets[data.train.index].sum())
    assert 0 < data.lost_target_share() == 1 - int(data.train.target_counts.sum()) / whole
    caplog.set_level("INFO", "leansft")
    log_data(data, 40)
    assert "data: 8 training examples" in caplog.text
    assert f"cutting 1 examples at data.max_length 40 loses {100 * data.lost_target_share():.1f}%" in caplog.text


def test_plan_takes_on_bad_row(tmp_path, tiny_bpe_path, capsys):
    from leansft.tools.cli import main

    bad = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "a <|im_end|> b"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows(3) + bad)
    common = ["plan", "--data", path, "--tokenizer", tiny_bpe_path, "--cache-dir", str(tmp_path / "c")]
    assert main(common) == 2 and "inside its content" in capsys.readouterr().err
    assert main([*common, "--on-bad-row", "skip"]) == 0 and "3 examples" in capsys.readouterr().out
