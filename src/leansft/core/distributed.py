"""torch.distributed plumbing for torchrun: process group, rank helpers, DDP / FSDP2 wrapping.

Single-process runs go through the same calls, which then do nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as tdist

from leansft.core.errors import ConfigError, LeanSFTError


def is_distributed() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def init(timeout_s: float = 600) -> None:
    """Join the process group torchrun describes (nccl on CUDA, gloo on the CPU). Every collective then waits at
    most ``timeout_s`` for the other ranks (torch's defaults: 30 minutes for gloo, 10 for NCCL), and ends in an
    error that ``peer_failure`` turns into one line; a ``Heartbeat`` lets that line name the rank that stopped."""
    if is_distributed() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    global _HEARTBEAT
    _HEARTBEAT = Heartbeat()
    _HEARTBEAT.start()


def side_group(timeout_s: float):
    """A gloo process group of every rank beside the training's, for the collectives a background thread runs (a
    checkpoint written while training goes on): on the training's own group two threads' collectives would
    interleave in another order on each rank. Call it on every rank, in the same order; None in a single process."""
    if not is_distributed():
        return None
    return tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


class Heartbeat(threading.Thread):
    """A daemon thread that counts up this rank's beat in the process group's store (torchrun's) every
    ``EVERY_S``, with its host. A frozen process or a lost machine stops counting; ``stalled`` names who did."""

    EVERY_S = 1.0
    KEY = "leansft/heartbeat/{}"

    def __init__(self) -> None:
        super().__init__(name="leansft-heartbeat", daemon=True)
        self.store, self.key, self.host = _store(), self.KEY.format(rank()), socket.gethostname()
        self.stopped = threading.Event()

    def run(self) -> None:
        beat = 0
        while not self.stopped.is_set():
            try:
                self.store.set(self.key, f"{beat} {self.host}")
            except Exception:  # noqa: BLE001 - the store is gone with the run: nothing left to tell
                return
            beat += 1
            self.stopped.wait(self.EVERY_S)

    def stop(self, wait_s: float) -> None:
        """Stop beating and wait up to ``wait_s`` for the thread to leave the store: a process that exits while
        it is inside the store's C++ client can abort ("terminate called without an active exception")."""
        self.stopped.set()
        self.join(wait_s)


_HEARTBEAT: Heartbeat | None = None  # this process's, from ``init`` until ``shutdown``
_LEFT = False  # whether this process left a process group (``shutdown``): ``left_process_group``


def _store():
    return tdist.distributed_c10d._get_default_store()  # the process group's own (torchrun's rendezvous store)


def stalled(wait_s: float = 3 * Heartbeat.EVERY_S) -> list[str]:
    """The ranks whose heartbeat stood still for ``wait_s`` (``rank R on HOST``); [] where all beat on or the store
    does not answer (a lost machine that held it)."""
    if not is_distributed():
        return []
    try:
        store = _store()
        store.set_timeout(datetime.timedelta(seconds=5))
        keys = [Heartbeat.KEY.format(r) for r in range(world_size())]

        def beats() -> list[tuple[str, str]]:
            return [_beat(store.get(k)) if store.check([k]) else ("", "?") for k in keys]

        before = beats()
        time.sleep(wait_s)
        after = beats()
    except Exception:  # noqa: BLE001 - a store that does not answer tells nothing
        return []
    return [f"rank {r} on {host}" for r, ((b, host), (a, _)) in enumerate(zip(before, after, strict=True))
            if a == b != "?"]


def _beat(value: bytes) -> tuple[str, str]:
    """(count, host) of a heartbeat value; whatever else is in the store reads as ("?", "?"), so a value written by
    something else never hides the error being named."""
    count, _, host = value.decode("utf-8", "replace").partition(" ")
    return (count, host or "?") if count.isdigit() else ("?", "?")


def peer_failure(err: BaseException, timeout_s: float) -> str | None:
    """One line for a collective that failed because another rank stopped answering or ended, else None. A timeout
    names the ranks whose heartbeat stands still, where the store tells."""
    text = f"{type(err).__name__}: {err}"
    if not isinstance(err, (RuntimeError, tdist.DistError)):
        return None
    if "imed out" in text or "Timeout" in text or "timeout" in text:
        silent = stalled()
        who = (f": {', '.join(silent)} has no heartbeat (stopped, hung or lost the network)" if silent
               else " (a peer stopped, hung or lost the network)")
        return (f"a collective waited distributed.timeout_s={timeout_s:g} s without every rank answering{who}; the "
                "checkpoints already written stay as they are")
    if "closed by peer" in text or "Connection reset" in text or "Broken pipe" in text:
        return ("another rank ended (connection closed): its own message says why; the checkpoints already "
                "written stay as they are")
    return None


def shutdown(wait: bool = True) -> None:
    """Leave the process group; ``wait``: after a barrier (a run that ended well), else at once (a peer may be
    gone: a barrier would only time out again)."""
    global _LEFT
    if not is_distributed():
        return
    _LEFT = True
    if wait:
        tdist.barrier()  # (beating still: a rank that waits here is not the one a timeout should name)
        _stop_heartbeat(2 * Heartbeat.EVERY_S)
        tdist.destroy_process_group()
        return
    _stop_heartbeat(0.2)
    with contextlib.suppress(Exception):
        tdist.destroy_process_group()


def left_process_group() -> bool:
    """Whether this process was one rank of a process group it has left. torch 2.13 keeps gloo's threads running
    after ``destroy_process_group`` where FSDP2 or functional collectives used the group, and the interpreter's
    teardown then races them into SIGABRT ("terminate called without an active exception"; about one two-rank
    FSDP2 run in three on the CPU): such a process ends without that teardown (``leansft.__main__``)."""
    return _LEFT


def _stop_heartbeat(wait_s: float) -> None:
    """Out of the store before the process group (and its store) goes."""
    global _HEARTBEAT
    if _HEARTBEAT is not None:
        _HEARTBEAT.stop(wait_s)
        _HEARTBEAT = None


def rank() -> int:
    return tdist.get_rank() if is_distributed() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """Processes of this run on this machine (torchrun's LOCAL_WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def world_size() -> int:
    return tdist.get_world_size() if is_distributed() else 1


def whoami() -> str:
    """``rank R on HOST``: how a message names the process it comes from."""
    return f"rank {rank()} on {socket.gethostname()}"


def all_gather_object(obj, group=None) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` in a single process); on ``group`` where given (every rank of
    the world in it)."""
    if not is_distributed():
        return [obj]
    out = [None] * world_size()
    tdist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if is_distributed():
        tdist.barrier()


@dataclass(frozen=True)
class Storage:
    """How the ranks share a folder: ``groups`` are the ranks that see the same files there, lowest rank first
    (one group: one folder for all, a single machine or shared storage; one per node: each node's own disk).
    The lowest rank of a group writes what the group keeps there."""

    groups: tuple[tuple[int, ...], ...] = ((0,),)
    names: tuple[str, ...] = ("rank 0",)  # each rank's ``whoami()``, for messages

    @classmethod
    def one_folder(cls) -> Storage:
        """Every rank sees the same folder (what a caller that did not look assumes)."""
        return cls((tuple(range(world_size())),), tuple(f"rank {r}" for r in range(world_size())))

    @property
    def shared(self) -> bool:
        return len(self.groups) == 1

    def group(self, of: int | None = None) -> tuple[int, ...]:
        r = rank() if of is None else of
        return next(g for g in self.groups if r in g)

    def writer(self) -> bool:
        """This rank writes for its group."""
        return rank() == self.group()[0]

    def describe(self) -> str:
        if self.shared:
            return "one folder for every rank"
        return f"each of {len(self.groups)} groups of ranks has its own ({'; '.join(map(_ranks, self.groups))})"


def _ranks(group: tuple[int, ...]) -> str:
    return f"rank {group[0]}" if len(group) == 1 else f"ranks {','.join(map(str, group))}"


def storage_of(folder: Path) -> Storage:
    """Which ranks see the same ``folder`` (created if missing): each rank leaves a token file there and reads
    back which of the others' it finds, each looked up by its name (NFS revalidates a lookup of a name it has not
    cached; a directory listing it may serve from its cache), again after 0.2, 0.5 and 1 s while a rank misses some. Ranks that see each other form a group; anything but clean
    groups (rank a sees b but not b a, say) is an error naming what each rank saw. A single process: one group."""
    if not is_distributed():
        return Storage(names=(whoami(),))
    nonce = broadcast_object(uuid.uuid4().hex)
    probe = Path(folder) / f".leansft-storage-{nonce[:12]}"
    mine = probe / f"rank-{rank()}"
    error = None
    try:
        probe.mkdir(parents=True, exist_ok=True)
        mine.write_text(nonce)
    except OSError as err:
        error = f"{type(err).__name__}: {err}"
    errors = all_gather_object((whoami(), error))  # also: every token is written before any is read
    if any(e for _, e in errors):
        who, e = next((w, e) for w, e in errors if e)
        raise LeanSFTError(f"{who} cannot write to {folder}: {e}", file=str(folder))
    for wait in (0.2, 0.5, 1.0, None):  # belt and braces: a shared file system's cached lookups catching up
        seen = tuple(r for r in range(world_size()) if _token(probe / f"rank-{r}") == nonce)
        views = all_gather_object((whoami(), seen))
        if wait is None or all(len(v) == world_size() for _, v in views):
            break
        time.sleep(wait)
    mine.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        probe.rmdir()  # the last rank of a group to get here removes it
    groups = sorted({v for _, v in views})
    if any(r not in views[r][1] for r in range(len(views))) or sum(map(len, groups)) != len(views):
        raise LeanSFTError(f"the ranks see {folder} inconsistently: "
                           + "; ".join(f"{who} sees the files of {_ranks(v) if v else 'no rank'}" for who, v in views),
                           hint="give the ranks of a node one folder, and every node the same path to it")
    return Storage(tuple(groups), tuple(who for who, _ in views))


def _token(path: Path) -> str | None:
    """The token file's text, opened by its name (a lookup, not a directory listing a file system may cache)."""
    try:
        return path.read_text()
    except OSError:
        return None


@contextlib.contextmanager
def writers_first(storage: Storage):
    """The writer of each group runs the block first (e.g. builds the tokenisation cache in its group's folder);
    the others then reuse what it made. If it fails there, the others are released all the same and meet the same
    error themselves, so every rank stops with one clear message instead of hanging at the barrier."""
    if not storage.writer():
        barrier()
    try:
        yield
    finally:
        if storage.writer():
            barrier()


def all_reduce_sum(value, device: torch.device, group=None):
    """Sum a number or tensor over ranks (of ``group``: default all); returns the same kind it was given."""
    if not is_distributed():
        return value
    if torch.is_tensor(value):
        t = value.detach().clone()
        tdist.all_reduce(t, group=group)
        return t
    t = torch.tensor(float(value), device=device, dtype=torch.float64)
    tdist.all_reduce(t, group=group)
    return type(value)(t.item())


def wrap(module: torch.nn.Module, strategy: str, device: torch.device, mixed_precision: bool = False):
    """DDP, or FSDP2 (fully_shard per transformer block, then the root); unchanged when single-process."""
    if not is_distributed():
        return module
    # imported here: FSDP's modules take a third of a second to import, which commands that only read data
    # (``plan``, ``show-mask``) would pay for nothing
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

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


@dataclass(frozen=True)
class Mesh:
    """Where this rank sits: its data-parallel place (which micro-batches it reads) and its context-parallel place
    (which share of each row it runs; ``core/model/context_parallel``)."""

    dp_rank: int
    dp_size: int
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: object = None


def mesh(context_parallel: int) -> Mesh:
    """The ranks as a data-parallel x context-parallel grid (torch's DeviceMesh; the ranks of a context group
    are consecutive, so on one node where a node holds a group). Every rank a data-parallel place of its own
    without context parallelism."""
    world = world_size()
    if context_parallel == 1:
        return Mesh(rank(), world)
    if world % context_parallel:
        raise ConfigError(f"distributed.context_parallel {context_parallel} does not divide the world size {world}",
                          field="distributed.context_parallel",
                          hint="launch a multiple of context_parallel ranks (torchrun --nproc_per_node)")
    from torch.distributed.device_mesh import init_device_mesh

    grid = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world // context_parallel,
                            context_parallel), mesh_dim_names=("dp", "cp"))
    return Mesh(grid.get_local_rank("dp"), world // context_parallel, grid.get_local_rank("cp"), context_parallel,
                grid.get_group("cp"))

