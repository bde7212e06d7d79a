"""When things go wrong: damaged checkpoints, interrupted runs, bad input, divergence, exit codes.

Each case goes through the CLI where a user meets it: a fallback or one clear error (exit 2), never a
traceback and never a silently wrong resume.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import launcher
import pytest
import torch
import yaml
from helpers import run_config, write_jsonl
from safetensors.torch import load_file

from leansft.core.data.sources import read_rows
from leansft.core.errors import DataError, LeanSFTError
from leansft.core.io import checkpoint_files as ckpt
from leansft.recipe.train import EXIT_STOPPED, train
from leansft.tools.cli import main

pytestmark = pytest.mark.slow  # each test trains a tiny model end to end


def config_file(tmp_path: Path, assets: dict, *overrides: str) -> str:
    cfg = run_config(tmp_path, assets, *overrides)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return str(path)


def records(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(ln) for ln in (run / name).read_text().splitlines()]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run) if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_run_assets):
    """An uninterrupted 6-step run saving every 2 steps: its losses and checkpoints."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = run_config(tmp, tiny_run_assets, "checkpoint.save_every=2", "checkpoint.keep_last=5")
    train(cfg)
    return Path(cfg.output_dir)


DAMAGE = {
    "model truncated": ("model.safetensors", lambda b: b[: len(b) // 2]),
    "model garbled": ("model.safetensors", lambda b: b[:100] + bytes(len(b) - 100)),
    "model other finite values": ("model.safetensors", lambda b: b[:-64] + bytes(range(64))),
    "optimizer truncated": ("optimizer.safetensors", lambda b: b[:10]),
    "rng garbled": ("rng.safetensors", lambda b: b"x" * len(b)),
    "state empty": ("state.json", lambda b: b""),
    "state truncated": ("state.json", lambda b: b[: len(b) // 2]),
    "state binary": ("state.json", lambda b: bytes(range(256))),
    "state deleted": ("state.json", None),
    "manifest deleted": ("manifest.json", None),
    "manifest garbled": ("manifest.json", lambda b: b"{not json"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, tiny_run_assets, reference, case, caplog):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / "step-6")
    for f in ("metrics.jsonl", "samples.jsonl"):
        (run / f).unlink(missing_ok=True)
    name, change = DAMAGE[case]
    target = run / "checkpoints" / "step-4" / name
    if change is None:
        target.unlink()
    else:
        target.write_bytes(change(target.read_bytes()))
    path = config_file(tmp_path, tiny_run_assets, "checkpoint.save_every=2", "checkpoint.keep_last=5")
    text = yaml.safe_load(Path(path).read_text())
    text["output_dir"] = str(run)
    Path(path).write_text(yaml.safe_dump(text))
    assert main(["train", path, "--resume", "auto"]) == 0
    assert "step-4 is damaged" in caplog.text and "resuming from step-2" in caplog.text
    got = losses(run)
    assert sorted(got) == [3, 4, 5, 6] and all(got[k] == losses(reference)[k] for k in got)  # bitwise


def test_no_intact_checkpoint_is_one_clear_error(tmp_path, tiny_run_assets, reference, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for step in (2, 4, 6):
        (run / "checkpoints" / f"step-{step}" / "optimizer.safetensors").write_bytes(b"")
    path = config_file(tmp_path, tiny_run_assets)
    text = yaml.safe_load(Path(path).read_text())
    text["output_dir"] = str(run)
    Path(path).write_text(yaml.safe_dump(text))
    assert main(["train", path, "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "no intact checkpoint to resume" in err and "optimizer.safetensors has 0 bytes" in err
    assert "Traceback" not in err
    assert main(["train", path, "--resume", str(run / "checkpoints" / "step-2")]) == 2  # named: no silent fallback
    assert "damaged checkpoint" in capsys.readouterr().err


def test_early_stopping_samples_and_metrics_survive_an_interruption(tmp_path, tiny_run_assets):
    common = ["training.max_steps=12", "training.learning_rate=0.3", "training.schedule=constant",
              "data.eval_split=0.1", "eval.eval_every=1", "eval.early_stopping_patience=2", "eval.samples_every=2",
              "eval.max_new_tokens=2", "checkpoint.save_every=1", "checkpoint.keep_last=20",
              "training.loss_spike_factor=null", "checkpoint.export=true"]
    whole = run_config(tmp_path / "a", tiny_run_assets, *common)
    train(whole)
    stop_at = max(losses(Path(whole.output_dir)))
    assert stop_at < 12  # early stopping ended it
    cut = run_config(tmp_path / "b", tiny_run_assets, *common)
    train(cut)
    run = Path(cut.output_dir)
    shutil.rmtree(run / "final", ignore_errors=True)
    keep = max(stop_at - 2, 1)
    for p in ckpt.list_checkpoints(run / "checkpoints"):
        if int(p.name.split("-")[1]) > keep:
            shutil.rmtree(p)
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 99, "loss": 1.0, "torn')  # a crash mid-line
    train(cut, resume="auto")
    assert losses(run) == losses(Path(whole.output_dir))  # stops at the same step, same losses
    steps = [r["step"] for r in records(run) if "loss" in r]
    assert steps == sorted(set(steps))  # no duplicates
    samples = [(r["step"], r["prompt"]) for r in records(run, "samples.jsonl")]
    assert len(samples) == len(set(samples)) == len(records(Path(whole.output_dir), "samples.jsonl"))
    a = load_file(Path(whole.output_dir) / "final" / "model.safetensors")
    b = load_file(run / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_inputs_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl: row 2: not UTF-8 text: byte 0xe9 at byte offset 30"):
        list(read_rows(str(bad)))
    csv_bad = tmp_path / "bad.csv"
    csv_bad.write_bytes(b"instruction,output\nhi,there\nx,\xff\n")
    with pytest.raises(DataError, match="bad.csv: row 3: not UTF-8 text"):
        list(read_rows(str(csv_bad)))
    unclosed = tmp_path / "unclosed.csv"
    unclosed.write_text('instruction,output\na,b\n"c,d\ne,f\ng,h\ni,j\n')
    with pytest.raises(DataError, match="unclosed.csv: row 2: CSV does not parse: the record starting at line 3"):
        list(read_rows(str(unclosed)))
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("instruction,output\na,b\nc\n")
    with pytest.raises(DataError, match=r"ragged.csv: row 2: 1 fields where the header has 2 \(line 3\)"):
        list(read_rows(str(ragged)))
    bom = tmp_path / "bom.csv"
    bom.write_bytes("instruction,output\na,b\n".encode("utf-8-sig"))
    assert [r for _, r in read_rows(str(bom))] == [{"instruction": "a", "output": "b"}]


def test_output_dir_problems_are_caught_before_anything_is_written(tmp_path, tiny_run_assets, reference, capsys):
    a_file = tmp_path / "taken"
    a_file.write_text("not a folder")
    assert main(["train", config_file(tmp_path, tiny_run_assets, f"output_dir={a_file}")]) == 2
    assert "output_dir is a file" in capsys.readouterr().err
    finished = tmp_path / "finished"
    shutil.copytree(reference, finished)
    before = {p: p.read_bytes() for p in finished.rglob("*") if p.is_file()}
    assert main(["train", config_file(tmp_path, tiny_run_assets, f"output_dir={finished}",
                                      "training.learning_rate=1e-4")]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in finished.rglob("*") if p.is_file()} == before  # nothing was changed


def test_divergence_stops_the_run_naming_the_step(tmp_path, tiny_run_assets, capsys):
    path = config_file(tmp_path, tiny_run_assets, "training.learning_rate=1e6", "training.max_steps=20",
                       "checkpoint.export=true", "training.warmup_steps=0")
    assert main(["train", path]) == 2
    err = capsys.readouterr().err
    assert "stopped learning at step" in err or "loss spike at step" in err
    assert "learning_rate" in err and not (tmp_path / "run" / "final").exists()


def test_exit_codes_finished_stopped_failed(tmp_path, tiny_run_assets):
    path = config_file(tmp_path, tiny_run_assets, "training.max_steps=400", "checkpoint.save_every=1000")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = ["-m", "leansft", "train", path]  # a process of its own, forked (tests/launcher.py)
    with launcher.Launch(argv, env=env, stderr_to_stdout=True) as proc:
        for line in proc.lines(timeout=300):
            if line.startswith("step 3 "):
                proc.kill(signal.SIGTERM)
                break
        assert proc.wait(timeout=120) == EXIT_STOPPED, proc.output()[-2000:]
    assert len(ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")) == 1
    assert not (tmp_path / "run" / "final").exists()
    # a signal while the run starts (here: as the data are reported, before the model loads) ends it with the same
    # code and a line that says so (before: a bare exit 143)
    shutil.rmtree(tmp_path / "run")
    with launcher.Launch(argv, env=env, stderr_to_stdout=True) as proc:
        for line in proc.lines(timeout=300):  # a hung run fails the test instead of hanging it
            if "data:" in line:
                proc.kill(signal.SIGTERM)
                break
        assert proc.wait(timeout=120) == EXIT_STOPPED, proc.output()[-2000:]
        assert "outside the training steps" in proc.output()


def test_a_signal_right_after_the_save_decision_still_saves(tmp_path, tiny_run_assets, monkeypatch):
    """A signal is handled between any two bytecodes: one landing after a step's save decision (nothing to save)
    and before the stop check used to break unsaved, exit code 3 promising a checkpoint that was never written."""
    import leansft.recipe.train as train_module
    from leansft.recipe.checkpointer import Checkpointer
    from leansft.recipe.signals import StopFlag

    flags = []

    class RecordedStopFlag(StopFlag):
        def __enter__(self):
            flags.append(self)
            return super().__enter__()

    real = Checkpointer.should_save

    def decide_then_signal(self, step, done):
        answer = real(self, step, done)
        if step == 2:
            flags[0].requested = True  # what the handler does
        return answer

    monkeypatch.setattr(train_module, "StopFlag", RecordedStopFlag)
    monkeypatch.setattr(Checkpointer, "should_save", decide_then_signal)
    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=6", "checkpoint.save_every=1000")
    result = train(cfg)
    assert result["stopped"]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-3"]


def test_a_stop_signal_on_another_rank_stops_this_one_at_the_same_step(tmp_path, tiny_run_assets, monkeypatch):
    """torchrun's ranks get a signal each at its own moment: the stop request travels with the step's loss
    all-reduce, so a rank whose own flag is clear still stops and saves at the step its peer does (before, the
    ranks could part ways and wait in different collectives)."""
    from leansft.core import distributed

    real = distributed.all_reduce_sum
    calls = []

    def peer_signalled_at_step_2(value, device):
        out = real(value, device)
        if torch.is_tensor(value) and value.shape == (2,):  # the step's loss and stop request
            calls.append(1)
            return out + torch.tensor([0.0, 1.0]) if len(calls) == 2 else out
        return out

    monkeypatch.setattr(distributed, "all_reduce_sum", peer_signalled_at_step_2)
    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=6", "checkpoint.save_every=1000")
    result = train(cfg)
    assert result["stopped"] and result["step"] == 2
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-2"]


def test_trust_remote_code_is_always_explicit(tmp_path, tiny_run_assets, monkeypatch):
    import transformers

    seen = []
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        real = cls.from_pretrained.__func__

        def spy(klass, *a, _real=real, **kw):
            seen.append(kw.get("trust_remote_code"))
            return _real(klass, *a, **kw)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    train(run_config(tmp_path, tiny_run_assets, "training.max_steps=1"))
    assert seen and all(v is False for v in seen)


def test_data_error_under_torchrun_is_one_message(tmp_path, tiny_run_assets):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}])
    path = config_file(tmp_path, tiny_run_assets, f"data.sources=[{bad}]")
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "leansft", "train", path],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and out.count("unknown role 'bot'") == 1, out[-3000:]
    # no rank prints a traceback of its own (torchrun's launcher still reports the failed workers)
    assert "src/leansft" not in out and "leansft/core" not in out and "leansft/recipe" not in out, out[-3000:]


def test_resume_checkpoint_from_an_older_format_is_refused(tmp_path, tiny_run_assets, reference):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    state = run / "checkpoints" / "step-6" / "state.json"
    data = json.loads(state.read_text())
    data["optimizer"]["param_groups"][0]["params"] = [0, 1]
    state.write_text(json.dumps(data))
    ckpt._write_manifest(state.parent)  # consistent files, old content
    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=8")
    cfg.output_dir = str(run)
    with pytest.raises(LeanSFTError, match="older leansft"):
        train(cfg, resume="auto")


def test_resume_with_a_changed_config_is_refused_unless_the_change_is_honoured(tmp_path, tiny_run_assets, reference,
                                                                               caplog):
    """A new learning rate would be silently lost (the optimizer state keeps the saved one) and a new micro-batch
    size moves what the saved data position means: refused before anything is written. Logging and checkpoint
    settings may change, and the resumed steps are then the uninterrupted run's, bit for bit."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for later in ("step-4", "step-6"):
        shutil.rmtree(run / "checkpoints" / later)
    before = (run / "metrics.jsonl").read_bytes()
    base = ("checkpoint.save_every=2", "checkpoint.keep_last=5")
    cfg = run_config(tmp_path, tiny_run_assets, *base, "training.learning_rate=1e-3",
                     "batching.tokens_per_micro_batch=256")
    cfg.output_dir = str(run)
    with pytest.raises(LeanSFTError, match="changed config: batching.tokens_per_micro_batch: 384 -> 256; "
                                           "training.learning_rate: 0.003 -> 0.001"):
        train(cfg, resume="auto")
    assert (run / "metrics.jsonl").read_bytes() == before
    cfg = run_config(tmp_path, tiny_run_assets, *base[:1], "checkpoint.keep_last=3", "logging.log_every=2")
    cfg.output_dir = str(run)
    train(cfg, resume="auto")
    assert "checkpoint.keep_last: 5 -> 3; logging.log_every: 1 -> 2" in caplog.text
    assert losses(run) == {k: v for k, v in losses(reference).items() if k in (1, 2, 4, 6)}


def test_resume_on_data_changed_since_is_refused(tmp_path, tiny_run_assets):
    """The same config can read a data file that changed since the checkpoint: its position would point at
    other examples, so the resume is refused."""
    data = tmp_path / "data.jsonl"
    shutil.copy(tiny_run_assets["data"], data)
    assets = {**tiny_run_assets, "data": str(data)}
    train(run_config(tmp_path, assets, "training.max_steps=2", "checkpoint.save_every=2"))
    rows = data.read_text().splitlines()
    data.write_text("\n".join(rows[1:] + rows[:1]) + "\n")  # the same rows, another order
    with pytest.raises(LeanSFTError, match="training data differ from the checkpoint's"):
        train(run_config(tmp_path, assets, "training.max_steps=4", "checkpoint.save_every=2"), resume="auto")


def _newest_step(run: Path) -> int:
    """The step of the newest finished checkpoint in ``run`` (0 when none): renamed into place only when whole."""
    found = ckpt.list_checkpoints(run / "checkpoints")  # oldest first
    return int(found[-1].name.removeprefix(ckpt.PREFIX)) if found else 0


def test_chaos_kill_9_then_bitwise_equal(tmp_path, tiny_run_assets):
    """kill -9 during start-up, mid-step or mid-checkpoint, and during the export, resuming with --resume auto
    each time; the final weights equal an uninterrupted run's bit for bit.

    Kills are timed by what the run has done, not by the clock alone. The runs are processes of their own, forked
    with torch, transformers and leansft imported (tests/launcher.py): a start-up kill lands in leansft's own start
    (its lock, data, model, pre-flight check: ~0.3 s here, the first checkpoint after it), not in imports. A mid-run
    kill waits until this process has saved two new checkpoints (it is training; the time between them is one step
    and its checkpoint), then comes at a random point of the next such cycle; the export kill comes as soon as the
    last checkpoint is in place. Each phase's kills are counted, so the test cannot quietly turn into a start-up
    test again.
    """
    import random
    import time

    steps = 60
    common = [f"training.max_steps={steps}", "checkpoint.save_every=1", "checkpoint.keep_last=2",
              "checkpoint.export=true", "logging.log_every=10"]
    path = config_file(tmp_path / "chaos", tiny_run_assets, *common)
    run = tmp_path / "chaos" / "run"
    rng, env = random.Random(0), {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = ["-m", "leansft", "train", path, "--resume", "auto"]  # processes of their own, forked (tests/launcher.py)
    # The uninterrupted run goes through the same command, as the interrupted ones do.
    whole, whole_run = config_file(tmp_path / "whole", tiny_run_assets, *common), tmp_path / "whole" / "run"
    assert launcher.run(["-m", "leansft", "train", whole], env=env).returncode == 0
    plan = ["start-up"] * 2 + ["mid-run"] * 3  # kills inside checkpoint writes: the async test below, 20 of them
    rng.shuffle(plan)
    plan.append("export")
    killed: dict[str, int] = {}

    def wait_for(proc, done) -> None:
        """Poll until ``done()`` or the process ends."""
        deadline = time.monotonic() + 600
        while proc.poll() is None and not done():
            assert time.monotonic() < deadline, "the run made no progress in 10 minutes"
            time.sleep(0.01)

    for phase in plan:
        before = _newest_step(run)
        proc = launcher.Launch(cmd, env=env)
        if phase == "start-up":
            time.sleep(rng.uniform(0.0, 0.3))
        elif phase == "mid-run":  # one step-and-checkpoint cycle timed, the kill at a random point of the next
            wait_for(proc, lambda before=before: _newest_step(run) > before)
            t0, first = time.monotonic(), _newest_step(run)
            wait_for(proc, lambda first=first: _newest_step(run) > first)
            time.sleep(rng.uniform(0.0, time.monotonic() - t0))
        else:
            wait_for(proc, lambda: _newest_step(run) == steps)
        with proc:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                landed = "start-up" if _newest_step(run) == before else phase if phase == "export" else "mid-run"
                killed[landed] = killed.get(landed, 0) + 1
            else:
                assert proc.returncode == 0, proc.stderr()[-3000:]
    with launcher.Launch(cmd, env=env) as proc:  # the last one runs to the end
        assert proc.wait(timeout=600) == 0, proc.stderr()[-3000:]
    assert killed.get("mid-run", 0) >= 3 and killed.get("export") == 1, killed
    a = load_file(whole_run / "final" / "model.safetensors")
    b = load_file(run / "final" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(run) == losses(whole_run)


def test_disk_full_while_checkpointing_is_one_line_naming_folder_space_and_what_was_kept(tmp_path, tiny_run_assets,
                                                                                         monkeypatch, capsys):
    real = ckpt.write_safetensors

    def fills_up(tensors, path):
        if "step-4" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path)

    monkeypatch.setattr(ckpt, "write_safetensors", fills_up)
    path = config_file(tmp_path, tiny_run_assets, "training.max_steps=6", "checkpoint.save_every=2")
    assert main(["train", path]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "OSError" not in err
    assert "cannot write checkpoint step-4: the disk is full (about" in err and "needed" in err
    assert "kept: step-2 (intact)" in err and str(tmp_path / "run" / "checkpoints") in err
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_resuming_a_finished_run_says_so_and_touches_nothing(tmp_path, tiny_run_assets, monkeypatch, caplog):
    """A refused fresh start says "continue it with --resume auto"; done on a finished run, that must not rewrite
    its report, model card or metrics (it exported afresh and wrote totals of zeros): nothing left to train. A run
    resumed after a crash reports the whole run's totals, not the last process's."""
    import logging

    from helpers import train_crashing_after

    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=4", "checkpoint.save_every=2",
                     "checkpoint.export=true")
    train_crashing_after(monkeypatch, cfg, 3)
    train(cfg, resume="auto")
    run = Path(cfg.output_dir)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    totals, last = records[-1], next(r for r in reversed(records) if "loss" in r)
    assert totals["run_real_tokens"] == last["tokens_seen"]  # steps 1-2 of the first process included
    assert totals["run_real_tokens_per_s"] == pytest.approx(totals["run_real_tokens"] / totals["run_step_s"])
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert {"report.md", "README.md"} <= {p.name for p in files}
    with caplog.at_level(logging.INFO, logger="leansft"):
        assert main(["train", config_file(tmp_path, tiny_run_assets, "training.max_steps=4",
                                          "checkpoint.save_every=2", "checkpoint.export=true",
                                          f"output_dir={run}"), "--resume", "auto"]) == 0
    assert "nothing left to train" in caplog.text
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files


def test_a_checkpoint_missing_a_ranks_shard_does_not_verify(tmp_path):
    """The manifest lists every rank's FSDP shard with its rank: a copy without one is damaged (it used to verify,
    listing rank 0's files alone), while a node that holds its own ranks' shards checks only those."""
    folder = tmp_path / "step-1"
    (folder / "dcp").mkdir(parents=True)
    (folder / "state.json").write_text("{}")
    owned = {}
    for r in (0, 1):
        shard = folder / "dcp" / f"__{r}_0.distcp"
        shard.write_bytes(bytes([r]) * 64)
        owned[f"dcp/{shard.name}"] = {**ckpt._file_entry(shard), "rank": r}
    ckpt._write_manifest(folder, owned, "node_local")
    assert ckpt.damage(folder) is None
    (folder / "dcp" / "__1_0.distcp").unlink()  # what node 0 of two holds
    assert ckpt.damage(folder) == "dcp/__1_0.distcp missing (rank 1's shard)"
    assert ckpt.damage(folder, ranks={0}) is None
    assert ckpt.damage(folder, ranks={1}) == "dcp/__1_0.distcp missing (rank 1's shard)"


def test_extending_a_finished_run_follows_the_new_schedule_from_its_first_resumed_step(tmp_path, tiny_run_assets,
                                                                                      reference, caplog):
    """6 -> 8 steps through the CLI: step 7 runs at the 8-step cosine's rate, not at the 6-step cosine's end (0),
    and a warning says what the extension means."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    cfg = run_config(tmp_path, tiny_run_assets, "checkpoint.save_every=2", "checkpoint.keep_last=5")
    cfg.output_dir = str(run)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    with caplog.at_level(logging.WARNING, logger="leansft"):
        assert main(["train", str(path), "training.max_steps=8", "--resume", "auto"]) == 0
    lr = {r["step"]: r["lr"] for r in records(run) if "lr" in r}
    cosine = [3e-3 * (1 if s < 1 else 0.5 * (1 + math.cos(math.pi * (s - 1) / 7))) for s in range(8)]
    assert lr[7] == pytest.approx(cosine[6], rel=1e-9) and lr[8] == pytest.approx(cosine[7], rel=1e-9)
    assert "step 7 runs at lr" in caplog.text and "a decayed schedule extended trains little more" in caplog.text


def test_a_max_length_that_leaves_nothing_names_max_length(tmp_path, tiny_run_assets, capsys):
    path = config_file(tmp_path, tiny_run_assets)
    assert main(["train", path, "data.max_length=16"]) == 2
    err = capsys.readouterr().err
    assert "without a target token once cut at data.max_length 16" in err and "raise data.max_length to about" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def _written_since(path: Path, t_ns: int) -> bool:
    try:
        return path.stat().st_mtime_ns > t_ns
    except FileNotFoundError:  # not yet, or renamed away with its folder
        return False


@pytest.mark.slow
def test_kill_9_during_an_async_write_leaves_the_newest_complete_checkpoint(tmp_path, tiny_run_assets):
    """checkpoint.async: 20 runs killed (SIGKILL) while the background thread writes a checkpoint's files (caught by
    its half-written .tmp-step-N): each time the newest checkpoint in place verifies and loads, and the run
    resumed from there ends with the weights of an uninterrupted run, bit for bit. The runs are forked from this
    process (torch already imported: a new interpreter per kill took 5 s), the write slowed between its files so
    the kill lands inside it."""
    import random
    import time

    steps = 60
    cfg = run_config(tmp_path / "killed", tiny_run_assets, f"training.max_steps={steps}", "checkpoint.save_every=1",
                     "checkpoint.keep_last=2", "batching.gradient_accumulation=1")
    whole = run_config(tmp_path / "whole", tiny_run_assets, f"training.max_steps={steps}", "checkpoint.save_every=1",
                       "batching.gradient_accumulation=1")
    assert cfg.checkpoint.async_  # the default
    train(whole)
    folder = Path(cfg.output_dir) / "checkpoints"
    real_write = ckpt.write_safetensors

    def slow_write(tensors, path):  # in the forked run only: the kill's window
        real_write(tensors, path)
        time.sleep(0.05)

    caught, rng = 0, random.Random(0)
    for trial in range(60):  # until 20 kills have landed inside a write
        started = time.time_ns()
        pid = os.fork()
        if pid == 0:  # the run: killed before it ends
            code = 1
            try:
                torch.set_num_threads(1)  # the parent's OpenMP team does not exist here
                ckpt.write_safetensors = slow_write
                logging.getLogger("leansft").handlers.clear()
                train(cfg, resume="auto")
                code = 0
            finally:
                os._exit(code)
        deadline, writing = time.monotonic() + 120, []
        while not writing:  # this run's own write under way (a killed run's .tmp-step-N is older)
            writing = [p for p in folder.glob(".tmp-step-*") if _written_since(p / "model.safetensors", started)
                       ] if ckpt.list_checkpoints(folder) else []
            if os.waitpid(pid, os.WNOHANG)[0]:
                pytest.fail(f"trial {trial}: the run ended before a write could be caught")
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"trial {trial}: no background write seen in 120 s")
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.2))  # at a random point of the write (its files are 50 ms apart), or after
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        caught += writing[0].exists()  # killed inside the write (not just after its rename)
        newest = ckpt.list_checkpoints(folder)[-1]
        assert ckpt.damage(newest) is None, (trial, newest, ckpt.damage(newest))
        assert json.loads((newest / "state.json").read_text())["step"] == int(newest.name.removeprefix("step-"))
        if caught == 20:
            break
    assert caught == 20
    train(cfg, resume="auto")
    assert not list(folder.glob(".tmp-*"))
    got = load_file(str(ckpt.list_checkpoints(folder)[-1] / "model.safetensors"))
    want = load_file(str(ckpt.list_checkpoints(Path(whole.output_dir) / "checkpoints")[-1] / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
