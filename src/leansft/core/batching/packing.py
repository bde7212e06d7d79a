"""Packers: lengths in, rows (or padded batches) out. numpy only; no model, no tokens.

A plan is a list of rows, each a list of pieces ``(example, start, length)``. Packed strategies
(bfd, bfd_split, wrapped) fill rows of ``max_length`` tokens that are run padding-free with varlen
attention; sorted and padded make ordinary padded batches of ``batch_size`` examples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from leansft.core.config import PACKED_STRATEGIES as PACKED
from leansft.core.config import STRATEGIES


@dataclass
class PackPlan:
    strategy: str
    max_length: int
    row_offsets: np.ndarray  # (rows + 1,) into the piece arrays
    example: np.ndarray  # piece -> example index
    start: np.ndarray  # piece -> first token inside the example
    length: np.ndarray  # piece -> tokens
    truncated: int = 0  # examples cut at max_length (their tail is lost)
    split: int = 0  # examples spread over several pieces

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def row_tokens(self) -> np.ndarray:
        csum = np.concatenate([[0], np.cumsum(self.length)])
        return csum[self.row_offsets[1:]] - csum[self.row_offsets[:-1]]

    @property
    def row_sizes(self) -> np.ndarray:
        return np.diff(self.row_offsets)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = self.row_offsets[i], self.row_offsets[i + 1]
        return self.example[a:b], self.start[a:b], self.length[a:b]

    @property
    def slots(self) -> np.ndarray:
        """Tensor positions computed per row, as training counts them (``padding_share = 1 - real / slots``): a
        packed row's own tokens (padding-free: its pieces are concatenated, nothing pads it to max_length), rows x
        longest for a padded batch."""
        if self.strategy in PACKED:
            return self.row_tokens
        longest = np.maximum.reduceat(self.length, self.row_offsets[:-1]) if self.num_rows else np.zeros(0, np.int64)
        return longest * self.row_sizes

    @property
    def fill(self) -> float:
        """A packed plan's tokens over its rows' capacity (rows x max_length): how tightly the packer fills them."""
        return float(self.length.sum() / max(self.num_rows * self.max_length, 1))

    @property
    def attention_work(self) -> float:
        """Sum of attention cost computed (L^2 per segment attended as one block)."""
        if self.strategy in PACKED:  # varlen: each piece attends to itself only
            return float(np.sum(self.length.astype(np.float64) ** 2))
        longest = np.maximum.reduceat(self.length, self.row_offsets[:-1]).astype(np.float64)
        return float(np.sum(self.row_sizes * longest**2))


def _check(lengths: np.ndarray, max_length: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if lengths.ndim != 1 or (lengths < 0).any():
        raise ValueError("lengths must be a 1-D array of non-negative integers")
    return lengths


def bfd_assign(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Best-fit decreasing: row id for every item (each <= capacity), and the number of rows.

    Rows are kept in buckets by remaining capacity. Items of equal size are placed in bulk: best fit
    puts ``r // L`` of them in a row with ``r`` free (after each one that row is the tightest fit),
    so the loop runs once per (distinct size, bucket) pair rather than once per item.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    n = len(sizes)
    row_of = np.empty(n, dtype=np.int64)
    if n == 0:
        return row_of, 0
    order = np.argsort(-sizes, kind="stable")
    ssorted = sizes[order]
    buckets: list[list[int]] = [[] for _ in range(capacity + 1)]
    nonempty = np.zeros(capacity + 2, dtype=bool)
    nonempty[capacity + 1] = True  # sentinel: "open a new row"
    n_rows = 0
    starts = np.flatnonzero(np.r_[True, ssorted[1:] != ssorted[:-1]])
    ends = np.r_[starts[1:], n]
    for s, e in zip(starts.tolist(), ends.tolist()):
        size = int(ssorted[s])
        pos = s
        if size == 0:  # empty items go anywhere; give them row 0 (or a new one)
            row_of[order[s:e]] = 0
            n_rows = max(n_rows, 1)
            continue
        while pos < e:
            count = e - pos
            r = size + int(np.argmax(nonempty[size:]))
            if r == capacity + 1:  # no open row fits: open new ones, q items each
                q = capacity // size
                used = -(-count // q)
                row_of[order[pos:e]] = n_rows + np.arange(count) // q
                full_rem = capacity - q * size
                buckets[full_rem].extend(range(n_rows, n_rows + used - 1))
                last = count - (used - 1) * q
                buckets[capacity - last * size].append(n_rows + used - 1)
                nonempty[full_rem] |= used > 1
                nonempty[capacity - last * size] = True
                n_rows += used
                pos = e
                continue
            q = r // size
            rows_r = buckets[r]
            used = min(len(rows_r), -(-count // q))
            take = rows_r[len(rows_r) - used :]
            del rows_r[len(rows_r) - used :]
            nonempty[r] = bool(rows_r)
            k = min(count, used * q)
            row_of[order[pos : pos + k]] = np.asarray(take, dtype=np.int64)[np.arange(k) // q]
            last = k - (used - 1) * q
            if used > 1:
                buckets[r - q * size].extend(take[:-1])
                nonempty[r - q * size] = True
            buckets[r - last * size].append(take[-1])
            nonempty[r - last * size] = True
            pos += k
    return row_of, n_rows


def _plan_from_rows(strategy, max_length, row_of, n_rows, example, start, length, **counts) -> PackPlan:
    perm = np.lexsort((np.arange(len(row_of)), row_of))
    row_offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of, minlength=n_rows), out=row_offsets[1:])
    return PackPlan(strategy, max_length, row_offsets, example[perm], start[perm], length[perm], **counts)


def _pieces_split(lengths: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    chunks = np.maximum(1, -(-lengths // max_length))
    example = np.repeat(np.arange(len(lengths)), chunks)
    first = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    start = (np.arange(len(example)) - np.repeat(first, chunks)) * max_length
    return example, start, np.minimum(max_length, lengths[example] - start)


def bfd(lengths, max_length: int) -> PackPlan:
    """Best-fit decreasing; examples longer than a row are truncated to ``max_length``."""
    lengths = _check(lengths, max_length)
    clipped = np.minimum(lengths, max_length)
    row_of, n_rows = bfd_assign(clipped, max_length)
    idx = np.arange(len(lengths))
    return _plan_from_rows(
        "bfd", max_length, row_of, n_rows, idx, np.zeros_like(idx), clipped, truncated=int((lengths > max_length).sum())
    )


def bfd_split(lengths, max_length: int) -> PackPlan:
    """As bfd, but an over-long example is split into ``max_length`` pieces instead of truncated."""
    lengths = _check(lengths, max_length)
    example, start, length = _pieces_split(lengths, max_length)
    row_of, n_rows = bfd_assign(length, max_length)
    return _plan_from_rows(
        "bfd_split", max_length, row_of, n_rows, example, start, length, split=int((lengths > max_length).sum())
    )


def wrapped(lengths, max_length: int, seed: int = 0) -> PackPlan:
    """Concatenate (seeded order) and cut rows at exactly ``max_length``; examples are cut mid-sequence."""
    lengths = _check(lengths, max_length)
    order = np.random.default_rng(seed).permutation(len(lengths))
    ordered = lengths[order]
    ex_start = np.concatenate([[0], np.cumsum(ordered)])
    total = int(ex_start[-1])
    cuts = np.union1d(ex_start, np.arange(0, total, max_length))
    cuts = cuts[cuts < total]
    seg_len = np.diff(np.append(cuts, total))
    seg_ex = np.searchsorted(ex_start, cuts, side="right") - 1
    keep = seg_len > 0
    cuts, seg_len, seg_ex = cuts[keep], seg_len[keep], seg_ex[keep]
    row_of = cuts // max_length
    n_rows = int(-(-total // max_length))
    ends = ex_start[1:] - 1
    cut_examples = int(((ex_start[:-1] // max_length) != (ends // max_length))[ordered > 0].sum())
    return _plan_from_rows(
        "wrapped", max_length, row_of, n_rows, order[seg_ex], cuts - ex_start[seg_ex], seg_len, split=cut_examples
    )


def _batches(strategy, order: np.ndarray, lengths: np.ndarray, batch_size: int, max_length: int) -> PackPlan:
    """Consecutive examples of ``order`` in batches of ``batch_size``, each example cut at ``max_length``."""
    n = len(order)
    n_rows = -(-n // batch_size)
    return PackPlan(
        strategy, max_length, np.minimum(np.arange(n_rows + 1) * batch_size, n), order,
        np.zeros(n, dtype=np.int64), np.minimum(lengths[order], max_length),
        truncated=int((lengths > max_length).sum()),
    )


def padded(lengths, max_length: int, batch_size: int, seed: int = 0) -> PackPlan:
    """Random batches of ``batch_size`` examples, each padded to its longest member."""
    lengths = _check(lengths, max_length)
    order = np.random.default_rng(seed).permutation(len(lengths))
    return _batches("padded", order, lengths, batch_size, max_length)


def sorted_batches(lengths, max_length: int, batch_size: int, window: int = 512, seed: int = 0) -> PackPlan:
    """Shuffle, sort by length inside windows of ``window`` examples, batch, then shuffle the batches."""
    lengths = _check(lengths, max_length)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    parts = []
    for w in range(0, len(order), window):
        chunk = order[w : w + window]
        parts.append(chunk[np.argsort(-lengths[chunk], kind="stable")])
    order = np.concatenate(parts) if parts else order
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    batches = [batches[i] for i in rng.permutation(len(batches))]
    order = np.concatenate(batches) if batches else order
    plan = _batches("sorted", order, lengths, batch_size, max_length)
    # batches were reordered whole, so offsets follow the batch sizes, not fixed strides
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    plan.row_offsets = np.concatenate([[0], np.cumsum(sizes)])
    return plan


def pack(strategy: str, lengths, max_length: int, *, batch_size: int = 8, window: int = 512, seed: int = 0) -> PackPlan:
    if strategy == "bfd":
        return bfd(lengths, max_length)
    if strategy == "bfd_split":
        return bfd_split(lengths, max_length)
    if strategy == "wrapped":
        return wrapped(lengths, max_length, seed)
    if strategy == "sorted":
        return sorted_batches(lengths, max_length, batch_size, window, seed)
    if strategy == "padded":
        return padded(lengths, max_length, batch_size, seed)
    raise ValueError(f"unknown strategy '{strategy}'; expected one of {', '.join(STRATEGIES)}")


def micro_batches(plan: PackPlan, tokens_per_micro_batch: int, rows: np.ndarray | None = None) -> list[np.ndarray]:
    """Group consecutive packed rows into micro-batches of at most ``tokens_per_micro_batch`` tokens."""
    rows = np.arange(plan.num_rows) if rows is None else np.asarray(rows)
    tokens = plan.row_tokens[rows]
    groups, cur, used = [], [], 0
    for r, t in zip(rows.tolist(), tokens.tolist()):
        if cur and used + t > tokens_per_micro_batch:
            groups.append(np.asarray(cur))
            cur, used = [], 0
        cur.append(r)
        used += t
    if cur:
        groups.append(np.asarray(cur))
    return groups


def deal_to_ranks(row_tokens: np.ndarray, world_size: int) -> list[np.ndarray]:
    """Deal rows to ranks: equal row counts (within one), token loads within one row's tokens.

    Rows go out largest first, a round at a time, the largest row of a round to the lightest rank.
    """
    row_tokens = np.asarray(row_tokens, dtype=np.int64)
    order = np.argsort(-row_tokens, kind="stable")
    load = np.zeros(world_size, dtype=np.int64)
    out: list[list[int]] = [[] for _ in range(world_size)]
    for r0 in range(0, len(order), world_size):
        rnd = order[r0 : r0 + world_size]
        ranks = np.argsort(load, kind="stable")[: len(rnd)]
        for row, rank in zip(rnd.tolist(), ranks.tolist()):
            out[rank].append(row)
            load[rank] += row_tokens[row]
    return [np.asarray(o, dtype=np.int64) for o in out]
