"""``python -m leansft`` and the ``leansft`` command. Only opt-in process settings run before the CLI: glibc's malloc
tunables (``cpu.malloc_tunables`` / ``LEANSFT_MALLOC=1``, ``core/cpu/malloc.py``), read by glibc at start."""

import sys

from leansft.core.cpu.malloc import reexec_with_malloc_settings


def main() -> int:
    reexec_with_malloc_settings(sys.argv[1:])  # returns at once unless asked for, before torch is imported
    from leansft.tools.cli import main as cli

    return cli()


if __name__ == "__main__":
    sys.exit(main())
