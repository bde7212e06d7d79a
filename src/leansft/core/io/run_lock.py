"""One run per output_dir: an OS lock on a file in the folder, held for the run's whole life.

A second ``leansft train`` started on a running run's folder used to remove the first run's half-written checkpoint
at its start (the first then died at its next save), and two runs started together on one fresh folder both
trained into it. A run now takes ``LOCK`` in output_dir before it changes anything there; a second run (a resume, a
cleanup of ``.tmp-*``) refuses in one line naming the holder (host, pid, start time, written into the file).

The lock is a POSIX record lock (``fcntl.lockf``): the kernel drops it with the process, however it ends (kill -9
included), forked helper processes do not inherit it, and NFS carries it to other machines (lockd / NFSv4). A file
system that has no working locks is said in a warning, not silently raced.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from leansft.core.paths import try_lock

log = logging.getLogger("leansft")
LOCK = ".leansft-run.lock"
_HELD: dict[Path, int] = {}  # folders this process holds (POSIX locks never conflict within one process)


def acquire(folder: Path) -> str | None:
    """Take ``folder``'s run lock for this process; None when taken (or when locks do not work there, with a
    warning), else who holds it (``holder``'s words)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    if key in _HELD:
        return "this process (another run in it holds the folder)"
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        taken = try_lock(fd)
    except OSError:
        os.close(fd)
        raise
    if taken is not True:
        os.close(fd)
        if taken is False:
            return holder(folder)
        log.warning("output_dir %s is on a file system without working locks (%s): nothing keeps a second run off "
                    "this folder while this one runs", folder, taken)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode())
    _HELD[key] = fd
    return None


def release(folder: Path) -> None:
    """Give ``folder``'s lock back (closing the file drops it); nothing where this process does not hold it."""
    fd = _HELD.pop(folder.resolve(), None)
    if fd is not None:
        os.ftruncate(fd, 0)  # no holder named: a run that ended leaves an empty file (a killed one, its last words)
        os.close(fd)


def holder(folder: Path) -> str:
    """``pid P on HOST, started T``: who holds ``folder``'s lock, as it wrote into the file."""
    try:
        who = json.loads((folder / LOCK).read_text())
        return f"pid {who['pid']} on {who['host']}, started {who['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not said who yet)"
