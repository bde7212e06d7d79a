"""glibc's malloc told to keep freed memory for reuse, set before a process that runs the model over data starts.

On the CPU every tensor is a malloc. glibc hands out blocks above its mmap threshold (128 KiB, rising
to at most 32 MiB) as fresh mmaps and returns them on free, so each step's large activations, casts and
the loss's [chunk, vocab] logits are new pages: every 4 KiB page faults and is zeroed by the kernel
before use. Measured on a 2-core KVM Xeon: a 106 MB tensor filled in 27-30 ms fresh vs 7 ms reused; a
SmolLM2 LoRA bf16 step 1-12% faster over three A/B pairs, system time cut by half or more. Raising the
mmap and trim thresholds keeps the freed blocks in the heap (the way a CUDA caching allocator keeps GPU
memory): the process holds its peak, not more. glibc reads these settings only at process start, so
``leansft train`` (and ``eval`` and ``doctor``, which run the model over data too: ``leansft eval`` of the 999
demo chats on a Zen 4 VM in 315 s instead of 367, 0.4M minor faults instead of 33M) re-executes itself once with
them (same PID, same command line); ``LEANSFT_MALLOC=0`` or an existing malloc setting in ``GLIBC_TUNABLES``
leaves the process as it is. Imports nothing heavy: it runs before torch loads.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLES = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=68719476736"
COMMANDS = {"train", "eval", "doctor"}  # those that run the model over a dataset, step after step


def command(argv: list[str]) -> str | None:
    """The subcommand of a ``leansft [options] COMMAND ...`` command line."""
    return next((a for a in argv if not a.startswith("-")), None)


def wanted(argv: list[str], environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this command line should run under the malloc settings and does not yet."""
    return (command(argv) in COMMANDS and sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
            and environ.get("LEANSFT_MALLOC", "1") != "0" and "glibc.malloc." not in environ.get("GLIBC_TUNABLES", ""))


def reexec_with_malloc_settings(argv: list[str]) -> None:
    """Re-execute this very command line with ``TUNABLES`` added to ``GLIBC_TUNABLES`` (returns if not wanted)."""
    if not wanted(argv):
        return
    old = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = f"{old}:{TUNABLES}" if old else TUNABLES
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)
