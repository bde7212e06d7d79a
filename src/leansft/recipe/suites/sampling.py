"""``limit``: a fixed sample from the seed spread over strata (instruction types, subjects, categories)."""

from __future__ import annotations

import numpy as np


def spread_sample(items: list[dict], limit: int | None, seed: int) -> list[dict]:
    """At most ``limit`` items, drawn round-robin over the items' ``stratum`` (each stratum shuffled by the seed),
    so a small limit still covers every kind; the kept items stay in file order. All of them without a limit."""
    if limit is None or limit >= len(items):
        return items
    rng = np.random.default_rng(seed)
    strata: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        strata.setdefault(str(item.get("stratum", "")), []).append(i)
    queues = [list(rng.permutation(members)) for _, members in sorted(strata.items())]
    order = [queues[k] for k in rng.permutation(len(queues))]
    picked: list[int] = []
    while len(picked) < limit:
        for queue in order:
            if queue and len(picked) < limit:
                picked.append(int(queue.pop()))
    return [items[i] for i in sorted(picked)]
