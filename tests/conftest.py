"""Test configuration: strict rank promotion, warnings as errors (pyproject), two markers.

- ``torch``: the test compares live against torch (the ``torch`` fixture, or
  the ``source`` fixture's ``"torch"`` reference); it skips when torch is not
  importable. Every such comparison has an offline twin (golden fixtures from
  torch 2.13, or a float64 reference in ``_references.py``) that runs
  everywhere, so ``pytest -m torch`` re-runs only the live duplicates.
- ``multidevice``: the test needs 8 CPU devices (``cpu_devices``); it runs
  in one child pytest with 8 simulated devices (``_multidevice.py``), started in
  the background when the session starts; their stand-ins run last.

64-bit tests use the ``x64`` fixture (``enable_x64`` as a context), so the
doctests, which run in the same process, keep JAX's float32 default.

Each test process (every pytest-xdist worker, the 8-device child) keeps the
executables it compiles in a persistent compilation cache of its own, in a
temporary directory removed when the session ends: a program compiled again —
after ``jax.clear_caches()`` (which ends each test module), or traced again by another
test — is loaded from it, not recompiled. A load counts as a compilation in
``count_compiles``; the determinism tests compile without it (``fresh_compilations``).

XLA:CPU compiles the session's programs for speed (``_references.XLA_TEST_FLAGS`` added
to ``XLA_FLAGS``, which the subprocesses of the examples' and the 8-device tests inherit):
no LLVM optimisation, XLA's loop emitters instead of its MLIR fusion emitters, no
constant folding. What the suite checks is decided before the backend — the traced,
lowered and partitioned program, its buffers (``memory_analysis``), its numbers — and its
compilations take about half the CPU this way. A test of bit-level numerics compiles with
``compiler_options=_references.DEFAULT_CODEGEN`` (XLA's defaults back); the benchmarks and
the demo compile with XLA's defaults.

``KLDIV_JAX_TEST_SAMPLE=K`` (an integer, used by ``.ci/run`` for the suite at the
dependency floor) runs a sample of the suite: every test function, and of a parametrised
one its first case and each other case whose id hashes to 0 modulo ``K`` (about one in
``K``, spread over every parameter; the same cases on every run and in the 8-device child).
"""

import gc
import os
import shutil
import tempfile
import zlib

import _multidevice
import jax
import numpy as np
import pytest
from _references import add_xla_test_flags, enable_x64, platform_branch

# Before JAX starts its CPU backend (on first use), which reads XLA_FLAGS once.
add_xla_test_flags()
jax.config.update("jax_numpy_rank_promotion", "raise")
# JAX's caches hold the traced programs of a test module: some GB of Python objects, which
# each full collection of the garbage collector walks (about a tenth of the suite's time at
# Python's default thresholds). Collections a fourteenth as often, and caches emptied after
# each module, which seldom shares a shape with the next.
gc.set_threshold(10_000, 10, 10)

_COMPILATION_CACHE = tempfile.mkdtemp(prefix="kldiv_jax-tests-xla-cache-")
jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_configure(config):
  config.addinivalue_line(
    "markers", "torch: compares live against torch (skipped without torch; run: pytest -m torch)"
  )
  config.addinivalue_line(
    "markers", f"{_multidevice.MARKER}: runs on 8 simulated CPU devices, in a child pytest"
  )


def _sampled(items: list[pytest.Item], every: int) -> list[pytest.Item]:
  """Each test function's first case and the cases whose id hashes to 0 modulo ``every``."""
  seen: set[str] = set()
  kept = []
  for item in items:
    function, _, case = item.nodeid.partition("[")
    if function not in seen or zlib.crc32(case.encode()) % every == 0:
      kept.append(item)
    seen.add(function)
  return kept


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
  every = int(os.environ.get("KLDIV_JAX_TEST_SAMPLE", "1"))
  if every > 1:
    kept = _sampled(items, every)
    chosen = set(kept)
    config.hook.pytest_deselected(items=[i for i in items if i not in chosen])
    items[:] = kept
  for item in items:
    if "torch" in item.fixturenames and item.get_closest_marker("torch") is None:
      raise pytest.UsageError(f"{item.nodeid} uses the torch fixture: mark it @pytest.mark.torch")
  if not _multidevice.runs_in_process():
    # The stand-ins last: by then the child, started with the session's first test, is done.
    items[:] = [i for i in items if not _multidevice.marked(i)] + [
      _multidevice.stand_in(i) for i in items if _multidevice.marked(i)
    ]


def pytest_runtest_logreport(report):
  if _multidevice.in_child():
    _multidevice.record(report)


def pytest_unconfigure(config):
  shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
  if _multidevice.in_child():
    _multidevice.write(session.config)
  else:
    stop = exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldfail or session.shouldstop
    _multidevice.finish(stop=bool(stop))


@pytest.fixture(scope="module", autouse=True)
def _empty_jax_caches():
  yield
  jax.clear_caches()


@pytest.fixture
def x64():
  with enable_x64(True):
    yield


@pytest.fixture
def rng():
  return np.random.default_rng(0)


@pytest.fixture
def accelerator_branch():
  """Every ``lax.platform_dependent`` takes its non-CPU branch: the GPU/TPU code run on CPU
  (``_references.platform_branch``)."""
  with platform_branch():
    yield


@pytest.fixture(params=["default", "cuda"])
def accelerator_platform(request):
  """As :func:`accelerator_branch`, for each accelerator branch a kernel may have: the
  default one (TPU) and, where there is one, the ``cuda`` one (XLA:GPU)."""
  with platform_branch(request.param) as platform:
    yield platform


@pytest.fixture(scope="session")
def torch():
  return pytest.importorskip("torch")


@pytest.fixture(params=["numpy", pytest.param("torch", marks=pytest.mark.torch)])
def source(request):
  """Which reference a test compares against: float64 NumPy, or torch itself (live)."""
  if request.param == "torch":
    request.getfixturevalue("torch")
  return request.param


@pytest.fixture(scope="session")
def cpu_devices():
  """The 8 CPU devices of a ``multidevice`` test."""
  devices = jax.devices("cpu")
  if len(devices) < _multidevice.NUM_DEVICES:
    pytest.fail(f"needs {_multidevice.NUM_DEVICES} CPU devices, has {len(devices)}")
  return devices[: _multidevice.NUM_DEVICES]


@pytest.fixture(scope="session", autouse=True)
def _multidevice_child(request, tmp_path_factory):
  """Starts the child pytest of the session's ``multidevice`` tests in the background."""
  if not _multidevice.runs_in_process():
    _multidevice.start(request.config, tmp_path_factory, request.session.items)


@pytest.fixture(scope="session")
def multidevice_outcomes(request, tmp_path_factory):
  """The child pytest's outcomes of the ``multidevice`` tests (their stand-ins' fixture)."""
  return _multidevice.outcomes(request.config, tmp_path_factory, request.session.items)
