"""Reading torch.distributed.checkpoint (DCP) folders as data, never as code.

DCP keeps its index (``dcp/.metadata``) as a pickle and loads non-tensor items (an optimizer's learning rate, its
betas) with ``torch.load(weights_only=False)``: a checkpoint folder from someone else could run code on
``train --resume`` or ``export``, and its manifest would not help, because whoever crafts the folder writes the
manifest too. Here the index is read by an unpickler that admits DCP's own metadata classes and plain values only,
every file it names must sit in the folder itself, and non-tensor items load with ``weights_only=True``. Anything else
is a ``LeanSFTError`` naming the file, before any of it is used.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from leansft.core.errors import LeanSFTError

_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) pairs a DCP index holds, as torch 2.13 writes it (read off a saved checkpoint with a logging
# unpickler): its dataclasses, the paths and shapes inside them, and a layout looked up by name.
_ALLOWED = {
    (_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                   "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                   "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _IndexUnpickler(pickle.Unpickler):
    """Admits the classes of ``_ALLOWED`` and torch's dtypes (``torch.float32``); nothing else resolves."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def read_index(path: Path) -> Metadata:
    """The DCP index ``path`` (a ``.metadata`` file), checked: DCP's classes only, and every data file it names a
    plain name inside its folder. A ``LeanSFTError`` otherwise."""
    try:
        with open(path, "rb") as fh:
            metadata = _IndexUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as err:
        raise LeanSFTError(f"not a checkpoint index leansft reads: {err}", file=str(path),
                           hint="a checkpoint is data; this file asks to build other objects (or is damaged), so "
                                "it was not used") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise LeanSFTError("not a checkpoint index leansft reads: it holds no DCP metadata", file=str(path))
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise LeanSFTError(f"the checkpoint index points at {name!r}, outside its folder", file=str(path))
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, with the index read by ``read_index``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_index(Path(self._get_metadata_path(rank)))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor items (an optimizer's scalars and tuples) read with
    ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise LeanSFTError(f"checkpoint item '{read_item.dest_index.fqn}' is not plain data: "
                               f"{str(err).splitlines()[0][:200]}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(state: dict, folder: Path) -> None:
    """``dcp.load(state, folder)`` with the index and items read as data (``SafeReader``, ``SafePlanner``). The index
    is checked first, and a refusal from inside DCP's load (which wraps every error in a ``CheckpointException``, a
    ``BaseException``) comes out as the ``LeanSFTError`` it is."""
    read_index(Path(folder) / ".metadata")
    try:
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafePlanner())
    except CheckpointException as err:
        own = next((e for e, _ in err.failures.values() if isinstance(e, LeanSFTError)), None)
        if own is not None:
            raise own from None
        first = next(iter(err.failures.values()), (err, None))[0]
        raise LeanSFTError(f"cannot load checkpoint: {type(first).__name__}: {str(first)[:300]}",
                           file=str(folder)) from None
