#!/usr/bin/env bash
# One prepared GPU check (for the device tool, or any machine with one CUDA GPU and torch/transformers):
# the GPU tests, then the throughput/MFU benchmark. Installs nothing from the network: what the H200 image lacks
# (pydantic) or has in another version (transformers 5.17) travels as wheels in .whl/, made here beforehand by
# benchmarks/gpu_wheels.sh (carry: [".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
# Both halves run whatever the other's outcome (a lent GPU is rare): a failing test still leaves the table.
tests=0; bench=0
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py || tests=$?
timeout 300 python3 benchmarks/bench_gpu.py --steps 20 --tokens 16384 || bench=$?
echo "gpu_check: tests rc=$tests, benchmark rc=$bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
