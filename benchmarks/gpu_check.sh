#!/usr/bin/env bash
# One prepared GPU check (for the device tool, or any machine with one CUDA GPU and torch/transformers):
# the GPU tests, then the throughput/MFU benchmark. Installs nothing from the network; missing pure-Python
# packages (pydantic and its needs are not on the H200 image) travel as wheels in .whl/ (see benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import pydantic" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
timeout 300 python3 benchmarks/bench_gpu.py --steps 20 --tokens 16384
