"""``python -m leansft`` and the ``leansft`` command: the malloc settings for training, then the CLI."""

import sys

from leansft.tools.allocator import reexec_with_malloc_settings


def main() -> int:
    reexec_with_malloc_settings(sys.argv[1:])  # before torch is imported: glibc reads them at process start
    from leansft.tools.cli import main as cli

    return cli()


if __name__ == "__main__":
    sys.exit(main())
