"""Agent and reasoning data on real tokenizers with the templates they ship: tool calls, tool results,
thinking, templates that rewrite history (per-turn expansion), and per-message loss flags.

Each test decodes the loss spans and compares them with exactly the assistant content, tool-call text and
end-of-turn token; nothing of tool results, tool definitions or earlier turns.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import trl_template, write_jsonl
from test_tools import WEATHER, loss_texts

from leansft.core.data.formats import Conversation, convert_row
from leansft.core.data.masking import ChatEncoder, resolve_template
from leansft.core.errors import DataError, TemplateError
from leansft.tools.cli import main

AGENT = {"tools": [WEATHER], "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "abcdefghi", "name": "get_weather", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 degrees."}]}
THINKING = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "reasoning_content": "Two and two make four.", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "reasoning_content": "Three and three make six.", "content": "6."}]


def encode_all(tok, rows, template=None, fmt="messages", **options):
    enc = ChatEncoder(tok, resolve_template(tok, template), **options)
    convs = [r if isinstance(r, Conversation) else convert_row(r, fmt, "f", i + 1) for i, r in enumerate(rows)]
    return enc.encode(convs), enc.stats


def spans_of(tok, examples) -> list[list[str]]:
    return [loss_texts(tok, ids, labels) for ids, labels in examples]


def test_qwen25_tools_in_the_system_prompt_and_tool_call_tags(load_tok, qwen25_path):
    tok = load_tok(qwen25_path)
    (examples,), stats = encode_all(tok, [AGENT])
    assert spans_of(tok, examples) == [[
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 21 degrees.<|im_end|>"]]
    text = tok.decode(examples[0][0])
    assert "<tools>" in text and "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text
    assert stats["tool_call_turns"] == 1 and stats["tool_results"] == 1 and not stats["per_turn_conversations"]


def test_llama31_tool_call_and_ipython_result(load_tok, llama3_path):
    tok = load_tok(llama3_path)  # the Llama-3.1 tokenizer (<|python_tag|>, <|eom_id|>) with Llama-3.1's template
    (examples,), _ = encode_all(tok, [AGENT], trl_template("llama3_1"))
    assert spans_of(tok, examples) == [[
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is 21 degrees.<|eot_id|>"]]
    text = tok.decode(examples[0][0])
    assert "<|start_header_id|>ipython<|end_header_id|>" in text and '"name": "get_weather",' in text


def test_text_beside_a_tool_call_that_the_template_drops_is_refused(load_tok, llama3_path, qwen25_path):
    """Llama 3.1's template writes a tool-calling turn as the call alone: "Let me check." beside the call was
    silently left out of training (11 templates of the zoo do this). Refused naming the content; without the text
    the turn trains as the model generates it."""
    tok = load_tok(llama3_path)
    said = json.loads(json.dumps(AGENT))
    said["messages"][2]["content"] = "Let me check."
    with pytest.raises(TemplateError, match="does not write the text of message 2 beside its tool calls") as err:
        encode_all(tok, [said], trl_template("llama3_1"))
    assert err.value.field == "messages[2].content"
    qwen = load_tok(qwen25_path)  # Qwen2.5's own template writes both
    (examples,), _ = encode_all(qwen, [said])
    assert spans_of(qwen, examples)[0][0].startswith("Let me check.\n<tool_call>")


def test_mistral_v3_moves_tools_to_the_last_user_turn_so_each_turn_trains_in_its_own_context(load_tok,
                                                                                             mistral_v3_path):
    tok = load_tok(mistral_v3_path)
    row = {**AGENT, "messages": AGENT["messages"] + [{"role": "user", "content": "And Rome?"},
                                                     {"role": "assistant", "content": "Sunny."}]}
    (examples,), stats = encode_all(tok, [row])
    assert spans_of(tok, examples) == [
        ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]</s>'],
        ["It is 21 degrees.</s>"], ["Sunny.</s>"]]
    last = tok.decode(examples[-1][0])  # at inference the tools sit before the last user message
    assert last.index("[AVAILABLE_TOOLS]") > last.index("[TOOL_RESULTS]")
    assert stats["per_turn_conversations"] == 1 and stats["per_turn_examples"] == 3
    assert stats["per_turn_extra_tokens"] == sum(map(len, (ids for ids, _ in examples))) - len(
        tok(tok.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False), add_special_tokens=False)
        ["input_ids"])
    with pytest.raises(TemplateError, match="rewrites or closes earlier turns"):
        encode_all(tok, [row], multi_turn="single")


def test_qwen3_thinking_per_turn_expansion(load_tok, qwen3_path):
    tok = load_tok(qwen3_path)  # Qwen3's own template drops the thinking of turns before the last question
    (examples,), stats = encode_all(tok, [{"messages": THINKING}])
    assert spans_of(tok, examples) == [
        ["<think>\nTwo and two make four.\n</think>\n\n4.<|im_end|>"],
        ["<think>\nThree and three make six.\n</think>\n\n6.<|im_end|>"]]
    assert "Two and two" not in tok.decode(examples[1][0])  # the context as the template gives it at inference
    assert stats["per_turn_conversations"] == 1 and stats["thinking_turns"] == 2
    assert stats["thinking_tokens"] == sum(len(tok(t, add_special_tokens=False)["input_ids"])
                                           for t in ("Two and two make four.", "Three and three make six."))
    with pytest.raises(TemplateError, match="multi_turn: auto"):
        encode_all(tok, [{"messages": THINKING}], multi_turn="single")


def test_thinking_written_into_the_content_renders_like_reasoning_content(load_tok, qwen3_path):
    tok = load_tok(qwen3_path)
    inline = [THINKING[0], {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\n4."}]
    (a,), _ = encode_all(tok, [{"messages": inline}])
    (b,), _ = encode_all(tok, [{"messages": THINKING[:2]}])
    assert np.array_equal(a[0][0], b[0][0]) and np.array_equal(a[0][1], b[0][1])


def test_reasoning_drop_trains_the_answers_only(load_tok, qwen3_path):
    tok = load_tok(qwen3_path)
    (examples,), stats = encode_all(tok, [{"messages": THINKING}], reasoning="drop")
    # the empty <think></think> block Qwen3 writes into the last turn (the model writes it too) still moves,
    # so still one example a turn
    assert spans_of(tok, examples) == [["<think>\n\n</think>\n\n4.<|im_end|>"], ["<think>\n\n</think>\n\n6.<|im_end|>"]]
    assert "Two and two" not in tok.decode(examples[1][0]) and not stats["thinking_tokens"]


def test_a_template_that_ignores_thinking_is_an_error(load_tok, qwen25_path):
    tok = load_tok(qwen25_path)  # Qwen2.5's template does not render reasoning_content
    with pytest.raises(TemplateError, match="does not render the thinking of message 1.*") as err:
        encode_all(tok, [{"messages": THINKING}])
    assert "data.reasoning: drop" in str(err.value) and "row 1" in str(err.value)
    (examples,), _ = encode_all(tok, [{"messages": THINKING}], reasoning="drop")
    assert spans_of(tok, examples) == [["4.<|im_end|>", "6.<|im_end|>"]]


def test_per_turn_on_a_prefix_template_covers_the_same_turns(load_tok, qwen25_path):
    tok = load_tok(qwen25_path)
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                          {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]}]
    (single,), _ = encode_all(tok, rows)
    (turns,), stats = encode_all(tok, rows, multi_turn="per_turn")
    assert len(single) == 1 and len(turns) == 2
    assert [s for ex in spans_of(tok, turns) for s in ex] == spans_of(tok, single)[0]
    # the last turn's example is the whole conversation up to its stop token (not the newline after it)
    assert np.array_equal(turns[1][0], single[0][0][:-1])
    assert stats["per_turn_extra_tokens"] == len(turns[0][0]) - 1


def test_per_message_loss_flags(load_tok, qwen25_path):
    tok = load_tok(qwen25_path)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "train": False},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye.", "weight": 1}]
    (examples,), _ = encode_all(tok, [{"messages": msgs}])
    assert spans_of(tok, examples) == [["Goodbye.<|im_end|>"]]
    zero = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello.", "weight": 0}]
    (examples,), _ = encode_all(tok, [{"conversations": zero + [{"from": "human", "value": "x"},
                                                                {"from": "gpt", "value": "y"}]}], fmt="sharegpt")
    assert spans_of(tok, examples) == [["y<|im_end|>"]]
    with pytest.raises(DataError, match=r"messages\[1\].train': expected true or false"):
        convert_row({"messages": [msgs[0], {**msgs[1], "train": "no"}]}, "messages", "f", 1)


def test_expanded_turns_reach_the_plan_report(tmp_path, qwen3_path):
    data = write_jsonl(tmp_path / "think.jsonl", [{"messages": THINKING}, {"messages": THINKING[:2]}])
    assert main(["plan", "--data", data, "--tokenizer", qwen3_path, "--json", str(tmp_path / "plan.json"),
                 "--cache-dir", str(tmp_path / "c")]) == 0
    prep = json.loads((tmp_path / "plan.json").read_text())["preparation"]
    assert prep["examples"] == 3
    stats = prep["sources"][0]["template"]
    assert stats["per_turn_conversations"] == 1 and stats["per_turn_examples"] == 2 and stats["thinking_turns"] == 3


def test_show_mask_colours_tool_calls_results_and_thinking(tmp_path, qwen3_path):
    data = write_jsonl(tmp_path / "agent.jsonl", [AGENT, {"messages": THINKING[:2]}])
    page, js = tmp_path / "mask.html", tmp_path / "mask.json"
    assert main(["show-mask", "--data", data, "--tokenizer", qwen3_path, "--html", str(page), "--json", str(js),
                 "--cache-dir", str(tmp_path / "c")]) == 0
    html = page.read_text()
    for kind in ("target", "thinking", "tool_call", "tool_result", "ctx"):
        assert f"{kind}\" title=" in html, kind
    examples = json.loads(js.read_text())
    assert all(set(e) == {"row", "input_ids", "labels", "stop_tokens"} for e in examples)
    assert examples[0]["row"] == 1 and examples[0]["stop_tokens"] == ["<|im_end|>"]
    assert "stop tokens (template &#x27;tokenizer&#x27;): &lt;|im_end|&gt;" in html


@pytest.mark.slow
def test_glaive_trains_with_a_tool_template(tmp_path, tiny_run_assets):
    from helpers import run_config
    from test_tools import GLAIVE

    from leansft.recipe.train import train

    template = Path(GLAIVE).parents[1] / "templates" / "chatml_tools.jinja"
    cfg = run_config(tmp_path, tiny_run_assets, f"data.sources=[{GLAIVE}]", f"data.template={template}",
                     "data.max_length=1024", "batching.tokens_per_micro_batch=2048", "training.max_steps=3")
    last = train(cfg)
    assert last["step"] == 3 and last["target_tokens_per_s"] > 0


def test_fractional_message_weights_reach_the_batches(tmp_path, load_tok, qwen25_path, monkeypatch):
    from leansft.core.batching.collate import collate_packed
    from leansft.core.config import DataConfig
    from leansft.core.data import shards
    from leansft.core.data.dataset import build_dataset

    tok = load_tok(qwen25_path)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "weight": 0.5},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]
    (ex,), _ = encode_all(tok, [{"messages": msgs}])
    ids, labels = ex[0]
    on = labels != -100
    assert set(ex[0].weights[on].tolist()) == {0.5, 1.0} and (ex[0].weights[~on] == 1).all()
    assert tok.decode(ids[on & (ex[0].weights == 0.5)]) == "Hello.<|im_end|>"
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(DataError, match=r"messages\[1\].weight': expected a number from 0 to 1"):
            convert_row({"messages": [msgs[0], {**msgs[1], "weight": bad}]}, "messages", "f", 1)
    # through the cache (one byte per token, the weights in a per-source table), identical for 1 and 2 workers
    monkeypatch.setattr(shards, "SHARD", 4)
    rows = [{"messages": [msgs[0], {**msgs[1], "weight": w}, *msgs[2:]]} for w in (0.5, 0.25, 1, 0.75) * 5]
    rows = [{"messages": [{**m, "content": f"{m['content']} {i}"} for m in r["messages"]]} for i, r in enumerate(rows)]
    path = write_jsonl(tmp_path / "w.jsonl", rows)
    built = []
    for workers in (1, 2):
        cfg = DataConfig(sources=[path], cache_dir=str(tmp_path / f"c{workers}"), num_workers=workers)
        data, report = build_dataset(cfg, tok, resolve_template(tok, None))
        batch = collate_packed(data, np.arange(len(data)), np.zeros(len(data), np.int64), data.lengths)
        built.append((report.sources[0]["weights"], batch.weights, batch.labels))
    assert built[0][0] == built[1][0] == [0.5, 0.25, 0.75]
    assert torch.equal(built[0][1], built[1][1]) and torch.equal(built[0][2], built[1][2])
    w, lab = built[0][1][0, 1:], built[0][2][0, 1:]
    assert sorted(set(w[lab != -100].tolist())) == [0.25, 0.5, 0.75, 1.0]


def test_thinking_is_part_of_the_duplicate_key_and_of_the_pii_scrub():
    from collections import Counter

    from leansft.core.data.clean import content_hash, scrub

    def conv(thinking):
        return convert_row({"messages": [THINKING[0], {**THINKING[1], "reasoning_content": thinking}]},
                           "messages", "f", 1)

    # two traces that reach the same answer by different reasoning are two examples, not duplicates
    assert content_hash(conv("Two and two make four.")) != content_hash(conv("Count: 1, 2, 3, 4."))
    counts = Counter()
    scrubbed = scrub(conv("Ask bob@example.com."), counts)
    assert scrubbed.messages[1]["reasoning_content"] == "Ask [EMAIL]." and counts["email"] == 1


def test_thinking_under_other_field_names_becomes_reasoning_content():
    for key in ("reasoning", "thinking", "reasoning_content"):
        conv = convert_row({"messages": [THINKING[0], {"role": "assistant", "content": "4.", key: "Two and two."}]},
                           "messages", "f", 1)
        assert conv.messages[1]["reasoning_content"] == "Two and two."


def test_per_turn_applies_to_templates_with_generation_markers_too(load_tok, qwen25_path):
    tok = load_tok(qwen25_path)
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                          {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]}]
    (marked,), _ = encode_all(tok, rows, trl_template("qwen2_5_training"), multi_turn="per_turn")
    assert spans_of(tok, marked) == [["Hello.<|im_end|>"], ["Goodbye.<|im_end|>"]]


def test_a_tokenizer_that_truncates_is_not_used_truncated(load_tok, qwen25_path):
    tok = load_tok(qwen25_path)
    tok.backend_tokenizer.enable_truncation(8)  # a tokenizer.json may carry truncation settings
    (examples,), _ = encode_all(tok, [AGENT])
    assert len(examples[0][0]) > 100 and tok.backend_tokenizer.truncation is not None  # the user's tokenizer kept


def test_liger_refuses_weighted_targets():
    from helpers import tiny_model

    from leansft.core.batching.collate import PackedBatch
    from leansft.core.errors import ConfigError
    from leansft.core.model.forward import loss_of

    ids = torch.zeros(1, 4, dtype=torch.long)
    batch = PackedBatch(ids, ids, torch.arange(4)[None], torch.tensor([0, 4], dtype=torch.int32), 4,
                        np.zeros(1), np.zeros(1), weights=torch.full((1, 4), 0.5))
    with pytest.raises(ConfigError, match="per-token loss weights"):
        loss_of(tiny_model("llama"), batch, torch.zeros(1, 4, 64), 16, backend="liger")


def test_more_than_254_distinct_weights_in_a_source_is_an_error(tmp_path, load_tok, tiny_bpe_path):
    from leansft.core.config import DataConfig
    from leansft.core.data.dataset import build_dataset

    tok = load_tok(tiny_bpe_path)
    rows = [{"messages": [{"role": "user", "content": f"Hi {i}"},
                          {"role": "assistant", "content": "Hello.", "weight": (i + 1) / 1000}]} for i in range(255)]
    cfg = DataConfig(sources=[write_jsonl(tmp_path / "w.jsonl", rows)], cache_dir=str(tmp_path / "c"), num_workers=1)
    with pytest.raises(DataError, match="more than 254 different loss weights"):
        build_dataset(cfg, tok, resolve_template(tok, None))
