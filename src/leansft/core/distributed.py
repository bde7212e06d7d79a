"""torch.distributed plumbing for torchrun: process group, rank helpers, DDP / FSDP2 wrapping.

Single-process runs go through the same calls, which then do nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket

import torch
import torch.distributed as tdist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP


def is_distributed() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def init(timeout_s: float = 600) -> None:
    """Join the process group torchrun describes (nccl on CUDA, gloo on the CPU). Every collective then waits at
    most ``timeout_s`` for the other ranks (torch's defaults: 30 minutes for gloo, 10 for NCCL), and ends in an
    error that ``peer_failure`` turns into one line."""
    if is_distributed() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def peer_failure(err: BaseException, timeout_s: float) -> str | None:
    """One line for a collective that failed because another rank stopped answering or ended, else None."""
    text = f"{type(err).__name__}: {err}"
    if not isinstance(err, (RuntimeError, tdist.DistError)):
        return None
    if "imed out" in text or "Timeout" in text or "timeout" in text:
        return (f"a collective waited distributed.timeout_s={timeout_s:g} s without every rank answering (a peer "
                "stopped, hung or lost the network); the checkpoints already written stay as they are")
    if "closed by peer" in text or "Connection reset" in text or "Broken pipe" in text:
        return ("another rank ended (connection closed): its own message says why; the checkpoints already "
                "written stay as they are")
    return None


def shutdown(wait: bool = True) -> None:
    """Leave the process group; ``wait``: after a barrier (a run that ended well), else at once (a peer may be
    gone: a barrier would only time out again)."""
    if not is_distributed():
        return
    if wait:
        tdist.barrier()
        tdist.destroy_process_group()
        return
    with contextlib.suppress(Exception):
        tdist.destroy_process_group()


def rank() -> int:
    return tdist.get_rank() if is_distributed() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    return tdist.get_world_size() if is_distributed() else 1


def whoami() -> str:
    """``rank R on HOST``: how a message names the process it comes from."""
    return f"rank {rank()} on {socket.gethostname()}"


def all_gather_object(obj) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` in a single process)."""
    if not is_distributed():
        return [obj]
    out = [None] * world_size()
    tdist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if is_distributed():
        tdist.barrier()


@contextlib.contextmanager
def rank_zero_first():
    """Rank 0 runs the block first (e.g. builds the tokenisation cache); the others then reuse it. If it
    fails on rank 0, the others are released all the same and meet the same error themselves, so every
    rank stops with one clear message instead of hanging at the barrier."""
    if rank() != 0:
        barrier()
    try:
        yield
    finally:
        if rank() == 0:
            barrier()


def all_reduce_sum(value, device: torch.device):
    """Sum a number or tensor over ranks; returns the same kind it was given."""
    if not is_distributed():
        return value
    if torch.is_tensor(value):
        t = value.detach().clone()
        tdist.all_reduce(t)
        return t
    t = torch.tensor(float(value), device=device, dtype=torch.float64)
    tdist.all_reduce(t)
    return type(value)(t.item())


def wrap(module: torch.nn.Module, strategy: str, device: torch.device, mixed_precision: bool = False):
    """DDP, or FSDP2 (fully_shard per transformer block, then the root); unchanged when single-process."""
    if not is_distributed():
        return module
    if strategy == "ddp":
        return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
    kw = {}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = getattr(module.model.get_decoder(), "layers", [])
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(module, **kw)
    return module


def no_sync(module):
    """Skip gradient communication on the accumulation micro-batches before a step's last one.

    DDP: ``no_sync()`` (no all-reduce). FSDP2: ``set_requires_gradient_sync(False)`` (no
    reduce-scatter; unsharded gradients accumulate locally). A plain module: nothing to skip."""
    if hasattr(module, "no_sync"):
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):
        return _fsdp_no_sync(module)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
