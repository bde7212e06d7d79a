"""tests/launcher.py, which starts the multi-process tests' ranks: they must see what torchrun's ranks see, meet
through its store, and end as torchrun ends them. Its scripts import nothing heavy, so torchrun costs little here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import launcher

ENV = """
import json, os, sys
with open(os.path.join(sys.argv[2], "env-" + os.environ["RANK"] + ".json"), "w") as f:  # a file a rank: torchrun's
    json.dump({k: os.environ[k] for k in os.environ if k not in sys.argv[1].split(",")}, f)  # ranks share one pipe
"""

# Set per launch (a port, an id, a file of the launch's own): their presence is compared, not their values.
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


def test_ranks_see_torchruns_environment(tmp_path):
    script = tmp_path / "env.py"
    script.write_text(ENV)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    given = ",".join(env)
    torchrun = Path(sys.executable).with_name("torchrun")
    (tmp_path / "real").mkdir()
    (tmp_path / "forked").mkdir()
    subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=2", str(script), given, str(tmp_path / "real")],
                   capture_output=True, text=True, env=env, timeout=120, check=True)
    forked = launcher.run([str(script), given, str(tmp_path / "forked")], 2, env=env, timeout=120)
    assert forked.returncode == 0, forked.stderr
    want, got = ([json.loads(f.read_text()) for f in sorted((tmp_path / side).glob("env-*.json"))]
                 for side in ("real", "forked"))
    want = sorted(({k: v for k, v in w.items() if k != "_"} for w in want), key=lambda e: e["RANK"])
    got = sorted(got, key=lambda e: e["RANK"])
    assert [set(e) for e in got] == [set(e) for e in want]
    for w, g in zip(want, got, strict=True):
        assert {k: v for k, v in g.items() if k not in PER_LAUNCH} == {k: v for k, v in w.items()
                                                                        if k not in PER_LAUNCH}


RANKS = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {total.item():.0f}", flush=True)
if dist.get_rank() == 1:
    sys.exit(3)
time.sleep(120)  # rank 0 waits: a peer's failure must end it
"""


def test_ranks_meet_through_the_store_and_a_failed_rank_ends_the_launch(tmp_path):
    """torchrun's way: the first failure's exit code is the launch's, and the ranks still running are ended."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    t0 = time.monotonic()
    with launcher.Launch([str(script)], 2) as ranks:
        assert ranks.wait(timeout=90) == 3, ranks.output()
        assert time.monotonic() - t0 < launcher.GRACE_S + 30
        assert sorted(ranks.stdout().splitlines()) == ["rank 0 of 2: 3", "rank 1 of 2: 3"]
        assert [p.exitcode for p in ranks.procs] == [-15, 3]  # rank 0 ended by SIGTERM
    assert not ranks.folder.exists()  # its output files went with it


SCRIPT = """
import os, sys
print(sys.argv[1:], os.getcwd(), os.environ["PICKED"], sys.stdin.read().strip(), sys.path[0] == os.getcwd())
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_the_python_shim_runs_a_script_as_python_would_and_ends_with_it(tmp_path):
    """``$PYTHON ARGS`` through tests/pyshim.py: the script's arguments, folder, environment and standard streams,
    its exit code, in a process forked with torch imported; the shim ended (as ``timeout`` ends it), the forked
    process ends too; with no shim served, a plain interpreter."""
    (tmp_path / "s.py").write_text(SCRIPT)
    plain = subprocess.run([sys.executable, str(launcher.SHIM), "-c", "import sys; print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "LEANSFT_TEST_PYSHIM"})
    assert plain.stdout.strip() == "False"
    with launcher.python_shim() as python:
        env, shim = {**os.environ, **python, "PICKED": "yes"}, python["PYTHON"].split()
        r = subprocess.run([*shim, "s.py", "a", "b c"], input="from stdin", capture_output=True, text=True,
                           cwd=tmp_path, env=env, timeout=60)
        assert (r.returncode, r.stderr) == (3, "to stderr\n")
        assert r.stdout == f"['a', 'b c'] {tmp_path} yes from stdin True\n"
        r = subprocess.run([*shim, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True, text=True,
                           env=env, timeout=60)
        assert (r.returncode, r.stdout) == (0, "True\n")
        slow = subprocess.Popen([*shim, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"],
                                stdout=subprocess.PIPE, text=True, env=env)
        pid = int(slow.stdout.readline())
        slow.terminate()
        assert slow.wait(timeout=30) != 0
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid)
        served = Path(python["LEANSFT_TEST_PYSHIM"]).parent
    assert not served.exists() and tmp_path.joinpath("s.py").exists()  # its own folder removed, nothing else


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
