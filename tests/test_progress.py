"""Long work shows progress: phase lines as each piece starts and ends, a bar with an ETA on a terminal, plain
lines every few seconds elsewhere, and a line per checkpoint saved."""

from __future__ import annotations

import logging
import os
import time

import launcher
import pytest
import yaml
from helpers import run_config

from leansft.core import progress


def test_track_prints_plain_lines_with_an_eta_when_not_on_a_terminal(caplog, monkeypatch):
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    monkeypatch.setattr(progress, "_terminal", lambda: False)
    with caplog.at_level(logging.INFO, logger="leansft"):
        assert list(progress.track(range(3), 3, "eval batches", lambda: "loss 1.0")) == [0, 1, 2]
        with progress.phase("exporting x"):
            pass
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [f"eval batches: {i}/3, about 0 s left (loss 1.0)" for i in (1, 2, 3)]
    assert lines[3] == "exporting x..." and lines[4].startswith("exporting x: done in ")


def test_other_ranks_stay_quiet(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO, logger="leansft"):
        with progress.phase("loading"):
            list(progress.track(range(2), 2, "eval"))
    assert not caplog.records


@pytest.mark.slow
def test_a_run_logged_to_a_file_says_what_it_is_doing_as_it_starts_each_phase(tmp_path, tiny_run_assets):
    """`leansft train` with its output in a file (no terminal): every phase that took minutes on a busy machine
    says so as it starts, and each checkpoint saved is a line with its path and size."""
    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=2", "checkpoint.save_every=2",
                     "checkpoint.export=true", "eval.eval_every=2", "eval.samples_every=2", "eval.num_samples=1",
                     "eval.max_new_tokens=4", "data.eval_split=0.1", "logging.log_every=100")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    with launcher.Launch(["-m", "leansft", "train", str(path)], env=env, stderr_to_stdout=True) as run:
        for line in run.lines(timeout=300):  # a hung run fails the test instead of hanging it
            seen.append((time.monotonic() - t0, line.strip()))
        assert run.wait(timeout=300) == 0, "\n".join(s for _, s in seen)[-3000:]
    text = "\n".join(s for _, s in seen)
    order = ["loading ", "checking the run's forward and loss against the plain model", "step 0: held-out eval",
             "step 0: sampling 1 answer", "saved checkpoint", "exporting"]
    at = [next((i for i, (_, s) in enumerate(seen) if want in s), None) for want in order]
    assert None not in at and at == sorted(at), (at, text[-3000:])
    assert "MB," in seen[at[4]][1] and "step-2" in seen[at[4]][1]
    assert ": done in " in text
