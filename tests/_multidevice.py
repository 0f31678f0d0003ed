"""Tests on 8 simulated CPU devices: the ``multidevice`` marker.

JAX fixes the number of CPU devices when its backend starts
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``), and the rest of the
suite must run on one device (kldiv_jax's CPU row blocking is for one device).
So a test marked ``@pytest.mark.multidevice`` is an ordinary pytest test that
needs 8 devices (the ``cpu_devices`` fixture gives them), and every such test
runs in one child pytest started with that flag:

- In the test session (``conftest.py``), each marked test is replaced by a
  stand-in with the same node id (:func:`stand_in`), moved to the end of the
  session: it passes, fails or skips as the child's run of the test did, with
  the child's failure text. The child starts in the background when the
  session's first test starts (:func:`start`, once per session, in any
  pytest-xdist worker: a file lock in the session's temporary directory), so it
  runs while the session runs its other tests; the stand-ins wait for its result
  (:func:`outcomes`).
- In the child (``KLDIV_JAX_MULTIDEVICE_REPORT`` names its result file), the
  marked tests run as usual and :func:`record` keeps their outcomes.

A session that already has 8 CPU devices runs the marked tests in-process.
"""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
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


def _shared(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
  """The session's temporary directory, shared by its pytest-xdist workers."""
  shared = tmp_path_factory.getbasetemp()
  return shared.parent if hasattr(config, "workerinput") else shared


_STARTED: list[subprocess.Popen] = []  # the runner this process started, if any


def start(
  config: pytest.Config, tmp_path_factory: pytest.TempPathFactory, items: list[pytest.Item]
) -> None:
  """Starts the child on every marked test of ``items`` in the background, once per session.

  The first caller, in any pytest-xdist worker, starts a runner process
  (this file run as a script: :func:`_run_child`, then the result file); the
  others find the mark it left and return.
  """
  paths = sorted({str(i.path.relative_to(config.rootpath)) for i in items if marked(i)})
  shared = _shared(config, tmp_path_factory)
  with open(shared / "multidevice.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
    started = shared / "multidevice.started"
    if not paths or started.exists():
      return
    started.touch()
    cmd = [sys.executable, __file__, str(config.rootpath), str(shared), *paths]
    _STARTED.append(subprocess.Popen(cmd, cwd=config.rootpath, stdin=subprocess.DEVNULL))


def finish(stop: bool) -> None:
  """At the end of the session of the process that started the runner: waits for it.

  Another pytest-xdist worker may still be waiting for its result. When the
  session stopped early (``stop``: interrupted, ``-x``), the runner is stopped
  instead, and writes a crash for any stand-in still waiting.
  """
  for proc in _STARTED:
    if stop:
      proc.terminate()
    try:
      proc.wait(timeout=TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def outcomes(
  config: pytest.Config, tmp_path_factory: pytest.TempPathFactory, items: list[pytest.Item]
) -> dict:
  """The child's outcomes, once its runner has written them (starting it if need be)."""
  start(config, tmp_path_factory, items)
  done = _shared(config, tmp_path_factory) / "multidevice.json"
  deadline = time.monotonic() + TIMEOUT_S + 60  # the runner stops the child at TIMEOUT_S
  while not done.exists():
    if time.monotonic() > deadline:
      return {"crash": f"the {NUM_DEVICES}-device pytest's runner left no result"}
    time.sleep(0.1)
  return json.loads(done.read_text())


def _run_child(root: Path, paths: list[str], out: Path) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {CHILD_XLA_FLAGS}".strip()
  env[REPORT_ENV] = str(out)
  cmd = [sys.executable, "-m", "pytest", *paths, "-m", MARKER, "-q"]
  try:
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired as err:
    return {"crash": f"the {NUM_DEVICES}-device pytest ran past {TIMEOUT_S} s: {err}"}
  if not out.exists():
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-3000:]).strip()
    return {
      "crash": f"the {NUM_DEVICES}-device pytest (exit {proc.returncode}) left no report:\n{tail}"
    }
  return {"outcomes": json.loads(out.read_text())}


def _runner(root: str, shared: str, *paths: str) -> None:
  """The background runner (:func:`start`): the child's result into ``multidevice.json``."""
  shared_dir = Path(shared)
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # finish(): subprocess.run kills the child
  try:
    result = _run_child(Path(root), list(paths), shared_dir / "multidevice.child.json")
  except BaseException as err:  # the waiting stand-ins get a crash, not a hang
    result = {"crash": f"the {NUM_DEVICES}-device pytest's runner failed: {err!r}"}
  tmp = shared_dir / "multidevice.json.tmp"
  tmp.write_text(json.dumps(result))
  tmp.replace(shared_dir / "multidevice.json")


if __name__ == "__main__":
  _runner(*sys.argv[1:])
