"""Nothing a user owns is lost and no file runs code: exports onto folders leansft did not write, two runs on one
output_dir, checkpoints and configs from someone else, the vendored converter's reach.

Each slip and each crafted file goes through the CLI where a user meets it: one line saying what to do (exit 2),
nothing outside what leansft wrote deleted or changed, and a payload's marker file never created.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import launcher
import pytest
import yaml
from helpers import run_config

from leansft.core.io import checkpoint_files as ckpt
from leansft.core.io import run_lock
from leansft.recipe.train import train
from leansft.tools.cli import main


def config_file(tmp_path: Path, assets: dict, *overrides: str) -> str:
    cfg = run_config(tmp_path, assets, *overrides)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return str(path)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    line = err.strip()
    assert line.startswith("error: ") and "Traceback" not in line, line
    for needle in needles:
        assert needle in line, line
    return line


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_run_assets) -> Path:
    """A finished 2-step run (full fine-tuning, no final export): its checkpoints are what others would share."""
    tmp = tmp_path_factory.mktemp("trained")
    cfg = run_config(tmp, tiny_run_assets, "training.max_steps=2")
    train(cfg)
    return Path(cfg.output_dir)


def a_copy(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


# -- exports never delete what leansft did not write ---------------------------------------------------------------
def test_an_export_onto_a_users_folder_is_refused_unless_overwrite(tmp_path, tiny_run_assets, capsys):
    models = tmp_path / "models"
    (models / "other-model").mkdir(parents=True)
    (models / "notes.txt").write_text("mine")
    (models / "other-model" / "config.json").write_text("{}")
    before = tree(models)
    src = tiny_run_assets["model"]
    refused(capsys, main(["export", src, str(models)]), "leansft did not export", "--overwrite")
    assert tree(models) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # no temporary folder left beside it
    # an earlier export of leansft's is replaced without the flag; the user's folder only with it
    assert main(["export", src, str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / ".leansft-export").is_file()
    assert main(["export", src, str(tmp_path / "exported")]) == 0
    assert main(["export", src, str(models), "--overwrite"]) == 0
    assert not (models / "notes.txt").exists() and (models / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "models"]


def test_an_export_never_replaces_what_it_reads_a_run_or_the_current_folder(tmp_path, trained, tiny_run_assets,
                                                                            capsys, monkeypatch):
    run = a_copy(trained, tmp_path)
    before = tree(run)
    refused(capsys, main(["export", str(run), str(run), "--overwrite"]), "is what the export reads")
    refused(capsys, main(["export", str(run), str(run / "exported")]), "is inside what the export reads")
    refused(capsys, main(["export", str(run / "checkpoints" / "step-2"), str(tmp_path)]), "holds what the export")
    other = tmp_path / "other"
    shutil.copytree(trained, other)
    refused(capsys, main(["export", str(run), str(other), "--overwrite"]), "holds a training run")
    base = Path(tiny_run_assets["model"])  # the base model the checkpoint's config names
    refused(capsys, main(["export", str(run), str(base), "--overwrite"]), "is what the export reads")
    plain = tmp_path / "a-file"
    plain.write_text("x")
    refused(capsys, main(["export", str(run), str(plain)]), "OUT is a file")
    monkeypatch.chdir(tmp_path)
    refused(capsys, main(["export", str(run), ".", "--overwrite"]), "current folder")
    assert tree(run) == before and plain.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "other", "run"]  # no OUT.tmp anywhere


def test_a_gguf_export_replaces_only_its_own_file(tmp_path, tiny_run_assets, capsys):
    src, out = tiny_run_assets["model"], tmp_path / "model.gguf"
    out.write_bytes(b"someone else's file")
    refused(capsys, main(["export", src, str(out), "--to", "gguf"]), "leansft did not export", "--overwrite")
    assert out.read_bytes() == b"someone else's file"
    assert main(["export", src, str(out), "--to", "gguf", "--overwrite"]) == 0
    assert main(["export", src, str(out), "--to", "gguf", "--dtype", "f32"]) == 0  # its own: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.Modelfile", "model.gguf"]  # no temp file left
    refused(capsys, main(["export", src, str(tmp_path), "--to", "gguf", "--overwrite"]), "OUT is a folder")


# -- one run per output_dir ----------------------------------------------------------------------------------------
HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from leansft.core.io import run_lock
    assert run_lock.acquire(Path(sys.argv[1])) is None
    print("holding", flush=True)
    time.sleep(120)
""")


def test_a_second_run_on_a_held_folder_refuses_and_a_killed_holder_leaves_no_lock(tmp_path, trained,
                                                                                   tiny_run_assets, capsys):
    """A run in progress (here: a process holding the folder, then killed with SIGKILL) keeps a second run off its
    folder: the second names the holder and changes nothing, its half-written checkpoint included."""
    run = a_copy(trained, tmp_path)
    half = run / "checkpoints" / ".tmp-step-4"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half written")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        before = tree(run)
        cfg = config_file(tmp_path, tiny_run_assets, f"output_dir={run}", "training.max_steps=3")
        line = refused(capsys, main(["train", cfg, "--resume", "auto"]), "in use by another leansft run",
                       f"pid {holder.pid}")
        assert "choose another output_dir" in line
        assert tree(run) == before  # the running run's .tmp-step-4 is still there
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert main(["train", cfg, "--resume", "auto"]) == 0  # the lock went with the killed process
    assert not half.exists()  # now an abandoned write, cleaned by the run that holds the folder
    assert (run / run_lock.LOCK).read_text() == ""  # a run that ended leaves no holder named


def test_a_run_deletes_only_what_leansft_wrote_in_its_folders(tmp_path, trained, tiny_run_assets, capsys):
    """A fresh run on a folder holding a user's files of the names a run writes refuses before changing anything;
    in a run folder's checkpoints/ a user's ``step-N`` without a manifest and ``.tmp-*`` of other names outlive a
    resume's cleanup and the pruning of old checkpoints, and a step to save over a user's folder is refused."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("# my notes\n")
    (mine / "metrics.jsonl").write_text("my measurements\n")
    before = tree(mine)
    cfg = config_file(tmp_path, tiny_run_assets, f"output_dir={mine}", "training.max_steps=3")
    refused(capsys, main(["train", cfg]), "output_dir holds config.yaml, metrics.jsonl", "no leansft run wrote them")
    assert tree(mine) == before
    theirs = tmp_path / "theirs"  # the files a run writes since the run page and the suites, a user's here
    theirs.mkdir()
    for name in ("suites.jsonl", "progress.json", "report.html"):
        (theirs / name).write_text(f"my {name}\n")
    before = tree(theirs)
    cfg = config_file(tmp_path, tiny_run_assets, f"output_dir={theirs}", "training.max_steps=3")
    refused(capsys, main(["train", cfg]), "output_dir holds suites.jsonl, progress.json, report.html")
    assert tree(theirs) == before

    run = a_copy(trained, tmp_path)
    folder, cache = run / "checkpoints", tmp_path / "cache"
    kept = {folder / "step-1": "not leansft's", folder / ".tmp-mine": "notes", folder / ".tmp-step-x": "notes",
            folder / ".tmp-step-7": "a name like leansft's", cache / ".tmp-mine": "notes",
            cache / "tokenized" / ".tmp-mine": "notes"}
    for path, text in kept.items():
        path.mkdir(parents=True)
        (path / "notes.txt").write_text(text)
    (folder / "step-2" / "notes.txt").write_text("added to leansft's checkpoint")
    half = folder / ".tmp-step-9"  # a killed run's half-written checkpoint: leansft's to clean
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half")
    cfg = config_file(tmp_path, tiny_run_assets, f"output_dir={run}", "training.max_steps=4",
                      "checkpoint.save_every=1", "checkpoint.keep_last=1")
    assert main(["train", cfg, "--resume", "auto"]) == 0
    for path, text in kept.items():
        assert (path / "notes.txt").read_text() == text, path
    assert not half.exists()
    assert (folder / "step-2" / "notes.txt").exists()  # not pruned: it holds a file leansft did not write
    assert sorted(p.name for p in folder.iterdir() if ckpt.ours(p)) == ["step-4"]  # leansft's older steps pruned

    run = a_copy(trained, tmp_path / "again")
    (run / "checkpoints" / "step-3").mkdir()
    (run / "checkpoints" / "step-3" / "notes.txt").write_text("mine")
    cfg = config_file(tmp_path, tiny_run_assets, f"output_dir={run}", "training.max_steps=3",
                      "checkpoint.save_every=1")
    refused(capsys, main(["train", cfg, "--resume", "auto"]), "step-3 exists and holds files leansft does not write")
    assert (run / "checkpoints" / "step-3" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_two_runs_started_together_on_one_fresh_folder_train_once(tmp_path, tiny_run_assets):
    cfg = config_file(tmp_path, tiny_run_assets, "training.max_steps=2")
    procs = [launcher.Launch(["-m", "leansft", "train", cfg]) for _ in range(2)]  # forked (tests/launcher.py)
    said, printed = {}, {}  # by exit code: stderr, and stdout (where a loser that says nothing on stderr went)
    for p in procs:
        with p:
            code = p.wait(timeout=300)
            said[code], printed[code] = p.stderr(), p.stdout()
    assert sorted(said) == [0, 2], said
    loser = said[2]
    assert "in use by another leansft run" in loser and "Traceback" not in loser, (loser, printed[2][-3000:])


def test_a_folder_without_working_locks_is_said(tmp_path, monkeypatch, caplog):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "lockf", no_locks)  # (taken through core/paths.try_lock)
    assert run_lock.acquire(tmp_path / "out") is None
    assert "without working locks" in caplog.text


# -- checkpoints and configs from elsewhere are data, never code -------------------------------------------------
class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _as_fsdp_checkpoint(step: Path, metadata: bytes) -> None:
    """Make ``step`` claim to be an FSDP checkpoint whose dcp/.metadata is ``metadata``, manifest rewritten to
    match (whoever crafts a folder writes its manifest too)."""
    state = json.loads((step / "state.json").read_text())
    state.update(sharded=True, world_size=2)
    (step / "state.json").write_text(json.dumps(state))
    config = yaml.safe_load((step / "config.yaml").read_text())
    config["distributed"]["strategy"] = "fsdp"
    (step / "config.yaml").write_text(yaml.safe_dump(config))
    (step / "dcp").mkdir()
    (step / "dcp" / ".metadata").write_bytes(metadata)
    (step / "manifest.json").unlink()
    ckpt._write_manifest(step)


def test_a_crafted_dcp_index_is_refused_on_export_and_on_resume(tmp_path, trained, tiny_run_assets, capsys):
    marker = tmp_path / "payload-ran"
    run = a_copy(trained, tmp_path)
    step = run / "checkpoints" / "step-2"
    _as_fsdp_checkpoint(step, pickle.dumps(_Payload(marker)))
    refused(capsys, main(["export", str(step), str(tmp_path / "out")]), "not a checkpoint index leansft reads",
            "posix.system")
    cfg = config_file(tmp_path, tiny_run_assets, f"output_dir={run}", "training.max_steps=3")
    refused(capsys, main(["train", cfg, "--resume", str(step)]), "not a checkpoint index leansft reads")
    assert not marker.exists()


def test_a_dcp_item_that_is_not_plain_data_is_refused(tmp_path):
    """Non-tensor items of a DCP checkpoint (an optimizer's scalars) load with weights_only=True: a pickled payload
    there is refused; plain values load."""
    import torch
    import torch.distributed.checkpoint as dcp

    from leansft.core.errors import LeanSFTError
    from leansft.core.io import dcp_safe

    marker = tmp_path / "payload-ran"
    dcp.save({"w": torch.ones(3), "lr": 0.5, "betas": (0.9, 0.95)}, checkpoint_id=str(tmp_path / "good"))
    back = {"w": torch.zeros(3), "lr": 0.0, "betas": (0.0, 0.0)}
    dcp_safe.load(back, tmp_path / "good")
    assert back["lr"] == 0.5 and back["betas"] == (0.9, 0.95) and torch.equal(back["w"], torch.ones(3))
    dcp.save({"w": torch.ones(3), "evil": _Payload(marker)}, checkpoint_id=str(tmp_path / "bad"))
    with pytest.raises(LeanSFTError, match="is not plain data"):
        dcp_safe.load({"w": torch.zeros(3), "evil": None}, tmp_path / "bad")
    assert not marker.exists()


def test_a_checkpoint_config_runs_no_code_and_fetches_nothing(tmp_path, trained, capsys):
    """export reads a checkpoint's config.yaml as data: trust_remote_code comes from the command line only, and a Hub
    id it names is read from the local cache only (or with --base-model)."""
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "custom-model"
    evil.mkdir()
    (evil / "config.json").write_text(json.dumps({
        "model_type": "evil", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                     "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}))
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (evil / name).write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    run = a_copy(trained, tmp_path)
    step = run / "checkpoints" / "step-2"
    config = yaml.safe_load((step / "config.yaml").read_text())
    for model, needle in ((str(evil), str(evil)), ("someone/never-named", "--base-model")):
        config.update(model=model, trust_remote_code=True)
        (step / "config.yaml").write_text(yaml.safe_dump(config))
        (step / "manifest.json").unlink()
        ckpt._write_manifest(step)
        refused(capsys, main(["export", str(step), str(tmp_path / "out")]), needle)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_manifest_entries_outside_the_checkpoint_and_links_do_not_verify(tmp_path, trained):
    run = a_copy(trained, tmp_path)
    step = run / "checkpoints" / "step-2"
    manifest = json.loads((step / "manifest.json").read_text())
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"x")
    for name in ("../../../elsewhere.bin", str(outside), "a/./b"):
        crafted = {**manifest, "files": {**manifest["files"], name: {"bytes": 1, "sha256": "0"}}}
        (step / "manifest.json").write_text(json.dumps(crafted))
        assert "not a file of the checkpoint folder" in ckpt.damage(step)
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert ckpt.damage(step) is None
    (step / "rng.safetensors").rename(tmp_path / "rng.safetensors")
    (step / "rng.safetensors").symlink_to(tmp_path / "rng.safetensors")
    assert "symbolic link" in ckpt.damage(step)


# -- smaller items -------------------------------------------------------------------------------------------------
def test_pkg_paths_import_nothing_and_stay_inside_their_package():
    from leansft.core.errors import ModelError
    from leansft.core.paths import resolve_package_path

    probe = ("from leansft.core.paths import resolve_package_path\n"
             "try:\n    resolve_package_path('pkg:this.x/f')\nexcept Exception as e:\n    print(type(e).__name__)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert r.stdout.strip() == "ModelError", r.stdout  # `import this` would have printed the Zen of Python
    with pytest.raises(ModelError, match="not inside package"):
        resolve_package_path("pkg:leansft/../../etc/passwd")


def test_a_heartbeat_value_that_is_not_one_never_hides_the_error():
    from leansft.core.distributed import _beat

    assert _beat(b"12 host-a") == ("12", "host-a")
    assert _beat(b"garbage") == ("?", "?") and _beat(b"\xff\xfe") == ("?", "?")


def test_export_modes_are_read_without_touching_the_umask():
    """Setting the process umask, even for a moment, changes the mode of files other threads create meanwhile."""
    from leansft.core.paths import plain_file_mode

    src = Path(__file__).parents[1] / "src" / "leansft"
    assert not [f for f in src.rglob("*.py") if "_vendor" not in f.parts and "os.umask(" in f.read_text()]
    umask = os.umask(0o022)
    try:
        assert plain_file_mode() == 0o644
    finally:
        os.umask(umask)


def test_torch_compiles_cache_is_private_to_the_user(tmp_path, monkeypatch):
    from leansft.core.paths import private_compile_cache

    monkeypatch.setenv("LEANSFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = private_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert folder.parent == tmp_path / "cache" and folder.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert private_compile_cache() == tmp_path / "mine"  # the user's own choice stands


def test_node_local_storage_refuses_a_folder_nodes_share(monkeypatch):
    from leansft.core import distributed
    from leansft.core.config import load_config
    from leansft.core.errors import LeanSFTError
    from leansft.recipe.checkpointer import checkpoint_storage

    shared = distributed.Storage(((0, 1),), ("rank 0 on a", "rank 1 on b"))
    monkeypatch.setattr(distributed, "storage_of", lambda folder: shared)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "all_gather_object", lambda obj: ["0", "1"])  # two nodes' GROUP_RANK
    cfg = load_config(None, ["model=m", "checkpoint.storage=node_local"])
    with pytest.raises(LeanSFTError, match="rank 0 on a and rank 1 on b, on different nodes, share"):
        checkpoint_storage(cfg, Path("out"))
    monkeypatch.setattr(distributed, "all_gather_object", lambda obj: ["0", "0"])  # one node: its own folder
    assert checkpoint_storage(cfg, Path("out")) is shared


def test_overrides_are_taken_before_or_after_the_options(monkeypatch):
    import leansft.tools.cli as cli

    seen = {}
    monkeypatch.setattr(cli, "cmd_train", lambda args: seen.update(vars(args)) or 0)
    assert cli.main(["train", "c.yaml", "--resume", "auto", "training.max_steps=3", "logging.log_every=2"]) == 0
    assert seen["resume"] == "auto" and seen["overrides"] == ["training.max_steps=3", "logging.log_every=2"]
    assert cli.main(["train", "c.yaml", "a=1", "--doctor", "b=2"]) == 0
    assert seen["overrides"] == ["a=1", "b=2"] and seen["doctor"]
    with pytest.raises(SystemExit):
        cli.main(["train", "c.yaml", "--resume", "auto", "--bogus"])


def test_the_command_imports_no_torch_before_it_needs_it():
    """``python -m leansft`` answers a mistyped argument without importing torch (its re-exec check used to import
    it through core/cpu/__init__)."""
    probe = ("import sys\nsys.argv = ['leansft', 'export', 'a', 'b', '--dtype', 'q9']\n"
             "from leansft.__main__ import main\n"
             "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
             "print(code, sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert r.stdout.strip() == "2 []", (r.stdout, r.stderr[-2000:], time.monotonic() - t0)


@pytest.mark.parametrize("background", ["true", "false"])
def test_a_save_refuses_a_temporary_folder_of_someone_elses_and_leaves_it(tmp_path, tiny_run_assets, capsys,
                                                                          background):
    """A user's folder named as a save's temporary one (``.tmp-step-2`` with notes in it): the save, written in the
    background or not, stops in one line naming it, and the folder and the checkpoints before it are left as they
    were; a half-written ``.tmp-step-1`` of leansft's own is replaced."""
    folder = tmp_path / "run" / "checkpoints"
    mine, half = folder / ".tmp-step-2", folder / ".tmp-step-1"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half")
    cfg = config_file(tmp_path, tiny_run_assets, "training.max_steps=3", "checkpoint.save_every=1",
                      f"checkpoint.async={background}")
    assert main(["train", cfg]) == 2
    err = capsys.readouterr().err
    assert f"{mine} exists and holds files leansft does not write there" in err and "Traceback" not in err
    assert (mine / "notes.txt").read_text() == "mine" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["step-1"] and ckpt.damage(folder / "step-1") is None
    assert not half.exists()
