"""MKL's AVX-512 kernels on AVX-512 CPUs not made by Intel (core/mkl_kernels.py): when the shim is wanted,
that it is built once, that it reaches MKL, and that wrong products are refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from leansft.core import mkl_kernels
from leansft.core.errors import ModelError

PROBE = """
import ctypes, os, sys
from pathlib import Path
from leansft.core import mkl_kernels
if sys.argv[2] == "torch-first":
    import torch
mkl_kernels.load_shim(cache=Path(sys.argv[1]))
import torch
a = torch.randn(256, 256)
(a @ a).sum()
mkl_kernels.check_products()
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
print(lib.mkl_serv_cpu_detect(), mkl_kernels.loaded(), mkl_kernels.note())
"""


def test_wanted_on_avx512_cpus_not_made_by_intel_unless_switched_off(monkeypatch):
    for vendor, flags, env, expected in (("AuthenticAMD", {"avx2", "avx512f"}, {}, True),
                                         ("AuthenticAMD", {"avx2", "avx512f"}, {"LEANSFT_MKL_AVX512": "0"}, False),
                                         ("GenuineIntel", {"avx2", "avx512f"}, {}, False),
                                         ("AuthenticAMD", {"avx2"}, {}, False), ("", {"avx512f"}, {}, False)):
        monkeypatch.setattr(mkl_kernels, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(mkl_kernels, "cpu_flags", lambda f=flags: frozenset(f))
        monkeypatch.setattr(mkl_kernels.platform, "machine", lambda: "x86_64")
        assert mkl_kernels.wanted(env) == (expected and sys.platform == "linux"), (vendor, flags, env)


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_the_shim_is_built_once_and_only_with_a_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    assert mkl_kernels.shim_path(tmp_path) is None
    monkeypatch.setenv("CC", "no-such-compiler -O2")
    assert mkl_kernels.shim_path(tmp_path) is None
    monkeypatch.setenv("CC", f"{shutil.which('cc') or shutil.which('gcc')} -O1")  # a compiler with arguments
    path = mkl_kernels.shim_path(tmp_path)
    assert path is not None and path.parent == tmp_path / "native" and path.stat().st_size > 0
    stamp = path.stat().st_mtime_ns
    assert mkl_kernels.shim_path(tmp_path) == path and path.stat().st_mtime_ns == stamp
    assert os.listdir(path.parent) == [path.name]  # no build folders left behind


@pytest.mark.skipif(not mkl_kernels.wanted() or not (shutil.which("cc") or shutil.which("gcc")),
                    reason="only on an AVX-512 CPU not made by Intel, with a C compiler")
def test_the_shim_reaches_mkl_before_torch_loads_and_not_after(tmp_path):
    """MKL's CPU dispatch (``mkl_serv_cpu_detect``, 0 = its generic choice on a CPU it does not know) moves to
    an AVX-512 code path with the shim loaded first; loaded after torch it could not, and the note says so."""
    def run(order: str) -> list[str]:
        r = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), order], capture_output=True, text=True,
                           check=False, env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().split(maxsplit=2)

    on, late = run("shim-first"), run("torch-first")  # (LEANSFT_MKL_AVX512=0: `wanted`, above)
    assert on[1:] == ["True", mkl_kernels.LOADED_NOTE] and late[1] == "False"
    assert "torch was imported before" in late[2]
    assert int(on[0]) > int(late[0])


def test_wrong_products_are_refused(monkeypatch):
    """With the shim loaded, a product outside float32 rounding stops the run before training."""
    monkeypatch.setitem(mkl_kernels._state, "loaded", "shim.so")
    mkl_kernels.check_products()  # this process's MKL, right
    monkeypatch.setitem(mkl_kernels._state, "checked", False)  # (checked once per process)
    matmul = torch.Tensor.__matmul__  # below: fp32 products off by 2e-4 of their value, float64 ones right
    monkeypatch.setattr(torch.Tensor, "__matmul__",
                        lambda a, b: matmul(a, b) * (1 + 2e-4) if a.dtype == torch.float32 else matmul(a, b))
    with pytest.raises(ModelError, match="outside float32 rounding"):
        mkl_kernels.check_products()
    monkeypatch.setitem(mkl_kernels._state, "loaded", None)
    mkl_kernels.check_products()  # nothing loaded: nothing to check


def test_the_commands_that_run_the_model_load_the_shim_before_torch(monkeypatch):
    """`python -m leansft` loads it for train and for doctor, eval, generate, chat and export too, so their
    products run under the kernels training uses; commands that only read text and numbers do not."""
    import leansft.__main__ as entry
    from leansft.tools import cli

    loads = []
    monkeypatch.setattr(entry.mkl_kernels, "load_shim", lambda: loads.append(True))
    monkeypatch.setattr(entry, "reexec_with_malloc_settings", lambda argv: None)
    monkeypatch.setattr(cli, "main", lambda: 0)
    for argv, expected in ((["doctor", "run.yaml"], True), (["-v", "eval", "m", "d.jsonl"], True),
                           (["export", "runs/x"], True), (["train", "run.yaml"], True),
                           (["plan", "run.yaml"], False), (["show-mask", "d.jsonl"], False)):
        loads.clear()
        monkeypatch.setattr(sys, "argv", ["leansft", *argv])
        assert entry.main() == 0 and loads == ([True] if expected else []), argv


def test_model_commands_log_the_kernels_they_run(monkeypatch, caplog, tmp_path):
    """eval, generate, chat and export say which fp32 kernels computed their numbers, as train's log does."""
    from leansft.tools import cli

    monkeypatch.setitem(mkl_kernels._state, "note", mkl_kernels.LOADED_NOTE)
    monkeypatch.setattr(mkl_kernels, "check_products", lambda: None)
    for argv, expected in ((["export", str(tmp_path), str(tmp_path / "out")], True),  # an empty folder: refused
                           (["report", str(tmp_path / "no-run")], False)):
        caplog.clear()
        with caplog.at_level("INFO", logger="leansft"):
            cli.main(argv)  # both fail on their input, after the kernels were (or were not) named
        assert (f"fp32 matmuls (MKL): {mkl_kernels.LOADED_NOTE}" in caplog.text) == expected, argv
