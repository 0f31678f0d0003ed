"""Every loss under ``jax.jit`` with ``NamedSharding`` inputs equals the single-device result.

``multidevice`` tests (8 simulated CPU devices, see ``_multidevice.py``). For
each loss, mesh and layout the inputs are placed with ``NamedSharding``
(batch-sharded, or batch x class-sharded) and ``jax.jit`` of the value and
the gradients wrt every floating input is compared with the same computation
on one device. Errors are relative to the largest magnitude of the
single-device result. The module fixture ``summary`` runs every case at once;
each (loss, mesh, layout) is asserted as its own test, so a failure names them.
"""

import os
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _public_calls import PUBLIC_CALLS
from _public_calls import inputs as public_inputs
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kldiv_jax as kd

# convex_kl_divergence is optax's deprecated alias: it warns on every call.
pytestmark = pytest.mark.filterwarnings("ignore:The function convex_kl_divergence is deprecated")

NUM_DEVICES = 8
MESHES = {"8": (8,), "2x4": (2, 4), "4x2": (4, 2)}
# (8,) has one axis: batch only. 2-D meshes: the batch over both axes, or
# the batch over "data" and the class (vocabulary) axis over "vocab".
LAYOUTS = {"8": ("batch",), "2x4": ("batch", "batch_vocab"), "4x2": ("batch", "batch_vocab")}
AXIS_NAMES = {1: ("data",), 2: ("data", "vocab")}
# Every public call (_public_calls), and variants: other reductions, masks, -inf, more rows.
VARIANTS = (
  "kl_div[none]",
  "kl_div[mean]",
  "kl_div[batchmean]",
  "kl_div[batchmean,3d]",
  "kl_div[batchmean,log_target]",
  "KLDivLoss[batchmean,log_target]",
  "kl_div_pointwise[log_target]",
  "kl_divergence[where]",
  "kl_div_from_logits[forward,-inf,where]",
  "kl_div_from_logits[reverse,class_mask]",
  "kl_div_from_logits[row_blocks]",
  "distillation_loss[forward_kl,labels]",
  "distillation_loss[jsd,where,normalizer]",
  "kl_estimate[k1]",
  "kl_estimate[k3,clip]",
  "gaussian_kl[prior_arrays]",
  "kl_div_from_topk[-inf_slots]",
  "kl_div_from_topk[slot_mask]",
  "fused_distillation_loss[where]",
)
CASES = (*PUBLIC_CALLS, *VARIANTS)
# The kind of data each role of _public_calls is (see _cases).
ROLE_KINDS = {"labels": "b", "idx": "b", "topk_lp": "b", "lp": "b", "ref_lp": "b", "adv": "b"}
ROLE_KINDS |= {"h": "b", "th": "b", "w": "w", "tw": "w", "b": "w", "tb": "w"}


def _public_cases(B, V):
  """The cases of the public calls: ``{name: (fn, args)}`` as :func:`_cases`."""
  data = public_inputs(B, V, 8, 4, seed=3, scale=2.0)
  cases = {}
  for name, call in PUBLIC_CALLS.items():
    fn = call.positional(**({"chunk_size": 4} if call.chunked else {}))
    args = [
      (data[role], ROLE_KINDS.get(role, "bc"), i in call.argnums)
      for i, role in enumerate(call.roles)
    ]
    cases[name] = (fn, args)
  return cases


# Relative tolerance (float32, reductions reordered).
RTOL = 2e-6


def _cases(rng):
  """``{name: (fn, args)}``; ``args`` are ``(array, kind, differentiable)``.

  Kinds: ``"bc"`` batch on axis 0 and classes on the last axis, ``"b"``
  batch on axis 0 only, ``"w"`` a ``[hidden, vocab]`` weight (classes last),
  ``"r"`` replicated.
  """
  B, V = 16, 16

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)

  def logits(*shape):
    return rng.normal(scale=2.0, size=shape).astype(np.float32)

  x = log_softmax(logits(B, V))
  p = np.exp(log_softmax(logits(B, V)))
  p[0, :3] = 0.0  # zero-mass targets
  log_t = log_softmax(logits(B, V))
  log_t[1, 2] = -np.inf
  x3, p3 = log_softmax(logits(B, 3, 8)), np.exp(log_softmax(logits(B, 3, 8)))
  example_mask = rng.uniform(size=B) > 0.3
  z, y = logits(B, V), logits(B, V)
  y_inf = y.copy()
  y_inf[2, :4] = -np.inf
  class_mask = rng.uniform(size=(B, V)) > 0.2
  class_mask[:, 0] = True
  labels = rng.integers(0, V, size=B).astype(np.int32)
  labels[3] = -100
  rows = 8200  # more rows than one CPU block of kl_div_from_logits (2**17 / 16)
  zr, yr = logits(rows, V), logits(rows, V)
  tok_lp = (-rng.exponential(size=(B, 8))).astype(np.float32)
  tok_ref = (-rng.exponential(size=(B, 8))).astype(np.float32)
  mean, log_var = logits(B, 8), logits(B, 8) * 0.3
  prior_mean, prior_log_var = logits(B, 8), logits(B, 8) * 0.3
  k = 4
  teacher = logits(B, V)
  ids = np.argsort(-teacher, axis=-1)[:, :k].astype(np.int32)
  lp = np.take_along_axis(log_softmax(teacher), ids, axis=-1)
  lp_inf = lp.copy()
  lp_inf[5, 2:] = -np.inf
  slot_mask = rng.uniform(size=(B, k)) > 0.25
  H = 8
  hidden, weight = logits(B, H), logits(H, V) * 0.3
  t_hidden, t_weight = logits(B, H), logits(H, V) * 0.3

  def kl_div(reduction, **kw):
    def fn(a, b):
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 'mean' warns, as torch
        return kd.kl_div(a, b, reduction=reduction, **kw)

    return fn

  return _public_cases(B, V) | {
    "kl_div[none]": (kl_div("none"), [(x, "bc", True), (p, "bc", True)]),
    "kl_div[mean]": (kl_div("mean"), [(x, "bc", True), (p, "bc", True)]),
    "kl_div[batchmean]": (kl_div("batchmean"), [(x, "bc", True), (p, "bc", True)]),
    "kl_div[batchmean,3d]": (kl_div("batchmean"), [(x3, "bc", True), (p3, "bc", True)]),
    "kl_div[batchmean,log_target]": (
      kl_div("batchmean", log_target=True),
      [(x, "bc", True), (log_t, "bc", True)],
    ),
    "KLDivLoss[batchmean,log_target]": (
      lambda a, b: kd.KLDivLoss(reduction="batchmean", log_target=True)(a, b),
      [(x, "bc", True), (log_t, "bc", True)],
    ),
    "kl_div_pointwise[log_target]": (
      lambda a, b: kd.kl_div_pointwise(a, b, log_target=True),
      [(x, "bc", True), (log_t, "bc", True)],
    ),
    "kl_divergence[where]": (
      lambda a, b, w: kd.kl_divergence(a, b, where=w),
      [(x, "bc", True), (p, "bc", True), (example_mask, "b", False)],
    ),
    "kl_div_from_logits[forward,-inf,where]": (
      lambda a, b, w: kd.kl_div_from_logits(a, b, temperature=2.0, where=w),
      [(z, "bc", True), (y_inf, "bc", True), (example_mask, "b", False)],
    ),
    "kl_div_from_logits[reverse,class_mask]": (
      lambda a, b, w: kd.kl_div_from_logits(a, b, direction="reverse", where=w),
      [(z, "bc", True), (y, "bc", True), (class_mask, "bc", False)],
    ),
    "kl_div_from_logits[row_blocks]": (
      lambda a, b: kd.kl_div_from_logits(a, b, temperature=1.5),
      [(zr, "bc", True), (yr, "bc", True)],
    ),
    "distillation_loss[forward_kl,labels]": (
      lambda a, b, lab: kd.distillation_loss(a, b, lab, temperature=2.0, alpha=0.7),
      [(z, "bc", True), (y, "bc", True), (labels, "b", False)],
    ),
    "distillation_loss[jsd,where,normalizer]": (
      lambda a, b, w: kd.distillation_loss(
        a, b, divergence="jsd", beta=0.4, temperature=1.5, where=w, normalizer=20.0
      ),
      [(z, "bc", True), (y, "bc", True), (example_mask, "b", False)],
    ),
    "kl_estimate[k1]": (
      lambda a, b: kd.kl_estimate(a, b, estimator="k1"),
      [(tok_lp, "bc", True), (tok_ref, "bc", True)],
    ),
    "kl_estimate[k3,clip]": (
      lambda a, b: kd.kl_estimate(a, b, estimator="k3", clip=1.0),
      [(tok_lp, "bc", True), (tok_ref, "bc", True)],
    ),
    "gaussian_kl[prior_arrays]": (
      lambda m, lv, pm, plv: kd.gaussian_kl(m, lv, pm, plv),
      [
        (mean, "bc", True),
        (log_var, "bc", True),
        (prior_mean, "bc", True),
        (prior_log_var, "bc", True),
      ],
    ),
    "kl_div_from_topk[-inf_slots]": (
      lambda a, i, b: kd.kl_div_from_topk(a, i, b, temperature=1.5),
      [(z, "bc", True), (ids, "b", False), (lp_inf, "b", True)],
    ),
    "kl_div_from_topk[slot_mask]": (
      lambda a, i, b, w: kd.kl_div_from_topk(a, i, b, where=w),
      [(z, "bc", True), (ids, "b", False), (lp, "b", True), (slot_mask, "b", False)],
    ),
    "fused_distillation_loss[where]": (
      lambda h, w, th, tw, m: kd.fused_distillation_loss(
        h, w, th, tw, temperature=2.0, where=m, chunk_size=4
      ),
      [
        (hidden, "b", True),
        (weight, "w", True),
        (t_hidden, "b", False),
        (t_weight, "w", False),
        (example_mask, "b", False),
      ],
    ),
  }


def _spec(kind, ndim, mesh_axes, layout):
  if kind == "r":
    return P()
  if layout == "batch":
    batch, vocab = (mesh_axes if len(mesh_axes) > 1 else mesh_axes[0]), None
  else:
    batch, vocab = "data", "vocab"
  if kind == "w":
    return P(*([None] * (ndim - 1)), vocab)
  if kind == "b" or ndim == 1:
    return P(batch, *([None] * (ndim - 1)))
  return P(batch, *([None] * (ndim - 2)), vocab)


def _value_and_grads(fn, args, cotangent):
  """``(value, grads)``: grads of ``sum(value * cotangent)`` wrt the differentiable args."""
  diff = [i for i, (_, _, d) in enumerate(args) if d]

  def loss(*arrays):
    out = fn(*arrays)
    return jnp.sum(out * cotangent) if out.ndim else out, out

  def run(*arrays):
    grads, out = jax.grad(loss, argnums=diff, has_aux=True)(*arrays)
    return out, grads

  return run


def _rel_err(got, want):
  """Max ``|got - want|`` over the finite ``want``, relative to its largest magnitude.

  ``inf`` if the shapes differ, NaNs sit elsewhere, an infinite ``want`` is
  not matched exactly, or ``got`` is not finite where ``want`` is.
  """
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape or np.any(np.isnan(got) != np.isnan(want)):
    return float("inf")
  infinite = np.isinf(want)
  if np.any(got[infinite] != want[infinite]):
    return float("inf")
  fin = np.isfinite(want)
  if not np.all(np.isfinite(got[fin])):
    return float("inf")
  scale = max(float(np.max(np.abs(want[fin]), initial=0.0)), 1e-30)
  return float(np.max(np.abs(got[fin] - want[fin]), initial=0.0)) / scale


@pytest.fixture(scope="module")
def summary(cpu_devices) -> dict:
  """Every case on every mesh and layout, and one device: ``{"results": [...], "extra": {...}}``.

  Every case of one layout runs in one program; the programs (one per layout
  and the single-device reference) compile in parallel threads. A program
  that fails is rerun case by case, so that a failure names its loss.
  """
  start = time.perf_counter()
  devices = cpu_devices
  cases = _cases(np.random.default_rng(0))
  assert set(cases) == set(CASES)
  runs = {}
  for name in CASES:
    fn, args = cases[name]
    out_shape = jax.eval_shape(fn, *[a for a, _, _ in args])
    cot = np.random.default_rng(1).normal(size=out_shape.shape).astype(np.float32)
    runs[name] = _value_and_grads(fn, args, cot)

  def run_all(batch):
    return {name: runs[name](*arrays) for name, arrays in batch.items()}

  def one_by_one(batch):
    out = {}
    for name, arrays in batch.items():
      try:
        v, gs = jax.jit(runs[name])(*arrays)
        out[name] = (np.asarray(v), [np.asarray(g) for g in gs])
      except Exception:
        out[name] = traceback.format_exc(limit=4)
    return out

  batches = {
    ("single", ""): {n: [jax.device_put(a, devices[0]) for a, _, _ in cases[n][1]] for n in CASES}
  }
  for mesh_name, shape in MESHES.items():
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(shape), AXIS_NAMES[len(shape)])
    for layout in LAYOUTS[mesh_name]:
      batches[mesh_name, layout] = {
        n: [
          jax.device_put(a, NamedSharding(mesh, _spec(kind, np.ndim(a), mesh.axis_names, layout)))
          for a, kind, _ in cases[n][1]
        ]
        for n in CASES
      }
  jitted = jax.jit(run_all)
  lowered = {}
  for key, batch in batches.items():
    try:
      lowered[key] = jitted.lower(batch)
    except Exception:
      lowered[key] = None

  def compile_one(key):
    try:
      return key, lowered[key].compile() if lowered[key] is not None else None
    except Exception:
      return key, None

  with ThreadPoolExecutor(max_workers=max(1, min(len(batches), os.cpu_count() or 1))) as pool:
    compiled = dict(pool.map(compile_one, batches))
  outputs = {}
  for key, batch in batches.items():
    try:
      out = compiled[key](batch)
      outputs[key] = {n: (np.asarray(v), [np.asarray(g) for g in gs]) for n, (v, gs) in out.items()}
    except Exception:
      outputs[key] = one_by_one(batch)

  single = outputs["single", ""]
  results = []
  for (mesh_name, layout), sharded in outputs.items():
    if mesh_name == "single":
      continue
    for n in CASES:
      row = {"loss": n, "mesh": mesh_name, "layout": layout}
      want, got = single[n], sharded[n]
      if isinstance(want, str):
        row.update(status="error", message="single device: " + want)
      elif isinstance(got, str):
        row.update(status="error", message=got)
      else:
        row.update(
          status="ok",
          value_err=_rel_err(got[0], want[0]),
          grad_err=max(_rel_err(g, w) for g, w in zip(got[1], want[1])),
          input_shards=len(
            {str(s.index) for s in batches[mesh_name, layout][n][0].addressable_shards}
          ),
        )
      results.append(row)

  # batchmean divides by the global batch size: check against float64 NumPy too.
  fn, args = cases["kl_div[batchmean]"]
  x, p = (np.asarray(a, np.float64) for a, _, _ in args)
  terms = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - x), 0.0)
  expected = terms.sum() / x.shape[0]
  mesh = jax.sharding.Mesh(np.asarray(devices).reshape(2, 4), ("data", "vocab"))
  placed = [jax.device_put(a, NamedSharding(mesh, P("data", "vocab"))) for a, _, _ in args]
  got = float(jax.jit(fn)(*placed))
  extra = {
    "batchmean_numpy_rel_err": abs(got - expected) / abs(expected),
    "seconds": time.perf_counter() - start,
  }
  return {"devices": len(jax.devices()), "results": results, "extra": extra}


PARAMS = [
  (loss, mesh, layout) for loss in CASES for mesh, layouts in LAYOUTS.items() for layout in layouts
]


@pytest.mark.multidevice
@pytest.mark.parametrize(("loss", "mesh", "layout"), PARAMS)
def test_sharded_equals_single_device(summary, loss, mesh, layout):
  rows = [
    r for r in summary["results"] if (r["loss"], r["mesh"], r["layout"]) == (loss, mesh, layout)
  ]
  assert len(rows) == 1, f"no result for {loss} on mesh {mesh} ({layout})"
  row = rows[0]
  assert row["status"] == "ok", f"{loss} on mesh {mesh} ({layout}) raised:\n{row['message']}"
  # The inputs really were split over the devices.
  assert row["input_shards"] > 1
  if layout == "batch":
    assert row["input_shards"] == NUM_DEVICES
  assert row["value_err"] <= RTOL, (
    f"{loss} on mesh {mesh} ({layout}): value differs from one device by "
    f"{row['value_err']:.3g} (relative)"
  )
  assert row["grad_err"] <= RTOL, (
    f"{loss} on mesh {mesh} ({layout}): gradients differ from one device by "
    f"{row['grad_err']:.3g} (relative)"
  )


@pytest.mark.multidevice
def test_eight_devices(summary):
  assert summary["devices"] == NUM_DEVICES


@pytest.mark.multidevice
def test_batchmean_divides_by_global_batch(summary):
  # kl_div(reduction="batchmean") on a (2, 4) batch x vocab mesh against float64 NumPy.
  assert summary["extra"]["batchmean_numpy_rel_err"] <= 1e-6


def test_rel_err_detects_differences():
  # The comparison the sharded tests make can fail.
  want = np.array([1.0, -2.0, np.inf, 0.0])
  assert _rel_err(want, want) == 0.0
  assert _rel_err(want + np.array([0, 1e-3, 0, 0]), want) == pytest.approx(5e-4)
  assert _rel_err(np.array([1.0, -2.0, 5.0, 0.0]), want) == np.inf
  assert _rel_err(np.array([1.0, np.nan, np.inf, 0.0]), want) == np.inf
  assert _rel_err(want[:3], want) == np.inf
  assert _rel_err(np.array(3.0), np.array(3.0)) == 0.0
