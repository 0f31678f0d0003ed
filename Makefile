# kldiv_jax: `make demo` and `make test` work on a fresh clone (Python >= 3.10).
# Each target creates the virtual environment $(VENV) when missing and installs
# the package (editable) with the `test` and `examples` extras.
#
#   make demo      knowledge distillation on scikit-learn's digits
#   make test      the test suite (live torch parity when torch is installed)
#   make lint      ruff (installed into the venv on first use)
#   make bench     benchmarks/run.py
#   make fixtures  regenerate tests/fixtures from torch (installs torch==2.13.0 if missing)
#
# VENV=path selects another environment (.ci/run uses a fresh one).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kldiv_jax-installed
PYTEST_ARGS ?= -q -n 2

.PHONY: venv demo test lint bench fixtures clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test,examples]'
	touch $(STAMP)

demo: venv
	$(PY) examples/distill_digits.py

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff --version >/dev/null 2>&1 || $(PY) -m pip install 'ruff>=0.6'
	$(PY) -m ruff check .

bench: venv
	$(PY) benchmarks/run.py $(BENCH_ARGS)

# The golden fixtures come from torch 2.13 (CPU), the version the reference measured.
fixtures: venv
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install 'torch==2.13.0'
	$(PY) tests/fixtures/make_torch_fixtures.py

clean:
	rm -rf examples/output .pytest_cache .hypothesis
