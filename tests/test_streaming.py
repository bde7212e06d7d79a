"""Streaming sources (data.sources[*].streaming): prepared while training runs, a window at a time. Judged against
the cached run of the same rows (a window holding the whole source trains its losses), the asked shares, and an
uninterrupted streaming run (a crash and resume trains its losses, reading each source from a saved offset)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import launcher
import numpy as np
import psutil
import pytest
from helpers import losses, run_config, three_sources

from leansft.core.config import load_config
from leansft.core.data.masking import resolve_template
from leansft.core.data.stream import Cursor, Stream
from leansft.core.errors import ConfigError

@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[str]:
    """Three sources of other sizes and answer lengths: 3,000 short answers, 500 long ones, 200 in between."""
    return three_sources(tmp_path_factory.mktemp("stream"))


def _data(sources, *options, weights=(0.5, 0.3, 0.2)):
    spec = ", ".join(f"{{path: {p}, weight: {w}, streaming: true}}" for p, w in zip(sources, weights, strict=True))
    return load_config(None, ["model=m", "training.max_steps=1", f"data.sources=[{spec}]", *options]).data


@pytest.mark.parametrize("by", ["tokens", "examples"])
def test_each_source_holds_its_share_over_ten_thousand_steps_of_examples(sources, load_tok, qwen25_path, by):
    """stop: steps repeats every source as long as the run goes; the measured shares of every 20,000 examples
    (windows of 1,000) are the asked ones within 1%, and the small sources are read through many times."""
    tok = load_tok(qwen25_path)
    cfg = _data(sources, "data.mix.mode=interleave", f"data.mix.by={by}", "data.mix.stop=steps",
                "data.stream.window=1000", "data.num_workers=1")
    stream = Stream(cfg, tok, resolve_template(tok, None))
    amount, windows = np.zeros(3), stream.windows(stream.start())
    try:
        for _ in range(20):
            w = next(windows)
            got = w.data.target_counts if by == "tokens" else np.ones(len(w.data))
            amount += np.bincount(w.source, weights=got, minlength=3)
        assert w.end["epoch"] == 0  # steps: never exhausted
        assert w.end["cursors"][2]["lap"] >= 5  # c (200 examples at 20%) read through again and again
    finally:
        windows.close()
        stream.close()
    assert np.abs(amount / amount.sum() - [0.5, 0.3, 0.2]).max() < 0.01


def test_a_window_started_from_a_saved_state_is_the_window_the_stream_made(sources, load_tok, qwen25_path):
    """The state at a window's start is all a resume needs: the windows made from it equal the uninterrupted
    stream's, and a .jsonl source is read from the saved byte offset (its first rows overwritten with garbage of
    the same length are never read again)."""
    tok = load_tok(qwen25_path)
    cfg = _data(sources[:2], "data.mix.mode=interleave", "data.mix.stop=first_exhausted", "data.stream.window=700",
                "data.num_workers=2", weights=(1, 1))
    stream = Stream(cfg, tok, resolve_template(tok, None))
    windows = stream.windows(stream.start())
    made = [next(windows) for _ in range(4)]
    windows.close()
    third = made[2].start
    assert Cursor(**third["cursors"][0]).offset > 0  # source a is past its first shard
    a = Path(sources[0])
    original = a.read_bytes()
    try:
        cut, was = Cursor(**third["cursors"][0]).offset, a.stat()
        a.write_bytes(b"x" * (cut - 1) + b"\n" + original[cut:])  # what lies before the cursor is unreadable
        os.utime(a, ns=(was.st_atime_ns, was.st_mtime_ns))  # (the same size and time: not a file changed under it)
        again = stream.windows(third)
        for before in made[2:]:
            after = next(again)
            assert after.start == before.start and after.end == before.end
            assert np.array_equal(after.data.hashes, before.data.hashes)
            assert np.array_equal(after.data.flat()[0], before.data.flat()[0])
        again.close()
    finally:
        a.write_bytes(original)
        stream.close()


def test_a_stream_whose_window_holds_the_source_trains_the_cached_runs_losses(tmp_path, tiny_run_assets):
    from leansft.recipe.train import train

    cached = run_config(tmp_path / "cached", tiny_run_assets, "training.max_steps=4")
    train(cached)
    streamed = run_config(tmp_path / "stream", tiny_run_assets, "training.max_steps=4",
                          f"data.sources=[{{path: {tiny_run_assets['data']}, streaming: true}}]",
                          "data.stream.window=1000", "data.num_workers=2")
    before = {c.pid for c in psutil.Process().children()}
    train(streamed)
    assert {c.pid for c in psutil.Process().children()} <= before  # its data workers stopped with the loop
    assert losses(Path(streamed.output_dir)) == losses(Path(cached.output_dir))
    assert not list((tmp_path / "stream" / "cache").glob("tokenized/*"))  # nothing cached


KILLED_RUN = """
import sys, time
import leansft.recipe.train as recipe
from leansft.tools.cli import main
real = recipe.train_step
def slow(*args, **kwargs):  # time to be killed between the step-6 checkpoint and the run's end
    out = real(*args, **kwargs)
    time.sleep(0.4)
    return out
recipe.train_step = slow
sys.exit(main(["train", sys.argv[1]]))
"""


@pytest.mark.slow
def test_a_streaming_run_killed_and_resumed_trains_the_uninterrupted_losses(tmp_path, tiny_run_assets, caplog):
    """Windows of 16 examples, so the saved positions fall inside windows and steps span two of them; two sources
    interleaved 3:1 by examples; the run goes past the end of the stream's first epoch. ``leansft train`` is killed
    (SIGKILL) after its step-6 checkpoint: its data workers end with it, and the resume (seeking each source to its
    saved offset) trains the uninterrupted run's losses."""
    import os
    import time

    import yaml

    other = tmp_path / "other.jsonl"
    rows = [json.loads(line) for line in Path(tiny_run_assets["data"]).read_text().splitlines()][:8]
    other.write_text("".join(json.dumps({**r, "instruction": "Briefly: " + r["instruction"]}) + "\n" for r in rows))
    mix = (f"data.sources=[{{path: {tiny_run_assets['data']}, weight: 3, streaming: true}}, "
           f"{{path: {other}, weight: 1, streaming: true}}]", "data.mix.mode=interleave", "data.mix.by=examples",
           "data.mix.stop=first_exhausted", "data.stream.window=16", "training.max_steps=12", "data.num_workers=2")
    full = run_config(tmp_path / "a", tiny_run_assets, *mix)
    from leansft.recipe.train import train

    caplog.set_level(logging.INFO, "leansft")
    train(full)
    assert "the stream, epoch 1" in caplog.text  # 8 examples of other.jsonl at a quarter: an epoch of 32
    given = json.loads((Path(full.output_dir) / "data_report.json").read_text())["stream"]
    assert [g["share_asked"] for g in given] == [0.75, 0.25] and given[0]["epoch"] == 1
    cut = run_config(tmp_path / "b", tiny_run_assets, *mix, "checkpoint.save_every=3")
    config = tmp_path / "b.yaml"
    config.write_text(yaml.safe_dump(cut.model_dump(mode="json")))
    script = tmp_path / "killed_run.py"
    script.write_text(KILLED_RUN)
    step6, deadline = Path(cut.output_dir) / "checkpoints" / "step-6", time.monotonic() + 240
    with launcher.Launch([str(script), str(config)], env={**os.environ, "OMP_NUM_THREADS": "1"}) as proc:
        while not (step6 / "manifest.json").exists():  # (leaving the with kills the run in any case)
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no step-6 checkpoint in 240 s"
            time.sleep(0.05)
        workers = psutil.Process(proc.pids[0]).children(recursive=True)
        assert len(workers) == 2  # the stream's workers, reading ahead
        proc.kill()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, "a data worker outlived its killed run"
    assert max(losses(Path(cut.output_dir))) < 12  # killed before the end
    train(cut, resume="auto")
    assert losses(Path(cut.output_dir)) == losses(Path(full.output_dir))


@pytest.mark.parametrize("override, message", [
    ("data.eval_split=0.1", "data.eval_split holds out a share of the whole data"),
    ("data.sources=[{path: X, streaming: true}, {path: X}]", "some sources stream and some do not"),
    ("data.sources=[{path: X, streaming: true, weight: 2}]", "needs data.mix.mode: interleave"),
])
def test_what_a_stream_cannot_do_is_refused_by_name(tiny_run_assets, tmp_path, override, message):
    from leansft.core.data.prepare import prepare_data

    cfg = run_config(tmp_path, tiny_run_assets, f"data.sources=[{{path: {tiny_run_assets['data']}, streaming: true}}]",
                     override.replace("X", tiny_run_assets["data"]))
    with pytest.raises(ConfigError, match=message):
        prepare_data(cfg.data, cfg.model, holdout=False)


def test_a_stream_without_max_steps_is_refused(tiny_run_assets):
    with pytest.raises(ConfigError, match="set training.max_steps"):
        load_config(None, [f"model={tiny_run_assets['model']}",
                           f"data.sources=[{{path: {tiny_run_assets['data']}, streaming: true}}]"])


def test_plan_says_what_the_window_costs_in_packing(sources, qwen25_path, tmp_path, capsys):
    from leansft.tools.cli import main

    config = tmp_path / "run.yaml"
    spec = ", ".join(f"{{path: {p}, weight: {w}, streaming: true}}" for p, w in zip(sources, (0.5, 0.3, 0.2)))
    config.write_text(f"model: {qwen25_path}\ndata:\n  sources: [{spec}]\n  mix: {{mode: interleave}}\n"
                      "  stream: {window: 200}\ntraining: {max_steps: 10}\n")
    assert main(["plan", "--config", str(config), "--max-length", "128", "--json", str(tmp_path / "p.json")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"{sources[0]}: streaming (1 file, a resume seeks it by byte offset), 50.0% of the mix asked" in said
    assert "streaming: the figures below are the first window's (200 examples)" in said
    stream = json.loads((tmp_path / "p.json").read_text())["stream"]
    assert stream["windows"] == 4 and stream["examples"] == 800
    assert 0 < stream["fill_per_window"] <= stream["fill_together"] <= 1


def test_a_registry_entry_that_streams_needs_max_steps_too(tiny_run_assets, tmp_path):
    (tmp_path / "datasets.yaml").write_text(f"big: {{path: {tiny_run_assets['data']}, streaming: true}}\n")
    (tmp_path / "run.yaml").write_text(f"model: {tiny_run_assets['model']}\ndata: {{sources: [big]}}\n")
    with pytest.raises(ConfigError, match="set training.max_steps"):
        load_config(str(tmp_path / "run.yaml"))
    cfg = load_config(str(tmp_path / "run.yaml"), ["training.max_steps=5"])
    assert cfg.data.sources[0].streaming


def test_concat_reads_the_sources_one_after_another(sources, load_tok, qwen25_path):
    tok = load_tok(qwen25_path)
    cfg = _data([sources[2], sources[1]], "data.stream.window=300", "data.num_workers=1", weights=(1, 1))
    stream = Stream(cfg, tok, resolve_template(tok, None))
    windows = stream.windows(stream.start())
    made = [next(windows) for _ in range(3)]
    windows.close()
    stream.close()
    assert [np.bincount(w.source, minlength=2).tolist() for w in made] == [[200, 100], [0, 300], [0, 100]]
    assert made[2].end["epoch"] == 1 and made[1].end["epoch"] == 0


def test_parquet_and_saved_dataset_folders_stream_and_resume_by_row(sources, load_tok, qwen25_path, tmp_path):
    """The same 3,000 rows as .jsonl, as parquet (row groups of 50) and as a saved dataset folder: the same examples
    in the same windows, and windows made from a saved state (its source's second shard: row 1,024, inside a row
    group) equal the stream's."""
    import datasets

    rows = [json.loads(line) for line in Path(sources[0]).read_text().splitlines()]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "a.parquet"), batch_size=50)
    table.save_to_disk(str(tmp_path / "a_saved"))
    tok = load_tok(qwen25_path)
    made = {}
    for name, path in (("jsonl", sources[0]), ("parquet", tmp_path / "a.parquet"), ("saved", tmp_path / "a_saved")):
        cfg = _data([path], "data.stream.window=1100", "data.num_workers=1", weights=(1,))
        stream = Stream(cfg, tok, resolve_template(tok, None))
        windows = stream.windows(stream.start())
        made[name] = [next(windows) for _ in range(3)]
        windows.close()
        assert made[name][1].start["cursors"][0]["line"] == 1024 and made[name][1].start["cursors"][0]["skip"] == 76
        again = stream.windows(made[name][1].start)
        assert np.array_equal(next(again).data.hashes, made[name][1].data.hashes)
        again.close()
        stream.close()
    for name in ("parquet", "saved"):
        for a, b in zip(made["jsonl"], made[name]):
            assert np.array_equal(a.data.hashes, b.data.hashes) and np.array_equal(a.data.flat()[0], b.data.flat()[0])


def test_what_a_saved_stream_position_depends_on(sources, load_tok, qwen25_path):
    """A checkpoint's stream state means the same after a change of workers or read-ahead, not of the window."""
    tok = load_tok(qwen25_path)

    def fingerprint(*options):
        return Stream(_data(sources, "data.mix.mode=interleave", *options), tok, resolve_template(tok, None)
                      ).fingerprint()

    base = fingerprint()
    assert fingerprint("data.stream.ahead=5", "data.num_workers=1") == base
    assert fingerprint("data.stream.window=500") != base and fingerprint("data.mix.by=examples") != base


def test_the_first_window_is_made_once(sources, load_tok, qwen25_path):
    """Made for plan and the check before step 1, then the stream's first window again, not prepared anew."""
    tok = load_tok(qwen25_path)
    stream = Stream(_data(sources[:1], "data.stream.window=500", "data.num_workers=1", weights=(1,)), tok,
                    resolve_template(tok, None))
    first = stream.first_window()
    windows = stream.windows(stream.start())
    assert next(windows) is first and next(windows).start == first.end
    windows.close()
    stream.close()


def test_the_ranks_on_a_machine_share_its_cores(sources, load_tok, qwen25_path, monkeypatch):
    import leansft.core.data.stream as stream_module

    tok = load_tok(qwen25_path)
    monkeypatch.setattr(stream_module, "cpu_count", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    stream = Stream(_data(sources[:1], weights=(1,)), tok, resolve_template(tok, None))
    try:
        assert stream.open().workers == 2  # each rank reads the whole stream: 4 cores, 2 ranks, 2 workers each
    finally:
        stream.close()


def test_a_source_read_through_too_often_is_warned_about(sources, caplog):
    from leansft.core.data.stream import contributions

    cfg = _data(sources[:2], "data.mix.mode=interleave", "data.mix.by=examples", weights=(3, 1))
    state = {"epoch": 0, "cursors": [{"lap": 0}, {"lap": 9}],
             "taken": {"examples": [300, 100], "tokens": [3000, 500], "through": [False, True]}}
    given = contributions(state, cfg)
    assert [g["share_got"] for g in given] == [0.75, 0.25] and [g["read_through"] for g in given] == [0, 9]
    assert "b.jsonl: read through 9 times" in caplog.text and "a.jsonl: read through" not in caplog.text


def _break(folder: Path, how: str) -> None:
    last = sorted(folder.glob("*.jsonl"))[-1]  # not read yet at step 2: the stream reads a few shards ahead
    if how == "vanished":
        folder.rename(folder.with_name("moved"))
    elif how == "truncated":
        with last.open("r+b") as fh:
            fh.truncate(last.stat().st_size // 2)
    else:  # rewritten in place: the same size, other rows
        text = last.read_text()
        last.write_text(text.replace("a", "e"))
        os.utime(last, ns=(last.stat().st_atime_ns, last.stat().st_mtime_ns + 10**9))


@pytest.mark.parametrize("how, said", [("vanished", "vanished"), ("truncated", "shrank from"),
                                       ("rewritten", "was rewritten")])
def test_a_stream_that_breaks_under_the_run_ends_in_one_line_and_its_checkpoint_resumes(
        tmp_path, tiny_run_assets, monkeypatch, capsys, how, said):
    """A folder of 12 shards streamed; after the step-2 checkpoint the folder is moved away, a shard not yet read is
    cut short, or one is rewritten: ``leansft train`` exits 2 with one ``error:`` line naming the source, the file
    and what changed, no traceback; with the data put back, the run resumes from its checkpoint and trains on."""
    import shutil

    import yaml

    import leansft.recipe.train as recipe
    from leansft.tools.cli import main

    folder = tmp_path / "shards"
    folder.mkdir()
    lines = Path(tiny_run_assets["data"]).read_text().splitlines(keepends=True)
    for i in range(12):
        (folder / f"{i:03d}.jsonl").write_text("".join(lines[8 * i: 8 * i + 8]))
    shutil.copytree(folder, tmp_path / "kept")
    cfg = run_config(tmp_path, tiny_run_assets, f"data.sources=[{{path: {folder}, streaming: true}}]",
                     "data.stream.window=8", "data.stream.ahead=1", "data.num_workers=1", "training.max_steps=30",
                     "checkpoint.save_every=2")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    real = recipe.train_step

    def breaking(*args, **kwargs):
        out = real(*args, **kwargs)
        if args[3] == 2:
            _break(folder, how)
        return out

    monkeypatch.setattr(recipe, "train_step", breaking)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"streaming source {folder}" in errors[0] and said in errors[0] and ".jsonl" in errors[0], errors[0]
    steps = max(losses(Path(cfg.output_dir)))
    assert 2 <= steps < 30
    monkeypatch.setattr(recipe, "train_step", real)
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(tmp_path / "kept", folder)  # the data as the run started with it
    shutil.copystat(tmp_path / "kept", folder)
    for f in (tmp_path / "kept").iterdir():
        shutil.copystat(f, folder / f.name)
    assert main(["train", str(config), "--resume", "auto"]) == 0, capsys.readouterr().err
    assert max(losses(Path(cfg.output_dir))) == 30


def test_a_bad_row_inside_a_stream_follows_on_bad_row(sources, load_tok, qwen25_path, tmp_path, caplog):
    """As in cached data: ``error`` stops with the file and row named; ``skip`` leaves it out, counted, warned."""
    from leansft.core.errors import DataError

    rows = Path(sources[2]).read_text().splitlines(keepends=True)[:40]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(rows[:30]) + '{"instruction": "torn\n' + "".join(rows[30:]))
    tok = load_tok(qwen25_path)
    for on_bad_row in ("error", "skip"):
        stream = Stream(_data([str(bad)], "data.stream.window=100", "data.num_workers=1", f"data.on_bad_row={on_bad_row}",
                              weights=(1,)), tok, resolve_template(tok, None))
        try:
            if on_bad_row == "error":
                with pytest.raises(DataError, match="row 31.*invalid JSON"):
                    stream.first_window()
            else:
                caplog.set_level(logging.WARNING, "leansft")
                assert len(stream.first_window().data) == 40 and stream.sources[0].bad_rows == 1
                assert "rows skipped (data.on_bad_row: skip)" in caplog.text
        finally:
            stream.close()
