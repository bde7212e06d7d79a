"""The install the docs give is the install that works: a virtual environment made with exactly the commands of
docs/evaluation.md's "Installing the benchmarks" (no test extra, nothing else), where each benchmark suite then
runs once (on given responses where a model is not needed; MMLU scores a tiny model). The suite's own venv holds
the test extra, which once hid a package lm-eval's tasks import (sacrebleu) from every test.

torch is there first, as the README has GPU users install it (the CUDA build their driver wants, then leansft):
the suite's own torch and what it requires, linked into the new environment, so pip sees torch==2.13.0 installed
and installs everything else itself (unpacking torch's 700 MB again would test nothing of leansft's)."""

from __future__ import annotations

import json
import os
import re
from importlib.metadata import distribution
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_benchmark_suites import write_mmlu

ROOT = Path(__file__).resolve().parents[1]


def documented_installs() -> list[list[str]]:
    """The ``pip install`` lines of docs/evaluation.md's install block, as a user types them in a clone."""
    text = (ROOT / "docs" / "evaluation.md").read_text()
    block = re.search(r"\*\*Installing the benchmarks\.\*\*.*?```bash\n(.*?)```", text, re.S).group(1)
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    commands = [shlex.split(line) for line in lines if line.startswith("pip install")]
    assert commands and any("[evals]" in " ".join(c) for c in commands), block
    return commands


def torch_first(venv: Path) -> None:
    """This environment's torch and its requirements, visible in ``venv`` through a .pth file (a folder of links)."""
    folder = venv / "torch_first"
    folder.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        name = todo.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        dist = distribution(name)
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {".."}:
            if (base / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(base / top)
        todo += [re.split(r"[ ;<>=!\[~(]", r)[0] for r in dist.requires or [] if "extra ==" not in r]
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "torch_first.pth").write_text(f"{folder}\n")


@pytest.mark.slow
def test_the_documented_evaluation_install_runs_every_suite(tmp_path, tiny_run_assets):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    torch_first(venv)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_COMPILE": "1", "HF_HUB_OFFLINE": "1",
           "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    for command in documented_installs():
        done = subprocess.run([str(venv / "bin" / "python"), "-m", *command, "-q"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-3000:])
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"], env=env,
                            capture_output=True, text=True, check=True).stdout
    assert not {p["name"].lower() for p in json.loads(listed)} & {"pytest", "trl", "playwright"}  # no test extra

    rows = [{"key": 1, "prompt": "Answer in lowercase only.", "instruction_id_list": ["change_case:english_lowercase"],
             "kwargs": [{}]}]
    (tmp_path / "ifeval.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (tmp_path / "one.jsonl").write_text(json.dumps({"response": "all lowercase here"}) + "\n")
    (tmp_path / "three.jsonl").write_text("".join(json.dumps({"response": "Hi."}) + "\n" for _ in range(3)))
    (tmp_path / "two.jsonl").write_text("".join(json.dumps({"turns": ["First.", "Second."]}) + "\n" for _ in range(2)))
    mmlu = write_mmlu(tmp_path / "mmlu", test=1)
    runs = {"ifbench": ["--suite", "ifbench", "--limit", "3", "--responses", "three.jsonl"],
            "ifeval": ["--suite", f"ifeval={tmp_path / 'ifeval.jsonl'}", "--responses", "one.jsonl"],
            "mtbench": ["--suite", "mtbench", "--limit", "2", "--responses", "two.jsonl"]}
    # MMLU by the installed command; the three scored on given answers in one interpreter of the venv (its imports
    # once), each through the command's own entry point
    done = subprocess.run([str(venv / "bin" / "leansft"), "eval", tiny_run_assets["model"], "--suite", f"mmlu={mmlu}",
                           "--shots", "1", "--json", "mmlu.json"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, (done.stdout, done.stderr[-3000:])
    script = ("import sys; from leansft.tools.cli import main\n"
              f"sys.exit(max(main(['eval', 'none', *args, '--json', name + '.json']) for name, args in {runs!r}.items()))")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, (done.stdout, done.stderr[-3000:])
    for name, n in {"ifbench": 3, "ifeval": 1, "mtbench": 2, "mmlu": 2}.items():
        (result,) = json.loads((tmp_path / f"{name}.json").read_text())
        assert result["suite"] == name and result["n"] == n, (name, result["n"])
