"""Vocabulary parallelism (``axis_name``): sharded == unsharded on 8 simulated devices.

The device count of the CPU backend is fixed when JAX starts, so the sharded
programs run in one subprocess, ``tests/_vocab_parallel_worker.py`` (with
``--xla_force_host_platform_device_count=8``); the tests here read its JSON
report. Each case runs inside ``jax.shard_map`` with the class axis split over
the mesh axis ``"vocab"`` (and the batch over ``"data"`` on the (2, 4) and
(4, 2) meshes) and is compared, value and gradients, with the unsharded call.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import _vocab_parallel_worker as worker  # tests/ is on sys.path (pytest's rootdir import)
import jax.numpy as jnp
import numpy as np
import pytest

import kldiv_jax as kd

WORKER = Path(worker.__file__)
CASES = [(name, mesh) for name, case in worker._cases(np, kd).items() for mesh in case.meshes]
IDS = [f"{name}-{mesh}" for name, mesh in CASES]


@pytest.fixture(scope="module")
def report():
  env = dict(os.environ)
  flag = f"--xla_force_host_platform_device_count={worker.NUM_DEVICES}"
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
    [sys.executable, str(WORKER)], env=env, capture_output=True, text=True, timeout=900
  )
  lines = proc.stdout.strip().splitlines()
  if proc.returncode != 0 or not lines:
    pytest.fail(f"worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
  payload = json.loads(lines[-1])
  assert payload["devices"] == worker.NUM_DEVICES
  payload["by_case"] = {(r["case"], r["mesh"]): r for r in payload["results"]}
  return payload


def _result(report, name, mesh):
  r = report["by_case"].get((name, mesh))
  assert r is not None, f"{name} on mesh {mesh} did not run"
  assert not r["message"], f"{name} on mesh {mesh} raised: {r['message']}"
  return r


@pytest.mark.parametrize(("name", "mesh"), CASES, ids=IDS)
def test_sharded_equals_unsharded(report, name, mesh):
  r = _result(report, name, mesh)
  # Errors are in units of the tolerance (atol 1e-6 + rtol 1e-5 |expected|).
  assert r["value_err"] <= 1.0, r
  assert max(r["grad_errs"]) <= 1.0, r
  assert r["nonfinite_match"], r


@pytest.mark.parametrize(("name", "mesh"), CASES, ids=IDS)
def test_only_per_row_values_cross_devices(report, name, mesh):
  """No all-gather (or other data movement) in the compiled program, and no
  collective whose result is vocabulary-sized.

  On the 1-D mesh every collective is over ``"vocab"``: none may have a
  dimension of the local vocabulary slice either. On (data, vocab) meshes
  the weight gradient of the fused loss is summed over ``"data"`` (plain data
  parallelism): a local-slice-sized all-reduce there is expected.
  """
  r = _result(report, name, mesh)
  ops = {op for op, _ in r["collectives"]}
  assert ops, "no collective at all: the softmax statistics were not combined"
  assert ops <= {"all-reduce", "all-reduce-start"}, ops
  shape, names = worker.MESHES[mesh]
  forbidden = {worker.VOCAB}
  if len(shape) == 1:
    forbidden.add(worker.VOCAB // shape[names.index("vocab")])
  for op, result in r["collectives"]:
    dims = {int(d) for d in _dims(result)}
    assert not dims & forbidden, f"{op} of vocabulary size: {result}"


def _dims(shape_text: str) -> list[str]:
  return re.findall(r"\d+", " ".join(re.findall(r"\[([\d,]*)\]", shape_text)))


def test_every_case_and_mesh_ran(report):
  assert {(r["case"], r["mesh"]) for r in report["results"]} == set(CASES)
  meshes = {mesh for _, mesh in CASES}
  assert meshes == set(worker.MESHES)


def test_negative_controls(report):
  """A shard's own softmax (no axis_name) is far off, and gathering the
  vocabulary shows up as a vocabulary-sized all-gather: both checks can fail."""
  assert isinstance(report["controls"], list), report["controls"]
  by_axis = {c["axis_name"]: c for c in report["controls"]}
  assert by_axis["vocab"]["value_err"] <= 1.0
  assert by_axis[None]["value_err"] > 1e3
  gathers = [res for op, res in by_axis["all_gather"]["collectives"] if "all-gather" in op]
  assert any(worker.VOCAB in {int(d) for d in _dims(res)} for res in gathers), by_axis["all_gather"]


def test_second_order(report):
  """jax.hessian and jax.jvp through the sharded kernels equal the unsharded ones."""
  assert isinstance(report["second_order"], list), report["second_order"]
  assert {r["loss"] for r in report["second_order"]} == {
    "kl[reverse,T=1.5]",
    "jsd[beta=0.3]",
    "distill[forward_kl,labels]",
  }
  for r in report["second_order"]:
    assert r["hessian_err"] <= 1.0 and r["jvp_err"] <= 1.0, r


def test_per_device_temp_memory(report):
  """Compiled per-device temp bytes, 8-way vocabulary parallel vs one device: at most 0.2x."""
  assert isinstance(report["memory"], list), report["memory"]
  for row in report["memory"]:
    assert row["sharded"] <= 0.2 * row["single"], row


# Bad input, in this process (no devices needed).


FUNCTIONS = {
  "kl_div_from_logits": lambda a, **kw: kd.kl_div_from_logits(a, a, **kw),
  "generalized_jsd": lambda a, **kw: kd.generalized_jsd(a, a, **kw),
  "distillation_loss": lambda a, **kw: kd.distillation_loss(a, a, **kw),
  "fused_linear_kl_div": lambda a, **kw: kd.fused_linear_kl_div(a, a, a, a, **kw),
}


@pytest.mark.parametrize("fn", FUNCTIONS.values(), ids=FUNCTIONS.keys())
def test_axis_name_outside_shard_map_raises(fn):
  x = jnp.ones((3, 3))
  with pytest.raises(ValueError, match="axis_name='vocab' is not a mesh axis"):
    fn(x, axis_name="vocab")


@pytest.mark.parametrize("fn", FUNCTIONS.values(), ids=FUNCTIONS.keys())
def test_axis_name_must_be_a_string(fn):
  with pytest.raises(TypeError, match="axis_name must be a str"):
    fn(jnp.ones((3, 3)), axis_name=0)
