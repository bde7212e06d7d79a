"""``python -m leansft`` and the ``leansft`` command. Only opt-in process settings run before the CLI: glibc's malloc
tunables (``cpu.malloc_tunables`` / ``LEANSFT_MALLOC=1``, ``core/cpu/malloc.py``), read by glibc at start. A rank
of a distributed run leaves without the interpreter's teardown once its output is flushed (``_leave``)."""

import logging
import os
import sys

from leansft.core.cpu.malloc import reexec_with_malloc_settings


def main() -> int:
    reexec_with_malloc_settings(sys.argv[1:])  # returns at once unless asked for, before torch is imported
    from leansft.tools.cli import main as cli

    code = cli()
    _leave(code)
    return code


def _leave(code: int) -> None:
    """End a process that left a process group now, its logs and output flushed: the interpreter's teardown would
    race the threads torch leaves running into an abort, and a run that finished would end in SIGABRT
    (``core.distributed.left_process_group``). Nothing of leansft's waits for that teardown: its files are closed
    and its worker pools shut down by then."""
    distributed = sys.modules.get("leansft.core.distributed")  # imported only by commands that may use one
    if distributed is None or not distributed.left_process_group():
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
