"""MKL's AVX-512 kernels on AVX-512 CPUs not made by Intel, for fp32 training on the CPU.

Why: PyTorch multiplies fp32 matrices on the CPU with MKL (linked into libtorch_cpu), and MKL chooses its
kernels only after asking ``mkl_serv_intel_cpu_true()``: on an AMD CPU with AVX-512 (Zen 4) the answer is no
and it runs AVX2 code. A shared library whose one line answers yes, loaded into the process's global symbol
scope before torch, takes that call, and MKL then picks its kernels by the CPU's feature flags alone (the
shim known as "fakeintel"). Measured on a 2-core Zen 4 EPYC: fp32 products at SmolLM2's shapes 1.1-1.5x
faster, weight gradients included (which oneDNN did not speed up, ``core/onednn_linear.py``), and a SmolLM2
full fine-tuning step 5-18% shorter (benchmarks/README.md). bf16 products go through oneDNN: unchanged.

MKL then runs code that Intel validates on Intel CPUs, so ``check_products()`` holds fp32 products of
several shapes and layouts to a float64 reference within the rounding bound of any summation order before a
command computes (``COMMANDS``: training and the commands that run the model), and refuses if one is off. The
library is compiled from ``SOURCE`` with the system's C compiler into the cache folder, once; without a compiler,
or with ``LEANSFT_MKL_AVX512=0``, MKL stays as it is. The run's log says which (``note()``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from leansft.core.cpuinfo import cpu_flags, cpu_vendor
from leansft.core.errors import ModelError
from leansft.core.paths import default_cache_dir

SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
LOADED_NOTE = "AVX-512 kernels on this non-Intel CPU (LEANSFT_MKL_AVX512=0: MKL's own choice)"
COMMANDS = {"train", "doctor", "eval", "generate", "chat", "export"}  # those that run the model's products
_state: dict[str, object] = {"loaded": None, "note": "", "checked": False}


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """On Linux x86-64, an AVX-512 CPU whose vendor is not Intel, unless ``LEANSFT_MKL_AVX512=0``."""
    return (sys.platform == "linux" and platform.machine() == "x86_64" and environ.get("LEANSFT_MKL_AVX512", "1") != "0"
            and cpu_vendor() not in ("GenuineIntel", "") and "avx512f" in cpu_flags())


def shim_path(cache: Path | None = None) -> Path | None:
    """The compiled shim in the cache folder, built on first use; None without a working C compiler."""
    folder = (cache or default_cache_dir()) / "native"
    path = folder / f"mkl_intel_cpu_true-{hashlib.sha256(SOURCE.encode()).hexdigest()[:12]}.so"
    if path.exists():
        return path
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0] or not shutil.which(compiler[0]):
        return None
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # ranks starting together each build, one rename wins
        src, lib = Path(tmp) / "shim.c", Path(tmp) / "shim.so"
        src.write_text(SOURCE)
        built = subprocess.run([*compiler, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src)],
                               capture_output=True, check=False)
        if built.returncode != 0 or not lib.exists():
            return None
        os.replace(lib, path)
    return path


def load_shim(environ: Mapping[str, str] = os.environ, cache: Path | None = None) -> None:
    """Load the shim where ``wanted``; must run before torch is imported (MKL binds the call when torch loads)."""
    if loaded() or not wanted(environ):
        return
    if "torch" in sys.modules:
        _state["note"] = "AVX2 kernels (torch was imported before leansft could load its AVX-512 shim)"
        return
    path = shim_path(cache)
    if path is None:
        _state["note"] = "AVX2 kernels (no C compiler to build the AVX-512 shim, core/mkl_kernels.py)"
        return
    ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
    _state["loaded"] = path
    _state["note"] = LOADED_NOTE


def loaded() -> bool:
    return _state["loaded"] is not None


def kernels() -> str:
    """The fp32 kernels this process's products run, as a checkpoint records them: a CPU run resumed under other
    kernels continues correctly, but its losses are no longer the uninterrupted run's bit for bit. With the shim
    every fp32 product is MKL's ("mkl-avx512"; older versions recorded "mkl-avx512-shim" while oneDNN still took
    the forward products); without it MKL chooses, and oneDNN takes them where ``core/onednn_linear.py`` says."""
    return "mkl-avx512" if loaded() else "mkl-own-choice"


def note() -> str:
    """What ``load_shim`` did, for the run's log ('' where it had nothing to do)."""
    return str(_state["note"])


def check_products() -> None:
    """Where the shim is loaded: fp32 products of a few shapes and layouts within the rounding bound of any
    summation order (gamma_k = k u / (1 - k u) times ``|a| |b|``, u = 2^-24) of float64 ones, else refuse to run.
    Once per process."""
    if not loaded() or _state["checked"]:
        return
    import torch

    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 64, 64), (33, 576, 1536), (257, 1536, 576), (96, 4096, 40)):
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        exact, scale = a.double() @ b.double(), a.double().abs() @ b.double().abs()
        gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
        for got in (a @ b, (b.t().contiguous() @ a.t().contiguous()).t(), a.t().contiguous().t() @ b):
            if not ((got.double() - exact).abs() <= gamma * scale).all():
                raise ModelError(f"MKL's fp32 product [{m} x {k}] x [{k} x {n}] with its AVX-512 kernels on this "
                                 f"{cpu_vendor()} CPU is outside float32 rounding; not running on it",
                                 hint="LEANSFT_MKL_AVX512=0 keeps MKL's own kernels")
    _state["checked"] = True
