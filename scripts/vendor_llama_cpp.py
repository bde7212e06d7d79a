"""Vendor llama.cpp's HF -> GGUF converter (``conversion/``) and its ``gguf`` package into leansft.

    python scripts/vendor_llama_cpp.py [llama_cpp_python-0.3.36.tar.gz]

The source is the llama.cpp tree pinned inside the ``llama-cpp-python`` 0.3.36 source distribution (downloaded with
``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`` when no path is given). Written to
``src/leansft/_vendor/llama_cpp/`` with llama.cpp's MIT licence, and changed only as listed in PATCHES: imports
renamed into the package (the converter's ``gguf`` is newer than the ``gguf`` on PyPI, which transformers uses to
read GGUF files, so the two live side by side), tokenizers read without running a model folder's own code (every
``from_pretrained`` call says ``trust_remote_code=False``), nothing put on ``sys.path`` and no vocabulary read
relative to it. SHA256SUMS records every file written.
"""

from __future__ import annotations

import ast
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
    (r"^(\s*)sys\.path\.insert\(.*\)$", r"\1pass  # leansft: sys.path is left alone",
     "importing the converter puts nothing on sys.path"),
    (r'^(\s*)tokenizer_path = Path\(sys\.path\[0\]\) / "models" / f"ggml-vocab-\{model_name\}\.gguf"$',
     r'\1raise NotImplementedError(f"ggml-vocab-{model_name}.gguf: the built-in vocabularies of llama.cpp are '
     r'not shipped with leansft")',
     "no vocabulary is read from a folder relative to sys.path[0] (the working directory under torchrun)"),
]
KEYWORD = "trust_remote_code=False"  # put into every from_pretrained call that does not say it (AST-found)


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
    text, n = explicit_trust(text)
    counts[KEYWORD] = counts.get(KEYWORD, 0) + n
    return text


def explicit_trust(text: str) -> tuple[str, int]:
    """``trust_remote_code=False`` in every ``*.from_pretrained(...)`` call that does not pass it (transformers asks
    on stdin where it is left out, and runs the folder's code on "y"), after the call's last argument; found by the
    AST, so calls over several lines are found too."""
    lines = text.splitlines(keepends=True)
    calls = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "from_pretrained" and "trust_remote_code" not in {k.arg for k in n.keywords}]
    edits = []
    for call in calls:
        last = max([*call.args, *call.keywords], key=lambda a: (a.end_lineno, a.end_col_offset), default=None)
        if last is None:
            edits.append((call.func.end_lineno - 1, call.func.end_col_offset + 1, KEYWORD))  # just inside "("
        else:
            edits.append((last.end_lineno - 1, last.end_col_offset, ", " + KEYWORD))
    for row, col, words in sorted(edits, reverse=True):
        line = lines[row].encode()  # AST offsets count UTF-8 bytes
        lines[row] = (line[:col] + words.encode() + line[col:]).decode()
    out = "".join(lines)
    ast.parse(out)  # still Python
    return out, len(calls)


def checksums(root: Path) -> str:
    """``sha256  path`` of every vendored file (SHA256SUMS' text, ``sha256sum -c`` reads it): a test holds the tree to
    it, so a hand edit shows."""
    files = sorted(f for f in root.rglob("*")
                   if f.is_file() and f.name != "SHA256SUMS" and "__pycache__" not in f.parts)
    return "".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.relative_to(root).as_posix()}\n" for f in files)


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
    lines += [f"- `{KEYWORD}` put into every `from_pretrained(...)` call that did not pass "
              f"`trust_remote_code` ({counts[KEYWORD]}x): transformers would ask on stdin, and run the folder's code "
              "on \"y\"",
              "\nSHA256SUMS lists every file's sha256 (`sha256sum -c SHA256SUMS`); the test suite checks the tree "
              "against it."]
    (DEST / "README.md").write_text("\n".join(lines) + "\n")
    (DEST / "SHA256SUMS").write_text(checksums(DEST))
    print(f"vendored into {DEST}: " + ", ".join(f"{n}x {p}" for p, n in counts.items()))


if __name__ == "__main__":
    main()
