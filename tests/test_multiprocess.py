"""Several processes, one mesh: ``jax.distributed`` on localhost equals one device.

:func:`test_two_processes_equal_one_device` starts two processes
(``_multiprocess_worker.py``), each with 4 CPU devices, joined by
``jax.distributed.initialize`` (coordinator on ``127.0.0.1``, gloo CPU
collectives) into one (2, 4) ``("data", "vocab")`` mesh whose rows and
columns both span the two processes. Each runs jitted ``optax.adam`` steps of
``distillation_loss`` (XLA-partitioned, and vocabulary-parallel in
``jax.shard_map``), the fused LM-head loss and per-token divergences, twice,
and this test compares the losses, the first step's gradients and the final
parameters with the same steps on this process's one device.

Tolerance: float32 sums in another order (the sharded reductions, the
one-device row blocks), ``|sharded - one device| <= ATOL + RTOL |one device|``
elementwise. Observed: at most 3e-7 of each array's largest magnitude, a
fifteenth of the tolerance (see ``docs/beyond-one-machine.md``). Run to run,
and between the processes, the results are bit-identical.

Safety: the workers bind loopback only (the coordinator on ``127.0.0.1``;
gloo on the address the host name resolves to, so the test skips unless that
is loopback), each checks its own listening sockets in ``/proc``, exits by
itself after ``--deadline`` seconds, and is killed with its process group when
the test fails or times out.

:func:`test_example_runs_on_two_processes` runs
``examples/multihost_distillation.py`` at small sizes (it starts its own two
processes) and compares its printed losses with one device.
"""

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import _multiprocess_worker as worker
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "multihost_distillation.py"
TIMEOUT_S = 100  # the whole job; it takes 10-25 s on a loaded 2-core machine
ATOL, RTOL = 1e-6, 1e-5

_NOT_LOOPBACK = worker.loopback_hostname_problem()
pytestmark = [
  pytest.mark.skipif(sys.platform != "linux", reason="reads listening sockets from /proc"),
  pytest.mark.skipif(_NOT_LOOPBACK is not None, reason=f"no local job: {_NOT_LOOPBACK}"),
]


def _child_env() -> dict[str, str]:
  """This environment for the processes: CPU, no forced device count (each sets its own).

  Without LLVM optimisation (``--xla_backend_optimization_level=0``): the
  small programs compile 2x faster, and the partitioning under test happens
  on HLO, before the backend.
  """
  # Not a task of a SLURM or Open MPI job (jax.distributed would read theirs).
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
  env["JAX_PLATFORMS"] = "cpu"
  flags = env.get("XLA_FLAGS", "").split()
  flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join([*flags, "--xla_backend_optimization_level=0"])
  return env


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(commands: list[list[str]], logs: Path, timeout: float, meanwhile=lambda: None):
  """Runs the commands together, each in its own process group: ``(outputs, meanwhile())``.

  ``meanwhile`` runs here while they do. Fails, after killing every process
  group still alive, when one exits with an error or all have not finished
  within ``timeout`` seconds; the message holds the tail of every output.
  """
  procs, files = [], []
  problem, result = None, None
  try:
    for i, cmd in enumerate(commands):
      files.append(open(logs / f"process_{i}.log", "w+"))  # closed below
      procs.append(
        subprocess.Popen(
          cmd,
          cwd=ROOT,
          env=_child_env(),
          stdin=subprocess.DEVNULL,
          stdout=files[-1],
          stderr=subprocess.STDOUT,
          start_new_session=True,
        )
      )
    deadline = time.monotonic() + timeout
    result = meanwhile()
    while True:
      codes = [p.poll() for p in procs]
      failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
      if failed:
        problem = f"process {failed[0]} exited with {codes[failed[0]]}"
      elif time.monotonic() > deadline:
        problem = f"still running after {timeout} s"
      if problem or all(code == 0 for code in codes):
        break
      time.sleep(0.05)
  finally:
    for p in procs:  # the whole group: also what a process started, if it is still there
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()
  outputs = []
  for f in files:
    f.seek(0)
    outputs.append(f.read())
    f.close()
  if problem:
    tails = "\n".join(f"--- process {i}:\n{out[-3000:]}" for i, out in enumerate(outputs))
    pytest.fail(f"{problem}\n{tails}", pytrace=False)
  return outputs, result


def _errors(got, want) -> tuple[float, float, float]:
  """``max |got - want| / (ATOL + RTOL |want|)`` (at most 1 passes), the largest absolute
  difference, and that relative to the largest ``|want|``."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  diff = np.abs(got - want)
  scale = max(float(np.max(np.abs(want))), 1e-30)
  return float(np.max(diff / (ATOL + RTOL * np.abs(want)))), float(diff.max()), diff.max() / scale


def _per_shard_mean(version: str) -> float:
  """The first step's loss with each ``"data"`` shard's own mean, averaged: the wrong normaliser."""
  params, teacher = worker.initial_state()
  batch = worker.batches()[0]
  h = worker.student_hidden(params, batch["tokens"])
  th = worker.teacher_hidden(teacher, batch["tokens"])
  local = worker.LOCAL_LOSSES[version]
  means = []
  for rows in np.split(np.arange(worker.BATCH), worker.NUM_PROCESSES):
    labels = batch["labels"][rows]
    count = jnp.sum(labels != worker.IGNORE).astype(jnp.float32)
    means.append(local(h[rows], params["head"], th[rows], teacher["head"], labels, count, None))
  return float(np.mean(means))


def test_two_processes_equal_one_device(tmp_path):
  port, start = _free_port(), time.perf_counter()
  job = ["--num-processes", str(worker.NUM_PROCESSES), "--port", str(port)]
  job += ["--out", str(tmp_path), "--deadline", str(TIMEOUT_S - 5)]
  commands = [
    [sys.executable, str(ROOT / "tests" / "_multiprocess_worker.py"), "--process-id", str(i), *job]
    for i in range(worker.NUM_PROCESSES)
  ]
  # The reference (one device, here) while the processes run.
  references = lambda: {v: worker.train(v, mesh=None, runs=1) for v in worker.VERSIONS}  # noqa: E731
  outputs, references = _run(commands, tmp_path, TIMEOUT_S, references)
  seconds = time.perf_counter() - start
  results = [dict(np.load(tmp_path / f"process_{i}.npz")) for i in range(worker.NUM_PROCESSES)]
  problems = []

  # The job: 2 processes x 4 devices, each mesh row ("vocab" group) and column
  # ("data" group) on both processes.
  first = results[0]
  assert first["devices"].tolist() == [2, 4, 8], first["devices"]
  grid = first["mesh_processes"]
  for name, groups in (("vocab", grid), ("data", grid.T)):
    if any(len(set(g.tolist())) < worker.NUM_PROCESSES for g in groups):
      problems.append(f"a {name!r} group of the mesh is inside one process: {grid.tolist()}")

  # Loopback only: the coordinator (process 0) and gloo's listeners (all).
  for i, r in enumerate(results):
    listening = r["listening"].tolist()
    if not all(worker.is_loopback(a) for a in listening):
      problems.append(f"process {i} listens on {listening}")
  if f"127.0.0.1:{port}" not in first["listening"].tolist():
    problems.append(f"the coordinator is not on 127.0.0.1:{port}: {first['listening']}")

  report = []
  for version in worker.VERSIONS:
    keys = [k for k in first if k.startswith(f"{version}.") and not k.endswith(".seconds")]
    # Bit-identical from run to run and between the processes (replicated results).
    for key in keys:
      runs = first[key]
      if not all(np.array_equal(run, runs[0]) for run in runs):
        problems.append(f"{key}: not bit-identical from run to run")
      if not all(np.array_equal(r[key], runs) for r in results[1:]):
        problems.append(f"{key}: the processes disagree")
    # Equal to one device, to float32 summation order.
    reference = references[version]
    worst = (0.0, 0.0, 0.0)
    for key in keys:
      errors = _errors(first[key][0], reference[key.split(".", 1)[1]][0])
      if errors[0] > 1:
        problems.append(
          f"{key}: |2 processes - 1 device| up to {errors[1]:.2e} ({errors[0]:.1f}x the tolerance)"
        )
      worst = tuple(max(a, b) for a, b in zip(worst, errors))
    report.append(f"{version}: max abs {worst[1]:.1e}, relative to max {worst[2]:.1e}")
    # The global normaliser: the per-shard mean is far off (so the check above can fail).
    if version != "materialised":
      wrong = _per_shard_mean(version)
      if abs(wrong - first[f"{version}.loss"][0, 0]) < 100 * (ATOL + RTOL * abs(wrong)):
        problems.append(f"{version}: the per-shard mean {wrong} is the global mean too")

  # The evaluation metric: gathered over the processes, or psum-ed over the mesh.
  metric = worker.metric_values(None)
  for key, want in metric.items():
    for i, r in enumerate(results):
      got = r[key]
      if got[2] != want[2] or not np.allclose(got[:2], want[:2], rtol=RTOL, atol=ATOL):
        problems.append(f"process {i}: {key} [compute, total, count] = {got}, one device {want}")

  print(f"two processes (and the reference): {seconds:.1f} s; vs one device: " + "; ".join(report))
  assert not problems, "\n".join(problems) + "\n--- process 0:\n" + outputs[0][-2000:]


# -- the example --------------------------------------------------------------------------------


def _example():
  spec = importlib.util.spec_from_file_location("multihost_distillation", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


SMALL = ["--steps", "2", "--batch", "8", "--seq", "8", "--vocab", "256", "--hidden", "16"]
SMALL += ["--embed", "8", "--timeout", str(TIMEOUT_S - 10)]  # the example's own time limit


def test_example_runs_on_two_processes(tmp_path):
  example = _example()
  (output,), reference = _run(
    [[sys.executable, str(EXAMPLE), *SMALL]],
    tmp_path,
    TIMEOUT_S,
    lambda: example.single_device_losses(example.parse_args(SMALL)),
  )
  losses = {
    m["name"]: [float(x) for x in m["losses"].split()]
    for m in re.finditer(
      r"^(?P<name>[\w ()]+): loss per step (?P<losses>[\d. ]+?)\s+\(", output, re.M
    )
  }
  assert set(losses) == set(example.VERSIONS), output[-3000:]
  assert "per-device memory" in output and "temporaries" in output, output[-3000:]
  for name, got in losses.items():
    np.testing.assert_allclose(got, reference, rtol=RTOL, atol=1e-5, err_msg=name)
