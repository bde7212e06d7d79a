"""Vendor llama.cpp's HF -> GGUF converter (``conversion/``) and its ``gguf`` package into leansft.

    python scripts/vendor_llama_cpp.py [llama_cpp_python-0.3.36.tar.gz]

The source is the llama.cpp tree pinned inside the ``llama-cpp-python`` 0.3.36 source distribution (downloaded with
``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`` when no path is given). Written to
``src/leansft/_vendor/llama_cpp/`` with llama.cpp's MIT licence, and changed only as listed in PATCHES: imports
renamed into the package (the converter's ``gguf`` is newer than the ``gguf`` on PyPI, which transformers uses to
read GGUF files, so the two live side by side), and tokenizers read without running a model folder's own code.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / "src" / "leansft" / "_vendor" / "llama_cpp"
PKG = "leansft._vendor.llama_cpp"
GGUF_MODULES = ("__init__", "constants", "gguf_reader", "gguf_writer", "lazy", "metadata", "quants",
                "tensor_mapping", "utility", "vocab")
PATCHES = [  # (pattern, replacement, why)
    (r"^(\s*)import gguf$", rf"\1from {PKG} import gguf", "the vendored gguf, not PyPI's"),
    (r"^(\s*)from gguf(\.\w+)? import", rf"\1from {PKG}.gguf\2 import", "the vendored gguf, not PyPI's"),
    (r"^(\s*)from conversion import", rf"\1from {PKG}.conversion import", "the package's own name"),
    (r'__import__\(f"conversion\.', f'__import__(f"{PKG}.conversion.', "the package's own name"),
    (r"trust_remote_code=True", "trust_remote_code=False",
     "a model folder's tokenizer code is never run (leansft runs no code a file names)"),
]


def sdist(path: str | None) -> Path:
    if path:
        return Path(path)
    import subprocess

    tmp = Path(tempfile.mkdtemp())
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(tmp),
                    f"llama-cpp-python=={VERSION}"], check=True)
    return next(tmp.glob("llama_cpp_python-*.tar.gz"))


def patched(text: str, counts: dict[str, int]) -> str:
    for pattern, repl, _ in PATCHES:
        text, n = re.subn(pattern, repl, text, flags=re.M)
        counts[pattern] = counts.get(pattern, 0) + n
    return text


def main() -> None:
    archive = sdist(sys.argv[1] if len(sys.argv) > 1 else None)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        tree = next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        shutil.rmtree(DEST, ignore_errors=True)
        (DEST / "gguf").mkdir(parents=True)
        (DEST / "conversion").mkdir()
        counts: dict[str, int] = {}
        for name in GGUF_MODULES:
            src = tree / "gguf-py" / "gguf" / f"{name}.py"
            (DEST / "gguf" / src.name).write_text(patched(src.read_text(), counts))
        for src in sorted((tree / "conversion").glob("*.py")):
            (DEST / "conversion" / src.name).write_text(patched(src.read_text(), counts))
        shutil.copy(tree / "LICENSE", DEST / "LICENSE")
    (DEST / "__init__.py").write_text('"""llama.cpp\'s HF -> GGUF converter and gguf package, vendored by '
                                      'scripts/vendor_llama_cpp.py (see README.md)."""\n')
    lines = ["# llama.cpp's converter, vendored\n",
             f"From `vendor/llama.cpp` of the llama-cpp-python {VERSION} source distribution "
             f"(sha256 {digest}): `conversion/*.py` (what `convert_hf_to_gguf.py` runs) and `gguf-py/gguf/` "
             f"({', '.join(GGUF_MODULES)}). MIT licence: LICENSE. Regenerate with `python "
             "scripts/vendor_llama_cpp.py`; do not edit by hand.\n", "Changes (regular expressions, all files):\n"]
    lines += [f"- `{p}` -> `{r}` ({counts[p]}x): {why}" for p, r, why in PATCHES]
    (DEST / "README.md").write_text("\n".join(lines) + "\n")
    print(f"vendored into {DEST}: " + ", ".join(f"{counts[p]}x {p}" for p, _, _ in PATCHES))


if __name__ == "__main__":
    main()
