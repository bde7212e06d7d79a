"""A GGUF file's metadata (its key-value header), read in one pass.

The gguf package's reader makes a memory-mapped numpy view of every part of every field: for a 151k-token
vocabulary that is ~10 s before the first key can be read. The header is a plain sequence of typed values
(GGUF v2/v3: little-endian, 64-bit lengths and counts), which this reads straight into Python values, in well under
a second.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, data) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        text = bytes(self.data[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALARS:
                fmt = _SCALARS[item]
                values = list(struct.unpack_from(f"<{count}{fmt}", self.data, self.at))
                self.at += count * struct.calcsize("<" + fmt)
                return values
            return [self.value(item) for _ in range(count)]
        return self.take(_SCALARS[kind])


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # as GGUF lists it (innermost first)
    ggml_type: int
    offset: int  # from the start of the file


def read_metadata(path: Path, prefix: str = "") -> dict:
    """The key-value metadata of the GGUF file ``path`` (the keys starting with ``prefix``), as Python values:
    strings, numbers, booleans and lists of them. The file is memory-mapped: only its header is read."""
    return _header(path, prefix, tensors=False)[0]


def read_header(path: Path) -> tuple[dict, dict[str, TensorInfo]]:
    """``(metadata, tensor name -> TensorInfo)``: the whole header, the tensors' data left unread."""
    return _header(path, "", tensors=True)


def _header(path: Path, prefix: str, tensors: bool) -> tuple[dict, dict[str, TensorInfo]]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        cursor = _Cursor(data)
        cursor.at = 4
        version, n_tensors, n_kv = cursor.take("I"), cursor.take("Q"), cursor.take("Q")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not read here")
        out = {}
        for _ in range(n_kv):
            key = cursor.string()
            value = cursor.value(cursor.take("I"))
            if key.startswith(prefix):
                out[key] = value
        if not tensors:
            return out, {}
        table = []
        for _ in range(n_tensors):
            name = cursor.string()
            shape = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
            table.append((name, shape, cursor.take("I"), cursor.take("Q")))
        align = int(out.get("general.alignment", 32))
        start = cursor.at + (-cursor.at % align)
        return out, {name: TensorInfo(shape, kind, start + offset) for name, shape, kind, offset in table}


def tensor_data(path: Path, info: TensorInfo) -> np.ndarray | None:
    """A float32 or float16 tensor's values as flat float32; None for another (quantised) type."""
    if info.ggml_type not in (0, 1):  # ggml's F32, F16
        return None
    dtype = np.dtype(np.float32 if info.ggml_type == 0 else np.float16)
    count = int(np.prod(info.shape)) if info.shape else 1
    with open(path, "rb") as f:
        f.seek(info.offset)
        return np.frombuffer(f.read(count * dtype.itemsize), dtype=dtype).astype(np.float32)
