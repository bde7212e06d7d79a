"""Two CPU ranks (gloo), started as torchrun starts them (tests/launcher.py; torchrun itself where the test is about
torchrun): world-size invariance for DDP and FSDP2, and resume."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import launcher
import pytest
import torch
import yaml
from helpers import run_config
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def write(cfg, path: Path) -> str:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return str(path)


def launch(config: str, nproc: int, *extra: str) -> str:
    """``leansft train`` on ``nproc`` ranks as torchrun starts them, forked with torchrun's environment
    (tests/launcher.py: without ~3.5 s of imports in every rank); one process runs in this one."""
    if nproc == 1:
        from leansft.tools.cli import main

        assert main(["train", config, *extra]) == 0
        return ""
    proc = launcher.run(["-m", "leansft", "train", config, *extra], nproc,
                        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return " ".join((proc.stdout + proc.stderr).split())  # rich wraps long lines: one space-joined text


def records(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run)}


def weights(run: Path) -> dict:
    return load_file(run / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tiny_run_assets) -> tuple[str, ...]:
    """The runs compared across world sizes below train on two sources mixed 3:1 by examples (data.mix.mode
    interleave): the mix, drawn from the seed, must be the same on every rank and after a resume."""
    other = tmp_path_factory.mktemp("mixed") / "other.jsonl"
    rows = [json.loads(line) for line in Path(tiny_run_assets["data"]).read_text().splitlines()][:40]
    other.write_text("".join(json.dumps({**r, "instruction": "Briefly: " + r["instruction"]}) + "\n" for r in rows))
    return (f"data.sources=[{{path: {tiny_run_assets['data']}, weight: 3}}, {{path: {other}, weight: 1}}]",
            "data.mix.mode=interleave", "data.mix.by=examples")


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_run_assets, mixed):
    tmp = tmp_path_factory.mktemp("single")
    cfg = run_config(tmp, tiny_run_assets, *mixed, "training.max_steps=3", "batching.gradient_accumulation=2",
                     "checkpoint.export=true", "training.learning_rate=1e-4")
    from leansft.recipe.train import train

    train(cfg)
    return Path(cfg.output_dir)


@pytest.fixture(scope="module")
def fsdp_two_ranks(tmp_path_factory, tiny_run_assets, single, mixed) -> tuple[Path, str]:
    """Three steps on two FSDP ranks (accumulation 1), a checkpoint after each, and what rank 0 said: compared with
    the one-process run below, and its step-1 checkpoint the first leg of two resumes (one launch for both)."""
    tmp = tmp_path_factory.mktemp("fsdp_two_ranks")
    cfg = run_config(tmp, tiny_run_assets, *mixed, "training.max_steps=3", "batching.gradient_accumulation=1",
                     "checkpoint.export=true", "training.learning_rate=1e-4", "distributed.strategy=fsdp",
                     "checkpoint.save_every=1", "checkpoint.keep_last=3", f"data.cache_dir={single.parent / 'cache'}")
    return tmp, launch(write(cfg, tmp / "c.yaml"), 2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_accum_1_equal_one_rank_accum_2(tmp_path, tiny_run_assets, single, mixed, strategy, request):
    if strategy == "fsdp":
        folder, said = request.getfixturevalue("fsdp_two_ranks")
        run = folder / "run"
    else:
        cfg = run_config(tmp_path, tiny_run_assets, *mixed, "training.max_steps=3", "batching.gradient_accumulation=1",
                         "checkpoint.export=true", "training.learning_rate=1e-4", f"distributed.strategy={strategy}",
                         f"data.cache_dir={single.parent / 'cache'}")
        said, run = launch(write(cfg, tmp_path / "c.yaml"), 2), Path(cfg.output_dir)
    # rank 0 alone tells the story, and says how the ranks share the work
    assert said.count("training 3 steps") == 1 and f"{strategy.upper()} over 2 ranks" in said, said[-3000:]
    ref, got = losses(single), losses(run)
    assert set(got) == set(ref)
    mix = json.loads((run / "data_report.json").read_text())["sources"]  # the 3:1 mix, the same on both ranks
    assert [s["share_got"] for s in mix] == pytest.approx([0.75, 0.25], abs=0.01)
    progress = json.loads((run / "progress.json").read_text())  # the run page's: rank 0's, with the world size
    assert progress["world_size"] == 2 and progress["step"] == progress["total_steps"] == 3 and progress["finished"]
    # counters are global sums over ranks, so they equal the single-process run's
    for key in ("tokens_seen", "examples_seen"):
        assert [r[key] for r in records(run)] == [r[key] for r in records(single)]
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-5)
    a, b = weights(single), weights(run)
    assert set(a) == set(b)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_resume_from_a_distributed_checkpoint(tmp_path, tiny_run_assets):
    """A LoRA run under FSDP saving at step 2 and step 4, resumed from its step-2 checkpoint (DCP shards written by
    two ranks): steps 3 and 4 log the losses of the uninterrupted run again (evaluation and samples included), and
    the export holds the merged weights. With NEFTune each rank draws its own noise: restored from rank 0's
    generator alone, steps 3-4 were 6e-4 off. (LoRA under DDP: test_lora_under_ddp_on_a_streaming_mix.)"""
    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=4", "training.schedule=constant",
                     "training.warmup_steps=0", "checkpoint.save_every=2", "checkpoint.keep_last=2",
                     "data.eval_split=0.1", "eval.eval_every=2", "eval.samples_every=2", "distributed.strategy=fsdp",
                     "training.neftune_noise_alpha=5", "training.method=lora", "training.lora.r=4",
                     "training.learning_rate=1e-2", "checkpoint.export=true")
    path = write(cfg, tmp_path / "c.yaml")
    launch(path, 2)
    run = Path(cfg.output_dir)
    uninterrupted = losses(run)
    step2 = run / "checkpoints" / "step-2"
    assert (step2 / "dcp").is_dir()
    launch(path, 2, "--resume", str(step2))
    assert sorted(uninterrupted) == [1, 2, 3, 4]
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4]  # resumed after step 2: its log kept, not restarted
    assert losses(run) == pytest.approx(uninterrupted, rel=1e-6)
    exported = weights(run)
    assert exported and not any("lora" in k for k in exported)  # merged on export
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_lora_under_ddp_on_a_streaming_mix(tmp_path, tiny_run_assets, mixed):
    """LoRA under DDP, its two sources streaming in windows of 16 examples (so steps span two windows): two ranks
    (accumulation 1) train the losses of one process (accumulation 2), each rank reading the whole stream in the same
    order. (LoRA under FSDP: test_resume_from_a_distributed_checkpoint, one launch fewer.)"""
    streaming = (mixed[0].replace("weight: 3}", "weight: 3, streaming: true}").replace(
        "weight: 1}", "weight: 1, streaming: true}"), *mixed[1:], "data.stream.window=16")
    common = ("training.method=lora", "training.lora.r=4", "training.max_steps=4", "checkpoint.export=true",
              "training.learning_rate=1e-2")
    one = run_config(tmp_path / "one", tiny_run_assets, *streaming, *common, "batching.gradient_accumulation=2")
    launch(write(one, tmp_path / "one.yaml"), 1)
    cfg = run_config(tmp_path, tiny_run_assets, *streaming, *common, "distributed.strategy=ddp",
                     "batching.gradient_accumulation=1")
    launch(write(cfg, tmp_path / "c.yaml"), 2)
    ref, got = losses(Path(one.output_dir)), losses(Path(cfg.output_dir))
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    assert [got[k] for k in ref] == pytest.approx([ref[k] for k in ref], rel=1e-5)
    exported = weights(Path(cfg.output_dir))
    assert exported and not any("lora" in k for k in exported)  # merged on export


@pytest.mark.parametrize("first,then", [((1, "ddp"), (2, "fsdp")), ((2, "fsdp"), (1, "ddp")),
                                        ((2, "fsdp"), (2, "ddp"))],
                         ids=["1-to-fsdp2", "fsdp2-to-1", "fsdp-to-ddp"])  # DDP's checkpoint is a single process's
def test_resume_on_another_world_size_and_strategy(tmp_path, tiny_run_assets, single, mixed, fsdp_two_ranks, first,
                                                   then):
    """Saved on N ranks (DDP or FSDP), resumed on M: the global step (world x accumulation) is kept and the
    run continues the uninterrupted run's loss sequence; the exported weights agree. The two-rank FSDP first
    leg is ``fsdp_two_ranks`` up to its step-1 checkpoint, copied for each resume without what came after."""
    (n, strategy), (m, strategy_after) = first, then
    run = tmp_path / "run"
    if n == 2:
        shutil.copytree(fsdp_two_ranks[0] / "run", run)
        for later in ("checkpoints/step-2", "checkpoints/step-3", "final"):
            shutil.rmtree(run / later)
        path = str(fsdp_two_ranks[0] / "c.yaml")
    else:
        cfg = run_config(tmp_path, tiny_run_assets, *mixed, "training.max_steps=1", "batching.gradient_accumulation=2",
                         "checkpoint.export=true", "training.learning_rate=1e-4", f"distributed.strategy={strategy}",
                         f"data.cache_dir={single.parent / 'cache'}")
        path = write(cfg, tmp_path / "c.yaml")
        launch(path, n)
    launch(path, m, f"output_dir={run}", "training.max_steps=3", f"distributed.strategy={strategy_after}",
           "--resume", "auto")
    ref, got = losses(single), losses(run)
    assert [r["step"] for r in records(run)] == sorted(ref)  # resumed after step 1, not started again
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-6)
    a, b = weights(single), weights(run)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def _gather_on_rank(rank: int, init: str, out: str) -> None:
    """One of two ranks: FSDP2 over a small model with wide MLPs, then the export's gather, its live tensors counted."""
    import torch
    import torch.distributed as tdist
    from helpers import tiny_model
    from torch.distributed.tensor import DTensor

    from leansft.core import distributed
    from leansft.core.io.hf_export import gather_full_weights
    from leansft.core.metrics.memtrack import TensorMemoryTracker
    from leansft.core.model.forward import LossModule

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        trained = tiny_model("qwen2", seed=1, intermediate_size=1024)  # no tensor above 1/7 of the model
        expected = {k: v.clone() for k, v in trained.state_dict().items()}
        root = distributed.wrap(LossModule(trained), "fsdp", torch.device("cpu"))
        plain = tiny_model("qwen2", seed=2, intermediate_size=1024) if rank == 0 else None
        held = [t.to_local() if isinstance(t, DTensor) else t for t in root.state_dict().values()]
        held += list(plain.state_dict().values()) if plain is not None else []
        with TensorMemoryTracker(exclude=held) as tracker:
            gather_full_weights(root, plain)
        if rank == 0:
            sizes = [p.numel() * p.element_size() for p in plain.parameters()]
            Path(out).write_text(json.dumps({
                "peak": tracker.peak, "model": sum(sizes), "largest": max(sizes),
                "equal": all(torch.equal(v, expected[k]) for k, v in plain.state_dict().items())}))
    finally:
        tdist.destroy_process_group()
    os._exit(0)  # as leansft's ranks end (distributed.left_process_group): torch's gloo threads outlive FSDP2


def test_a_rank_that_left_its_process_group_ends_without_the_interpreters_teardown(monkeypatch):
    """torch leaves gloo's threads running after FSDP2 and functional collectives, and the interpreter's teardown
    raced them into SIGABRT in about a third of two-rank runs (a finished run reported failed by torchrun): a
    process that left a process group ends at once with its exit code, output flushed; any other exits as usual."""
    import leansft.__main__ as entry
    from leansft.core import distributed

    ended: list[int] = []
    monkeypatch.setattr(os, "_exit", ended.append)
    monkeypatch.setattr(entry.logging, "shutdown", lambda: None)  # this process's logging goes on
    entry._leave(3)
    assert ended == []  # never in a process group: the usual exit
    monkeypatch.setattr(distributed, "_LEFT", True)
    entry._leave(3)
    assert ended == [3]


def _spawn(mp, fn, args: tuple, nprocs: int, timeout_s: float = 180) -> None:
    """``mp.spawn`` that fails instead of hanging: ranks still running after ``timeout_s`` are killed. The ranks are
    forked by tests/launcher.py's fork server (torch and leansft imported there once), not new interpreters."""
    import time

    launcher.context()  # its fork server, with what it imports
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"{fn.__name__}: ranks still running after {timeout_s:.0f} s")


def test_an_fsdp_export_holds_the_model_once_on_rank_0(tmp_path):
    """Rank 0 receives each gathered weight into its plain copy before the next is gathered, so beside that copy
    it holds about one tensor, not a gathered state dict the size of the model (7B in fp32: 28 GB more)."""
    import torch.multiprocessing as mp

    out = tmp_path / "rank0.json"
    _spawn(mp, _gather_on_rank, (f"file://{tmp_path / 'store'}", str(out)), nprocs=2)
    seen = json.loads(out.read_text())
    assert seen["equal"]
    assert seen["peak"] <= 2 * seen["largest"] < seen["model"] / 3, seen


@pytest.mark.slow
def test_a_stopped_peer_ends_the_run_naming_the_timeout(tmp_path, tiny_run_assets):
    """A rank that stops answering (SIGSTOP: a frozen machine or a partition) ends the others within
    distributed.timeout_s and a grace, with one line naming the timeout and the rank whose heartbeat stood still,
    not gloo's 30 minutes of silence.
    Timed to the end of the rank that waited: the teardown of the stopped one (torchrun's: SIGTERM, 30 s, SIGKILL)
    is the launcher's, and on a loaded machine it outlasted any fair limit."""
    import signal
    import time

    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=400", "distributed.timeout_s=20",
                     "checkpoint.save_every=1000")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    stopped, out = None, []
    with launcher.Launch(["-m", "leansft", "train", write(cfg, tmp_path / "c.yaml")], 2, env=env,
                         stderr_to_stdout=True) as launch:  # leaving it kills what still runs
        lines = launch.lines(timeout=240)
        for line in lines:
            out.append(line)
            if line.lstrip().startswith("step 3 "):
                waiting, stopped = launch.pids
                os.kill(stopped, signal.SIGSTOP)
                t0 = time.monotonic()
                break
        assert stopped is not None, "".join(out)[-3000:]
        for line in lines:  # rank 0's line, then the end of rank 0 itself
            out.append(line)
            if "distributed.timeout_s=" in line:
                break
        while _alive(waiting) and time.monotonic() - t0 < 120:
            time.sleep(0.2)
        took = time.monotonic() - t0
    text = " ".join("".join(out).split())
    assert took < 90, (took, text[-3000:])
    assert "distributed.timeout_s=20" in text and "(rank 0/2 on " in text, text[-3000:]
    assert "answering: rank 1 on " in text and "has no heartbeat" in text, text[-3000:]  # the frozen rank, named


def _alive(pid: int) -> bool:
    """Running (not gone, and not a zombie its parent has yet to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            for task in Path(f"/proc/{parent}/task").iterdir():
                kids = (task / "children").read_text().split()
                found += map(int, kids)
                todo += map(int, kids)
    return found


@pytest.mark.slow
def test_an_elastic_restart_resumes_and_trains_the_uninterrupted_losses(tmp_path, tiny_run_assets):
    """torchrun --max-restarts 1: a worker killed after a checkpoint is started again, resumes from it by itself
    (TORCHELASTIC_RESTART_COUNT > 0 means --resume auto) and ends with the uninterrupted run's losses."""
    import signal

    from leansft.recipe.train import train

    common = ["training.max_steps=6", "checkpoint.save_every=2", "training.learning_rate=1e-4"]
    whole = run_config(tmp_path / "whole", tiny_run_assets, *common)
    train(whole)
    cfg = run_config(tmp_path / "elastic", tiny_run_assets, *common)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc_per_node=1", "--max-restarts=1", "-m",
                             "leansft", "train", write(cfg, tmp_path / "c.yaml")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    out, killed = [], False
    watchdog = threading.Timer(300, os.killpg, (proc.pid, signal.SIGKILL))  # reading never outlives the test
    watchdog.start()
    try:
        for line in proc.stdout:
            out.append(line)
            if not killed and "saved checkpoint" in line and "step-2" in line:
                os.kill(_children(proc.pid)[0], signal.SIGKILL)
                killed = True
        assert proc.wait(timeout=300) == 0, "".join(out)[-3000:]
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = " ".join("".join(out).split())
    assert killed and "resuming from the newest complete checkpoint" in text, text[-3000:]
    got, ref = losses(Path(cfg.output_dir)), losses(Path(whole.output_dir))
    assert set(got) == set(ref) and all(got[k] == pytest.approx(ref[k], abs=1e-6) for k in ref), (got, ref)


def _two_nodes(config: str, dirs: list[Path], *extra: str, timeout: float = 240,
               kill_on: str | None = None) -> list[subprocess.CompletedProcess]:
    """Two nodes (one rank each), each in its own working directory: two nodes with their own disks, their ranks
    started as torchrun's rendezvous would (tests/launcher.py). ``kill_on``: every rank is killed (SIGKILL) as soon as
    one prints it. Past ``timeout`` everything is killed (the test then fails on what it printed)."""
    argv = ["-m", "leansft", "train", config, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    with launcher.Launch(argv, nodes=dirs, env=env, stderr_to_stdout=True) as launch:
        with contextlib.suppress(subprocess.TimeoutExpired):
            for line in launch.lines(timeout) if kill_on else ():
                if kill_on in line:
                    launch.kill()  # at once: the tiny run takes milliseconds a step
                    break
            launch.wait(timeout)
        return [subprocess.CompletedProcess(argv, p.exitcode, launch.stdout(r), "")
                for r, p in enumerate(launch.procs)]


def _nodes(tmp_path: Path) -> list[Path]:
    nodes = [tmp_path / "node-a", tmp_path / "node-b"]
    for n in nodes:
        n.mkdir()
    return nodes


# Two nodes (one rank each, accumulation 1) against one process with accumulation 2: the same global steps.
NODE_RUN = ("training.max_steps=24", "checkpoint.save_every=2", "checkpoint.keep_last=2", "training.learning_rate=1e-3")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_run_assets) -> dict[int, float]:
    from leansft.recipe.train import train

    cfg = run_config(tmp_path_factory.mktemp("one_process"), tiny_run_assets, *NODE_RUN)
    train(cfg)
    return losses(Path(cfg.output_dir))


def _node_losses(nodes: list[Path]) -> dict[int, float]:
    """The run's losses as rank 0 logged them, read on both nodes (under torchrun's c10d rendezvous rank 0 may be on
    either node in each launch)."""
    found: dict[int, float] = {}
    for n in nodes:
        if (n / "run" / "metrics.jsonl").exists():
            for step, loss in losses(n / "run").items():
                assert found.get(step, loss) == loss  # a step logged on both nodes: the same value
                found[step] = loss
    return found


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_node_local_disks_killed_then_resumed_train_the_one_process_losses(tmp_path, tiny_run_assets, one_process,
                                                                          strategy):
    """Two nodes with their own disks, both killed (SIGKILL) once the first checkpoint is saved, then started again
    with --resume auto: every node holds its part of each checkpoint, every rank resumes from the same one, and the
    losses are the single process's. FSDP: each node holds its rank's shard, and each node's manifest lists both.
    Then, with one node's checkpoints gone, every node stops with the same line and nothing is pruned."""
    import time

    cfg = run_config(tmp_path, tiny_run_assets, *NODE_RUN, "batching.gradient_accumulation=1", "output_dir=run",
                     "data.cache_dir=cache", f"distributed.strategy={strategy}", "distributed.timeout_s=60")
    config, nodes = write(cfg, tmp_path / "c.yaml"), _nodes(tmp_path)
    first = _two_nodes(config, nodes, kill_on="saved checkpoint")
    said = " ".join((first[0].stdout + first[1].stdout).split())
    assert "node-local storage" in said and "once per node" in said, said[-3000:]
    assert all(p.returncode != 0 for p in first)  # killed
    saved = [{p.name for p in (n / "run" / "checkpoints").glob("step-*")} for n in nodes]
    assert "step-2" in saved[0] & saved[1], (saved, said[-3000:])  # saved before the kill: on both disks
    second = _two_nodes(config, nodes, "--resume", "auto")
    text = " ".join((second[0].stdout + second[1].stdout).split())
    assert all(p.returncode == 0 for p in second), text[-3000:]
    assert "resumed from run/checkpoints/step-" in text, text[-3000:]
    got = _node_losses(nodes)
    assert sorted(got) == sorted(one_process), (got, one_process)
    assert all(got[k] == pytest.approx(one_process[k], abs=1e-6) for k in one_process), (got, one_process)
    for n in nodes:
        assert not list((n / "run" / "checkpoints").glob(".tmp-*"))
        assert sorted(p.name for p in (n / "run" / "checkpoints").iterdir()) == ["step-22", "step-24"]
    if strategy == "fsdp":
        for n in nodes:
            listed = json.loads((n / "run" / "checkpoints" / "step-24" / "manifest.json").read_text())["files"]
            assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata"} <= set(listed)
            held = {p.name for p in (n / "run" / "checkpoints" / "step-24" / "dcp").glob("*.distcp")}
            assert len(held) == 1  # its own rank's shard only
        return
    shutil.rmtree(nodes[1] / "run" / "checkpoints")
    before = sorted(p.name for p in (nodes[0] / "run" / "checkpoints").iterdir())
    t0 = time.monotonic()
    third = _two_nodes(config, nodes, "training.max_steps=30", "--resume", "auto", timeout=120)
    took = time.monotonic() - t0
    lines = [next((ln for ln in p.stdout.splitlines() if ln.startswith("error")), "") for p in third]
    assert all(p.returncode != 0 for p in third) and took < 60, (took, third[0].stdout[-2000:])
    reasons = [ln.split("): ", 1)[1] for ln in lines]  # after "error (rank R/2 on HOST)"
    assert reasons[0] == reasons[1] and "no intact checkpoint in common" in reasons[0], lines
    assert "step-22, step-24" in reasons[0] and ": none" in reasons[0]
    assert sorted(p.name for p in (nodes[0] / "run" / "checkpoints").iterdir()) == before  # nothing pruned


@pytest.mark.slow
def test_shared_storage_is_refused_on_node_local_disks(tmp_path, tiny_run_assets):
    """checkpoint.storage: shared promises one output_dir for every node; on two nodes' own disks every node
    stops at once, naming the rank that cannot see rank 0's files."""
    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=2", "output_dir=run", "data.cache_dir=cache",
                     "checkpoint.storage=shared", "distributed.timeout_s=60")
    done = _two_nodes(write(cfg, tmp_path / "c.yaml"), _nodes(tmp_path), timeout=120)
    lines = [next((ln for ln in p.stdout.splitlines() if ln.startswith("error")), "") for p in done]
    assert all(p.returncode != 0 for p in done), done[0].stdout[-2000:]  # torchrun's 1 for its worker's 2
    assert all("checkpoint.storage is shared" in ln and "rank 1 on " in ln for ln in lines), lines


def test_a_peer_failure_is_named_and_anything_else_is_left_alone():
    from leansft.core.distributed import peer_failure

    line = peer_failure(RuntimeError("[gloo] Timed out waiting 20000ms for recv operation"), 20)
    assert line is not None and "distributed.timeout_s=20" in line
    assert "another rank ended" in peer_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), 600)
    assert peer_failure(RuntimeError("shape mismatch"), 600) is None
    assert peer_failure(ValueError("Timed out"), 600) is None  # not a collective's error


def _storage_on_rank(rank: int, init: str, base: str, out: str) -> None:
    """One of three ranks: ranks 0 and 1 share a folder, rank 2 has its own; then all share one."""
    import torch.distributed as tdist

    from leansft.core import distributed

    tdist.init_process_group("gloo", init_method=init, rank=rank, world_size=3, timeout=timedelta(seconds=60))
    try:
        split = distributed.storage_of(Path(base) / ("a" if rank < 2 else "b"))
        one = distributed.storage_of(Path(base) / "shared")
        tdist.barrier()  # every rank has removed its token before rank 2 looks
        if rank == 2:
            Path(out).write_text(json.dumps({"split": split.groups, "writer": split.writer(), "one": one.groups,
                                             "left": sorted(p.name for p in Path(base).rglob("*"))}))
    finally:
        tdist.destroy_process_group()


def test_ranks_that_share_a_folder_are_found_by_the_token_files_they_read_back(tmp_path):
    """The storage check behind checkpoint.storage and the data cache: the ranks that read each other's token files
    form a group, whose lowest rank writes for it; the token files are gone afterwards."""
    import torch.multiprocessing as mp

    out = tmp_path / "rank2.json"
    _spawn(mp, _storage_on_rank, (f"file://{tmp_path / 'store'}", str(tmp_path / "disks"), str(out)), nprocs=3)
    seen = json.loads(out.read_text())
    assert seen["split"] == [[0, 1], [2]] and seen["writer"] is True and seen["one"] == [[0, 1, 2]]
    assert seen["left"] == ["a", "b", "shared"]  # the folders, not the probes


def test_a_heartbeat_stops_before_the_process_group_goes(monkeypatch):
    """``shutdown`` stops this rank's heartbeat thread and waits for it to leave the store (a process that exits
    with the thread inside the store's C++ client can abort)."""
    from leansft.core import distributed

    beats = threading.Event()

    class Store:
        def set(self, key, value):
            beats.set()

    monkeypatch.setattr(distributed, "_store", lambda: Store())
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    beat = distributed.Heartbeat()
    monkeypatch.setattr(distributed, "_HEARTBEAT", beat)
    beat.start()
    assert beats.wait(10)
    distributed._stop_heartbeat(10)
    assert not beat.is_alive() and distributed._HEARTBEAT is None


def test_commands_that_only_read_data_import_no_fsdp():
    """``plan`` and ``show-mask`` import distributed (through the data preparation) but not FSDP (a third of a second
    of their start): it is imported when a run wraps its model."""
    probe = "import sys, leansft.core.data.prepare\nprint('torch.distributed.fsdp' in sys.modules)\n"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert r.stdout.strip() == "False", r.stderr[-2000:]


SLOW_WRITES = """
import sys, time
import leansft.core.io.checkpoint_files as ckpt
from leansft.tools.cli import main
real = ckpt.write_safetensors
def slow(tensors, path):  # a background write long enough to be killed inside
    real(tensors, path)
    time.sleep(0.6)
ckpt.write_safetensors = slow
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_kill_9_of_a_rank_inside_a_background_save_leaves_the_newest_complete_checkpoint(tmp_path, tiny_run_assets,
                                                                                        strategy):
    """checkpoint.async on two ranks: ten launches, each killed (SIGKILL, one rank, the other ended as torchrun ends
    it) while a checkpoint's files are written in the background (caught by its half-written .tmp-step-N, a
    random moment into it); each time the newest checkpoint in place verifies and its state is its step's. Resumed
    on two ranks, the run ends with the uninterrupted run's weights, bit for bit."""
    import random
    import signal
    import time

    from leansft.core.io import checkpoint_files as ckpt

    common = ("training.max_steps=8", "checkpoint.keep_last=2", "checkpoint.export=true",
              "batching.gradient_accumulation=1", f"distributed.strategy={strategy}", "distributed.timeout_s=60",
              f"data.cache_dir={tmp_path / 'cache'}")
    whole = run_config(tmp_path / "whole", tiny_run_assets, *common)  # saved once, at its end: saves change nothing
    said = launch(write(whole, tmp_path / "whole.yaml"), 2)
    assert "in the background" in said, said[-2000:]
    cut = run_config(tmp_path / "cut", tiny_run_assets, *common, "checkpoint.save_every=1")
    config, script = write(cut, tmp_path / "cut.yaml"), tmp_path / "slow_writes.py"
    script.write_text(SLOW_WRITES)
    folder, rng, caught = Path(cut.output_dir) / "checkpoints", random.Random(0), 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for trial in range(10):
        started = time.time_ns()
        with launcher.Launch([str(script), config, "--resume", "auto"], 2, env=env, stderr_to_stdout=True) as run:
            deadline, writing = time.monotonic() + 120, []
            while not writing:  # this launch's own write under way, with a checkpoint before it
                writing = [p for p in folder.glob(".tmp-step-*") if any(
                    f.stat().st_mtime_ns > started for f in p.glob("*.safetensors"))] if ckpt.list_checkpoints(
                    folder) else []
                assert run.poll() is None, f"trial {trial}: ended before a write was caught: {run.output()[-2000:]}"
                assert time.monotonic() < deadline, f"trial {trial}: no background write in 120 s"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.3))  # into the write: its first file is 0.6 s from the next
            os.kill(run.pids[rng.randrange(2)], signal.SIGKILL)
            caught += writing[0].exists()  # killed inside the write (not after its rename)
            run.wait(120)  # the other rank ended as torchrun ends a failed rank's peers
        newest = ckpt.list_checkpoints(folder)[-1]
        assert ckpt.damage(newest) is None, (trial, newest, ckpt.damage(newest))
        assert json.loads((newest / "state.json").read_text())["step"] == int(newest.name.removeprefix("step-"))
    assert caught == 10, caught  # every kill landed inside a write
    launch(config, 2, "--resume", "auto", "checkpoint.save_every=4")
    assert not list(folder.glob(".tmp-*"))
    a, b = weights(Path(whole.output_dir)), weights(Path(cut.output_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
