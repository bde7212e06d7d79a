"""``python -m leansft`` and the ``leansft`` command: the process settings for training, then the CLI."""

import sys

from leansft.core.mkl_kernels import load_shim
from leansft.tools.allocator import reexec_with_malloc_settings, trains


def main() -> int:
    reexec_with_malloc_settings(sys.argv[1:])  # before torch is imported: glibc reads them at process start
    if trains(sys.argv[1:]):
        load_shim()  # before torch is imported too: MKL's AVX-512 kernels on AVX-512 CPUs not made by Intel
    from leansft.tools.cli import main as cli

    return cli()


if __name__ == "__main__":
    sys.exit(main())
