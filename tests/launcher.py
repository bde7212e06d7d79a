"""Processes for the tests, forked from one that has imported leansft: ``python -m leansft ...`` (or a script) alone, or
as the ranks torchrun would start, with torchrun's environment and its store.

Why: a new process spends ~3.5 s of CPU importing torch, transformers and leansft before it does anything, and a
torchrun launch of two ranks three times that with torchrun's own start; most of what the multi-process tests spent
went there. Here a fork server (``multiprocessing``'s, one per pytest worker) imports them once and every process
the tests start is forked from it, then runs the same entry point as ``python -m`` would (``runpy``), its exit code
and output its own. What torchrun itself does (restarts, its rendezvous across machines, its report of a failed
worker) is tested through torchrun (tests/test_distributed.py, tests/test_recovery.py). A script that starts
``$PYTHON ...`` itself (benchmarks/gpu_check.sh) gets those processes forked too, under ``python_shim()``.

The fork server's environment is the pytest worker's when it started: what Python or a library reads at import
(``PYTHONUNBUFFERED``, HF_HUB_OFFLINE, the OpenMP thread count) is that, and the rest of ``env`` is set before the
entry point runs (the thread count through ``torch.set_num_threads``). Each process writes the CPU it spent to a
file read back here (``spent``), so ``LEANSFT_TEST_CPU`` counts forked processes with the test that started them
(not those ``torch.multiprocessing`` forks through ``context()``, nor one killed before it could write); the server
itself is reaped at the session's end (``stop``), so ``time make test`` counts them all.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

# Imported once in the fork server: what a training run imports (the model classes the tests' tiny models use, DCP
# and FSDP for the distributed runs, PEFT for LoRA (which imports bitsandbytes: 0.95 s of CPU), pyplot for the
# run's report (0.25 s)), so that a forked process imports next to nothing.
PRELOAD = ["leansft.tools.cli", "leansft.recipe.train", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen2.modeling_qwen2", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "peft", "matplotlib.pyplot", "launcher"]
GRACE_S = 10  # after a rank fails, the others' time to end on SIGTERM before SIGKILL (torchrun gives 30)
_SPENT = [0.0]


def context():
    """The fork server's context (also for ``torch.multiprocessing.start_processes(start_method="forkserver")``)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def spent() -> float:
    """CPU seconds the forked processes started so far spent (user + system, their own children's included)."""
    return _SPENT[0]


def stop() -> None:
    """End the fork server and reap it (its processes' CPU then counts for this one)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    with contextlib.suppress(AttributeError, OSError, ChildProcessError):
        server._stop()


class _Fd:
    """A file descriptor of this process, duplicated into the forked one (multiprocessing's ``DupFd``): an int there."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _entry(argv: list[str], env: dict[str, str], cwd: str, out: str | int, err: str | int, cpu: str,
           stdin: int | None = None) -> None:
    """In the forked process: become ``python ARGV`` in ``cwd`` with ``env``, output to ``out``/``err`` (files, or
    descriptors handed over, as ``stdin``)."""
    import atexit
    import runpy
    import traceback

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, target in ((0, stdin), (1, out), (2, err)):
        if target is None:
            continue
        opened = target if isinstance(target, int) else os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own, to its end)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if stdin is not None:  # (multiprocessing gave the process /dev/null)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    real_exit = os._exit

    def leave(code: int) -> None:  # what the process spent, written as it ends (leansft's ranks end by os._exit)
        t = os.times()
        with contextlib.suppress(OSError):
            Path(cpu).write_text(str(t.user + t.system + t.children_user + t.children_system))
        real_exit(code)

    os._exit = leave  # this forked process's own
    code = 0
    # sys.path as the interpreter starts it: the script's folder (or the working folder), then PYTHONPATH's
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.path.dirname(os.path.abspath(argv[0])) if argv[0] not in ("-m", "-c") else ""
    sys.path[:0] = [first, *extra]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop_:
        if isinstance(stop_.code, int) or stop_.code is None:
            code = stop_.code or 0
        else:
            print(stop_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (as the interpreter does: the traceback, exit code 1)
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as the interpreter's exit would; the rest of its teardown is not needed here
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    leave(code)


class Launch:
    """Processes started together: one plain process, or the ranks of one launch."""

    def __init__(self, argv: Sequence[str], nproc: int | None = None, *, cwd: str | Path | None = None,
                 env: Mapping[str, str] | None = None, nodes: Sequence[str | Path] | None = None,
                 stderr_to_stdout: bool = False) -> None:
        """``nproc`` None: one process as ``python ARGV`` starts it; a number: that many ranks on one machine, as
        ``torchrun --standalone --nproc_per_node=N ARGV`` (a failed rank's peers are ended). ``nodes``: one rank per
        node, each in its folder (its own disk), as single-rank torchrun launches on each node that met by
        rendezvous (a node's failure ends no other). ``env`` replaces this process's environment."""
        from torch.distributed import TCPStore

        assert "malloc_tunables=true" not in " ".join(argv), "re-executes sys.orig_argv: a real process's test"
        self.folder = Path(tempfile.mkdtemp(prefix="launch-"))
        base = dict(os.environ if env is None else env)
        cwds = [str(cwd or os.getcwd())] if nodes is None else [str(n) for n in nodes]
        world = len(cwds) if nodes is not None else (nproc or 1)
        self.store = None
        envs = [base]
        if nproc is not None or nodes is not None:
            self.store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # torchrun's agent store
            local = 1 if nodes is not None else world
            common = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(self.store.port), "WORLD_SIZE": str(world),
                      "ROLE_WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local), "ROLE_NAME": "default",
                      "GROUP_WORLD_SIZE": str(world // local), "TORCHELASTIC_RESTART_COUNT": "0",
                      "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
                      "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                      "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT"}
            if world > 1:
                common.setdefault("OMP_NUM_THREADS", base.get("OMP_NUM_THREADS", "1"))  # torchrun's default
            envs = [{**base, **common, "RANK": str(r), "ROLE_RANK": str(r), "LOCAL_RANK": str(r % local),
                     "GROUP_RANK": str(r // local), "TORCHELASTIC_ERROR_FILE": str(self.folder / f"error-{r}.json")}
                    for r in range(world)]
            if nodes is None:
                cwds = cwds * world
        ctx = context()
        n = len(envs)
        self.out, self.err, self.cpu = ([self.folder / f"{kind}-{r}" for r in range(n)]
                                        for kind in ("out", "err", "cpu"))
        if stderr_to_stdout:
            self.err = self.out
        self.standalone = nodes is None
        for f in self.out + self.err:
            f.touch()
        self.procs = [ctx.Process(target=_entry, name=f"rank-{r}", args=(
            list(argv), envs[r], cwds[r], str(self.out[r]), str(self.err[r]), str(self.cpu[r]))) for r in range(n)]
        for p in self.procs:
            p.start()
        self.returncode: int | None = None
        self.first_failure: int | None = None

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc) -> None:
        """Kill what still runs and remove this launch's own folder (its output files)."""
        if self.poll() is None:
            self.kill()
            self.poll()
        shutil.rmtree(self.folder, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def poll(self) -> int | None:
        """The launch's exit code once every process ended (the first failed rank's own; torchrun says 1), else
        None. A failed rank's peers are sent SIGTERM, and SIGKILL ``GRACE_S`` later, as torchrun ends them."""
        codes = [p.exitcode for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed and self.first_failure is None:
            self.first_failure = failed[0]
            if None in codes and self.standalone:
                self._end_peers()
                codes = [p.exitcode for p in self.procs]
        if None in codes:
            return None
        if self.returncode is None:
            self.returncode = self.first_failure or 0
            self._done()
        return self.returncode

    def _end_peers(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        for p in self.procs:
            p.join(GRACE_S)
        self.kill()

    def wait(self, timeout: float = 600) -> int:
        """Wait for the end (killing everything past ``timeout``, then raising ``subprocess.TimeoutExpired``)."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                self.poll()
                raise subprocess.TimeoutExpired(["launch"], timeout, self.output())
            multiprocessing.connection.wait([p.sentinel for p in self.procs if p.exitcode is None], timeout=0.2)
        return self.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process still running (SIGKILL: and wait until they are gone)."""
        for p in self.procs:
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)
        if sig == signal.SIGKILL:
            for p in self.procs:
                p.join(30)

    def _done(self) -> None:
        for f in self.cpu:
            _count(f)
        self.store = None

    def stdout(self, rank: int | None = None) -> str:
        """What the processes (or one rank) wrote to stdout, rank by rank."""
        return _read(self.out, rank)

    def stderr(self, rank: int | None = None) -> str:
        return _read(self.err, rank)

    def output(self, rank: int | None = None) -> str:
        return self.stdout(rank) + (self.stderr(rank) if self.err is not self.out else "")

    def lines(self, timeout: float = 600) -> Iterator[str]:
        """Lines of stdout, every rank's, as they are written, until the processes ended (stderr: other files)."""
        deadline = time.monotonic() + timeout
        with contextlib.ExitStack() as files:
            readers = [files.enter_context(f.open(errors="replace")) for f in self.out]
            pending = [""] * len(readers)
            while True:
                ended = self.poll() is not None
                read = False
                for i, f in enumerate(readers):
                    chunk = f.read()
                    read = read or bool(chunk)
                    *done, pending[i] = (pending[i] + chunk).split("\n")
                    yield from (line + "\n" for line in done)
                if ended and not read:
                    yield from (p for p in pending if p)
                    return
                if time.monotonic() > deadline:
                    self.kill()
                    raise subprocess.TimeoutExpired(["launch"], timeout, self.output())
                if not read:
                    time.sleep(0.02)


def _count(cpu: Path) -> None:
    """Add the CPU a forked process wrote as it ended (none where it was killed first) to ``spent``."""
    with contextlib.suppress(OSError, ValueError):
        _SPENT[0] += float(cpu.read_text())


def _read(files: list[Path], rank: int | None) -> str:
    return "".join(f.read_text(errors="replace") for f in (files if rank is None else files[rank:rank + 1]))


SHIM = Path(__file__).with_name("pyshim.py")


@contextlib.contextmanager
def python_shim() -> Iterator[dict[str, str]]:
    """While inside: ``PYTHON`` (and ``LEANSFT_TEST_PYSHIM``) for a script that starts ``$PYTHON ARGS...`` (many
    times: the GPU check's miniature), each such process forked from the fork server (tests/pyshim.py) with the
    standard streams, folder and environment it was given; its exit code the shim's, its CPU counted here."""
    folder = Path(tempfile.mkdtemp(prefix="launch-"))
    path = str(folder / "python.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    served: list[threading.Thread] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the shim's time is over
                return
            served.append(threading.Thread(target=_serve, args=(conn, folder), daemon=True))
            served[-1].start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield {"LEANSFT_TEST_PYSHIM": path, "PYTHON": f"{sys.executable} {SHIM}"}
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)
        server.close()
        acceptor.join(10)
        for thread in served:
            thread.join(GRACE_S + 30)
        shutil.rmtree(folder, ignore_errors=True)


def _serve(conn: socket.socket, folder: Path) -> None:
    """One shim's process: started with its streams, waited for, ended (SIGTERM, SIGKILL ``GRACE_S`` later) if the
    shim ends first (killed: ``timeout``), its exit code sent back."""
    with conn:
        head, fds, _, _ = socket.recv_fds(conn, 8, 3)
        size, request = int.from_bytes(head, "big"), b""
        while len(request) < size and (chunk := conn.recv(size - len(request))):
            request += chunk
        if len(head) != 8 or len(fds) != 3 or len(request) != size:
            for fd in fds:
                os.close(fd)
            return
        req = json.loads(request)
        cpu = folder / f"cpu-{uuid.uuid4().hex}"
        proc = context().Process(target=_entry, args=(req["argv"], req["env"], req["cwd"], _Fd(fds[1]), _Fd(fds[2]),
                                                      str(cpu), _Fd(fds[0])))
        try:
            proc.start()
        finally:
            for fd in fds:
                os.close(fd)
        while proc.exitcode is None:
            if conn in multiprocessing.connection.wait([proc.sentinel, conn]) and proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
                proc.join(GRACE_S)
                if proc.exitcode is None:
                    proc.kill()
            proc.join(0.1)
        _count(cpu)
        with contextlib.suppress(OSError):
            conn.sendall(str(proc.exitcode).encode())


def run(argv: Sequence[str], nproc: int | None = None, *, timeout: float = 600, **kwargs) -> \
        subprocess.CompletedProcess:
    """Start, wait, and return what ``subprocess.run(..., capture_output=True, text=True)`` would."""
    with Launch(argv, nproc, **kwargs) as launch:
        code = launch.wait(timeout)
        return subprocess.CompletedProcess(list(argv), code, launch.stdout(), launch.stderr())
