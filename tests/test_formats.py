"""Format converters, auto-detection and source loaders: valid rows and malformed ones."""

from __future__ import annotations

import json

import pytest
from helpers import write_jsonl

from leansft.core.data.formats import convert_row, detect_format
from leansft.core.data.sources import read_rows
from leansft.core.errors import DataError

F = "data.jsonl"


def conv(row, fmt):
    return convert_row(row, fmt, F, 7).messages


def test_alpaca():
    m = conv({"instruction": "Add", "input": "2 and 2", "output": "4", "system": "Be exact."}, "alpaca")
    assert m == [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Add\n\n2 and 2"},
                 {"role": "assistant", "content": "4"}]
    assert conv({"instruction": "Hi", "input": "", "output": "Hello"}, "alpaca")[0] == {"role": "user", "content": "Hi"}


def test_sharegpt_maps_roles():
    row = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                             {"from": "gpt", "value": "A"}]}
    assert [x["role"] for x in conv(row, "sharegpt")] == ["system", "user", "assistant"]


def test_messages_and_prompt_completion_and_text():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert conv({"messages": msgs}, "messages") == msgs
    assert conv({"prompt": "Q", "completion": "A"}, "prompt_completion") == msgs
    assert conv({"prompt": msgs[:1], "completion": msgs[1:]}, "prompt_completion") == msgs
    assert convert_row({"text": "plain"}, "text", F, 1).text == "plain"


@pytest.mark.parametrize(
    "row,fmt,field,what",
    [
        ({"instruction": "Q"}, "alpaca", "output", "missing"),
        ({"instruction": 3, "output": "A"}, "alpaca", "instruction", "expected str"),
        ({"instruction": "Q", "output": "  "}, "alpaca", "output", "empty content"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "sharegpt", "conversations[0].from", "unknown role"),
        ({"conversations": "hi"}, "sharegpt", "conversations", "expected list"),
        ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant"}]}, "messages",
         "messages[1].content", "missing"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0].content", "expected str"),
        ({"messages": [{"content": "x"}]}, "messages", "messages[0].role", "missing"),
        ({"messages": []}, "messages", "messages", "empty"),
        ({"prompt": "Q"}, "prompt_completion", "completion", "missing"),
        ({"prompt": "Q", "completion": ""}, "prompt_completion", "completion", "empty content"),
        ({"text": None}, "text", "text", "missing"),
    ],
)
def test_malformed_rows_name_file_row_and_field(row, fmt, field, what):
    with pytest.raises(DataError) as err:
        convert_row(row, fmt, F, 7)
    e = err.value
    assert (e.file, e.row, e.field) == (F, 7, field)
    assert what in str(e) and F in str(e) and "row 7" in str(e) and field in str(e)


def test_auto_detection_and_ambiguity():
    assert detect_format({"instruction": "a", "input": "", "output": "b"}, F, 1) == "alpaca"
    assert detect_format({"conversations": [{"from": "human", "value": "x"}]}, F, 1) == "sharegpt"
    assert detect_format({"conversations": [{"role": "user", "content": "x"}]}, F, 1) == "messages"
    assert detect_format({"messages": [{"role": "user", "content": "x"}]}, F, 1) == "messages"
    assert detect_format({"prompt": "a", "completion": "b"}, F, 1) == "prompt_completion"
    assert detect_format({"text": "a"}, F, 1) == "text"
    with pytest.raises(DataError, match="ambiguous.*alpaca and text"):
        detect_format({"instruction": "a", "output": "b", "text": "c"}, F, 3)
    with pytest.raises(DataError, match="cannot detect"):
        detect_format({"question": "a"}, F, 3)
    with pytest.raises(DataError, match="unknown format"):
        convert_row({"text": "a"}, "vicuna", F, 1)


ROWS = [{"prompt": "Q1", "completion": "A1"}, {"prompt": "Q2", "completion": "A2"}]


def test_loaders_read_every_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    (tmp_path / "d.csv").write_text("prompt,completion\nQ1,A1\nQ2,A2\n")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    for name in ("d.jsonl", "d.json", "d.csv", "d.parquet", "hf"):
        rows = list(read_rows(str(tmp_path / name)))
        assert [r for _, r in rows] == ROWS, name
        assert [n for n, _ in rows] == [1, 2]


def test_loader_errors(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        list(read_rows(str(tmp_path / "missing.jsonl")))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError) as err:
        list(read_rows(str(tmp_path / "bad.jsonl")))
    assert err.value.row == 2 and "invalid JSON" in str(err.value)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="unknown data file type"):
        list(read_rows(str(tmp_path / "x.txt")))
    with pytest.raises(DataError, match="Hub"):
        list(read_rows("someone/no-such-dataset"))


def test_openai_content_parts_and_role_aliases():
    row = {"messages": [{"role": "developer", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                        {"role": "assistant", "content": "Hello"}]}
    assert conv(row, "messages") == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    bad = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    with pytest.raises(DataError) as err:
        convert_row(bad, "messages", F, 4)
    assert err.value.field == "messages[0].content[0]" and "image_url" in str(err.value)


@pytest.mark.parametrize("fmt,row", [
    ("sharegpt", {"conversations": [{"from": "human", "value": "<image>What is it?"}, {"from": "gpt", "value": "A cat."}],
                  "images": ["cat.png"]}),
    ("messages", {"messages": [{"role": "user", "content": "<image><image>Same?"},
                               {"role": "assistant", "content": "Yes."}], "images": ["a.png", "b.png"]}),
    ("alpaca", {"instruction": "Describe <video>", "output": "Waves.", "videos": ["sea.mp4"]}),
])
def test_a_row_with_media_is_refused_not_trained_as_text(fmt, row):
    """LLaMA-Factory's multimodal rows (media beside the text, <image> placeholders in it) trained as text with exit
    0: the placeholders learned as words, the images never seen. Now one line naming the row and the column."""
    key = next(k for k in ("images", "videos") if k in row)
    with pytest.raises(DataError) as err:
        convert_row(row, fmt, F, 3)
    assert err.value.row == 3 and err.value.field == key and "text alone" in str(err.value)
    assert f"has {len(row[key])} {key.rstrip('s')}" in str(err.value)
    assert convert_row({**row, key: []}, fmt, F, 3)  # an empty media column is no media


def test_csv_unclosed_quote_names_where_it_opened(tmp_path, tiny_bpe_path, capsys):
    from leansft.tools.cli import main

    path = tmp_path / "bad.csv"
    path.write_text('prompt,completion\nfirst,ok\nsecond,"unclosed quote\nthird,a\nfourth,b\nfifth,c\n')
    assert main(["plan", "--data", str(path), "--tokenizer", tiny_bpe_path, "--cache-dir", str(tmp_path / "c")]) != 0
    msg = capsys.readouterr().err
    assert "bad.csv: row 2" in msg and "starting at line 3" in msg and "opened on line 3" in msg
    assert "Traceback" not in msg
