"""Run configuration: errors that name key and file, aliases, paths relative to the config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from leansft.core.config import load_config
from leansft.core.errors import ConfigError


def test_config_errors_name_key_and_file(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("model: m\ntraining:\n  learning_rte: 1e-4\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(bad))
    assert "training.learning_rte" in str(err.value) and "unknown key" in str(err.value) and "c.yaml" in str(err.value)
    assert "did you mean training.learning_rate?" in str(err.value)
    bad.write_text("model: m\ntraining:\n  max_steps: lots\n")
    with pytest.raises(ConfigError, match="training.max_steps"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="batching.gradient_accumulation"):
        load_config(None, ["batching.gradient_accumulation=0"])
    cfg = load_config(None, ["model=m", "training.max_steps=20", "output_dir=/tmp/x", "data.sources=[a.jsonl]"])
    assert cfg.training.max_steps == 20 and cfg.data.sources[0].path == "a.jsonl"


@pytest.mark.parametrize("name", ["lora_alpaca.yaml", "full_multi_source.yaml", "multi_gpu_fsdp.yaml", "demo.yaml"])
def test_example_configs_validate(name):
    path = Path(__file__).parents[1] / "examples" / name
    if not path.exists():
        pytest.skip(f"{name} not shipped")
    cfg = load_config(str(path))
    assert cfg.model and cfg.data.sources


def test_model_is_required_and_aliases_are_accepted(tmp_path):
    with pytest.raises(ConfigError, match="model"):
        load_config(None, ["data.sources=[a.jsonl]"])
    path = tmp_path / "hf.yaml"
    path.write_text("model_name_or_path: m\ngradient_accumulation_steps: 4\nnum_train_epochs: 2\n"
                    "lr_scheduler_type: constant_with_warmup\nsave_total_limit: 3\nattn_implementation: sdpa\n"
                    "training:\n  warmup_ratio: 0.1\n  max_grad_norm: 0.5\n")
    cfg = load_config(str(path))
    assert (cfg.model, cfg.batching.gradient_accumulation, cfg.training.epochs) == ("m", 4, 2)
    assert (cfg.training.schedule, cfg.checkpoint.keep_last, cfg.training.attention) == ("constant", 3, "sdpa_varlen")
    assert cfg.training.max_grad_norm == 0.5
    path.write_text("model: m\nbatching:\n  gradient_accumulation: 2\ngradient_accumulation_steps: 4\n")
    with pytest.raises(ConfigError, match="both are set"):
        load_config(str(path))
    assert load_config(None, ["model=m", "num_train_epochs=3"]).training.epochs == 3


def test_config_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    folder = tmp_path / "exp"
    (folder / "data").mkdir(parents=True)
    for name in ("data/train.jsonl", "data/held.jsonl", "chat.jinja"):
        (folder / name).write_text("{}")
    (folder / "c.yaml").write_text("model: m\ndata:\n  sources: [data/train.jsonl]\n  eval_file: data/held.jsonl\n"
                                   "  template: chat.jinja\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(folder / "c.yaml"))
    assert cfg.data.sources[0].path == str(folder / "data/train.jsonl")
    assert cfg.data.eval_file == str(folder / "data/held.jsonl")
    assert cfg.data.template == str(folder / "chat.jinja")
    assert cfg.model == "m"  # not a local path: a Hub id stays as written



@pytest.mark.parametrize("override,near", [
    ("max_lenght=3", "data.max_length"), ("trainig.max_steps=2", "training"),
    ("data.sources=[{path: x, fromat: alpaca}]", "data.sources.format"), ("training.lora.rr=4", "training.lora.r"),
])
def test_an_unknown_key_gets_the_closest_one(override, near):
    with pytest.raises(ConfigError, match=f"did you mean {near}\\?"):
        load_config(None, ["model=m", override])


def test_a_choice_in_another_case_is_the_choice():
    cfg = load_config(None, ["model=m", "training.method=LoRA", "training.schedule=Cosine", "data.loss_on=ASSISTANT"])
    assert (cfg.training.method, cfg.training.schedule, cfg.data.loss_on) == ("lora", "cosine", "assistant")
    with pytest.raises(ConfigError, match="training.method"):
        load_config(None, ["model=m", "training.method=LoRAX"])
