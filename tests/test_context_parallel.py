"""Context parallelism (issue 68): a packed row split along the sequence over torchrun ranks (gloo) computes what
one process computes, in the loss, the gradients, every step of a run and its resume on another split."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import launcher
import pytest
from helpers import run_config, tiny_model
from test_distributed import _alive, launch, losses, records, weights, write

from leansft.core import distributed
from leansft.core.config import load_config
from leansft.core.errors import ConfigError
from leansft.core.model.context_parallel import check_supported

pytestmark = pytest.mark.slow


def test_a_split_row_gives_one_process_loss_and_gradients_for_llama_qwen2_and_gemma3(tmp_path):
    """Two ranks, one packed row of four examples (two cross the share boundary, the last share padded): the loss
    summed over the ranks and the gradients summed over them equal the whole row's in one process (Gemma 3: its
    sliding-window layer and one key/value head repeated to the two ranks); each rank keeps under 0.6x the
    activations of the whole row."""
    worker = Path(__file__).with_name("context_parallel_worker.py")
    proc = launcher.run([str(worker)], 2, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["model"] for r in found] == ["llama", "qwen2", "gemma3"]
    for r in found:
        assert r["loss"] == pytest.approx(r["whole_loss"], rel=1e-5) and r["grad_rel"] < 1e-5, r
        assert r["tokens"] == r["whole_tokens"], r  # real tokens and targets counted once over the ranks
        assert r["peak_share"] < 0.6 * r["peak_whole"], r


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_run_assets):
    """6 steps in one process (accumulation 2), saving at step 3: the run every split must repeat."""
    tmp = tmp_path_factory.mktemp("cp_single")
    cfg = run_config(tmp, tiny_run_assets, "checkpoint.export=true", "training.learning_rate=1e-3",
                     "checkpoint.save_every=3")
    launch(write(cfg, tmp / "c.yaml"), 1)
    return Path(cfg.output_dir)


def test_cp2_then_dp2_x_cp2_under_fsdp_resumed_train_the_one_process_run(tmp_path, tiny_run_assets, one_process):
    """cp=2 on two ranks (DDP) trains the one-process losses and weights; its step-3 checkpoint resumed on four
    ranks, two data-parallel places x two context ranks under FSDP, trains steps 4-6 as one process did."""
    cfg = run_config(tmp_path, tiny_run_assets, "checkpoint.export=true", "training.learning_rate=1e-3",
                     "checkpoint.save_every=3", "checkpoint.keep_last=2", "distributed.context_parallel=2",
                     f"data.cache_dir={one_process.parent / 'cache'}")
    said = launch(write(cfg, tmp_path / "c.yaml"), 2)
    assert "each row split over 2 of them (context parallel)" in said, said[-2000:]
    run, ref = Path(cfg.output_dir), losses(one_process)
    assert losses(run) == pytest.approx(ref, rel=1e-5)
    for key in ("tokens_seen", "examples_seen"):  # a split row's tokens and examples counted once
        assert [r[key] for r in records(run)] == [r[key] for r in records(one_process)]
    a, b = weights(one_process), weights(run)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(run / "checkpoints" / "step-3", resumed / "checkpoints" / "step-3")
    for name in ("metrics.jsonl", "config.yaml"):
        shutil.copy(run / name, resumed / name)
    launch(str(tmp_path / "c.yaml"), 4, f"output_dir={resumed}", "distributed.strategy=fsdp", "--resume", "auto")
    assert [r["step"] for r in records(resumed)] == [1, 2, 3, 4, 5, 6]
    assert losses(resumed) == pytest.approx(ref, rel=1e-5)
    c = weights(resumed)
    assert max(float((a[k] - c[k]).abs().max()) for k in a) < 1e-5


def test_a_split_run_killed_then_resumed_unsplit_trains_the_one_process_run(tmp_path, tiny_run_assets, one_process):
    """cp=2 on two ranks, every rank killed with SIGKILL as soon as the step-2 checkpoint is in place; resumed in one
    process (cp=1): the run ends with the one-process losses."""
    import time

    cfg = run_config(tmp_path, tiny_run_assets, "training.learning_rate=1e-3", "checkpoint.save_every=2",
                     "checkpoint.keep_last=5", "distributed.context_parallel=2",
                     f"data.cache_dir={one_process.parent / 'cache'}")
    path = write(cfg, tmp_path / "c.yaml")
    run = Path(cfg.output_dir)
    with launcher.Launch(["-m", "leansft", "train", path], 2, env={**os.environ, "OMP_NUM_THREADS": "1"}) as ranks:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "step-2").is_dir() and ranks.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        ranks.kill()  # every rank, SIGKILL
        while (any(_alive(pid) for pid in ranks.pids) or _locked(run)) and time.monotonic() < deadline:
            time.sleep(0.05)  # the kernel drops a killed process's lock as it goes: a moment after it is gone
    saved = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    assert saved and saved[-1] < 6, saved  # killed mid-run
    launch(path, 1, "distributed.context_parallel=1", "--resume", "auto")
    assert losses(run) == pytest.approx(losses(one_process), rel=1e-5)


def _locked(run: Path) -> bool:
    """Whether some process still holds ``run``'s run lock."""
    import fcntl

    from leansft.core.io.run_lock import LOCK

    fd = os.open(run / LOCK, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # (dropping the lock if it was taken here)
    return False


def test_six_steps_of_gemma3_split_over_two_ranks_are_one_process(tmp_path, tiny_run_assets):
    """Gemma 3 (a sliding-window layer, one key/value head repeated to the two ranks, scaled embeddings): 6 steps at
    cp=2 train the one-process losses and weights. (Qwen2's biases and tied embeddings: the split row's loss and
    gradients in the first test; its six steps here were one more torchrun launch, ~17 s of CPU, for the same
    training loop.)"""
    import torch
    import transformers as tf

    folder = tmp_path / "gemma3"
    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=16, sliding_window=8, max_position_embeddings=512,
                              layer_types=["sliding_attention", "full_attention"],
                              vocab_size=len(tf.AutoTokenizer.from_pretrained(tiny_run_assets["model"])))
    torch_model = tf.AutoModelForCausalLM.from_config(cfg)
    torch_model.save_pretrained(folder)
    tf.AutoTokenizer.from_pretrained(tiny_run_assets["model"]).save_pretrained(folder)
    assets = {**tiny_run_assets, "model": str(folder)}
    runs = {}
    for name, nproc, extra in (("one", 1, []), ("split", 2, ["distributed.context_parallel=2"])):
        cfg = run_config(tmp_path / name, assets, "checkpoint.export=true", "training.learning_rate=1e-4",
                         f"data.cache_dir={tmp_path / 'cache'}", *extra)
        launch(write(cfg, tmp_path / f"{name}.yaml"), nproc)
        runs[name] = Path(cfg.output_dir)
    assert losses(runs["split"]) == pytest.approx(losses(runs["one"]), rel=1e-5)
    a, b = weights(runs["one"]), weights(runs["split"])
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


@pytest.mark.parametrize("overrides,needle", [
    (["batching.strategy=sorted"], "splits packed rows: batching.strategy sorted pads"),
    (["distributed.context_parallel=0"], "distributed.context_parallel"),
])
def test_what_the_config_cannot_split_is_refused(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, ["model=m", "distributed.context_parallel=2", *overrides])


def test_what_the_split_would_compute_otherwise_is_refused(monkeypatch):
    model = tiny_model("llama")  # 4 heads, 2 key/value heads
    check_supported(model, 2)
    check_supported(model, 4)  # key/value heads repeated to 4
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        check_supported(model, 3)
    with pytest.raises(ConfigError, match="draw random numbers per token"):
        check_supported(model, 2, neftune=True)
    with pytest.raises(ConfigError, match="draw random numbers per token"):
        check_supported(model, 2, lora_dropout=0.1)
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ConfigError, match=r"otherwise than by attention \(linear_attention\)"):
        check_supported(model, 2)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(ConfigError, match="context_parallel 4 does not divide the world size 2"):
        distributed.mesh(4)


def test_plan_recommends_a_context_parallel_size_where_a_row_does_not_fit(tmp_path):
    from leansft.tools.memory import ModelShape, estimate_memory, recommend_context_parallel

    shape = ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, tied=False)
    whole = estimate_memory(shape, 131072, method="lora", gradient_checkpointing=True)
    half = estimate_memory(shape, 131072, method="lora", gradient_checkpointing=True, context_parallel=2)
    assert half["parts"]["activations"] == whole["parts"]["activations"] // 2
    assert half["parts"]["weights"] == whole["parts"]["weights"]
    n = recommend_context_parallel(shape, 131072, 80 * 2**30, method="lora", gradient_checkpointing=True)
    assert n is not None and n > 1
    assert estimate_memory(shape, 131072, method="lora", gradient_checkpointing=True,
                           context_parallel=n)["total"] <= 80 * 2**30
