"""Checkpoint files: safetensors for tensors, JSON for the rest, written atomically and verified.

Nothing in a checkpoint can execute code: single-process and DDP checkpoints hold no pickle, and an FSDP
checkpoint's ``dcp/`` (torch.distributed.checkpoint, whose index ``.metadata`` is a pickle) is read through
``dcp_safe``, which admits DCP's own metadata classes and plain values only.

Layout of OUTPUT_DIR/checkpoints/step-N/:
  model.safetensors        trainable weights by name (LoRA: the adapters alone)
  optimizer.safetensors    optimizer state tensors, keyed "<parameter name>/<state name>"
  rng.safetensors          torch CPU (and CUDA) generator states: rank 0's, and each other rank's as "rankR.<name>"
  state.json               step, data position, counters, world size, accumulation, scheduler, optimizer
                           param groups, numpy/python RNG, evaluator state (best, patience, history)
  config.yaml              the resolved run config
  dcp/                     FSDP only: model and optimizer state (instead of the two files above)
  manifest.json            every other file with its size and sha256 (an FSDP shard also with its rank),
                           whether the ranks shared the folder ("storage"), and the world size; written last
Names are the parameter names of the model + loss module as torch.distributed.checkpoint's state-dict
helpers give them, whatever the wrapping (none, DDP, FSDP), so a checkpoint resumes on another world
size and strategy: safetensors load into any of them, and dcp/ is resharded on load.

A checkpoint is written into a temporary folder, every file fsynced, the manifest written last, then
renamed into place once every rank's part is written; a crash mid-write leaves the previous checkpoints untouched
(temporary folders are ignored and cleaned). Resume verifies the manifest and falls back to the newest intact
checkpoint. On node-local disks each node's folder holds the whole checkpoint but other nodes' FSDP shards.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import logging
import os
import random
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from leansft.core import distributed
from leansft.core.errors import LeanSFTError
from leansft.core.io import dcp_node_local, dcp_safe
from leansft.core.io.host_copies import HostBuffers

log = logging.getLogger("leansft")
PREFIX = "step-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_TRAINED = StateDictOptions(ignore_frozen_params=True)
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``tensors`` in safetensors' format, each brought to the host and written in turn.

    safetensors' ``save_file`` first turns every tensor into host bytes, so a GPU run's checkpoint held all its
    weights, then all its Adam state, in host memory at once (the Adam state of a 7B full fine-tune: 56 GB), and
    it refuses two names on one storage (tied weights), which cost a copy. Here the host holds one tensor at a
    time, and a CPU tensor is written from where it lives."""
    header, offset = {}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for t in tensors.values():
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _model_state(root) -> dict[str, torch.Tensor]:
    """Trainable weights by name (the LoRA adapters alone for LoRA), the model's own tensors (not copies)."""
    return get_model_state_dict(root, options=_TRAINED)


def _optimizer_state(root, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state keyed by parameter name: ("name/state": tensor, {param_groups, scalars}); the tensors are
    the optimizer's own (not copies)."""
    sd = get_optimizer_state_dict(root, optimizer, options=_TRAINED)
    tensors, scalars = {}, {}
    for name, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{name}/{k}"] = v
            else:
                scalars[f"{name}/{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_dict(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[str, dict] = {}
    for key, v in {**tensors, **meta["scalars"]}.items():
        name, k = key.rsplit("/", 1)
        state.setdefault(name, {})[k] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            tensors[f"torch_cuda_{i}"] = torch.cuda.get_rng_state(i)
    np_state = np.random.get_state()
    py = random.getstate()
    return tensors, {"numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
                     "python": [py[0], list(py[1]), py[2]]}


def _torch_rng_by_rank(rank0: dict[str, torch.Tensor], gathered: list[dict[str, torch.Tensor]]) -> dict:
    """rng.safetensors' tensors: rank 0's torch generator states by their own names (what a resume on another world
    size, or an older leansft, restores on every rank), and every other rank's as ``rank{R}.{name}``: dropout and
    NEFTune draw from each rank's own stream, which a resume on as many ranks continues."""
    return {**rank0, **{f"rank{r}.{k}": v for r, own in enumerate(gathered) if r for k, v in own.items()}}


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict, same_ranks: bool = False) -> None:
    """Restore the generators: this rank's own torch states where the checkpoint has them and ``same_ranks`` (saved
    on as many ranks), else rank 0's (the unprefixed names); numpy and python from rank 0 (nothing in training draws
    from them)."""
    own = f"rank{distributed.rank()}."
    if same_ranks and f"{own}torch_cpu" in tensors:
        tensors = {k.removeprefix(own): v for k, v in tensors.items() if k.startswith(own)}
    torch.set_rng_state(tensors["torch_cpu"])
    for k, v in tensors.items():
        if k.startswith("torch_cuda_") and torch.cuda.is_available():
            torch.cuda.set_rng_state(v, int(k.rsplit("_", 1)[1]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), *n[2:]))
    p = meta["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


@dataclass
class Snapshot:
    """What this rank gives checkpoint ``step``, read out of training (``take_snapshot``): the live tensors for a
    save written now, host copies of them for one written in the background while training goes on."""

    step: int
    rng: tuple[dict[str, torch.Tensor], dict]  # this rank's generators
    first: dict | None = None  # rank 0: the loop's state and the scheduler's
    weights: tuple | None = None  # a writer of an unsharded checkpoint: (model tensors, optimizer tensors, meta)
    shards: dict | None = None  # sharded: this rank's DCP state dicts {"model", "optim"}
    copied: torch.cuda.Event | None = None  # where device-to-host copies were queued: their end


def take_snapshot(step: int, root, optimizer, scheduler, state: dict, sharded: bool = False,
                  storage: distributed.Storage | None = None, buffers: HostBuffers | None = None) -> Snapshot:
    """This rank's part of checkpoint ``step``. Without ``buffers`` it holds the training tensors themselves (write
    it before the next step); with them, copies (the weights and optimizer state into ``buffers``), so training
    may go on while it is written."""
    storage = storage or distributed.Storage.one_folder()
    snap = Snapshot(step, _rng_state())
    if distributed.rank() == 0:
        snap.first = {"state": copy.deepcopy(state), "scheduler": copy.deepcopy(scheduler.state_dict())}
    if sharded:
        snap.shards = {"model": get_model_state_dict(root, options=_TRAINED),
                       "optim": get_optimizer_state_dict(root, optimizer)}
        if buffers is not None:
            snap.shards = buffers.copy_state_dict(snap.shards)
    elif storage.writer():
        model, (opt, meta) = _model_state(root), _optimizer_state(root, optimizer)
        if buffers is not None:
            model = {k: buffers.copy(f"model/{k}", v) for k, v in model.items()}
            opt, meta = {k: buffers.copy(f"optim/{k}", v) for k, v in opt.items()}, copy.deepcopy(meta)
        snap.weights = (model, opt, meta)
    if buffers is not None:
        snap.copied = buffers.queued()
    return snap


def save_checkpoint(folder: Path, step: int, root, optimizer, scheduler, state: dict, config: dict,
                    sharded: bool = False, storage: distributed.Storage | None = None) -> Path:
    """Write checkpoint ``step`` under ``folder`` now, atomically; return its path. Call it on every rank."""
    snap = take_snapshot(step, root, optimizer, scheduler, state, sharded, storage)
    return write_snapshot(folder, snap, root, config, sharded, storage)


def write_snapshot(folder: Path, snap: Snapshot, root, config: dict, sharded: bool = False,
                   storage: distributed.Storage | None = None, group=None) -> Path:
    """Write checkpoint ``snap.step`` under ``folder`` atomically; return its path. Call it on every rank, on the
    training thread or (with host copies in ``snap`` and ``group``, a process group of its own) on a thread of its
    own while training goes on: its collectives then run on ``group``, never beside the training's.

    ``root``: the model + loss module as trained (for a full disk's message: how much a checkpoint needs).
    ``storage``: which ranks share ``folder`` (``distributed.storage_of``; default: all of them). The first rank of
    each group writes the checkpoint into its group's folder (rank 0 alone on shared storage, each node on
    node-local disks), from rank 0's state; with ``sharded`` (FSDP) every rank writes its own shards of ``dcp/``
    through torch.distributed.checkpoint (``dcp_node_local`` where the ranks do not share a folder). The manifest
    lists every rank's files, so a checkpoint missing one does not verify. The step exists only when every group's
    part is complete: each is written into a temporary folder, the ranks agree it is complete, then each is renamed.
    A failure on any rank (a full disk, say) removes every temporary folder, leaves the earlier checkpoints as they
    were and raises the same error on every rank.
    """
    storage = storage or distributed.Storage.one_folder()
    step = snap.step
    final, tmp = folder / f"{PREFIX}{step}", folder / f".tmp-{PREFIX}{step}"
    rank, writer, several = distributed.rank(), storage.writer(), not storage.shared
    if snap.copied is not None:
        snap.copied.synchronize()

    def agreed(work) -> list:
        return _agreed(work, step, folder, tmp, writer, root, group)

    def begin():
        if writer:
            fresh_tmp(tmp)
            if sharded:
                (tmp / "dcp").mkdir()
        # what every folder holds is rank 0's (and every rank's generator state): the writers of other groups get it
        return {"rng": snap.rng, **(snap.first or {})}

    def shards():
        plans = None
        if several:  # each group's folder gets what its ranks read, and a .metadata pointing there
            plans = dcp_node_local.save(snap.shards, str(tmp / "dcp"), storage.groups, group)
        else:
            dcp.save(snap.shards, checkpoint_id=str(tmp / "dcp"), process_group=group)
        own = {f"dcp/{f.name}": f for f in sorted((tmp / "dcp").glob(f"__{rank}_*.distcp"))}
        return {name: {**_file_entry(f), "rank": rank} for name, f in own.items()}, plans

    def write():
        if not writer:
            return
        if sharded and plans:
            (tmp / "dcp" / ".metadata").write_bytes(plans[storage.group()])
        rng_tensors, rng_meta = first["rng"]
        rng = _torch_rng_by_rank(rng_tensors, [r["rng"][0] for r in began]), rng_meta
        full_state = {**first["state"], "step": step, "scheduler": first["scheduler"], "sharded": sharded,
                      "world_size": distributed.world_size()}
        return write_files(tmp, None if sharded else snap.weights, rng, full_state, config, owned,
                           "node_local" if several else "shared")

    def rename():
        if writer:
            put_in_place(tmp, final)

    try:
        began = agreed(begin)
        first = began[0]
        owned, plans = {}, None
        if sharded:
            parts = agreed(shards)
            owned, plans = {k: v for entries, _ in parts for k, v in entries.items()}, parts[0][1]
        copies = [files for files in agreed(write) if files]
        differ = sorted(name for name, entry in copies[0].items() if name != "dcp/.metadata"
                        and any(other.get(name) != entry for other in copies[1:]))
        if differ:  # every node's copy is rank 0's state: DDP replicas that differ have diverged
            raise LeanSFTError(f"cannot write checkpoint step-{step}: the nodes' copies differ ({', '.join(differ)}): "
                               "the ranks' replicas of the model diverged", file=str(folder))
        agreed(rename)
    except BaseException:
        if writer:
            _remove_if_ours(tmp)
        raise
    return final


def write_files(tmp: Path, weights: tuple | None, rng: tuple[dict, dict], state: dict, config: dict,
                owned: dict[str, dict] | None = None, storage: str = "shared") -> dict[str, dict]:
    """A checkpoint's files into ``tmp``, the manifest last: ``weights`` (model tensors, optimizer tensors, optimizer
    meta; None where ``dcp/`` holds them), the generators' states, ``state.json`` and ``config.yaml``."""
    opt_meta = None
    if weights is not None:
        model, opt_tensors, opt_meta = weights
        write_safetensors(model, tmp / "model.safetensors")
        write_safetensors(opt_tensors, tmp / "optimizer.safetensors")
    write_safetensors(rng[0], tmp / "rng.safetensors")
    (tmp / "state.json").write_text(json.dumps({**state, "optimizer": opt_meta, "rng": rng[1]}, indent=1))
    (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return _write_manifest(tmp, owned, storage)


def fresh_tmp(tmp: Path) -> None:
    """An empty ``tmp`` folder for a checkpoint being written: a leftover leansft wrote (a killed run's) is removed,
    one holding anything else is refused and left."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if not _remove_if_ours(tmp) and tmp.exists():
        raise LeanSFTError(f"{tmp} exists and holds files leansft does not write there", file=str(tmp),
                           hint="move it out of the checkpoints folder")
    tmp.mkdir()


def put_in_place(tmp: Path, final: Path) -> None:
    """Rename a written checkpoint into place (an earlier copy of the same step that leansft wrote is replaced)."""
    if final.exists():  # this step saved again (a resumed run)
        if not _remove_if_ours(final):
            raise LeanSFTError(f"{final} exists and holds files leansft does not write there",
                               file=str(final), hint="move it out of the checkpoints folder")
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def _agreed(work, step: int, folder: Path, tmp: Path, writer: bool, root, group=None) -> list:
    """``work()`` on every rank, then every rank's result (in rank order); where it failed on any rank, every rank
    removes its temporary folder and raises the same error, naming the rank where it failed."""
    own = None
    try:
        result, why = work(), None
    except Exception as err:  # noqa: BLE001 - every rank must hear of it, or the others wait at the next collective
        own, result, why = err, None, _why_not_written(err, root, folder)
    views = distributed.all_gather_object((distributed.whoami(), why, result), group)
    failed = [(who, w) for who, w, _ in views if w]
    if not failed:
        return [r for _, _, r in views]
    if writer:
        _remove_if_ours(tmp)
    if own is not None and not isinstance(own, OSError) and not why[1]:
        raise own  # not the disk's doing: its traceback here; the other ranks name this rank
    who, (text, full) = failed[0]
    raise not_written(step, folder, (f"{who}: " if distributed.world_size() > 1 else "") + text, full)


def not_written(step: int, folder: Path, why: str, full: bool) -> LeanSFTError:
    """The one line a failed save ends with: what went wrong, and the checkpoints kept."""
    kept = ", ".join(p.name for p in list_checkpoints(folder)) or "none"
    return LeanSFTError(f"cannot write checkpoint step-{step}: {why}; kept: {kept} (intact)", file=str(folder),
                        hint="free space or point output_dir elsewhere, then resume with --resume auto" if full else None)


def _why_not_written(err: Exception, root, folder: Path) -> tuple[str, bool]:
    """(what went wrong, whether the disk is full)."""
    full = getattr(err, "errno", None) == errno.ENOSPC or "No space left" in str(err)
    if full:
        return f"the disk is full (about {_gb(_checkpoint_bytes(root))} needed, {_gb(_free_bytes(folder))} free)", True
    return f"{type(err).__name__}: {str(err)[:300]}", False


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _checkpoint_bytes(root) -> int:
    """About what one checkpoint takes: the weights, and AdamW's two moments of the trainable ones."""
    params = list(root.parameters())
    return sum(p.numel() * p.element_size() for p in params) + sum(
        2 * p.numel() * 4 for p in params if p.requires_grad)


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder if folder.exists() else folder.parent).free
    except OSError:
        return 0


MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_entry(f: Path) -> dict:
    """A file's manifest entry, after fsyncing it."""
    with f.open("rb") as fh:
        os.fsync(fh.fileno())
    return {"bytes": f.stat().st_size, "sha256": _sha256(f)}


def _write_manifest(folder: Path, owned: dict[str, dict] | None = None, storage: str = "shared") -> dict[str, dict]:
    """List every file of the checkpoint with its size and sha256 in manifest.json, written last, and return the
    list: the files in ``folder`` and ``owned``, the files each rank wrote itself (FSDP shards, entered by their
    rank, which hashed them; on node-local disks they are on that rank's node only)."""
    owned = owned or {}
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.name != MANIFEST
                   and str(f.relative_to(folder)) not in owned)
    entries = {str(f.relative_to(folder)): _file_entry(f) for f in files}
    with (folder / MANIFEST).open("w") as fh:
        json.dump({"files": {**entries, **owned}, "storage": storage, "world_size": distributed.world_size()}, fh,
                  indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(folder)
    return {**entries, **owned}


def _inside(name: str) -> bool:
    """A manifest entry names a file inside the checkpoint folder: relative, no ``..``, no empty part."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts) and "\\" not in name


def damage(path: Path, ranks: set[int] | None = None) -> str | None:
    """What is wrong with checkpoint ``path`` (missing manifest, a file missing, truncated or changed),
    or None when every file is as the manifest lists it. ``ranks``: check only these ranks' own files (FSDP shards)
    besides the common ones."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"{MANIFEST} missing (an incomplete write, or a checkpoint of an older leansft)"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"{MANIFEST} is damaged"
    if not isinstance(files, dict):
        return f"{MANIFEST} is damaged"
    for name, want in files.items():
        if not _inside(name):
            return f"{MANIFEST} lists {name!r}, which is not a file of the checkpoint folder"
        if ranks is not None and "rank" in want and want["rank"] not in ranks:
            continue
        f = path / name
        if any((path / "/".join(name.split("/")[: i + 1])).is_symlink() for i in range(name.count("/") + 1)):
            return f"{name} is a symbolic link (a checkpoint holds its own files)"
        if not f.is_file():
            return f"{name} missing" + (f" (rank {want['rank']}'s shard)" if "rank" in want else "")
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, {want['bytes']} were written"
        if _sha256(f) != want["sha256"]:
            return f"{name} does not match its checksum (changed after it was written)"
    return None


def damage_for(path: Path, storage: distributed.Storage, sharded: bool) -> str | None:
    """What this rank's group lacks of checkpoint ``path`` to resume it (``damage``). A checkpoint written on
    node-local disks holds each rank's FSDP shards on that rank's node: resumed sharded on as many ranks, a group
    reads its own ranks' shards; otherwise (another world size, or gathered whole) every rank's, which one node
    alone does not hold."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return damage(path)
    own = (manifest.get("storage") == "node_local" and sharded
           and manifest.get("world_size") == distributed.world_size())
    problem = damage(path, set(storage.group()) if own else None)
    if problem and "shard)" in problem:
        problem += (": a checkpoint on node-local disks resumes with each node running the ranks it ran when it "
                    "was saved (FSDP, the same number of ranks)")
    return problem


def load_checkpoint(path: Path, root, optimizer, scheduler, verified: bool = False) -> dict:
    """Restore weights, optimizer, scheduler and RNG from a verified checkpoint; return its state.json.
    ``verified``: the caller checked the files this rank reads (``damage_for``); else every file is checked here.

    Works across world sizes and strategies: safetensors (single process, DDP) load as full state into
    any wrapping; an FSDP ``dcp/`` checkpoint is resharded to the current ranks, or gathered whole."""
    problem = None if verified else damage(path)
    if problem:
        raise LeanSFTError(f"damaged checkpoint: {problem}", file=str(path))
    try:
        state = json.loads((path / "state.json").read_text())
        rng = load_file(path / "rng.safetensors")
        if _sharded(path, state):
            opts = StateDictOptions(ignore_frozen_params=True)
            model_sd = get_model_state_dict(root, options=opts)
            optim_sd = get_optimizer_state_dict(root, optimizer)
            both = {"model": model_sd, "optim": optim_sd}
            dcp_safe.load(both, path / "dcp")
            set_model_state_dict(root, both["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(root, optimizer, both["optim"])
        else:
            meta = state["optimizer"]
            if meta is None or any(isinstance(p, int) for g in meta["param_groups"] for p in g["params"]):
                raise LeanSFTError("checkpoint written by an older leansft (optimizer state by index); it cannot "
                                   "be resumed", file=str(path))
            _load_model(root, path / "model.safetensors")
            _load_optimizer(root, optimizer, path / "optimizer.safetensors", meta)
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(rng, state["rng"], state.get("world_size", 1) == distributed.world_size())
    except LeanSFTError:
        raise
    except Exception as err:  # noqa: BLE001 - verified files that still do not load: name them, no traceback
        raise LeanSFTError(f"cannot load checkpoint: {type(err).__name__}: {str(err)[:300]}", file=str(path)) from None
    return state


def _sharded(path: Path, state: dict) -> bool:
    """Whether checkpoint ``path`` is read through DCP: only where the strategy its own config names (FSDP over
    several ranks) wrote it that way; a state.json that says otherwise is refused."""
    if state.get("sharded") is not True:
        return False
    saved = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else None
    strategy = ((saved or {}).get("distributed") or {}).get("strategy") if isinstance(saved, dict) else None
    if strategy != "fsdp" or int(state.get("world_size", 1)) < 2 or not (path / "dcp" / ".metadata").is_file():
        raise LeanSFTError("state.json says the checkpoint is sharded, but its config.yaml and files are not an "
                           "FSDP run's: not a checkpoint leansft wrote", file=str(path))
    return True


def _load_optimizer(root, optimizer, file: Path, meta: dict) -> None:
    """The optimizer state of a safetensors checkpoint, read one tensor at a time into the optimizer's own
    tensors. Read whole and handed to torch.distributed.checkpoint, the file sat beside the state it was
    copied into (which DCP first makes with a zero step), and a CPU run's resume needed 1.8x the memory of
    its training (a 0.5B full fine-tune: 14.4 GB of tensors against 8.0). That path remains for what this one
    does not cover: FSDP-sharded state, non-tensor state, or names and groups that differ."""
    live = get_optimizer_state_dict(root, optimizer)  # makes the state where it is empty, as DCP's load would
    own = {f"{n}/{k}": v for n, st in live["state"].items() for k, v in st.items() if torch.is_tensor(v)}
    held = {v.data_ptr() for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)}
    saved_groups = [g["params"] for g in meta["param_groups"]]
    with safe_open(file, "pt") as f:
        direct = (not meta["scalars"] and set(f.keys()) == set(own)
                  and saved_groups == [g["params"] for g in live["param_groups"]]
                  and all(type(v) is torch.Tensor and v.data_ptr() in held for v in own.values()))
        if direct:  # ``own`` are the optimizer's tensors themselves (checked above), so a copy restores them
            _copy_in(f, own, "optimizer state", file)
    if not direct:
        set_optimizer_state_dict(root, optimizer, _optimizer_dict(load_file(file), meta),
                                 options=StateDictOptions(full_state_dict=True))
        return
    for group, saved in zip(optimizer.param_groups, meta["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def load_weights(path: Path, root) -> dict:
    """Only the weights of a verified checkpoint into ``root`` (for export); returns its state.json."""
    problem = damage(path)
    if problem:
        raise LeanSFTError(f"damaged checkpoint: {problem}", file=str(path))
    state = json.loads((path / "state.json").read_text())
    if _sharded(path, state):
        model_sd = get_model_state_dict(root, options=StateDictOptions(ignore_frozen_params=True))
        both = {"model": model_sd}
        dcp_safe.load(both, path / "dcp")
        set_model_state_dict(root, both["model"], options=StateDictOptions(strict=False))
    else:
        _load_model(root, path / "model.safetensors")
    return state


def _load_model(root, file: Path) -> None:
    """The weights of a safetensors checkpoint, read one tensor at a time into the model's own tensors (read
    whole, a GPU run's resume held all its weights in host memory at once). Into sharded (FSDP) parameters the
    file goes whole through ``set_model_state_dict``, which places each shard."""
    live = get_model_state_dict(root, options=_TRAINED)  # the model's tensors by name, not copies
    with safe_open(file, "pt") as f:
        unknown = sorted(set(f.keys()) - set(live))
        if unknown:
            raise LeanSFTError(f"checkpoint weights do not match the model (e.g. '{unknown[0]}')", file=str(file))
        if any(type(live[name]) is not torch.Tensor for name in f.keys()):
            set_model_state_dict(root, load_file(file), options=StateDictOptions(full_state_dict=True, strict=False))
            return
        _copy_in(f, {name: live[name] for name in f.keys()}, "weight", file)


@torch.no_grad()
def _copy_in(f, targets: dict[str, torch.Tensor], what: str, file: Path) -> None:
    """Each tensor of the open safetensors file ``f`` into its target, one read at a time (shapes checked first)."""
    for name, target in targets.items():
        shape = tuple(f.get_slice(name).get_shape())
        if shape != tuple(target.shape):
            raise LeanSFTError(f"{what} '{name}' has shape {shape} in the checkpoint and {tuple(target.shape)} in "
                               f"this run", file=str(file))
        target.copy_(f.get_tensor(name))


def list_checkpoints(folder: Path) -> list[Path]:
    """Finished checkpoint folders, oldest first (temporary folders from a crash are not listed)."""
    if not folder.exists():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


WRITTEN = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json", "config.yaml", MANIFEST)


def _dcp_file(f: Path) -> bool:
    """A file torch.distributed.checkpoint writes into ``dcp/``: shards, and the index (or its temporary name)."""
    return f.is_file() and not f.is_symlink() and (f.name.endswith(".distcp") or ".metadata" in f.name)


def ours(path: Path) -> bool:
    """Whether ``path`` holds nothing but what ``save_checkpoint`` writes (``WRITTEN``, ``dcp/``): a checkpoint,
    whole or damaged, or one being written. Only such folders of ``checkpoints/`` are ever deleted; one that holds
    anything else (a user's notes, a link) is left alone."""
    if not path.is_dir() or path.is_symlink():
        return False
    for p in path.iterdir():
        if p.name == "dcp" and p.is_dir() and not p.is_symlink():
            if not all(_dcp_file(f) for f in p.iterdir()):
                return False
        elif p.name not in WRITTEN or not p.is_file() or p.is_symlink():
            return False
    return True


def _remove_if_ours(path: Path) -> bool:
    """Remove ``path`` where ``ours`` says leansft wrote it; whether it was removed."""
    if not ours(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def clean_unfinished(folder: Path) -> None:
    """Remove the temporary folders of checkpoints whose write never finished (a crash, a killed node): the
    ``.tmp-step-N`` ones ``save_checkpoint`` names, holding only what it writes."""
    if folder.is_dir():
        for tmp in folder.glob(f".tmp-{PREFIX}*"):
            if tmp.name[len(f".tmp-{PREFIX}"):].isdigit():
                _remove_if_ours(tmp)


def prune(folder: Path, keep_last: int, keep_best: int) -> list[Path]:
    """Delete checkpoints that are neither among the last ``keep_last`` nor the ``keep_best`` lowest eval
    losses; return what is kept."""
    found = list_checkpoints(folder)
    clean_unfinished(folder)
    keep = set(found[-keep_last:]) if keep_last else set()
    scored = []
    for p in found:
        try:
            loss = json.loads((p / "state.json").read_text()).get("eval_loss")
        except (OSError, ValueError):
            continue
        if loss is not None:
            scored.append((loss, int(p.name[len(PREFIX):]), p))
    keep |= {p for _, _, p in sorted(scored)[:keep_best]}
    for p in found:
        if p not in keep:
            _remove_if_ours(p)
    return [p for p in found if p in keep]
