#!/usr/bin/env bash
# One prepared GPU check (for the device tool, or any machine with one CUDA GPU and torch/transformers):
#   bash benchmarks/gpu_check.sh [tests,bench,trl]   (default: tests,bench)
# tests: the GPU tests; bench: the throughput/MFU table (bench_gpu.py); trl: leansft vs TRL on a Qwen2.5-0.5B-shaped
# model (bench_trl.py --device cuda). Each part runs whatever the others' outcome (a lent GPU is rare), and the
# last line gives each one's exit code. Never run yet; by estimate tests+bench take 5-8 minutes and trl 3-5 (their
# timeouts: 9 and 7), so on the device tool they are two calls (one call may run 10 minutes). Installs nothing from the network: what the H200 image lacks (pydantic,
# TRL, datasets) or has in another version (transformers 5.17) travels in .whl/, made here beforehand by
# benchmarks/gpu_wheels.sh (carry: [".whl"]).
set -uo pipefail
cd "$(dirname "$0")/.."
parts=",${1:-tests,bench},"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
summary=""
part() {  # name, timeout in seconds, command...
  local name=$1 limit=$2 rc=0
  shift 2
  case $parts in *",$name,"*) ;; *) return 0 ;; esac
  timeout "$limit" "$@" || rc=$?
  summary="$summary $name rc=$rc"
  [ "$rc" -eq 0 ] || failed=1
}
failed=0
part tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
part bench 300 python3 benchmarks/bench_gpu.py --steps 20 --tokens 16384
part trl 420 python3 benchmarks/bench_trl.py --device cuda --workload qwen0.5b --examples 3000 --max-length 16384 \
  --steps 20 --precision bf16
echo "gpu_check:$summary"
exit $failed
