"""The dataset registry: data sets named in a datasets.yaml, used by name in a config, listed by `leansft datasets`."""

from __future__ import annotations

import json

import pytest

from leansft.core.config import load_config
from leansft.core.errors import ConfigError
from leansft.tools.cli import main


@pytest.fixture
def registry(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "qa.csv").write_text("question,answer\nWhy?,Because.\nHow?,So.\n")
    (data / "chats.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                                      {"role": "assistant", "content": "a"}]}) + "\n"
                                              for i in range(3)))
    (tmp_path / "datasets.yaml").write_text(
        "qa:\n  path: data/qa.csv\n  format: prompt_completion\n  columns: {prompt: question, completion: answer}\n"
        "  weight: 0.5\n  description: questions and answers\n"
        "chats: data/chats.jsonl\n"
        "hub: {path: someone/a-hub-set, split: validation}\n")
    return tmp_path


def test_a_config_names_registered_data_sets_and_its_own_keys_win(registry):
    cfg = registry / "run.yaml"
    cfg.write_text("model: m\ndata:\n  sources:\n    - qa\n    - {path: chats, weight: 2.0}\n    - hub\n")
    qa, chats, hub = load_config(str(cfg)).data.sources
    assert qa.path == str(registry / "data" / "qa.csv") and qa.format == "prompt_completion" and qa.weight == 0.5
    assert qa.columns == {"prompt": "question", "completion": "answer"}
    assert chats.path == str(registry / "data" / "chats.jsonl") and chats.weight == 2.0  # the config's weight
    assert hub.path == "someone/a-hub-set" and hub.split == "validation"
    # named as an override, with the registry given explicitly
    other = load_config(None, ["model=m", f"data.registry={registry / 'datasets.yaml'}", "data.sources=[chats]"])
    assert other.data.sources[0].path == str(registry / "data" / "chats.jsonl")


def test_a_registry_mistake_or_an_ambiguous_name_is_one_line(registry):
    (registry / "datasets.yaml").write_text("qa: {path: data/qa.csv, formt: alpaca}\n")
    (registry / "run.yaml").write_text("model: m\ndata: {sources: [qa]}\n")
    with pytest.raises(ConfigError, match="datasets.yaml: qa: formt: Extra inputs are not permitted"):
        load_config(str(registry / "run.yaml"))
    (registry / "datasets.yaml").write_text("data: data/qa.csv\n")  # a name that is also a folder beside the config
    (registry / "run.yaml").write_text("model: m\ndata: {sources: [data]}\n")
    with pytest.raises(ConfigError, match="both a name in the dataset registry and a file or folder"):
        load_config(str(registry / "run.yaml"))


def test_leansft_datasets_lists_names_formats_and_rows(registry, capsys):
    assert main(["datasets", str(registry / "datasets.yaml")]) == 0
    out = capsys.readouterr().out
    for name, rows in (("qa", "2"), ("chats", "3")):
        line = next(ln for ln in out.splitlines() if f" {name} " in ln)
        assert f" {rows} " in line, line
    assert "questions and answers" in out and "not here" in out  # the Hub name is not a local file
