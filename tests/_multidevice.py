"""Tests on 8 simulated CPU devices: the ``multidevice`` marker.

JAX fixes the number of CPU devices when its backend starts
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``), and the rest of the
suite must run on one device (kldiv_jax's CPU row blocking is for one device).
So a test marked ``@pytest.mark.multidevice`` is an ordinary pytest test that
needs 8 devices (the ``cpu_devices`` fixture gives them), and every such test
runs in one child pytest started with that flag:

- In the test session (``conftest.py``), each marked test is replaced by a
  stand-in with the same node id (:func:`stand_in`): it passes, fails or skips
  as the child's run of the test did, with the child's failure text. The first
  stand-in to run, in any pytest-xdist worker, starts the child on every marked
  test (:func:`outcomes`, pytest-xdist's recipe for a session-wide fixture:
  a file lock in the session's temporary directory); the others read its result.
- In the child (``KLDIV_JAX_MULTIDEVICE_REPORT`` names its result file), the
  marked tests run as usual and :func:`record` keeps their outcomes.

A session that already has 8 CPU devices runs the marked tests in-process.
"""

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

NUM_DEVICES = 8
MARKER = "multidevice"
REPORT_ENV = "KLDIV_JAX_MULTIDEVICE_REPORT"
TIMEOUT_S = 900
# Compile the child's small programs without LLVM optimisation: 3-4x faster, and the
# SPMD partitioning under test happens on HLO, before the backend.
CHILD_XLA_FLAGS = (
  f"--xla_force_host_platform_device_count={NUM_DEVICES} --xla_backend_optimization_level=0"
)


def in_child() -> bool:
  return REPORT_ENV in os.environ


def runs_in_process() -> bool:
  """Whether this process can run the marked tests itself (the child, or 8 CPU devices)."""
  return in_child() or len(jax.devices("cpu")) >= NUM_DEVICES


# -- the child --------------------------------------------------------------------------------


_OUTCOMES: dict[str, dict] = {}


def record(report: pytest.TestReport) -> None:
  """Keeps ``report``'s outcome (child only): failures win, then skips, then passes."""
  current = _OUTCOMES.get(report.nodeid, {"outcome": "passed", "text": ""})
  if report.failed:
    text = f"[{report.when}] {report.longreprtext}"
    current = {"outcome": "failed", "text": (current["text"] + "\n" + text).strip()}
  elif report.skipped and current["outcome"] == "passed":
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longreprtext
    current = {"outcome": "skipped", "text": reason}
  _OUTCOMES[report.nodeid] = current


def write(config: pytest.Config) -> None:
  """Writes the recorded outcomes to the file the parent named (child only).

  Under pytest-xdist (``PYTEST_ADDOPTS=-n ...``) the controller, which sees
  every report, writes it.
  """
  if not hasattr(config, "workerinput"):
    Path(os.environ[REPORT_ENV]).write_text(json.dumps(_OUTCOMES))


# -- the parent -------------------------------------------------------------------------------


def marked(item: pytest.Item) -> bool:
  return item.get_closest_marker(MARKER) is not None


def stand_in(item: pytest.Function) -> pytest.Function:
  """An item with ``item``'s node id and marks whose test is the child's outcome of ``item``."""
  new = pytest.Function.from_parent(item.parent, name=item.name, callobj=_check_outcome)
  for mark in item.own_markers:
    if mark.name != "parametrize":
      new.add_marker(getattr(pytest.mark, mark.name).with_args(*mark.args, **mark.kwargs))
  return new


def _check_outcome(request: pytest.FixtureRequest, multidevice_outcomes: dict) -> None:
  """Passes, fails or skips as the child's run of this test did."""
  if "crash" in multidevice_outcomes:
    pytest.fail(multidevice_outcomes["crash"], pytrace=False)
  nodeid = request.node.nodeid
  result = multidevice_outcomes["outcomes"].get(nodeid)
  if result is None:
    pytest.fail(f"{nodeid} did not run in the {NUM_DEVICES}-device pytest", pytrace=False)
  if result["outcome"] == "failed":
    pytest.fail(f"in the {NUM_DEVICES}-device pytest:\n{result['text']}", pytrace=False)
  if result["outcome"] == "skipped":
    pytest.skip(result["text"])


def outcomes(
  config: pytest.Config, tmp_path_factory: pytest.TempPathFactory, items: list[pytest.Item]
) -> dict:
  """The child's outcomes, from the first caller in this session (pytest-xdist's recipe).

  The first worker to get here runs the child on every marked test of ``items``
  and writes the result file; the others wait on the lock, then read it.
  """
  shared = tmp_path_factory.getbasetemp()
  if hasattr(config, "workerinput"):  # a pytest-xdist worker: its parent is the session's
    shared = shared.parent
  done = shared / "multidevice.json"
  with open(shared / "multidevice.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
    if not done.exists():
      paths = sorted({str(i.path.relative_to(config.rootpath)) for i in items if marked(i)})
      tmp = done.with_suffix(".tmp")
      tmp.write_text(json.dumps(_run_child(config, paths, shared / "multidevice.child.json")))
      tmp.replace(done)
    return json.loads(done.read_text())


def _run_child(config: pytest.Config, paths: list[str], out: Path) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {CHILD_XLA_FLAGS}".strip()
  env[REPORT_ENV] = str(out)
  cmd = [sys.executable, "-m", "pytest", *paths, "-m", MARKER, "-q"]
  try:
    proc = subprocess.run(
      cmd, cwd=config.rootpath, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
  except subprocess.TimeoutExpired as err:
    return {"crash": f"the {NUM_DEVICES}-device pytest ran past {TIMEOUT_S} s: {err}"}
  if not out.exists():
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-3000:]).strip()
    return {
      "crash": f"the {NUM_DEVICES}-device pytest (exit {proc.returncode}) left no report:\n{tail}"
    }
  return {"outcomes": json.loads(out.read_text())}
