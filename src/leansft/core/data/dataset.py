"""Sources -> conversations -> cleaned -> tokenised, loss-masked examples, cached on disk, memory-mapped.

Each source is prepared once (in parallel shards, ``shards.py``) into a cache folder keyed by its
content hash, the tokenizer, the template and the masking options (not the number of workers): per
token an int32 id and a one-byte loss code (0 = no loss, 1 = weight 1, else an entry of the source's
weight table), per example its start, length, target count, prompt length, row and content hash. Loading is a memory map. Everything after it (mixing by weight, dedupe
across sources, length filters, truncation, the eval split) makes index arrays over the cache, never
a copy of the tokens, so changing those steps never re-tokenises and a large set costs little memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from leansft.core import distributed
from leansft.core.config import DataConfig, SourceConfig
from leansft.core.data import mixture
from leansft.core.data.content_tokens import special_in_content
from leansft.core.data.masking import IGNORE_INDEX, ChatEncoder, ChatTemplate
from leansft.core.data.shards import EXAMPLE_FILES, TOKEN_FILES, prepare_source
from leansft.core.data.sources import fingerprint
from leansft.core.data.tokenizer import tokenizer_fingerprint
from leansft.core.errors import DataError
from leansft.core.paths import default_cache_dir

log = logging.getLogger("leansft")
# 12: a row with media beside its messages (images: [...], LLaMA-Factory's form) refused, not trained as text;
# 11: every stop token inside an answer refused, special tokens in messages counted (special_tokens_in_content);
# 10: every tool call, argument value and the text beside them must be in the generated turn; 9: a stop token inside an answer, and
# tool calls outside the generated turn, refused; 8: loss spans by the inference contract; 7: thinking in the
# dedupe key; 6: loss codes
CACHE_VERSION = "12"


@dataclass
class TokenStore:
    """The tokenised examples of one or more sources: token arrays per source (part), memory-mapped from
    the cache, and per-example tables over all parts (``starts`` are within the example's part).
    ``mask`` holds loss codes (``shards.py``); ``weights[p][code]`` is the loss weight of a code in part p."""

    ids: list[np.ndarray]
    mask: list[np.ndarray]
    weights: list[np.ndarray]
    part: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    targets: np.ndarray
    prompts: np.ndarray
    rows: np.ndarray
    hashes: np.ndarray
    max_id: int = -1
    images: Any = None  # a vision model's data: each example's images (``core/vision/data.ImageTable``)

    @staticmethod
    def from_shard(shard: dict) -> TokenStore:
        """A prepared shard (``shards._prepare_shard``) in memory: what a streaming source's examples live in."""
        n = len(shard["starts"])
        return TokenStore([shard["input_ids"]], [shard["mask"]],
                          [np.array([0.0, 1.0, *shard["weights"]], dtype=np.float32)], np.zeros(n, np.int32),
                          *(shard[name] for name in EXAMPLE_FILES), max_id=shard["max_id"])

    @staticmethod
    def merge(stores: list[TokenStore]) -> TokenStore:
        """Several sources as one store; part i is source i (the tokens stay where they are)."""
        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(s, name) for s in stores]) if stores else np.zeros(0, np.int64)

        return TokenStore(
            [s.ids[0] for s in stores], [s.mask[0] for s in stores], [s.weights[0] for s in stores],
            np.concatenate([np.full(len(s.starts), i, np.int32) for i, s in enumerate(stores)]) if stores
            else np.zeros(0, np.int32),
            cat("starts"), cat("lengths"), cat("targets"), cat("prompts"), cat("rows"), cat("hashes"),
            max((s.max_id for s in stores), default=-1))


class TokenizedDataset:
    """Examples as index arrays over a ``TokenStore``: example i is stored example ``index[i]``, cut to
    ``lengths[i]`` tokens. Labels are unshifted: the id where the loss code is set, -100 elsewhere."""

    def __init__(self, store: TokenStore, index: np.ndarray | None = None, lengths: np.ndarray | None = None):
        self.store = store
        self.index = np.arange(len(store.starts), dtype=np.int64) if index is None else np.asarray(index, np.int64)
        self.lengths = store.lengths[self.index] if lengths is None else np.asarray(lengths, np.int64)

    @staticmethod
    def from_arrays(input_ids: np.ndarray, labels: np.ndarray, offsets: np.ndarray,
                    rows: np.ndarray | None = None) -> TokenizedDataset:
        """An in-memory dataset from flat arrays (tests, benchmarks)."""
        ids, mask = np.asarray(input_ids, np.int32), (np.asarray(labels) != IGNORE_INDEX).astype(np.uint8)
        weights = np.array([0.0, 1.0], dtype=np.float32)
        offsets = np.asarray(offsets, np.int64)
        starts, lengths = offsets[:-1], np.diff(offsets)
        targets = np.array([mask[a + 1 : b].sum() if b > a else 0 for a, b in zip(offsets[:-1], offsets[1:])],
                           dtype=np.int64)
        prompts = np.array([int(mask[a:b].argmax()) if mask[a:b].any() else b - a
                            for a, b in zip(offsets[:-1], offsets[1:])], dtype=np.int64)
        n = len(starts)
        rows = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
        store = TokenStore([ids], [mask], [weights], np.zeros(n, np.int32), starts, lengths, targets, prompts, rows,
                           np.arange(n, dtype=np.int64), int(ids.max()) if len(ids) else -1)
        return TokenizedDataset(store)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def rows(self) -> np.ndarray:
        return self.store.rows[self.index]

    @property
    def source(self) -> np.ndarray:
        return self.store.part[self.index]

    @property
    def hashes(self) -> np.ndarray:
        return self.store.hashes[self.index]

    def fingerprint(self) -> str:
        """A hash of which conversations, in which order, cut to which lengths: what a saved data position
        points into. Changes when a source file, the tokenizer or template (lengths) or the cleaning changes."""
        h = hashlib.blake2b(digest_size=16)
        for array in (self.hashes, self.lengths, self.store.targets[self.index]):
            h.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
        return h.hexdigest()

    @property
    def max_token_id(self) -> int:
        return self.store.max_id

    def _cut(self) -> np.ndarray:
        return np.flatnonzero(self.lengths < self.store.lengths[self.index])

    @property
    def target_counts(self) -> np.ndarray:
        """Tokens that are predicted (label set, not the first token of the example)."""
        out = self.store.targets[self.index].copy()
        for i in self._cut():  # examples cut at max_length: count what is left
            out[i] = int(np.count_nonzero(self._mask(i)[1:]))
        return out

    @property
    def prompt_lengths(self) -> np.ndarray:
        """Tokens before each example's first loss token (the whole example when none carries loss)."""
        return np.minimum(self.store.prompts[self.index], self.lengths)

    def _mask(self, i: int) -> np.ndarray:
        e = self.index[i]
        a = self.store.starts[e]
        return self.store.mask[self.store.part[e]][a : a + self.lengths[i]]

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        e = self.index[i]
        a = self.store.starts[e]
        ids = self.store.ids[self.store.part[e]][a : a + self.lengths[i]]
        return ids, np.where(self._mask(i) != 0, ids, IGNORE_INDEX).astype(np.int32)

    @property
    def weighted(self) -> bool:
        """Whether some target has a loss weight other than 1."""
        return any(len(w) > 2 for w in self.store.weights)

    def tokens(self, examples: np.ndarray, offsets: np.ndarray, counts: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(ids, labels) as int64 and loss weights as float32 (None when every target weighs 1), flat:
        ``counts[j]`` tokens of example ``examples[j]`` from token ``offsets[j]`` on, gathered from the
        (memory-mapped) store."""
        counts = np.asarray(counts, dtype=np.int64)
        ex = self.index[np.asarray(examples, dtype=np.int64)]
        cu = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        at = np.repeat(self.store.starts[ex] + np.asarray(offsets, np.int64) - cu[:-1], counts) + np.arange(cu[-1])
        part = self.store.part[ex]
        ids = np.empty(int(cu[-1]), dtype=np.int64)
        code = np.empty(int(cu[-1]), dtype=np.uint8)
        weights = np.empty(int(cu[-1]), dtype=np.float32) if self.weighted else None
        for p in np.unique(part):
            sel = slice(None) if len(self.store.ids) == 1 else np.repeat(part == p, counts)
            ids[sel] = self.store.ids[p][at[sel]]
            code[sel] = self.store.mask[p][at[sel]]
            if weights is not None:
                weights[sel] = self.store.weights[p][code[sel]]
        return ids, np.where(code != 0, ids, IGNORE_INDEX), weights

    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        """Every example's (ids, labels), concatenated: a copy, for inspection and tests."""
        return self.tokens(np.arange(len(self)), np.zeros(len(self), np.int64), self.lengths)[:2]

    def select(self, idx: np.ndarray, max_length: int | None = None) -> TokenizedDataset:
        """Examples ``idx`` (repeats allowed), each cut at ``max_length`` tokens: index arrays, no copy."""
        idx = np.asarray(idx, dtype=np.int64)
        lengths = self.lengths[idx]
        if max_length is not None:
            lengths = np.minimum(lengths, max_length)
        return TokenizedDataset(self.store, self.index[idx], lengths)


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
        cfg.special_tokens_in_content,
        *([json.dumps(src.columns, sort_keys=True)] if src.columns else []),  # (keys without columns as before)
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def _open(folder: Path, meta: dict) -> TokenStore:
    """The cached arrays of one source, memory-mapped."""
    def tokens(name: str, dtype) -> np.ndarray:
        path = folder / f"{name}.bin"
        return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)

    per_example = {n: np.load(folder / f"{n}.npy", mmap_mode="r") for n in EXAMPLE_FILES}
    n = len(per_example["starts"])
    weights = np.array([0.0, 1.0, *meta.get("weights", [])], dtype=np.float32)
    return TokenStore([tokens("input_ids", TOKEN_FILES["input_ids"])], [tokens("mask", TOKEN_FILES["mask"])],
                      [weights], np.zeros(n, np.int32), **per_example, max_id=meta.get("max_token_id", -1))


def load_source(
    src: SourceConfig, cfg: DataConfig, tokenizer, template: ChatTemplate, cache_dir: Path | None = None,
    tokenizer_fp: str | None = None,
) -> tuple[TokenStore, dict]:
    """Tokenised examples of one source, from the cache when the key matches. Returns (store, meta).
    ``tokenizer_fp``: ``tokenizer_fingerprint(tokenizer)`` where the caller has it (it serialises the whole
    tokenizer: 0.1-0.4 s of CPU for a real vocabulary)."""
    cache_root = Path(cache_dir or cfg.cache_dir or default_cache_dir()) / "tokenized"
    key = _cache_key(src, cfg, tokenizer_fp or tokenizer_fingerprint(tokenizer), template)
    folder = cache_root / key
    if (folder / "meta.json").exists():
        meta = json.loads((folder / "meta.json").read_text())
        meta["cache"] = "hit"
        _warn_loaded(meta)
        return _open(folder, meta), meta
    meta: dict = {"path": src.path}
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=".tmp-"))
    try:
        encoder = ChatEncoder(tokenizer, template, cfg.loss_on, cfg.reasoning, cfg.multi_turn,
                              cfg.special_tokens_in_content)
        prepare_source(src, cfg, encoder, tmp, meta)
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.rename(tmp, folder)
        except OSError:  # another process (rank) won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta["cache"] = "miss"
    _warn_loaded(meta)
    return _open(folder, meta), meta


def _warn_loaded(meta: dict) -> None:
    """Rows ``on_bad_row: skip`` left out are data the user meant to train on, and special tokens written in
    messages train as the tokens themselves: said on every load, not only when the cache is written."""
    if distributed.rank() != 0:
        return
    if meta.get("bad_rows"):
        log.warning("%d rows skipped (data.on_bad_row: skip), e.g. %s", meta["bad_rows"],
                    meta["bad_row_examples"][0].split("\n")[0])
    found = special_in_content(meta.get("template", {}))
    if found:
        log.warning("%s: %s; they train as the tokens themselves (data.special_tokens_in_content: escape trains "
                    "them as plain text, refuse refuses them, allow says nothing)", meta["path"], found)


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
    ``data.mix.mode`` concat repeats or thins each source by its weight first; interleave cleans every source whole,
    then draws each one's share of the mix (``mixture.mix``).

    ``truncate=False`` keeps every example whole: for planning, and for strategies that split long
    examples themselves."""
    sources = cfg.sources if sources is None else sources
    if not sources:
        raise DataError("no data sources given", field="data.sources")
    rng = np.random.default_rng(seed)
    report = PrepReport()
    interleave = cfg.mix.mode == "interleave"
    stores, picks, base = [], [], 0
    tokenizer_fp = tokenizer_fingerprint(tokenizer)  # once for every source
    for src in sources:
        store, meta = load_source(src, cfg, tokenizer, template, tokenizer_fp=tokenizer_fp)
        pick = np.arange(len(store.starts)) if interleave else _weighted_indices(len(store.starts), src.weight, rng)
        report.sources.append({**meta, "weight": src.weight, "examples": len(pick)})
        stores.append(store)
        picks.append(pick + base)
        base += len(store.starts)
    data = TokenizedDataset(TokenStore.merge(stores), np.concatenate(picks))
    whole, data = clean(data, cfg, report, truncate)
    if interleave and len(data):
        chosen, mixed = mixture.mix(data.source, data.target_counts, [s.weight for s in sources],
                                    [str(s.path) for s in sources], cfg.mix, rng)
        data = data.select(chosen)
        for entry, contributed in zip(report.sources, mixed, strict=True):
            entry.update(contributed)
    report.examples = len(data)
    if len(data) == 0:
        raise _nothing_left(report, cfg, whole, truncate)
    return data, report


def duplicates(data: TokenizedDataset, source: np.ndarray) -> np.ndarray:
    """Which examples repeat a text seen before. A repeat a weight or a mix made is intended: a text's first
    (source, row) owns it, and copies of that same row stay, while the same text at any other row is a duplicate."""
    _, owner_of, inverse = np.unique(data.hashes, return_index=True, return_inverse=True)
    owner = owner_of[inverse]
    return ~((source == source[owner]) & (data.rows == data.rows[owner]))


def clean(data: TokenizedDataset, cfg: DataConfig, report: PrepReport, truncate: bool = True, *,
          dedupe: bool | None = None) -> tuple[TokenizedDataset, TokenizedDataset]:
    """(the kept examples whole, the kept examples cut to ``cfg.max_length`` and with a target token left): the
    cleaning every run applies, the cached one over the whole data, a streaming one shard by shard (``stream.py``,
    ``dedupe=False``: it deduplicates each window); the counts go into ``report``."""
    keep = np.ones(len(data), dtype=bool)
    if cfg.clean.dedupe if dedupe is None else dedupe:
        keep &= ~duplicates(data, data.source)
        report.duplicates_removed += int((~keep).sum())
    lengths = data.lengths
    short = keep & (lengths < cfg.clean.min_tokens)
    report.too_short += int(short.sum())
    keep &= ~short
    if cfg.clean.max_tokens is not None:
        long_ = keep & (lengths > cfg.clean.max_tokens)
        report.too_long += int(long_.sum())
        keep &= ~long_
    over = keep & (lengths > cfg.max_length) if truncate else np.zeros(len(data), dtype=bool)
    if cfg.truncation == "drop":
        report.dropped_over_length += int(over.sum())
        keep &= ~over
    else:
        report.truncated += int(over.sum())
    whole = data.select(np.flatnonzero(keep))
    data = data.select(np.flatnonzero(keep), max_length=cfg.max_length if truncate else None)
    empty = data.target_counts == 0
    report.no_target_tokens += int(empty.sum())
    if empty.any():
        data = data.select(np.flatnonzero(~empty))
    return whole, data


def _nothing_left(report: PrepReport, cfg: DataConfig, whole: TokenizedDataset, truncate: bool) -> DataError:
    """The error when cleaning left nothing: the counts, the setting that removed them, and the number to use."""
    read = sum(src["examples"] for src in report.sources)
    removed = [f"{n:,} {what}" for n, what in (
        (report.duplicates_removed, "duplicates (data.clean.dedupe)"),
        (report.too_short, f"shorter than data.clean.min_tokens {cfg.clean.min_tokens}"),
        (report.too_long, f"longer than data.clean.max_tokens {cfg.clean.max_tokens}"),
        (report.dropped_over_length, f"longer than data.max_length {cfg.max_length} (data.truncation: drop)"),
        (report.no_target_tokens, "without a target token" + (
            f" once cut at data.max_length {cfg.max_length}" if truncate and report.truncated else ""))) if n]
    message = f"no examples left: {read:,} read; removed " + "; ".join(removed)
    hint = "check the data.clean settings"
    if len(whole):
        prompts, lengths = whole.prompt_lengths, whole.lengths
        p99 = int(np.percentile(lengths, 99))
        if truncate and cfg.max_length <= int(prompts.min()) or report.dropped_over_length:
            message += (f". Every prompt is at least {int(prompts.min()):,} tokens long (examples: median "
                        f"{int(np.median(lengths)):,}, p99 {p99:,})")
            hint = (f"raise data.max_length to about {p99 + 1:,} (keeps 99% of the examples whole; `leansft plan` "
                    "recommends one)")
    elif report.duplicates_removed or report.too_short or report.too_long:
        hint = "every example was removed by cleaning: relax data.clean (dedupe, min_tokens, max_tokens)"
    return DataError(message, field="data.max_length" if "max_length" in hint else "data.clean", hint=hint)
