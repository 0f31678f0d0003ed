"""Test configuration: strict rank promotion, warnings as errors (pyproject).

64-bit tests use the ``x64`` fixture (``jax.enable_x64`` as a context), so the
doctests, which run in the same process, keep JAX's float32 default.
"""

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")

# torch's tolerances per dtype (rtol, atol).
TOLERANCES = {
  "float64": (1e-7, 1e-7),
  "float32": (1.3e-6, 1e-5),
  "float16": (1e-3, 1e-5),
  "bfloat16": (1.6e-2, 1e-5),
}


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


@pytest.fixture
def rng():
  return np.random.default_rng(0)
