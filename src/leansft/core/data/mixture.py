"""Sources mixed by share (``data.mix.mode: interleave``): how many examples of each source go into the mix so that
each source holds its share of the target tokens (or of the examples), after cleaning and truncation.

The mix is a multiset of examples, drawn once from the run's seed (the same on every rank and after a resume: the
data fingerprint covers it); the batcher then shuffles it with the rest of the run's order. A source's count ``c``
over its ``n`` examples is each example ``c // n`` times and ``c % n`` more drawn without replacement, so a share
is met in expectation and exactly where the counts are whole multiples."""

from __future__ import annotations

import logging

import numpy as np

from leansft.core.config import MixConfig
from leansft.core.errors import DataError

log = logging.getLogger("leansft")


def counts(sizes: np.ndarray, amounts: np.ndarray, shares: np.ndarray, stop: str) -> np.ndarray:
    """Examples to take from each source: ``sizes`` its examples, ``amounts`` what they hold of what a share
    counts (target tokens, or the examples themselves), ``shares`` normalised. all_exhausted (and steps, the mix then
    repeated for as many steps as the run takes): the smallest mix in which every source is whole at least once;
    first_exhausted: the largest in which none repeats."""
    per_share = amounts / shares  # the mix's total amount that this source would make whole at its share
    total = per_share.min() if stop == "first_exhausted" else per_share.max()  # steps: the run repeats the mix
    mean = amounts / sizes
    return np.maximum(np.rint(shares * total / mean), 1).astype(np.int64)


def mix(part: np.ndarray, targets: np.ndarray, weights: list[float], names: list[str], cfg: MixConfig,
        rng: np.random.Generator) -> tuple[np.ndarray, list[dict]]:
    """(the examples of the mix, as indices into ``part``/``targets``; per source what it contributes).
    ``part[i]`` is example i's source, ``targets[i]`` its target tokens."""
    k = len(weights)
    sizes = np.bincount(part, minlength=k)
    for i in np.flatnonzero(sizes == 0):
        raise DataError(f"{names[i]}: no example left after cleaning, so its share of the mix cannot be met",
                        field=f"data.sources[{i}]", hint="drop the source, or relax data.clean / data.max_length")
    amounts = (np.bincount(part, weights=targets, minlength=k) if cfg.by == "tokens" else sizes).astype(np.float64)
    shares = np.asarray(weights, np.float64) / sum(weights)
    want = counts(sizes.astype(np.float64), amounts, shares, cfg.stop)
    chosen, report = [], []
    for i in range(k):
        members = np.flatnonzero(part == i)
        whole, rest = divmod(int(want[i]), len(members))
        pick = [np.tile(members, whole)] if whole else []
        if rest:
            pick.append(np.sort(rng.choice(members, size=rest, replace=False)))
        pick = np.concatenate(pick)
        chosen.append(pick)
        report.append({"mix_examples": len(pick), "mix_target_tokens": int(targets[pick].sum()),
                       "times_seen": round(len(pick) / len(members), 3)})
    total = {"tokens": sum(r["mix_target_tokens"] for r in report), "examples": sum(r["mix_examples"] for r in report)}
    for i, r in enumerate(report):
        r["share_of"] = "target tokens" if cfg.by == "tokens" else "examples"
        r["share_asked"] = round(float(shares[i]), 4)
        r["share_got"] = round((r["mix_target_tokens"] if cfg.by == "tokens" else r["mix_examples"]) / total[cfg.by], 4)
        if r["times_seen"] > cfg.warn_repeats:
            log.warning("%s: each example is in the mix %.1f times on average (its share %.0f%% of the %s): it may be "
                        "learned by heart; raise its data or lower its weight (data.mix.warn_repeats %g)", names[i],
                        r["times_seen"], 100 * shares[i], "target tokens" if cfg.by == "tokens" else "examples",
                        cfg.warn_repeats)
    return np.concatenate(chosen), report
