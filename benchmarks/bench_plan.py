"""Planning speed: best-fit decreasing over 1,000,000 lognormal lengths into 4,096-token rows.

Target (issue 3): under 3 s on the 2-core dev machine with fill above 99.9%.

    .venv/bin/python benchmarks/bench_plan.py
"""

from __future__ import annotations

import time

from leansft.core.batching.packing import PACKED, pack
from leansft.tools.stats import lognormal_lengths


def main() -> None:
    lengths = lognormal_lengths(1_000_000, 450, 0.9, 4096, seed=0)
    print(f"{'strategy':10s} {'seconds':>8s} {'rows':>9s} {'fill':>8s}")
    for s in ("bfd", "bfd_split", "wrapped", "sorted", "padded"):
        t0 = time.perf_counter()
        plan = pack(s, lengths, 4096, batch_size=8)
        dt = time.perf_counter() - t0
        fill = plan.fill if s in PACKED else plan.length.sum() / plan.slots.sum()  # rows filled / not padding
        print(f"{s:10s} {dt:8.2f} {plan.num_rows:9,d} {fill:8.4%}")


if __name__ == "__main__":
    main()
