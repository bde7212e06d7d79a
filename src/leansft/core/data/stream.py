"""Streaming sources (``data.sources[*].streaming``): read, prepared, mixed and cleaned while training runs, a window
at a time, never cached whole.

The pipeline is the cached one's: raw rows in shards (``shards.py``'s sizes), each shard prepared by
``_prepare_shard`` in worker processes (``ShardPool``) and cleaned by ``dataset.clean``; only where the examples
go differs. Here they are drawn into windows of ``data.stream.window`` examples (the mix decides which source gives
the next one, by its share), deduplicated within the window, and handed to the batcher, which packs and shuffles a
window as the cached run packs an epoch. Memory holds a window and the shards in flight, whatever the source's size.

Everything is a function of the stream's state at a window's start (each source's ``Cursor``, what the mix has
taken, the epoch and window number): a checkpoint stores that state, and a resume seeks each source to its cursor
(a byte offset in a .jsonl file, a row in a parquet file or a saved dataset) rather than reading it again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from leansft.core import distributed
from leansft.core.config import DataConfig, SourceConfig
from leansft.core.data.dataset import CACHE_VERSION, PrepReport, TokenizedDataset, TokenStore, clean, duplicates
from leansft.core.data.formats import detect_format, map_columns
from leansft.core.data.masking import ChatEncoder, ChatTemplate
from leansft.core.data.shards import ShardPool, cpu_count, cut_shards
from leansft.core.data.sources import parse_row, raw_rows_from, seeks_by
from leansft.core.data.tokenizer import tokenizer_fingerprint
from leansft.core.errors import ConfigError, DataError

log = logging.getLogger("leansft")
STREAM_FILES = (".jsonl", ".parquet")  # what a folder of shards is read for


@dataclass
class Cursor:
    """Where a source's reading stands: the shard holding its next example, and how many of that shard's (cleaned)
    examples were taken already. ``offset``: the shard's first row as a byte offset (.jsonl) or as the rows before it
    in the file; ``line``: the row number before it (errors name rows from line + 1); ``lap``: times the source was
    read through before (a mix repeats a source whose share outlasts it)."""

    lap: int = 0
    file: int = 0
    offset: int = 0
    line: int = 0
    skip: int = 0


def stream_files(src: SourceConfig) -> list[Path]:
    """The files a streaming source reads, in order: the file itself, a folder's .jsonl/.parquet files (sorted by
    path), or a saved dataset folder (``datasets.save_to_disk``)."""
    path = Path(src.path)
    if path.is_file():
        return [path]
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            return [path]
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in STREAM_FILES)
        if not files:
            raise DataError("a streaming folder holds no .jsonl or .parquet file", file=src.path)
        return files
    raise DataError("a streaming source is read from local files: not found" + (
        "" if path.suffix else " (a Hub dataset: datasets.load_dataset(name).save_to_disk(folder) once where it can "
        "be downloaded, then stream that folder)"), file=src.path, field="data.sources[*].streaming")


class SourceStream:
    """One streaming source: its shards from a cursor, prepared by the pool and cleaned, one example at a time."""

    def __init__(self, index: int, src: SourceConfig, cfg: DataConfig, encoder: ChatEncoder, truncate: bool) -> None:
        self.index, self.src, self.cfg, self.truncate = index, src, cfg, truncate
        self.files = stream_files(src)
        self.key = f"stream-{index}"
        first = next(raw_rows_from(self.files[0], 0, 0, src.split), None)
        if first is None:
            raise DataError("no rows (empty data)", file=str(self.files[0]))
        self.format = src.format
        if self.format == "auto":
            row = parse_row(first[1], src.path, first[0])
            row = map_columns(row, src.columns, src.path, first[0]) if src.columns else row
            self.format = detect_format(row, src.path, first[0])
            log.info("%s: detected format '%s' from row %d", src.path, self.format, first[0])
        self.job = {"src": src, "cfg": cfg, "encoder": encoder, "format": self.format}
        self.seen = {f: _identity(f) for f in self.files}  # what each file was when the run opened it
        self.report = PrepReport()  # what cleaning removed, over everything read so far
        self.bad_rows = 0

    def _shards(self, cursor: Cursor) -> Iterator[tuple[Cursor, list[tuple[int, str | dict]]]]:
        """``(cursor at the shard's first row, its rows)``: shards cut as the cached path cuts them, from the
        cursor's shard on (so a resumed stream cuts the same shards)."""
        for f in range(cursor.file, len(self.files)):
            offset, line = (cursor.offset, cursor.line) if f == cursor.file else (0, 0)
            self._unchanged(self.files[f])
            shards = cut_shards(raw_rows_from(self.files[f], offset, line, self.src.split))
            while True:
                try:
                    shard = next(shards, None)
                except OSError as err:  # the file went away (or its disk) while it was read
                    self._unchanged(self.files[f])
                    raise self._broken(self.files[f], f"cannot be read: {err.strerror or err}") from None
                self._unchanged(self.files[f])  # every shard from the file the run opened, or none
                if shard is None:
                    break
                number, _, where = shard[0]
                yield Cursor(cursor.lap, f, where, number - 1), [(n, raw) for n, raw, _ in shard]

    def _unchanged(self, path: Path) -> None:
        """Refuse a file that vanished, shrank, grew or was rewritten since the run opened the source: what it reads
        next would not be the data its saved positions and fingerprint point into."""
        was, now = self.seen[path], _identity(path)
        if now == was:
            return
        if now is None:
            raise self._broken(path, "vanished (moved or deleted)")
        if isinstance(was[0], int) and was[0] != now[0]:
            change = f"{'shrank' if now[0] < was[0] else 'grew'} from {was[0]:,} to {now[0]:,} bytes"
        else:
            change = "was rewritten (its modification time changed)"
        raise self._broken(path, change)

    def _broken(self, path: Path, what: str) -> DataError:
        return DataError(f"streaming source {self.src.path}: the file {what} while the run read it", file=str(path),
                         field=f"data.sources[{self.index}]",
                         hint="put the source back as it was when the run started and resume (--resume auto: the "
                              "newest checkpoint is intact), or start a new run on the new data")

    def examples(self, pool: ShardPool, cursor: Cursor) -> Iterator[tuple[Cursor, TokenizedDataset, int, int]]:
        """``(the cursor at the example's shard, the cleaned shard, the example's index in it, its target tokens)``
        from ``cursor`` on."""
        starts: deque[Cursor] = deque()

        def rows() -> Iterator[list]:
            for at, shard in self._shards(cursor):
                starts.append(at)
                yield shard

        skip = cursor.skip
        for prepared in pool.map(self.key, rows()):
            at = starts.popleft()
            self.bad_rows += len(prepared["bad"])
            if prepared["bad"] and self.bad_rows == len(prepared["bad"]):
                log.warning("%s: rows skipped (data.on_bad_row: skip), e.g. %s", self.src.path,
                            prepared["bad"][0].split("\n")[0])
            _, data = clean(TokenizedDataset(TokenStore.from_shard(prepared)), self.cfg, self.report, self.truncate,
                            dedupe=False)
            targets = data.target_counts.tolist()
            for j in range(skip, len(data)):
                yield at, data, j, targets[j]
            skip = 0


@dataclass
class Window:
    """``window`` examples of the stream (fewer at an epoch's end), and the stream's state before and after them."""

    data: TokenizedDataset
    source: np.ndarray  # each example's source
    start: dict
    end: dict
    duplicates: int = 0


@dataclass
class Taken:
    """What the mix has taken from each source in this epoch (examples, target tokens) and which sources it has
    read through at least once."""

    examples: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    through: list[bool] = field(default_factory=list)


class Stream:
    """The streaming sources of a run, mixed into windows (``windows``) from any saved state."""

    def __init__(self, cfg: DataConfig, tokenizer, template: ChatTemplate, truncate: bool = True) -> None:
        sources = cfg.sources
        if not all(s.streaming for s in sources):
            raise ConfigError("some sources stream and some do not: mark every source streaming: true (a small source "
                              "streams as well as a large one) or none", field="data.sources[*].streaming")
        if cfg.eval_split > 0:
            raise ConfigError("data.eval_split holds out a share of the whole data, which a stream never holds: give "
                              "data.eval_file (prepared and cached as usual)", field="data.eval_split")
        if cfg.mix.mode == "concat" and any(s.weight != 1 for s in sources):
            raise ConfigError("a weight on a streaming source needs data.mix.mode: interleave (its share of the mix); "
                              "concat reads the sources one after another, whole", field="data.sources[*].weight")
        self.cfg, self.truncate = cfg, truncate
        encoder = ChatEncoder(tokenizer, template, cfg.loss_on, cfg.reasoning, cfg.multi_turn,
                              cfg.special_tokens_in_content)
        self.sources = [SourceStream(i, s, cfg, encoder, truncate) for i, s in enumerate(sources)]
        self.shares = np.asarray([s.weight for s in sources], np.float64) / sum(s.weight for s in sources)
        self.pool: ShardPool | None = None
        self._fingerprint = _fingerprint(cfg, tokenizer, template, [s.files for s in self.sources])
        self._first: Window | None = None

    def open(self) -> ShardPool:
        """The worker processes, started (forked) now where they are not running: a run starts them before its
        training loop's threads do. Every rank reads the whole stream, so by default the ranks on a machine share
        its cores (8 ranks on 16 cores: 2 workers each, not 16)."""
        if self.pool is None:
            workers = self.cfg.num_workers or max(1, cpu_count() // distributed.local_world_size())
            self.pool = ShardPool({s.key: s.job for s in self.sources}, workers, self.cfg.stream.ahead)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def fingerprint(self) -> str:
        """What a saved stream state points into: the sources (their files' sizes and ends), the tokenizer, template,
        cleaning, mix and window."""
        return self._fingerprint

    def start(self) -> dict:
        k = len(self.sources)
        return {"epoch": 0, "window": 0, "cursors": [asdict(Cursor()) for _ in range(k)],
                "taken": asdict(Taken([0] * k, [0] * k, [False] * k)), "skip": 0}

    def _next_source(self, taken: Taken) -> int:
        """concat: the first source not read through; interleave: the one furthest below its share of what the mix
        has taken so far (ties: the first), so the shares hold at every point of the stream, not only on average."""
        if self.cfg.mix.mode == "concat":
            return taken.through.index(False)
        amount = taken.tokens if self.cfg.mix.by == "tokens" else taken.examples
        behind = [a / s for a, s in zip(amount, self.shares.tolist())]
        return behind.index(min(behind))

    def windows(self, state: dict) -> Iterator[Window]:
        """The windows from ``state`` on (a ``start()`` or a window's ``end``), across epochs, forever. The first
        window, made already for plan and the check before step 1, is not made again: the stream goes on from its
        end, as it would have."""
        size = self.cfg.stream.window
        pool = self.open()
        if self._first is not None and state == self.start():
            yield self._first
            state = self._first.end
        while True:
            epoch, number = state["epoch"], state["window"]
            cursors = [Cursor(**c) for c in state["cursors"]]
            taken = Taken(**{k: list(v) for k, v in state["taken"].items()})
            readers = [s.examples(pool, c) for s, c in zip(self.sources, cursors)]
            ended = False
            try:
                while not ended:
                    begin = _state(epoch, number, cursors, taken)
                    picks: list[tuple[int, TokenizedDataset, int]] = []
                    while len(picks) < size:
                        i = self._next_source(taken)
                        got = next(readers[i], None)
                        if got is None:
                            ended, got = self._exhausted(i, taken, cursors, readers)
                            if ended:
                                break
                            if got is None:  # concat: on to the next source
                                continue
                        at, data, j, targets = got
                        cursors[i] = Cursor(at.lap, at.file, at.offset, at.line, j + 1)
                        taken.examples[i] += 1
                        taken.tokens[i] += targets
                        picks.append((i, data, j))
                    end = {**self.start(), "epoch": epoch + 1} if ended else _state(epoch, number + 1, cursors, taken)
                    if picks:
                        yield self._window(picks, begin, end)
                    number += 1
            finally:
                for reader in readers:
                    reader.close()
            state = end

    def _exhausted(self, i: int, taken: Taken, cursors: list[Cursor], readers: list) -> tuple[bool, tuple | None]:
        """Source ``i`` has no example left in this lap: (whether the epoch ends, the next example where the source
        starts again)."""
        taken.through[i] = True
        if self.cfg.mix.mode == "concat":
            return all(taken.through), None
        stop = self.cfg.mix.stop
        if stop == "first_exhausted" or (stop == "all_exhausted" and all(taken.through)):
            return True, None
        if cursors[i].lap == 0 and taken.examples[i] == 0:
            raise DataError("no example left after cleaning, so its share of the mix cannot be met",
                            file=self.sources[i].src.path, field=f"data.sources[{i}]",
                            hint="drop the source, or relax data.clean / data.max_length")
        cursors[i] = Cursor(lap=cursors[i].lap + 1)
        readers[i].close()
        readers[i] = self.sources[i].examples(self.open(), cursors[i])
        got = next(readers[i], None)
        if got is None:
            raise DataError("no example left after cleaning", file=self.sources[i].src.path,
                            field=f"data.sources[{i}]")
        return False, got

    def _window(self, picks: list[tuple[int, TokenizedDataset, int]], begin: dict, end: dict) -> Window:
        """The picked examples as one dataset over their shards' stores (no token copied), deduplicated."""
        stores: dict[int, int] = {}
        parts = []
        for _, data, _ in picks:
            if id(data.store) not in stores:
                stores[id(data.store)] = len(parts)
                parts.append(data)
        bases = np.cumsum([0] + [len(d.store.starts) for d in parts])
        index = np.fromiter((bases[stores[id(d.store)]] + d.index[j] for _, d, j in picks), np.int64, len(picks))
        lengths = np.fromiter((d.lengths[j] for _, d, j in picks), np.int64, len(picks))
        source = np.fromiter((i for i, _, _ in picks), np.int64, len(picks))
        data = TokenizedDataset(TokenStore.merge([d.store for d in parts]), index, lengths)
        dropped = 0
        if self.cfg.clean.dedupe:
            repeat = duplicates(data, source)
            dropped = int(repeat.sum())
            if dropped:
                keep = np.flatnonzero(~repeat)
                data, source = data.select(keep), source[keep]
        return Window(data, source, begin, end, dropped)

    def first_window(self) -> Window:
        """The stream's first window: what plan, doctor and the check before step 1 look at (the workers stopped
        after it: a run starts them again for its loop)."""
        if self._first is None:
            windows = self.windows(self.start())
            try:
                self._first = next(windows)
            finally:
                windows.close()
                self.close()
        return self._first

    def report(self, first: Window) -> PrepReport:
        """The first window's counts, and per source its format, files and share: what a run's report can say before
        the stream is read through."""
        report = PrepReport(examples=len(first.data), duplicates_removed=first.duplicates,
                            truncated=int(np.count_nonzero(first.data.lengths < first.data.store.lengths[first.data.index])))
        for s in self.sources:  # over the shards read for the first window
            for name in ("too_short", "too_long", "dropped_over_length", "no_target_tokens"):
                setattr(report, name, getattr(report, name) + getattr(s.report, name))
        counts = np.bincount(first.source, minlength=len(self.sources))
        for s, share, n in zip(self.sources, self.shares, counts):
            report.sources.append({"path": s.src.path, "format": s.format, "streaming": True, "files": len(s.files),
                                   "seeks_by": seeks_by(s.files[0]),
                                   "weight": s.src.weight, "share_asked": round(float(share), 4),
                                   "examples": int(n), "examples_in_first_window": int(n)})
        return report


def _state(epoch: int, number: int, cursors: list[Cursor] | None, taken: Taken | None) -> dict:
    return {"epoch": epoch, "window": number, "cursors": [asdict(c) for c in cursors or []],
            "taken": asdict(taken) if taken else {}, "skip": 0}


def contributions(state: dict, cfg: DataConfig) -> list[dict]:
    """What each source gave the stream's current epoch up to ``state`` (a window's start): examples, target tokens,
    its share of what the mix counts, and how many times it was read through; a source read through more than
    ``data.mix.warn_repeats`` times is warned about, as a cached mix's is."""
    taken, by = state["taken"], cfg.mix.by
    counted = taken["tokens" if by == "tokens" else "examples"]
    total, shares = sum(counted) or 1, [s.weight / sum(x.weight for x in cfg.sources) for s in cfg.sources]
    out = []
    for i, src in enumerate(cfg.sources):
        laps = state["cursors"][i]["lap"]
        out.append({"path": src.path, "epoch": state["epoch"], "examples": taken["examples"][i],
                    "target_tokens": taken["tokens"][i], "share_of": "target tokens" if by == "tokens" else "examples",
                    "share_asked": round(shares[i], 4), "share_got": round(counted[i] / total, 4), "read_through": laps})
        if laps > cfg.mix.warn_repeats:
            log.warning("%s: read through %d times in this epoch of the stream (its share %.0f%%): it may be learned by "
                        "heart; raise its data or lower its weight (data.mix.warn_repeats %g)", src.path, laps,
                        100 * shares[i], cfg.mix.warn_repeats)
    return out


def _identity(path: Path) -> tuple | None:
    """A streamed file's (size, modification time), or a saved dataset folder's files' ones; None where it is gone."""
    try:
        if path.is_dir():
            return tuple((str(f.relative_to(path)), st.st_size, st.st_mtime_ns)
                         for f in sorted(path.rglob("*")) if f.is_file() for st in (f.stat(),))
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _quick_fingerprint(path: Path) -> str:
    """A file's size, and its first and last MiB hashed (hashing a source larger than the disk whole at every start
    would cost as much as reading it); a folder's files each so."""
    h = hashlib.sha256()
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()


def _fingerprint(cfg: DataConfig, tokenizer, template: ChatTemplate, files: list[list[Path]]) -> str:
    h = hashlib.sha256()
    parts = [CACHE_VERSION, tokenizer_fingerprint(tokenizer), template.source,
             json.dumps({**cfg.model_dump(mode="json", include={"loss_on", "reasoning", "multi_turn", "max_length",
                                                                "truncation", "special_tokens_in_content",
                                                                "on_bad_row", "clean", "mix"}),
                         "window": cfg.stream.window}, sort_keys=True)]  # (not stream.ahead: it changes no order)
    for src, read in zip(cfg.sources, files, strict=True):  # each source's files as its stream reads them
        parts.append(json.dumps(src.model_dump(mode="json"), sort_keys=True))
        parts += [_quick_fingerprint(f) for f in read]
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]
