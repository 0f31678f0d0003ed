"""Every loss under ``jax.jit`` with ``NamedSharding`` inputs equals the single-device result.

The checks run in one subprocess (``tests/_sharding_worker.py``) on 8
simulated CPU devices: ``--xla_force_host_platform_device_count`` must be set
before JAX initialises, which this pytest process has already done. The
worker prints a JSON summary; each (loss, mesh, layout) is asserted here as
its own test, so a failure names them. Under pytest-xdist the workers share
one run of the subprocess (the first one to need it runs it, the others wait
for its result file).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _sharding_worker as worker
import numpy as np
import pytest

WORKER = Path(__file__).with_name("_sharding_worker.py")
TIMEOUT_S = 600


def _run_worker() -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={worker.NUM_DEVICES}"
  )
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
    [sys.executable, str(WORKER)],
    env=env,
    capture_output=True,
    text=True,
    timeout=TIMEOUT_S,
    check=False,
  )
  if proc.returncode != 0:
    return {"crash": f"exit status {proc.returncode}\n{proc.stderr[-4000:]}"}
  try:
    return json.loads(proc.stdout.strip().splitlines()[-1])
  except (IndexError, json.JSONDecodeError):
    return {"crash": f"no JSON summary on stdout:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"}


@pytest.fixture(scope="session")
def summary(tmp_path_factory, worker_id) -> dict:
  if worker_id == "master":  # no xdist
    result = _run_worker()
  else:
    shared = tmp_path_factory.getbasetemp().parent
    done, lock = shared / "sharding_summary.json", shared / "sharding_summary.lock"
    try:
      fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
      deadline = time.monotonic() + TIMEOUT_S + 60
      while not done.exists():
        if time.monotonic() > deadline:
          pytest.fail("timed out waiting for another xdist worker's sharding run")
        time.sleep(0.5)
      time.sleep(0.2)  # written with a rename, but be gentle
    else:
      os.close(fd)
      result = _run_worker()
      tmp = shared / "sharding_summary.json.tmp"
      tmp.write_text(json.dumps(result))
      tmp.replace(done)
    result = json.loads(done.read_text())
  if "crash" in result:
    pytest.fail(f"sharding worker failed: {result['crash']}")
  return result


@pytest.fixture(scope="session")
def worker_id(request) -> str:
  """pytest-xdist's worker id, or ``"master"`` without xdist."""
  return getattr(request.config, "workerinput", {}).get("workerid", "master")


CASES = [
  (loss, mesh, layout)
  for loss in worker.CASES
  for mesh, layouts in worker.LAYOUTS.items()
  for layout in layouts
]


@pytest.mark.parametrize(("loss", "mesh", "layout"), CASES)
def test_sharded_equals_single_device(summary, loss, mesh, layout):
  rows = [
    r for r in summary["results"] if (r["loss"], r["mesh"], r["layout"]) == (loss, mesh, layout)
  ]
  assert len(rows) == 1, f"no result for {loss} on mesh {mesh} ({layout})"
  row = rows[0]
  if row["status"] == "missing":
    pytest.skip(f"kldiv_jax.{worker.CASES[loss]} does not exist yet")
  assert row["status"] == "ok", f"{loss} on mesh {mesh} ({layout}) raised:\n{row['message']}"
  # The inputs really were split over the devices.
  assert row["input_shards"] > 1
  if layout == "batch":
    assert row["input_shards"] == worker.NUM_DEVICES
  assert row["value_err"] <= worker.RTOL, (
    f"{loss} on mesh {mesh} ({layout}): value differs from one device by "
    f"{row['value_err']:.3g} (relative)"
  )
  assert row["grad_err"] <= worker.RTOL, (
    f"{loss} on mesh {mesh} ({layout}): gradients differ from one device by "
    f"{row['grad_err']:.3g} (relative)"
  )


def test_worker_saw_eight_devices(summary):
  assert summary["devices"] == worker.NUM_DEVICES


def test_batchmean_divides_by_global_batch(summary):
  # kl_div(reduction="batchmean") on a (2, 4) batch x vocab mesh against float64 NumPy.
  assert summary["extra"]["batchmean_numpy_rel_err"] <= 1e-6


def test_rel_err_detects_differences():
  # The comparison the worker makes can fail.
  want = np.array([1.0, -2.0, np.inf, 0.0])
  assert worker._rel_err(np, want, want) == 0.0
  assert worker._rel_err(np, want + np.array([0, 1e-3, 0, 0]), want) == pytest.approx(5e-4)
  assert worker._rel_err(np, np.array([1.0, -2.0, 5.0, 0.0]), want) == np.inf
  assert worker._rel_err(np, np.array([1.0, np.nan, np.inf, 0.0]), want) == np.inf
  assert worker._rel_err(np, want[:3], want) == np.inf
  assert worker._rel_err(np, np.array(3.0), np.array(3.0)) == 0.0
