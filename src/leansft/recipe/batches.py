"""The training order: per epoch a seeded plan, its rows shuffled, grouped into micro-batches.

Everything is a function of (seed, epoch), so a data position is just (epoch, micro-batch index)
and a resumed run regenerates exactly the same sequence. A streaming run (``StreamBatcher``) plans each window of
its stream as an epoch is planned; its position is the stream's state at the window holding the next micro-batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from leansft.core.batching.collate import PackedBatch, PaddedBatch, collate_padded, collate_rows
from leansft.core.batching.context_shard import context_shard
from leansft.core.batching.packing import PACKED, PackPlan, deal_to_ranks, micro_batches, pack
from leansft.core.config import BatchingConfig
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.data.stream import Stream


@dataclass
class Position:
    epoch: int = 0
    index: int = 0  # next micro-batch within the epoch (a stream: micro-batches since the start)
    stream: dict | None = None  # a stream's state at the window holding the next micro-batch, and ``skip`` into it


def deal(tokens: list[int], world_size: int, rank: int) -> list[int]:
    """Which of one global step's micro-batches (``tokens`` each) are this rank's: dealt by tokens, in order."""
    if world_size == 1:
        return list(range(len(tokens)))
    return sorted(deal_to_ranks(np.asarray(tokens), world_size)[rank])


class Batcher:
    def __init__(self, data: TokenizedDataset, cfg: BatchingConfig, max_length: int, pad_id: int, seed: int,
                 rank: int = 0, world_size: int = 1, context: tuple[int, int] = (0, 1)) -> None:
        """``rank``/``world_size``: the data-parallel place; ``context``: (place, size) in a context-parallel group,
        whose ranks read the same micro-batches and each keep its share of every row."""
        self.data, self.cfg, self.max_length, self.pad_id, self.seed = data, cfg, max_length, pad_id, seed
        self.rank, self.world_size, self.context = rank, world_size, context
        self._epoch_cache: tuple[int, PackPlan, list[np.ndarray]] | None = None

    @property
    def packed(self) -> bool:
        return self.cfg.strategy in PACKED

    def epoch_plan(self, epoch: int) -> tuple[PackPlan, list[np.ndarray]]:
        """All micro-batches (arrays of plan rows) of ``epoch``, in training order, for every rank."""
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1], self._epoch_cache[2]
        seed = self.seed + 1000 * epoch
        plan = pack(self.cfg.strategy, self.data.lengths, self.max_length, batch_size=self.cfg.batch_size,
                    window=self.cfg.window, seed=seed)
        order = np.random.default_rng(seed).permutation(plan.num_rows)
        if self.packed:
            groups = micro_batches(plan, self.cfg.tokens_per_micro_batch, order)
        else:
            groups = [np.asarray([r]) for r in order]
        self._epoch_cache = (epoch, plan, groups)
        return plan, groups

    def micro_batches_per_epoch(self) -> int:
        """Micro-batches per epoch for one rank."""
        return len(self.epoch_plan(0)[1]) // self.world_size

    def _mine(self, plan: PackPlan, step_groups: list[np.ndarray]) -> list[np.ndarray]:
        """This rank's share of one global step: ``accumulation`` micro-batches, dealt by tokens.

        A global step is the same ``world_size x accumulation`` micro-batches whatever the world size,
        so 2 ranks x accumulation 1 see exactly the rows of 1 rank x accumulation 2.
        """
        if self.world_size == 1:
            return step_groups
        tokens = [int(plan.row_tokens[g].sum()) for g in step_groups]
        return [step_groups[i] for i in deal(tokens, self.world_size, self.rank)]

    def collate(self, plan: PackPlan, rows: np.ndarray) -> PackedBatch | PaddedBatch:
        if self.packed:
            return context_shard(collate_rows(self.data, plan, rows), *self.context)
        (row,) = rows
        return collate_padded(self.data, plan.row(int(row))[0], self.pad_id, self.max_length)

    def steps(self, pos: Position, accumulation: int) -> Iterator[tuple[list[PackedBatch | PaddedBatch], Position]]:
        """Yield (this rank's micro-batches of one optimizer step, position after it) forever, across epochs.

        ``index`` counts global micro-batches; an incomplete last step of an epoch is dropped, so every
        step is full and every rank runs the same number of steps (no hang at an epoch's end)."""
        per_step = accumulation * self.world_size
        epoch, index = pos.epoch, pos.index
        while True:
            plan, groups = self.epoch_plan(epoch)
            if index + per_step > len(groups):
                epoch, index = epoch + 1, 0
                continue
            mine = self._mine(plan, groups[index : index + per_step])
            index += per_step
            yield [self.collate(plan, g) for g in mine], Position(epoch, index)


@dataclass
class _Group:
    """One micro-batch of a stream's window, and the stream's state after it."""

    batcher: Batcher
    plan: PackPlan
    rows: np.ndarray
    after: dict  # the window's start, ``skip`` past this micro-batch
    count: int  # micro-batches in the window
    end: dict  # the stream's state after the window


class StreamBatcher:
    """A streaming run's order: each window of the stream planned as ``Batcher`` plans an epoch (window w of epoch e
    with seed ``seed + 1000 e + 7919 w``, so a window holding a whole source plans as the cached run's epoch), and its
    micro-batches one sequence across windows and epochs: a step may take the last micro-batches of one window and
    the first of the next, and none is dropped."""

    def __init__(self, stream: Stream, cfg: BatchingConfig, max_length: int, pad_id: int, seed: int,
                 rank: int = 0, world_size: int = 1, context: tuple[int, int] = (0, 1)) -> None:
        self.stream, self.cfg, self.max_length, self.pad_id, self.seed = stream, cfg, max_length, pad_id, seed
        self.rank, self.world_size, self.context = rank, world_size, context

    def _groups(self, state: dict) -> Iterator[_Group]:
        """The micro-batches of the windows from ``state`` on, the first ``state['skip']`` of its window left out."""
        skip = state.get("skip", 0)
        for window in self.stream.windows(state):
            epoch, number = window.start["epoch"], window.start["window"]
            batcher = Batcher(window.data, self.cfg, self.max_length, self.pad_id,
                              self.seed + 1000 * epoch + 7919 * number, self.rank, self.world_size, self.context)
            plan, groups = batcher.epoch_plan(0)
            for k in range(skip, len(groups)):
                yield _Group(batcher, plan, groups[k], {**window.start, "skip": k + 1}, len(groups), window.end)
            skip = 0

    def steps(self, pos: Position, accumulation: int) -> Iterator[tuple[list[PackedBatch | PaddedBatch], Position]]:
        """As ``Batcher.steps``: (this rank's micro-batches of one optimizer step, the position after it), forever."""
        per_step = accumulation * self.world_size
        groups = self._groups(pos.stream or self.stream.start())
        index = pos.index
        try:
            while True:
                step = [next(groups) for _ in range(per_step)]
                index += per_step
                last = step[-1]
                after = last.after if last.after["skip"] < last.count else {**last.end, "skip": 0}
                tokens = [int(g.plan.row_tokens[g.rows].sum()) for g in step]
                mine = [step[i] for i in deal(tokens, self.world_size, self.rank)]
                yield [g.batcher.collate(g.plan, g.rows) for g in mine], Position(last.after["epoch"], index, after)
        finally:
            groups.close()


class Prefetched:
    """A step iterator (``Batcher.steps``) run ``depth`` steps ahead on a background thread, so collation (gathering
    tokens, laying rows out as flat sequences) happens while the device computes the step before, not between
    steps; with ``pin`` (a CUDA run) each batch is put in page-locked memory there too, so its copy to the device
    runs without the host waiting. Items come out in order, with their positions; an error on the thread comes out
    of ``next``. ``close`` (or leaving the ``with`` block) stops the thread."""

    _END = object()

    def __init__(self, steps: Iterator, depth: int = 2, pin: bool = False) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(steps, pin), name="leansft-batches", daemon=True)
        self._thread.start()

    def _fill(self, steps: Iterator, pin: bool) -> None:
        try:
            for batches, position in steps:
                item = ([b.pin_memory() for b in batches] if pin else batches, position)
                if not self._put(item):
                    return
        except BaseException as err:  # noqa: BLE001 - handed to the training loop, which raises it
            self._put(err)
            return
        self._put(self._END)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetched:
        return self

    def __next__(self):
        item = self._queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> Prefetched:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
