"""Checkpoint files: safetensors for tensors, JSON for the rest, written atomically.

Single-process and DDP checkpoints load no pickle (nothing in them can execute code). FSDP checkpoints
are written by torch.distributed.checkpoint into ``dcp/``: tensors as raw shards, but its ``.metadata``
file is pickled by torch, so resume an FSDP checkpoint only from a folder you trust.

Layout of OUTPUT_DIR/checkpoints/step-N/:
  model.safetensors        trainable weights (LoRA: the adapters alone)
  optimizer.safetensors    optimizer state tensors, keyed "<param index>.<name>"
  rng.safetensors          torch CPU (and CUDA) generator states
  state.json               step, data position, counters, scheduler, optimizer param groups, numpy/python RNG, eval loss
  config.yaml              the resolved run config
  dcp/                     FSDP only: sharded model and optimizer state (instead of the two files above)
A checkpoint is written into a temporary folder, every file fsynced, then renamed into place; a crash
mid-write leaves the previous checkpoints untouched (temporary folders are ignored and cleaned).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from leansft.core import parallel
from leansft.core.errors import LeanSFTError

PREFIX = "step-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The parameters that train (all of them, or the LoRA adapters), by parameter name."""
    return {n: p.detach().contiguous().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def _optimizer_tensors(optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().contiguous().cpu()
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _load_optimizer(optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    for key, v in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            tensors[f"torch_cuda_{i}"] = torch.cuda.get_rng_state(i)
    np_state = np.random.get_state()
    py = random.getstate()
    return tensors, {"numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
                     "python": [py[0], list(py[1]), py[2]]}


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    for k, v in tensors.items():
        if k.startswith("torch_cuda_") and torch.cuda.is_available():
            torch.cuda.set_rng_state(v, int(k.rsplit("_", 1)[1]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), *n[2:]))
    p = meta["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def save_checkpoint(folder: Path, step: int, model, optimizer, scheduler, state: dict, config: dict,
                    sharded_root=None) -> Path:
    """Write checkpoint ``step`` under ``folder`` atomically; return its path.

    With ``sharded_root`` (the FSDP-wrapped module), every rank writes its shards of the model and
    optimizer through torch.distributed.checkpoint into ``dcp/``; otherwise rank 0 writes safetensors.
    Call it on every rank when sharded, on rank 0 alone otherwise.
    """
    final = folder / f"{PREFIX}{step}"
    tmp = folder / f".tmp-{PREFIX}{step}"
    rank = parallel.rank()
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if sharded_root is not None:
        parallel.barrier()
    try:
        if sharded_root is not None:
            model_sd, optim_sd = get_state_dict(sharded_root, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
            parallel.barrier()
        if rank == 0:
            opt_meta = None
            if sharded_root is None:
                save_file(trainable_state(model), tmp / "model.safetensors")
                opt_tensors, opt_meta = _optimizer_tensors(optimizer)
                save_file(opt_tensors, tmp / "optimizer.safetensors")
            rng_tensors, rng_meta = _rng_state()
            save_file(rng_tensors, tmp / "rng.safetensors")
            full_state = {**state, "step": step, "scheduler": scheduler.state_dict(), "optimizer": opt_meta,
                          "rng": rng_meta, "sharded": sharded_root is not None}
            (tmp / "state.json").write_text(json.dumps(full_state, indent=1))
            (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            for f in tmp.rglob("*"):
                if f.is_file():
                    with f.open("rb") as fh:
                        os.fsync(fh.fileno())
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(folder)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if sharded_root is not None:
        parallel.barrier()
    return final


def load_checkpoint(path: Path, model, optimizer, scheduler, sharded_root=None) -> dict:
    """Restore weights, optimizer, scheduler and RNG from ``path``; return its state.json."""
    try:
        state = json.loads((path / "state.json").read_text())
        rng = load_file(path / "rng.safetensors")
        if state.get("sharded"):
            if sharded_root is None:
                raise LeanSFTError("a sharded (FSDP) checkpoint resumes only under FSDP with the same world size",
                                   file=str(path))
            model_sd, optim_sd = get_state_dict(sharded_root, optimizer)
            both = {"model": model_sd, "optim": optim_sd}
            dcp.load(both, checkpoint_id=str(path / "dcp"))
            set_state_dict(sharded_root, optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])
        else:
            weights = load_file(path / "model.safetensors")
            opt = load_file(path / "optimizer.safetensors")
            _load_weights(model, weights, path)
            _load_optimizer(optimizer, opt, state["optimizer"])
    except FileNotFoundError as err:
        raise LeanSFTError(f"incomplete checkpoint: {err.filename} missing", file=str(path)) from None
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(rng, state["rng"])
    return state


def _load_weights(model, weights: dict[str, torch.Tensor], path: Path) -> None:
    params = dict(model.named_parameters())
    unknown = sorted(set(weights) - set(params))
    if unknown:
        raise LeanSFTError(f"checkpoint weights do not match the model (e.g. '{unknown[0]}')", file=str(path))
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders from a crash are not listed)."""
    if not folder.exists():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").exists()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def find_resume(output_dir: Path, resume: str) -> Path | None:
    if resume == "auto":
        found = list_checkpoints(output_dir / "checkpoints")
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "state.json").exists():
        raise LeanSFTError("not a checkpoint folder (no state.json)", file=resume)
    return path


def prune(folder: Path, keep_last: int, keep_best: int) -> list[Path]:
    """Delete checkpoints that are neither among the last ``keep_last`` nor the ``keep_best`` lowest eval
    losses; return what is kept."""
    found = list_checkpoints(folder)
    for tmp in folder.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    keep = set(found[-keep_last:]) if keep_last else set()
    scored = []
    for p in found:
        loss = json.loads((p / "state.json").read_text()).get("eval_loss")
        if loss is not None:
            scored.append((loss, int(p.name[len(PREFIX):]), p))
    keep |= {p for _, _, p in sorted(scored)[:keep_best]}
    for p in found:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
    return [p for p in found if p in keep]
