"""``python -m leansft`` and the ``leansft`` command: the process settings for the commands that run the model
(allocator, MKL kernels), then the CLI."""

import sys

from leansft.core import mkl_kernels
from leansft.tools.allocator import command, reexec_with_malloc_settings


def main() -> int:
    reexec_with_malloc_settings(sys.argv[1:])  # allocator.COMMANDS, before torch: glibc reads them at start
    if command(sys.argv[1:]) in mkl_kernels.COMMANDS:  # the model's products under the kernels training uses
        mkl_kernels.load_shim()  # before torch is imported too: MKL's AVX-512 kernels on AVX-512 CPUs not by Intel
    from leansft.tools.cli import main as cli

    return cli()


if __name__ == "__main__":
    sys.exit(main())
