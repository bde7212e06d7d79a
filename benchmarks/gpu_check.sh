#!/usr/bin/env bash
# The prepared GPU check: one call of at most 9 minutes on the device tool (or any machine with one CUDA GPU and
# torch/transformers), its parts in order of value, each under its own timeout and all under one budget; every
# measurement is appended to $OUT/results.jsonl (else runs/results.jsonl) as its part ends, so a timeout loses one
# part, not all. Parts (default: all, in this order):
#   gemm     GEMM ceilings: bf16, fp32, TF32 (bench_gemm.py)
#   head     the loss head alone: chunked fp32 / chunked bf16 / Liger / full logits, time, memory, error vs fp64
#   bench    recipe and bare loop, 0.5b and 1.5b, eager and compiled: tokens/s, MFU, peak memory, recompiles
#   profile  a 0.5b recipe step's shares: bf16 GEMM, fp32 GEMM, attention, optimizer, other, idle
#   tests    tests/test_gpu.py
#   bench8b  the 8b-width shape (full fine-tuning) and 8b (LoRA), eager
#   trl      leansft vs TRL at its best (two alternating pairs) and TRL as shipped, 0.5b
#   bash benchmarks/gpu_check.sh [part,part,...]      GPU_CHECK_BUDGET=540 (seconds, all parts together)
#   GPU_CHECK_MINI=1 bash benchmarks/gpu_check.sh     the same code in miniature on the CPU (the test suite runs it)
# Installs nothing from the network: what the H200 image lacks (pydantic, TRL, datasets, liger-kernel) or has in
# another version (transformers 5.17) travels in .whl/, made here beforehand by benchmarks/gpu_wheels.sh
# (carry: [".whl"]). A part left out by the budget can run in a second call: bash benchmarks/gpu_check.sh trl
set -uo pipefail
cd "$(dirname "$0")/.."
parts=",${1:-gemm,head,bench,profile,tests,bench8b,trl},"
mini=${GPU_CHECK_MINI:-0}
budget=${GPU_CHECK_BUDGET:-540}
PY=${PYTHON:-python3}
if [ "$mini" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then  # the device: what its image lacks (gpu_wheels.sh)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export LEANSFT_RESULTS=${LEANSFT_RESULTS:-${OUT:-runs}/results.jsonl}
mkdir -p "$(dirname "$LEANSFT_RESULTS")"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
$PY -c "from importlib.metadata import version as v; print('torch', v('torch'), 'transformers', v('transformers'))"
start=$(date +%s)
summary=""
failed=0
part() {  # name, timeout in seconds, command...
  local name=$1 limit=$2 rc=0 left
  shift 2
  case $parts in *",$name,"*) ;; *) return 0 ;; esac
  left=$((budget - ($(date +%s) - start)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    summary="$summary $name=skipped(budget)"
    return 0
  fi
  echo "== $name (at most ${limit} s)"
  local t0=$(date +%s)
  timeout "$limit" "$@" || rc=$?
  summary="$summary $name=rc$rc/$(( $(date +%s) - t0 ))s"
  [ "$rc" -eq 0 ] || failed=1
}
if [ "$mini" = 1 ]; then
  part gemm 60 $PY benchmarks/bench_gemm.py --size 128 --repeat 2
  part head 120 $PY benchmarks/bench_head.py --shapes tiny --tokens 256 --chunk 64,128 --repeat 1
  # bench and bench8b run one script with other shapes: in miniature both shapes go in one process (bench8b's own
  # shapes, 8b-width and 8b, cannot run here anyway)
  part bench 300 $PY benchmarks/bench_gpu.py --shapes tiny,tiny-lora --compile false --steps 2 --warmup 1 --tokens 512 --examples 120
  part profile 120 $PY benchmarks/profile_gpu.py --shape tiny --steps 1 --warmup 1 --tokens 512 --examples 60
  part trl 300 $PY benchmarks/bench_trl.py --workload tiny --examples 24 --max-length 256 --steps 2 --warmup 1 --trl best,shipped --quick
else
  part gemm 45 $PY benchmarks/bench_gemm.py
  part head 90 $PY benchmarks/bench_head.py --shapes 0.5b,1.5b,8b --tokens 16384 --chunk 1024,4096
  part bench 240 $PY benchmarks/bench_gpu.py --shapes 0.5b,1.5b --compile false,true --steps 6 --warmup 3 --tokens 16384
  part profile 60 $PY benchmarks/profile_gpu.py --shape 0.5b --steps 2 --warmup 3 --tokens 16384
  part tests 150 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py
  part bench8b 200 $PY benchmarks/bench_gpu.py --shapes 8b-width,8b --compile false --steps 4 --warmup 2 --tokens 16384
  part trl 300 $PY benchmarks/bench_trl.py --device cuda --workload qwen0.5b --examples 3000 --max-length 16384 \
    --steps 10 --warmup 3 --precision bf16 --pairs 2 --trl best,shipped
fi
echo "gpu_check:$summary ($(( $(date +%s) - start )) s; results in $LEANSFT_RESULTS)"
exit $failed
