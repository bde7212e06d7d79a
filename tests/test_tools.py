"""Tool definitions, tool calls and tool results, rendered by the model's own chat template.

Loss goes on assistant content, tool-call text and the end-of-turn token; never on tool results, tool
definitions or system prompts. A template that drops the tools is an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import write_jsonl

from leansft.core.data.clean import content_hash
from leansft.core.data.formats import convert_row
from leansft.core.data.masking import IGNORE_INDEX, ChatEncoder, resolve_template
from leansft.core.errors import DataError, TemplateError
from leansft.tools.cli import main

GLAIVE = str(Path(__file__).parents[1] / "examples" / "data" / "glaive_toolcall_en_demo.json")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string"}}}}}


def loss_texts(tok, ids, labels) -> list[str]:
    on = np.r_[False, labels != IGNORE_INDEX, False].astype(np.int8)
    d = np.diff(on)
    return [tok.decode(ids[a:b]) for a, b in zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1))]


def encode(tok, conv, template=None):
    ((ids, labels),), = ChatEncoder(tok, resolve_template(tok, template)).encode([conv])
    return ids, labels


def test_glaive_sharegpt_row_with_qwen25(load_tok, qwen25_path):
    tok = load_tok(qwen25_path)
    row = json.loads(Path(GLAIVE).read_text())[0]
    conv = convert_row(row, "sharegpt", GLAIVE, 1)
    assert conv.tools[0]["function"]["name"] == "search_recipes"
    ids, labels = encode(tok, conv)
    text = tok.decode(ids)
    assert '<tools>\n{"type": "function", "function": {"name": "search_recipes"' in text  # definitions rendered
    spans = loss_texts(tok, ids, labels)
    call = json.loads(row["conversations"][3]["value"])
    assert spans[1] == ("<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call><|im_end|>")
    expected_answers = [m["value"] for m in row["conversations"] if m["from"] == "gpt"]
    assert [s.removesuffix("<|im_end|>") for s in spans if not s.startswith("<tool_call>")] == expected_answers
    observation = row["conversations"][4]["value"]
    assert all(observation[:40] not in s and "<tools>" not in s and "Tools" not in s for s in spans)


def test_openai_tool_calls_with_string_or_object_arguments_render_the_same(load_tok, qwen25_path):
    tok = load_tok(qwen25_path)

    def row(arguments):
        return {"tools": json.dumps([WEATHER]), "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21 degrees."}]}

    a = encode(tok, convert_row(row('{"city": "Paris"}'), "messages", "f", 1))
    b = encode(tok, convert_row(row({"city": "Paris"}), "messages", "f", 1))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    spans = loss_texts(tok, *a)
    assert spans == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                     "It is 21 degrees.<|im_end|>"]
    assert "<tool_response>" in tok.decode(a[0]) and not any('"temp"' in s for s in spans)


def test_a_template_without_tool_support_is_an_error(load_tok, tiny_bpe_path):
    tok = load_tok(tiny_bpe_path)  # plain ChatML: ignores tools
    conv = convert_row({"tools": [WEATHER], "messages": [{"role": "user", "content": "Hi"},
                                                         {"role": "assistant", "content": "Hello"}]}, "messages", "f", 3)
    with pytest.raises(TemplateError, match="does not render the tool definitions .*get_weather"):
        encode(tok, conv)


def test_bad_tool_fields_are_named():
    with pytest.raises(DataError, match=r"row 2: field 'messages\[1\].tool_calls\[0\].arguments': invalid JSON"):
        convert_row({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}]}, "messages", "f", 2)
    with pytest.raises(DataError, match=r"field 'tools\[0\]': expected a function schema"):
        convert_row({"tools": [{"description": "no name"}], "messages": [{"role": "user", "content": "x"},
                                                                         {"role": "assistant", "content": "y"}]},
                    "messages", "f", 2)


def test_tool_calls_are_part_of_the_duplicate_key():
    def conv(city):
        return convert_row({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": city}}}]}]}, "messages", "f", 1)

    assert content_hash(conv("Paris")) != content_hash(conv("Rome"))


def test_glaive_demo_through_plan_and_show_mask(tmp_path, qwen25_path):
    out = tmp_path / "mask.json"
    assert main(["show-mask", "--data", GLAIVE, "--tokenizer", qwen25_path, "-n", "3", "--json", str(out),
                 "--cache-dir", str(tmp_path / "c")]) == 0
    examples = json.loads(out.read_text())
    assert len(examples) == 3 and all(set(e) == {"row", "input_ids", "labels", "stop_tokens"} for e in examples)
    assert main(["plan", "--data", GLAIVE, "--tokenizer", qwen25_path, "--json", str(tmp_path / "plan.json"),
                 "--cache-dir", str(tmp_path / "c")]) == 0
    prep = json.loads((tmp_path / "plan.json").read_text())["preparation"]
    assert prep["sources"][0]["rows_read"] == 300 and prep["sources"][0]["bad_rows"] == 0
    assert prep["examples"] == 300 - prep["duplicates_removed"] - prep["no_target_tokens"]


def test_tools_column_in_jsonl_messages(tmp_path, qwen25_path):
    data = write_jsonl(tmp_path / "t.jsonl", [{"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Which city?"}]}])
    out = tmp_path / "m.json"
    assert main(["show-mask", "--data", data, "--tokenizer", qwen25_path, "--json", str(out),
                 "--cache-dir", str(tmp_path / "c")]) == 0
    from leansft.core.data.tokenizer import load_tokenizer

    (example,) = json.loads(out.read_text())
    assert "get_weather" in load_tokenizer(qwen25_path).decode(example["input_ids"])
