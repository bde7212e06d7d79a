"""Sources -> conversations -> cleaned -> tokenised, loss-masked examples, cached on disk.

Each source is tokenised once and cached under a key made of its content hash, the tokenizer, the
template and the masking options; the cache holds flat int32 arrays plus offsets, so loading it is a
memory map. Cheap steps (weights, dedupe across sources, length filters, truncation) run after the
cache, so changing them never re-tokenises.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from leansft.core.config import DataConfig, SourceConfig
from leansft.core.data.clean import content_hash, scrub
from leansft.core.data.formats import Conversation, convert_row, detect_format
from leansft.core.data.masking import IGNORE_INDEX, ChatEncoder, ChatTemplate
from leansft.core.data.sources import fingerprint, read_rows
from leansft.core.data.tokenizer import tokenizer_fingerprint
from leansft.core.errors import DataError, LeanSFTError
from leansft.core.paths import default_cache_dir

log = logging.getLogger("leansft")
CACHE_VERSION = "5"  # 5: reasoning, per-turn expansion, per-message loss flags
BATCH = 1024


@dataclass
class TokenizedDataset:
    """Examples as flat arrays. ``labels`` are unshifted and aligned with ``input_ids``."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    rows: np.ndarray
    source: np.ndarray
    hashes: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def target_counts(self) -> np.ndarray:
        """Tokens that are predicted (label set, not the first token of the example)."""
        mask = (self.labels != IGNORE_INDEX).astype(np.int64)
        mask[self.offsets[:-1][self.lengths > 0]] = 0
        csum = np.concatenate([[0], np.cumsum(mask)])
        return csum[self.offsets[1:]] - csum[self.offsets[:-1]]

    @property
    def prompt_lengths(self) -> np.ndarray:
        """Tokens before each example's first loss token (the whole example when none carries loss)."""
        targets = np.flatnonzero(self.labels != IGNORE_INDEX)
        owner = np.searchsorted(self.offsets, targets, side="right") - 1
        examples, first = np.unique(owner, return_index=True)
        out = self.lengths.copy()
        out[examples] = targets[first] - self.offsets[examples]
        return out

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.input_ids[a:b], self.labels[a:b]

    def select(self, idx: np.ndarray, max_length: int | None = None) -> TokenizedDataset:
        """Gather examples ``idx`` (repeats allowed), cutting each at ``max_length`` tokens."""
        idx = np.asarray(idx, dtype=np.int64)
        starts = self.offsets[:-1][idx]
        lens = self.lengths[idx]
        if max_length is not None:
            lens = np.minimum(lens, max_length)
        new_off = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lens, out=new_off[1:])
        gather = np.repeat(starts - new_off[:-1], lens) + np.arange(new_off[-1])
        return TokenizedDataset(
            self.input_ids[gather], self.labels[gather], new_off, self.rows[idx], self.source[idx], self.hashes[idx]
        )

    @staticmethod
    def concat(parts: list[TokenizedDataset]) -> TokenizedDataset:
        offs, base = [np.zeros(1, np.int64)], 0
        for p in parts:
            offs.append(p.offsets[1:] + base)
            base += int(p.offsets[-1])
        def cat(name: str, dtype) -> np.ndarray:
            return np.concatenate([getattr(p, name) for p in parts]).astype(dtype) if parts else np.zeros(0, dtype)

        return TokenizedDataset(
            cat("input_ids", np.int32), cat("labels", np.int32), np.concatenate(offs),
            cat("rows", np.int64), cat("source", np.int32), cat("hashes", np.int64),
        )


@dataclass
class PrepReport:
    """What preparation did, as counts; printed by the CLI and stored in plan/run outputs."""

    sources: list[dict] = field(default_factory=list)
    duplicates_removed: int = 0
    too_short: int = 0
    too_long: int = 0
    truncated: int = 0
    dropped_over_length: int = 0
    no_target_tokens: int = 0
    examples: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _cache_key(src: SourceConfig, cfg: DataConfig, tok_fp: str, template: ChatTemplate) -> str:
    h = hashlib.sha256()
    for part in (
        CACHE_VERSION, fingerprint(src.path), src.format, src.split, tok_fp, template.source, cfg.loss_on,
        cfg.reasoning, cfg.multi_turn, str(cfg.clean.pii_scrub), cfg.on_bad_row, str(cfg.clean.drop_no_assistant),
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def _convert_source(src: SourceConfig, cfg: DataConfig, meta: dict) -> list[Conversation]:
    fmt = src.format
    convs: list[Conversation] = []
    bad: list[str] = []
    pii: Counter = Counter()
    no_assistant = 0
    for number, row in read_rows(src.path, src.split):
        try:
            if fmt == "auto":
                fmt = detect_format(row, src.path, number)
                log.info("%s: detected format '%s' from row %d", src.path, fmt, number)
            conv = convert_row(row, fmt, src.path, number)
        except DataError as err:
            if cfg.on_bad_row == "error":
                raise
            bad.append(str(err))
            continue
        if cfg.clean.drop_no_assistant and not conv.has_assistant:
            no_assistant += 1
            continue
        if cfg.clean.pii_scrub:
            conv = scrub(conv, pii)
        convs.append(conv)
    if not convs and not bad and no_assistant == 0:
        raise DataError("no rows (empty data)", file=src.path)
    meta.update(format=fmt, rows_read=len(convs) + len(bad) + no_assistant, bad_rows=len(bad),
                bad_row_examples=bad[:5], no_assistant=no_assistant, pii_replaced=dict(pii))
    return convs


def _tokenize_source(src: SourceConfig, cfg: DataConfig, encoder: ChatEncoder, meta: dict) -> TokenizedDataset:
    convs = _convert_source(src, cfg, meta)
    ids_parts, lab_parts, lens, owner = [], [], [], []
    for i in range(0, len(convs), BATCH):
        try:
            for k, examples in enumerate(encoder.encode(convs[i : i + BATCH]), start=i):
                for ids, labels in examples:
                    ids_parts.append(ids)
                    lab_parts.append(labels)
                    lens.append(len(ids))
                    owner.append(k)
        except LeanSFTError as err:
            if err.file is None:
                err.file = src.path
            raise type(err)(err.message, file=err.file, row=err.row, field=err.field, hint=err.hint) from None
    meta["template"] = dict(encoder.stats)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return TokenizedDataset(
        np.concatenate(ids_parts).astype(np.int32) if ids_parts else np.zeros(0, np.int32),
        np.concatenate(lab_parts).astype(np.int32) if lab_parts else np.zeros(0, np.int32),
        offsets,
        np.asarray([convs[k].row for k in owner], dtype=np.int64),
        np.zeros(len(owner), dtype=np.int32),
        np.asarray([content_hash(convs[k]) for k in owner], dtype=np.int64),  # shared by a conversation's turns
    )


_ARRAYS = ("input_ids", "labels", "offsets", "rows", "source", "hashes")


def load_source(
    src: SourceConfig, cfg: DataConfig, tokenizer, template: ChatTemplate, cache_dir: Path | None = None
) -> tuple[TokenizedDataset, dict]:
    """Tokenised examples of one source, from the cache when the key matches. Returns (data, meta)."""
    cache_root = Path(cache_dir or cfg.cache_dir or default_cache_dir()) / "tokenized"
    key = _cache_key(src, cfg, tokenizer_fingerprint(tokenizer), template)
    folder = cache_root / key
    if (folder / "meta.json").exists():
        meta = json.loads((folder / "meta.json").read_text())
        arrays = {n: np.load(folder / f"{n}.npy", mmap_mode="r") for n in _ARRAYS}
        meta["cache"] = "hit"
        return TokenizedDataset(**arrays), meta
    meta: dict = {"path": src.path}
    data = _tokenize_source(src, cfg, ChatEncoder(tokenizer, template, cfg.loss_on, cfg.reasoning, cfg.multi_turn),
                            meta)
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=".tmp-"))
    try:
        for n in _ARRAYS:
            np.save(tmp / f"{n}.npy", getattr(data, n))
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.rename(tmp, folder)
        except OSError:  # another process (rank) won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta["cache"] = "miss"
    return data, meta


def _weighted_indices(n: int, weight: float, rng: np.random.Generator) -> np.ndarray:
    whole = int(weight)
    idx = [np.tile(np.arange(n), whole)] if whole else []
    rest = int(round((weight - whole) * n))
    if rest:
        idx.append(np.sort(rng.choice(n, size=rest, replace=False)))
    return np.concatenate(idx) if idx else np.zeros(0, np.int64)


def build_dataset(
    cfg: DataConfig, tokenizer, template: ChatTemplate, *, seed: int = 0, sources: list[SourceConfig] | None = None,
    truncate: bool = True,
) -> tuple[TokenizedDataset, PrepReport]:
    """All sources mixed by weight, deduplicated, length-filtered and (``truncate``) cut to ``cfg.max_length``.

    ``truncate=False`` keeps every example whole: for planning, and for strategies that split long
    examples themselves."""
    sources = cfg.sources if sources is None else sources
    if not sources:
        raise DataError("no data sources given", field="data.sources")
    rng = np.random.default_rng(seed)
    report = PrepReport()
    parts = []
    for si, src in enumerate(sources):
        data, meta = load_source(src, cfg, tokenizer, template)
        data = data.select(_weighted_indices(len(data), src.weight, rng))
        data.source[:] = si
        report.sources.append({**meta, "weight": src.weight, "examples": len(data)})
        parts.append(data)
    data = TokenizedDataset.concat(parts)
    keep = np.ones(len(data), dtype=bool)
    if cfg.clean.dedupe:
        # A repeat made by a weight > 1 is intended: a text's first (source, row) owns it, and copies of
        # that same row stay, while the same text at any other row is a duplicate.
        _, owner_of, inverse = np.unique(data.hashes, return_index=True, return_inverse=True)
        owner = owner_of[inverse]
        keep &= (data.source == data.source[owner]) & (data.rows == data.rows[owner])
        report.duplicates_removed = int((~keep).sum())
    lengths = data.lengths
    short = keep & (lengths < cfg.clean.min_tokens)
    report.too_short = int(short.sum())
    keep &= ~short
    if cfg.clean.max_tokens is not None:
        long_ = keep & (lengths > cfg.clean.max_tokens)
        report.too_long = int(long_.sum())
        keep &= ~long_
    over = keep & (lengths > cfg.max_length) if truncate else np.zeros(len(data), dtype=bool)
    if cfg.truncation == "drop":
        report.dropped_over_length = int(over.sum())
        keep &= ~over
    else:
        report.truncated = int(over.sum())
    data = data.select(np.flatnonzero(keep), max_length=cfg.max_length if truncate else None)
    empty = data.target_counts == 0
    report.no_target_tokens = int(empty.sum())
    if empty.any():
        data = data.select(np.flatnonzero(~empty))
    report.examples = len(data)
    if len(data) == 0:
        raise DataError("no examples left after cleaning", field="data", hint=json.dumps(report.as_dict())[:400])
    return data, report
