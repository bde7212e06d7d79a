"""Length statistics, a recommended max_length, and what each batching strategy does with the lengths."""

from __future__ import annotations

import numpy as np

from leansft.core.batching.packing import PACKED, STRATEGIES, micro_batches, pack


def length_stats(lengths: np.ndarray) -> dict[str, float]:
    lengths = np.asarray(lengths, dtype=np.float64)
    if len(lengths) == 0:
        raise ValueError("no examples")
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {"mean": float(lengths.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99),
            "max": int(lengths.max())}


def recommend_max_length(lengths: np.ndarray) -> int:
    """Strictly above p99, rounded up to a multiple of 64 (up to 1024) or 128 (beyond)."""
    p99 = float(np.percentile(np.asarray(lengths, dtype=np.float64), 99))
    step = 64 if p99 < 1024 else 128
    return int((int(p99) // step + 1) * step)


def strategy_table(
    lengths: np.ndarray, max_length: int, batch_size: int = 8, window: int = 512, seed: int = 0,
    strategies: tuple[str, ...] = STRATEGIES, tokens_per_micro_batch: int | None = None,
) -> dict[str, dict]:
    """For each strategy, what ``leansft train`` does with these lengths (the same packer, seed and micro-batch
    grouping as ``recipe.batches.Batcher``'s first epoch): real-token share of the positions computed (1 - the
    padding share train logs), attention work vs. each example alone, rows, micro-batches, cuts.

    Attention work is the sum of L^2 over the blocks actually attended (padded batch: rows x longest^2;
    packed row with varlen attention: each piece alone) divided by the sum of each example's length^2.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    ideal = float(np.sum(lengths.astype(np.float64) ** 2)) or 1.0
    out = {}
    for s in strategies:
        plan = pack(s, lengths, max_length, batch_size=batch_size, window=window, seed=seed)
        slots = int(plan.slots.sum())
        rows = plan.num_rows
        if s in PACKED and tokens_per_micro_batch:
            order = np.random.default_rng(seed).permutation(rows)
            rows = len(micro_batches(plan, tokens_per_micro_batch, order))
        out[s] = {
            "real_token_share": float(plan.length.sum() / slots) if slots else 0.0,
            "attention_work_ratio": plan.attention_work / ideal,
            "rows": plan.num_rows,
            "micro_batches": rows,
            "truncated": plan.truncated,
            "split": plan.split,
        }
    return out


def lognormal_lengths(n: int, median: float, sigma: float, cap: int, seed: int = 0) -> np.ndarray:
    """Synthetic example lengths: lognormal around ``median``, rounded, clipped to [1, cap]."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 1, cap).astype(np.int64)


def plan_summary(
    lengths: np.ndarray, target_counts: np.ndarray | None, max_length: int, batch_size: int = 8,
    window: int = 512, seed: int = 0, tokens_per_micro_batch: int | None = None,
) -> dict:
    """The numbers ``leansft plan`` and ``leansft simulate`` print and write as JSON."""
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens = int(lengths.sum())
    targets = int(target_counts.sum()) if target_counts is not None else None
    return {
        "examples": int(len(lengths)),
        "tokens": tokens,
        "target_tokens": targets,
        "loss_share": (targets / tokens) if targets is not None and tokens else None,
        "lengths": length_stats(lengths),
        "max_length": int(max_length),
        "truncated": int((lengths > max_length).sum()),
        "recommended_max_length": recommend_max_length(lengths),
        "batch_size": batch_size,
        "tokens_per_micro_batch": tokens_per_micro_batch,
        "strategies": strategy_table(lengths, max_length, batch_size, window, seed,
                                     tokens_per_micro_batch=tokens_per_micro_batch),
    }


def window_fill(stream, max_length: int, windows: int = 4) -> dict:
    """What packing a window at a time costs a stream (``core/data/stream.py``): how full best-fit rows are over its
    first ``windows`` windows packed one by one, against the same examples packed together."""
    lengths, rows, tokens = [], 0, 0
    made = stream.windows(stream.start())
    try:
        for _ in range(windows):
            window = next(made)
            if window.start["epoch"] > 0:  # the stream was read through
                break
            cut = np.minimum(window.data.lengths, max_length)
            plan = pack("bfd", cut, max_length)
            rows, tokens = rows + plan.num_rows, tokens + int(cut.sum())
            lengths.append(cut)
    finally:
        made.close()
        stream.close()
    together = pack("bfd", np.concatenate(lengths), max_length)
    return {"window": stream.cfg.stream.window, "windows": len(lengths), "examples": int(sum(map(len, lengths))),
            "fill_per_window": tokens / max(rows * max_length, 1), "fill_together": together.fill}
