"""Prepare one source in shards, in parallel, straight into its cache folder.

The main process streams raw rows (jsonl lines unparsed) in shards of ``SHARD`` rows; worker processes
(forked, so they share the tokenizer and template without pickling them) parse, convert, clean, render,
mask and tokenise a shard each; the main process appends each shard's arrays to the cache files in
shard order. Peak memory is a few shards, whatever the source's size, and the arrays are the same bytes
for any number of workers (shards never depend on it).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from itertools import chain, islice
from pathlib import Path

import numpy as np
from rich.progress import Progress, TextColumn, TimeElapsedColumn

from leansft.core.config import DataConfig, SourceConfig
from leansft.core.data.clean import content_hash, scrub
from leansft.core.data.formats import Conversation, convert_row, detect_format, map_columns
from leansft.core.data.masking import IGNORE_INDEX, ChatEncoder, Encoded
from leansft.core.data.sources import parse_row, read_raw_rows
from leansft.core.errors import DataError, LeanSFTError, TemplateError
from leansft.core.progress import console

log = logging.getLogger("leansft")
SHARD = 1024  # rows per shard at most: the unit of parallel work, of memory, and of the encoder's batches
SHARD_BYTES = 1 << 19  # ... and at most about this much jsonl text (long conversations make smaller shards)
TOKEN_FILES = {"input_ids": np.int32, "mask": np.uint8}  # per token: the id, and its loss code (below)
# Loss codes: 0 = no loss, 1 = weight 1, k >= 2 = the source's (k-2)-th fractional weight (meta "weights"):
# per-message weights stay exact in one byte per token.
EXAMPLE_FILES = ("starts", "lengths", "targets", "prompts", "rows", "hashes")  # per example, int64

_JOB: dict = {}  # what the workers need; set before the pool forks them
_JOBS: dict[str, dict] = {}  # streaming: the same per source, by its key (``ShardPool``)


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


TOP_SYSTEM_PROMPTS = 8  # per shard and source: enough to find one that most conversations share


def system_prompts(convs: list[Conversation]) -> Counter:
    """How many conversations open with each system prompt (``chat`` offers the one that dominated training)."""
    return Counter(c.messages[0]["content"] for c in convs if c.messages and c.messages[0]["role"] == "system"
                   and isinstance(c.messages[0].get("content"), str))


def _row(src: SourceConfig, raw: str | dict, number: int) -> dict:
    """One raw row parsed, its columns renamed as ``columns`` says."""
    row = parse_row(raw, src.path, number)
    return map_columns(row, src.columns, src.path, number) if src.columns else row


def _prepare_shard(shard: list[tuple[int, str | dict]], job: dict | None = None) -> dict:
    """Rows -> conversations -> examples as flat arrays, with this shard's counts (``job``: the source's, default
    ``_JOB``)."""
    job = _JOB if job is None else job
    src: SourceConfig = job["src"]
    cfg: DataConfig = job["cfg"]
    encoder: ChatEncoder = job["encoder"]
    convs, bad, no_assistant, pii = [], [], 0, Counter()
    for number, raw in shard:
        try:  # a line that is not JSON is a bad row too (data.on_bad_row: skip leaves it out)
            conv = convert_row(_row(src, raw, number), job["format"], src.path, number)
        except DataError as err:
            if cfg.on_bad_row == "error":
                raise
            bad.append(str(err))
            continue
        if cfg.clean.drop_no_assistant and not conv.has_assistant:
            no_assistant += 1
            continue
        convs.append(scrub(conv, pii) if cfg.clean.pii_scrub else conv)
    try:
        encoded, convs = _encode(encoder, convs, src.path, skip=cfg.on_bad_row == "skip", bad=bad)
    except LeanSFTError as err:
        raise type(err)(err.message, file=err.file or src.path, row=err.row, field=err.field, hint=err.hint) from None
    ids, labels, lengths, rows, hashes, weighted = [], [], [], [], [], []
    for conv, examples in zip(convs, encoded):
        h = content_hash(conv)  # shared by the examples of one conversation (per-turn expansion)
        for example in examples:
            if example.weights is not None:
                weighted.append((len(ids), example.weights, conv.row))
            ids.append(example[0])
            labels.append(example[1])
            lengths.append(len(example[0]))
            rows.append(conv.row)
            hashes.append(h)
    # the shard's examples as flat arrays at once (a handful of numpy calls a shard, not a handful an example)
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths_arr[:-1], out=starts[1:])
    flat_ids = np.concatenate(ids).astype(np.int32, copy=False) if ids else np.zeros(0, np.int32)
    flat_mask = (np.concatenate(labels) != IGNORE_INDEX).astype(np.uint8) if labels else np.zeros(0, np.uint8)
    weights: dict[float, int] = {}  # this shard's fractional weights -> loss code
    for k, example_weights, row in weighted:
        m = flat_mask[starts[k] : starts[k] + lengths[k]]  # a view: codes written into the shard's mask
        for w in np.unique(example_weights[(m == 1) & (example_weights != 1)]).tolist():
            code = weights.setdefault(w, len(weights) + 2)
            if code > 255:
                raise DataError("more than 254 different loss weights in one source", file=src.path, row=row,
                                field="weight")
            m[(m == 1) & (example_weights == w)] = code
    loss = flat_mask != 0
    after_first = loss.copy()
    after_first[starts[lengths_arr > 0]] = False  # the first token of an example never has a target
    targets = np.add.reduceat(after_first.astype(np.int64), starts) if len(after_first) else np.zeros(len(starts),
                                                                                                       np.int64)
    targets[lengths_arr == 0] = 0  # reduceat gives an empty segment the next element
    hits = np.flatnonzero(loss)
    first = np.searchsorted(hits, starts)  # each example's first loss token, if it lies inside the example
    inside = first < len(hits)
    inside[inside] = hits[first[inside]] < starts[inside] + lengths_arr[inside]
    prompts = lengths_arr.copy()
    prompts[inside] = hits[first[inside]] - starts[inside]
    return {
        "input_ids": flat_ids, "mask": flat_mask, "starts": starts, "lengths": lengths_arr,
        "targets": targets.astype(np.int64, copy=False), "prompts": prompts,
        "rows": np.asarray(rows, dtype=np.int64), "hashes": np.asarray(hashes, dtype=np.int64),
        "rows_read": len(shard), "bad": bad, "no_assistant": no_assistant, "pii": pii, "template": encoder.stats,
        "system_prompts": system_prompts(convs).most_common(TOP_SYSTEM_PROMPTS),
        "conversations": len(convs), "max_id": int(flat_ids.max()) if len(flat_ids) else -1,
        "weights": list(weights),
    }


def _encode(encoder: ChatEncoder, convs: list[Conversation], path: str, skip: bool, bad: list[str]
            ) -> tuple[list[list[Encoded]], list[Conversation]]:
    """The shard's conversations encoded in one batch, and the conversations kept. With ``skip``, a
    conversation the template refuses (an error naming its row) is dropped and counted like a malformed
    row: the shard is encoded again one conversation at a time."""
    encoder.stats = Counter()
    try:
        return encoder.encode(convs), convs
    except TemplateError as err:
        if not skip or err.row is None:
            raise
    encoder.stats = Counter()  # the failed batch counted some turns already
    encoded, kept = [], []
    for conv in convs:
        counted = encoder.stats.copy()
        try:
            encoded += encoder.encode([conv])
        except TemplateError as err:
            if err.row is None:
                raise
            encoder.stats = counted  # nothing of a skipped conversation is counted
            bad.append(str(TemplateError(err.message, file=path, row=err.row, field=err.field)))
            continue
        kept.append(conv)
    return encoded, kept


def cut_shards(rows: Iterator[tuple]) -> Iterator[list[tuple]]:
    """Consecutive rows (``(number, raw, ...)``, kept as given), ``SHARD`` at most and about ``SHARD_BYTES`` of raw
    text: boundaries depend on the data only, never on the number of workers."""
    shard, size = [], 0
    for row in rows:
        shard.append(row)
        size += len(row[1]) if isinstance(row[1], str) else 0
        if len(shard) >= SHARD or size >= SHARD_BYTES:
            yield shard
            shard, size = [], 0
    if shard:
        yield shard


def _start_worker() -> None:
    """In a worker: the Rust tokenizer on this process's thread alone (the workers already fill every core; its own
    threads on top of them only contended: 2 workers on 2 cores, 2% faster without), and what the worker inherits
    from the parent frozen for the garbage collector (its full collections walked torch's and transformers'
    objects: 5% of a worker's time on short chats). The worker also ends with its parent: a run killed (kill -9)
    while a stream is read leaves no worker behind, waiting forever on a queue nobody writes."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    gc.freeze()
    _end_with_parent()


def _end_with_parent() -> None:
    """A thread that ends this worker once its parent is gone (the parent id changes when it dies): no shared
    library call, one check a second."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="leansft-parent-watch", daemon=True).start()


def _map_shards(fn: Callable, shards: Iterator[list], workers: int) -> Iterator[dict]:
    """``fn`` over the shards, results in shard order; at most two shards per worker in flight."""
    head = list(islice(shards, 2))
    if workers <= 1 or len(head) < 2 or "fork" not in mp.get_all_start_methods():
        yield from map(fn, chain(head, shards))
        return
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"), initializer=_start_worker)
    try:
        pending: deque = deque()
        for shard in chain(head, shards):
            pending.append(pool.submit(fn, shard))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _prepare_keyed(key: str, shard: list[tuple[int, str | dict]]) -> dict:
    return _prepare_shard(shard, _JOBS[key])


class ShardPool:
    """Worker processes that prepare the shards of streaming sources while training runs: the cached path's own
    ``_prepare_shard``, each source's job by its key. The workers are forked once, when the pool is made (a run
    makes it before its training loop's thread starts; the model's pages they inherit are never touched), and each
    source keeps ``ahead`` shards per worker in flight: the buffer between preparation and the trainer."""

    def __init__(self, jobs: dict[str, dict], workers: int, ahead: int) -> None:
        _JOBS.update(jobs)
        self.workers, self.ahead = workers, ahead
        self.pool = None
        if workers > 1 and "fork" in mp.get_all_start_methods():
            self.pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"), initializer=_start_worker)
            self.pool.submit(int).result()  # with fork, the first task starts every worker: now, not mid-run

    def map(self, key: str, shards: Iterator[list]) -> Iterator[dict]:
        """The source ``key``'s shards prepared, in order; what is in flight is cancelled when the caller stops."""
        if self.pool is None:
            yield from (_prepare_keyed(key, shard) for shard in shards)
            return
        pending: deque = deque()
        try:
            for shard in shards:
                pending.append(self.pool.submit(_prepare_keyed, key, shard))
                if len(pending) >= self.ahead * self.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


class _Progress:
    """Conversations/s and tokens/s while a source is prepared: a live line on a terminal, else a log line
    every 10 s; the final counts either way."""

    def __init__(self, path: str) -> None:
        self.path, self.t0, self.last_log = path, time.perf_counter(), time.perf_counter()
        self.conversations = self.tokens = 0
        self.bar = None
        if console().is_terminal:  # the console the log lines go to: they print above the live line
            self.bar = Progress(TextColumn("preparing {task.description}"), TextColumn("{task.fields[info]}"),
                                TimeElapsedColumn(), console=console(), transient=True)
            self.task = self.bar.add_task(Path(path).name, info="")
            self.bar.start()

    def _rates(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return (f"{self.conversations:,} conversations ({self.conversations / dt:,.0f}/s), "
                f"{self.tokens:,} tokens ({self.tokens / dt:,.0f}/s)")

    def update(self, conversations: int, tokens: int) -> None:
        self.conversations += conversations
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(self.task, info=self._rates())
        elif time.perf_counter() - self.last_log > 10:
            self.last_log = time.perf_counter()
            log.info("preparing %s: %s", self.path, self._rates())

    def close(self, finished: bool = True) -> None:
        """Stop the bar; a finished source gets its counts (a refused one: the error says what happened)."""
        if self.bar is not None:
            self.bar.stop()
        if finished:
            log.info("prepared %s: %s in %.1f s", self.path, self._rates(), time.perf_counter() - self.t0)


def prepare_source(src: SourceConfig, cfg: DataConfig, encoder: ChatEncoder, folder: Path, meta: dict) -> None:
    """Write the source's arrays into ``folder`` (``TOKEN_FILES`` as raw arrays, ``EXAMPLE_FILES`` as .npy)
    and its counts into ``meta``."""
    rows = read_raw_rows(src.path, src.split)
    first = next(rows, None)
    if first is None:
        raise DataError("no rows (empty data)", file=src.path)
    fmt = src.format
    if fmt == "auto":
        fmt = detect_format(_row(src, first[1], first[0]), src.path, first[0])
        log.info("%s: detected format '%s' from row %d", src.path, fmt, first[0])
    _JOB.update(src=src, cfg=cfg, encoder=encoder, format=fmt)
    workers = cfg.num_workers or cpu_count()
    shards = cut_shards(chain([first], rows))
    per_example: dict[str, list[np.ndarray]] = {name: [] for name in EXAMPLE_FILES}
    counts: Counter = Counter()
    bad: list[str] = []
    pii: Counter = Counter()
    template: Counter = Counter()
    systems: Counter = Counter()
    progress, tokens, max_id = _Progress(src.path), 0, -1
    table: dict[float, int] = {}  # the source's fractional weights -> loss code, in order of first appearance
    files = {name: (folder / f"{name}.bin").open("wb") for name in TOKEN_FILES}
    finished = False
    try:
        for shard in _map_shards(_prepare_shard, shards, workers):
            if shard["weights"]:  # shard codes -> source codes
                lut = np.arange(256, dtype=np.uint8)
                for i, w in enumerate(shard["weights"]):
                    lut[i + 2] = table.setdefault(w, len(table) + 2)
                if len(table) > 254:
                    raise DataError("more than 254 different loss weights in one source", file=src.path,
                                    field="weight")
                shard["mask"] = lut[shard["mask"]]
            for name, fh in files.items():
                shard[name].tofile(fh)
            shard["starts"] += tokens
            for name in EXAMPLE_FILES:
                per_example[name].append(shard[name])
            tokens += len(shard["input_ids"])
            max_id = max(max_id, shard["max_id"])
            counts.update(rows_read=shard["rows_read"], no_assistant=shard["no_assistant"],
                          bad_rows=len(shard["bad"]))
            bad += shard["bad"][: max(0, 5 - len(bad))]
            pii.update(shard["pii"])
            template.update(shard["template"])
            systems.update(dict(shard["system_prompts"]))
            progress.update(shard["conversations"], len(shard["input_ids"]))
        finished = True
    finally:
        for fh in files.values():
            fh.close()
        progress.close(finished)
        _JOB.clear()
    for name in EXAMPLE_FILES:
        np.save(folder / f"{name}.npy", np.concatenate(per_example[name]) if per_example[name]
                else np.zeros(0, np.int64))
    meta.update(format=fmt, rows_read=counts["rows_read"], bad_rows=counts["bad_rows"], bad_row_examples=bad,
                no_assistant=counts["no_assistant"], pii_replaced=dict(pii), template=dict(template), tokens=tokens,
                max_token_id=max_id, weights=list(table),
                system_prompts=[[text, n] for text, n in systems.most_common(TOP_SYSTEM_PROMPTS)])
