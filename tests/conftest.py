"""Test configuration: strict rank promotion, warnings as errors (pyproject), the torch marker.

- ``torch``: the test compares live against torch (the ``torch`` fixture, or
  the ``source`` fixture's ``"torch"`` reference); it skips when torch is not
  importable. Every such comparison has an offline twin (golden fixtures from
  torch 2.13, or a float64 reference in ``_references.py``) that runs
  everywhere, so ``pytest -m torch`` re-runs only the live duplicates.

64-bit tests use the ``x64`` fixture (``enable_x64`` as a context), so the
doctests, which run in the same process, keep JAX's float32 default.
"""

import jax
import numpy as np
import pytest
from _references import enable_x64

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_configure(config):
  config.addinivalue_line(
    "markers", "torch: compares live against torch (skipped without torch; run: pytest -m torch)"
  )


def pytest_collection_modifyitems(config, items):
  for item in items:
    if "torch" in item.fixturenames and item.get_closest_marker("torch") is None:
      raise pytest.UsageError(f"{item.nodeid} uses the torch fixture: mark it @pytest.mark.torch")


@pytest.fixture
def x64():
  with enable_x64(True):
    yield


@pytest.fixture
def rng():
  return np.random.default_rng(0)


@pytest.fixture(scope="session")
def torch():
  return pytest.importorskip("torch")


@pytest.fixture(params=["numpy", pytest.param("torch", marks=pytest.mark.torch)])
def source(request):
  """Which reference a test compares against: float64 NumPy, or torch itself (live)."""
  if request.param == "torch":
    request.getfixturevalue("torch")
  return request.param
