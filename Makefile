# kldiv_jax: `make demo` and `make test` work on a fresh clone (Python >= 3.11).
# Each target creates the virtual environment $(VENV) when missing and installs
# the package (editable) with the `test` and `examples` extras; the maintainer
# targets add their own extra (`lint`, `release`, `docs`) on first use.
#
#   make demo       knowledge distillation on scikit-learn's digits
#   make test       the test suite (live torch parity too when torch is installed)
#   make lint       ruff check and ruff format --check
#   make format     ruff format (rewrites files)
#   make typecheck  pyright over kldiv_jax/
#   make build      wheel and sdist in dist/, then twine check
#   make docs       the documentation site in docs/_build/html (warnings are errors; a page
#                   that loads a script from the network fails: MathJax is a local copy),
#                   then the doctests of its pages, of the README and of the docstrings
#                   (DOCS_TEST_PATHS: .ci/run leaves out the docstrings, make test ran them)
#   make bench      benchmarks/run.py
#   make bench-accel  every loss compiled for TPU v5e/v6e and an H100 without the device
#                   (XLA's estimates; creates .venv-accel-tpu and .venv-accel-cuda on first use)
#   make bench-tunix  Tunix's GRPO policy update and distillation train step (Qwen 3 0.6B, Gemma 3
#                   1B), stock against the fused losses, compiled for v5e and an H100 without the
#                   device (XLA's estimates; adds google-tunix to bench-accel's environments)
#   make bench-device bench-accel's cases timed for real on the attached GPU or TPU (the
#                   venv's jax must see it: e.g. jax[cuda12] installed there)
#   make fixtures   regenerate tests/fixtures from torch (installs torch==2.13.0 if missing)
#   make integration  tests/test_integration_*.py against the peers themselves (Tunix, TRL,
#                   verl, torch), in their own environment $(INTEGRATION_VENV), pinned
#                   (kldiv_jax with its `tunix` extra)
#
# VENV=path selects another environment (.ci/run uses fresh ones).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kldiv_jax-installed
PYTEST_ARGS ?= -q -n 2
DOCS_TEST_PATHS ?= docs kldiv_jax README.md
DEMO_ARGS ?=

.PHONY: venv demo test lint format typecheck build docs bench bench-accel bench-tunix bench-device fixtures integration integration-deps clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test,examples]'
	touch $(STAMP)

# An extra installed on first use: $(call extra,NAME).
extra = test -f $(VENV)/.kldiv_jax-$(1) || { $(PY) -m pip install -e '.[test,examples,$(1)]' && touch $(VENV)/.kldiv_jax-$(1); }

demo: venv
	$(PY) examples/distill_digits.py $(DEMO_ARGS)

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	@$(call extra,lint)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: venv
	@$(call extra,lint)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

typecheck: venv
	@$(call extra,lint)
	$(VENV)/bin/pyright --pythonpath $(PY)

build: venv
	@$(call extra,release)
	rm -rf dist
	$(PY) -m build
	$(PY) -m twine check --strict dist/*

# From scratch every time: an incremental build would not repeat the warnings of
# unchanged pages, and would keep the API pages of removed names.
docs: venv
	@$(call extra,docs)
	rm -rf docs/_build docs/_autosummary
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	$(PY) docs/check_offline.py docs/_build/html
	$(PY) -m pytest -q $(DOCS_TEST_PATHS) --doctest-glob=README.md
	@echo "docs: open docs/_build/html/index.html"

bench: venv
	$(PY) benchmarks/run.py $(BENCH_ARGS)

# Compile-only: needs no accelerator; its environments are its own (benchmarks/bench_accel.py).
bench-accel: venv
	$(PY) benchmarks/bench_accel.py $(BENCH_ARGS)

bench-tunix: venv
	$(PY) benchmarks/bench_tunix.py $(BENCH_ARGS)

bench-device: venv
	$(PY) benchmarks/bench_device.py $(BENCH_ARGS)

# The golden fixtures come from torch 2.13 (CPU), the version the reference measured.
fixtures: venv
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install 'torch==2.13.0'
	$(PY) tests/fixtures/make_torch_fixtures.py

# The peers' own code (Tunix, TRL, verl; torch CPU) in an environment of its own: google-tunix
# pulls flax, optax and a jax of its choosing, and TRL and verl pull torch. Pinned to the
# versions the tests passed with. verl goes in without its dependencies (its GPU stack), with
# what `verl.trainer.ppo.core_algos` imports.
INTEGRATION_VENV ?= .venv-integration
INTEGRATION_PINS := google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 optax==0.2.8 \
  torch==2.13.0 trl==1.16.0 transformers==5.10.4 tokenizers==0.22.2 \
  tensordict==0.10.0 ray==2.60.0 codetiming==1.4.0 orjson==3.13.0
INTEGRATION_STAMP := $(INTEGRATION_VENV)/.kldiv_jax-integration-1
INTEGRATION_TESTS ?= tests/test_integration_*.py

$(INTEGRATION_STAMP): pyproject.toml
	test -x $(INTEGRATION_VENV)/bin/python || $(PYTHON) -m venv $(INTEGRATION_VENV)
	$(INTEGRATION_VENV)/bin/python -m pip install -e '.[test,tunix]' $(INTEGRATION_PINS)
	$(INTEGRATION_VENV)/bin/python -m pip install --no-deps verl==0.9.1
	touch $(INTEGRATION_STAMP)

integration: $(INTEGRATION_STAMP)
	$(INTEGRATION_VENV)/bin/python -m pytest -q -p no:xdist $(INTEGRATION_TESTS)

# The peers and their pins alone, without kldiv_jax (INTEGRATION_REQUIREMENTS: more pip
# arguments): .ci/run installs them in the background beside `make test`; `make integration`
# then finds them installed and adds kldiv_jax itself.
integration-deps:
	test -x $(INTEGRATION_VENV)/bin/python || $(PYTHON) -m venv $(INTEGRATION_VENV)
	$(INTEGRATION_VENV)/bin/python -m pip install $(INTEGRATION_PINS) $(INTEGRATION_REQUIREMENTS)
	$(INTEGRATION_VENV)/bin/python -m pip install --no-deps verl==0.9.1

clean:
	rm -rf examples/output .pytest_cache .hypothesis dist build docs/_build docs/_autosummary
