"""The GPU scripts run in miniature on the CPU: a GPU is lent rarely and for minutes, and a change elsewhere
must not leave it to find them broken."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_the_gpu_benchmark_runs_in_miniature_on_the_cpu(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("bench_gpu", None)
    import bench_gpu

    bench_gpu.main(["--device", "cpu", "--shapes", "tiny", "--steps", "1", "--tokens", "512", "--compile", "false"])
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| tiny |")]
    assert [r.split("|")[3].strip() for r in rows] == ["packed", "padded"]
    assert all(float(r.split("|")[5].replace(",", "")) > 0 for r in rows)  # real tokens/s measured
