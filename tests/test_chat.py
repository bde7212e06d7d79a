"""Talking to a trained model as it was trained (issue 67): chat and generate through the CLI with the run's own
system prompt, tools and template options; batch answers; the export's Ollama Modelfile; the run's last line."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import logging
from pathlib import Path

import pytest
import yaml
from helpers import run_config, write_jsonl

from leansft.tools.cli import main

pytestmark = pytest.mark.slow  # a tiny model trained once through the CLI

BOLT = "You are Bolt, a terse assistant who answers in one line."
PROMPT_START = "<|im_start|>system\n"


@pytest.fixture(scope="module")
def bolt_run(tmp_path_factory, tiny_run_assets):
    """A 2-step run on 24 conversations that all open with Bolt's system prompt (exported to final/)."""
    tmp = tmp_path_factory.mktemp("bolt")
    rows = [{"messages": [{"role": "system", "content": BOLT}, {"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{2 * i}."}]} for i in range(24)]
    data = write_jsonl(tmp / "bolt.jsonl", rows)
    cfg = run_config(tmp, {**tiny_run_assets, "data": data}, "training.max_steps=2", "checkpoint.export=true",
                     "eval.num_samples=0")
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    printed = io.StringIO()
    said = logging.StreamHandler(printed)  # the log lines, beside what is printed (as a pipe shows both)
    logging.getLogger("leansft").addHandler(said)
    try:
        with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as mp:
            mp.setattr("leansft.recipe.progress.EVERY_S", 0.0)  # a plain progress line due at every step
            assert main(["train", str(path)]) == 0
    finally:
        logging.getLogger("leansft").removeHandler(said)
    (tmp / "stdout.txt").write_text(printed.getvalue())
    return Path(cfg.output_dir)


def chat(monkeypatch, capsys, args: list[str], lines: list[str]) -> str:
    """``leansft chat`` with ``lines`` typed at its prompt; what it printed."""
    typed = iter(lines)

    def fake_input(prompt: str = "") -> str:
        print(prompt, end="")
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)
    assert main(["chat", *args, "--max-new-tokens", "3", "--show-prompt"]) == 0
    return capsys.readouterr().out


def test_piped_output_says_each_step_once(bolt_run):
    printed = (bolt_run.parent / "stdout.txt").read_text()
    for step in (1, 2):  # the metrics line, and no progress line repeating it
        assert printed.count(f"step {step}  loss") == 1 and f"step {step}/2" not in printed, printed


def test_the_run_ends_saying_where_the_model_is_and_how_to_talk_to_it(bolt_run):
    last = (bolt_run.parent / "stdout.txt").read_text().strip().splitlines()[-2:]
    assert last == [f"finished at step 2: the model is in {bolt_run / 'final'}; report: {bolt_run / 'report.md'}",
                    f"talk to it: leansft chat {bolt_run / 'final'}"], last
    report = json.loads((bolt_run / "data_report.json").read_text())
    assert report["sources"][0]["system_prompts"] == [[BOLT, 24]]


def test_chat_gives_the_model_its_training_system_prompt_by_default(bolt_run, monkeypatch, capsys):
    out = chat(monkeypatch, capsys, [str(bolt_run / "final")], ["hi"])
    assert "system prompt: the one 100% of the training conversations opened with" in out
    assert f"{PROMPT_START}{BOLT}<|im_end|>\n<|im_start|>user\nhi<|im_end|>" in out and "model> " in out


def test_chat_system_flag_and_commands(bolt_run, monkeypatch, capsys, tmp_path):
    other = tmp_path / "system.txt"
    other.write_text("You are Kite.\n")
    out = chat(monkeypatch, capsys, [str(bolt_run), "--system", f"@{other}"],
               ["/help", "hello", "/system", "/system You are Wren.", "again", "/reset", "/system none", "fresh",
                "/nope", "//slash", "/quit", "never sent"])
    assert "the one 100%" not in out and "/reset" in out and "/quit" in out  # /help listed the commands
    assert f"{PROMPT_START}You are Kite.<|im_end|>\n<|im_start|>user\nhello<|im_end|>" in out
    assert "system prompt: 'You are Kite.'" in out
    second = out[out.index("(system prompt set)"):]
    # the new system prompt over the conversation so far; after /reset and /system none: no system turn at all
    assert f"{PROMPT_START}You are Wren.<|im_end|>\n<|im_start|>user\nhello<|im_end|>" in second
    last = out[out.index("(system prompt removed)"):]
    assert "<|im_start|>user\nfresh<|im_end|>" in last and PROMPT_START not in last.split("fresh")[0]
    assert "unknown command /nope" in out and "<|im_start|>user\n/slash<|im_end|>" in out
    assert "never sent" not in out


def test_generate_labels_several_answers_and_takes_tools_and_template_options(bolt_run, capsys, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "add", "parameters": {}}}]))
    template = tmp_path / "t.jinja"  # renders the tools and an option, to see both reach the template
    template.write_text("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% if flag %}FLAG\n{% endif %}"
                        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert main(["generate", str(bolt_run), "--prompt", "one", "--prompt", "two", "--max-new-tokens", "2",
                 "--template", str(template), "--tools", str(tools), "--chat-template-kwargs", "flag=true",
                 "--system", "", "--show-prompt"]) == 0
    captured = capsys.readouterr()
    assert "[1] 'one'" in captured.out and "[2] 'two'" in captured.out
    assert "TOOL add\nFLAG\n<|im_start|>user\none" in captured.err and "system" not in captured.err


def test_generate_answers_a_file_of_conversations(bolt_run, tmp_path, capsys):
    rows = [{"messages": [{"role": "user", "content": "What is 3 plus 3?"}, {"role": "assistant", "content": "6."}],
             "id": 1}, {"prompt": "Hi", "id": 2}]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert main(["generate", str(bolt_run), "--from", src, "--out", str(out), "--max-new-tokens", "2"]) == 0
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["id"] for a in answers] == [1, 2] and all(isinstance(a["answer"], str) for a in answers)
    assert answers[0]["messages"][-1] == {"role": "assistant", "content": "6."}  # the row as given, answer beside
    assert "wrote 2 answers" in capsys.readouterr().out


def test_gguf_export_writes_an_ollama_modelfile_with_the_trained_system_prompt(bolt_run, tmp_path, capsys):
    out = tmp_path / "bolt.gguf"
    assert main(["export", str(bolt_run), str(out), "--to", "gguf"]) == 0
    text = (tmp_path / "bolt.Modelfile").read_text()
    assert text.startswith("# written by leansft export") and "FROM ./bolt.gguf" in text
    assert 'PARAMETER stop "<|im_end|>"' in text and f'SYSTEM """{BOLT}"""' in text
    mine = tmp_path / "mine.gguf"
    (tmp_path / "mine.Modelfile").write_text("FROM something-else\n")  # the user's own: left alone
    assert main(["export", str(bolt_run), str(mine), "--to", "gguf"]) == 0
    assert (tmp_path / "mine.Modelfile").read_text() == "FROM something-else\n"
    assert main(["export", str(bolt_run), str(tmp_path / "q.gguf"), "--to", "gguf", "--dtype", "q4_k_m"]) == 2
    err = capsys.readouterr().err
    assert "llama-quantize" in err and "Q4_K_M" in err and not (tmp_path / "q.gguf").exists()
