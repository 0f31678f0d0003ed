"""Vocabulary parallelism (``axis_name``): sharded == unsharded on 8 simulated devices.

``multidevice`` tests (see ``_multidevice.py``). Each case runs inside
``jax.shard_map`` with the class axis split over the mesh axis ``"vocab"``
(and the batch over ``"data"`` on the (2, 4) and (4, 2) meshes), under
``jax.jit`` of ``value_and_grad``, and is compared, value and gradients, with
the unsharded call. The compiled HLO of every sharded program is searched for
collectives.

Errors are ``max |sharded - unsharded| / (atol + rtol |unsharded|)`` over
finite entries (``<= 1`` passes), with ``atol = 1e-6``, ``rtol = 1e-5``;
``nonfinite_match`` says whether the infinities and NaNs sit at the same
places with the same values. The negative controls (a loss called without
``axis_name`` on a shard, which must differ, and a program that all-gathers
the vocabulary, whose collectives the HLO check must catch) show that the
checks can fail.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _public_calls import PUBLIC_CALLS
from _public_calls import inputs as public_inputs
from _references import collectives, compare_finite
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kldiv_jax as kd

NUM_DEVICES = 8
ATOL, RTOL = 1e-6, 1e-5
MESHES = {
  "8": ((8,), ("vocab",)),
  "2x4": ((2, 4), ("data", "vocab")),
  "4x2": ((4, 2), ("data", "vocab")),
}
BATCH, VOCAB = 8, 32  # 8 rows split over "data" (2 or 4), 32 classes over "vocab" (8, 4 or 2)
HIDDEN, TEACHER_HIDDEN = 5, 3  # fused: neither a vocabulary size, for the HLO check


def _inputs():
  """Logits with ``-inf`` classes, masks and labels (float32), seeded."""
  rng = np.random.default_rng(0)
  s = (2.0 * rng.normal(size=(BATCH, VOCAB))).astype(np.float32)
  t = (2.0 * rng.normal(size=(BATCH, VOCAB))).astype(np.float32)
  s[0, :5] = -np.inf  # student mass missing on classes the teacher has: forward KL = +inf
  t[1, 3:9] = -np.inf  # teacher without mass on a few classes
  s[2, :] = t[2, :] = -np.inf  # an all -inf row on both sides: 0
  t[3, : VOCAB // 2] = -np.inf  # the teacher's row empty on the first half of the devices
  s[4, VOCAB // 2 :] = t[4, VOCAB // 2 :] = -np.inf  # both rows empty on the second half
  class_mask = rng.random((1, VOCAB)) > 0.25
  class_mask[0, :4] = False  # a device's whole slice masked on the (8,) mesh
  row_mask = np.array([True, True, False, True, True, False, True, True])
  labels = rng.integers(0, VOCAB, size=BATCH).astype(np.int32)
  labels[1] = -100  # ignore_index
  labels[5] = VOCAB - 1  # the last class (the last device)
  labels[6] = 0
  labels[3] = VOCAB - 2  # where the teacher has mass
  return {"s": s, "t": t, "class_mask": class_mask, "row_mask": row_mask, "labels": labels}


def _fused_inputs():
  rng = np.random.default_rng(1)
  return {
    "h": rng.normal(size=(BATCH, HIDDEN)).astype(np.float32),
    "w": rng.normal(size=(HIDDEN, VOCAB)).astype(np.float32),
    "b": rng.normal(size=(VOCAB,)).astype(np.float32),
    "th": rng.normal(size=(BATCH, TEACHER_HIDDEN)).astype(np.float32),
    "tw": rng.normal(size=(TEACHER_HIDDEN, VOCAB)).astype(np.float32),
    "tb": rng.normal(size=(VOCAB,)).astype(np.float32),
    "where": np.array([True, False, True, True, True, True, False, True]),
  }


ALL, TWO = ("8", "2x4", "4x2"), ("8", "2x4")


class Case:
  """``loss(*args, axis_name=...)`` with its in_specs, differentiated args and meshes."""

  def __init__(self, loss, args, specs, argnums, meshes, per_example):
    self.loss, self.args, self.specs = loss, args, specs
    self.argnums, self.meshes, self.per_example = argnums, meshes, per_example


def _cases():
  """Case name -> :class:`Case`. ``specs(data)`` gives the in_specs, ``data``
  the batch mesh axis (None on the 1-D mesh)."""
  x = _inputs()
  s, t, class_mask, row_mask, labels = (x["s"], x["t"], x["class_mask"], x["row_mask"], x["labels"])
  logits = lambda data: P(data, "vocab")  # noqa: E731
  classes = lambda data: P(None, "vocab")  # noqa: E731
  rows = lambda data: P(data)  # noqa: E731
  scalar = lambda data: P()  # noqa: E731
  cases = {}

  def per_example(name, loss, extra, extra_specs, argnums=(0, 1), meshes=ALL):
    cases[name] = Case(
      loss,
      (s, t, *extra),
      lambda d: (logits(d), logits(d), *[f(d) for f in extra_specs]),
      argnums,
      meshes,
      True,
    )

  kl, jsd = kd.kl_div_from_logits, kd.generalized_jsd
  per_example(
    "kl[forward,T=2,-inf,class_mask]",
    lambda a, b, m, axis_name=None: kl(a, b, temperature=2.0, where=m, axis_name=axis_name),
    (class_mask,),
    (classes,),
  )
  per_example(
    "kl[reverse,traced_T,row_where]",
    lambda a, b, T, m, axis_name=None: kl(
      a, b, temperature=T, direction="reverse", where=m, axis_name=axis_name
    ),
    (np.float32(1.7), row_mask),
    (scalar, rows),
    argnums=(0, 1, 2),
  )
  per_example(
    "jsd[beta=0.3,T=1.5]",
    lambda a, b, axis_name=None: jsd(a, b, beta=0.3, temperature=1.5, axis_name=axis_name),
    (),
    (),
  )
  per_example(  # TRL's endpoints: forward and reverse KL
    "jsd[beta=0]+jsd[beta=1,class_mask]/2",
    lambda a, b, m, axis_name=None: (
      jsd(a, b, beta=0.0, axis_name=axis_name)
      + 0.5 * jsd(a, b, beta=1.0, where=m, axis_name=axis_name)
    ),
    (class_mask,),
    (classes,),
    meshes=TWO,
  )
  per_example(
    "jsd[traced_beta=0.7]",
    lambda a, b, beta, axis_name=None: jsd(a, b, beta=beta, axis_name=axis_name),
    (np.float32(0.7),),
    (scalar,),
    argnums=(0, 1, 2),
    meshes=("8",),
  )

  # distillation_loss: finite logits (the cross entropy of a label without
  # mass is +inf); labels with ignore_index; with a normalizer, the data
  # shards' losses are summed over "data" (see run_case).
  sf = np.where(np.isfinite(s), s, -3.0).astype(np.float32)
  tf = np.where(np.isfinite(t), t, -30.0).astype(np.float32)
  valid = float(np.sum(labels != -100))
  distill = kd.distillation_loss
  mask_with_labels = class_mask.copy()
  mask_with_labels[0, labels[labels >= 0]] = True  # labels on classes with mass

  def scalar_case(name, loss, extra, extra_specs, meshes=ALL):
    cases[name] = Case(
      loss,
      (sf, tf, *extra),
      lambda d: (logits(d), logits(d), *[f(d) for f in extra_specs]),
      (0, 1),
      meshes,
      False,
    )

  scalar_case(
    "distill[forward_kl,labels,T=2,alpha=0.4,normalizer]",
    lambda a, b, y, axis_name=None: distill(
      a, b, y, temperature=2.0, alpha=0.4, normalizer=valid, axis_name=axis_name
    ),
    (labels,),
    (rows,),
  )
  scalar_case(
    "distill[reverse_kl,labels,class_mask,normalizer]",
    lambda a, b, y, m, axis_name=None: distill(
      a,
      b,
      y,
      divergence="reverse_kl",
      temperature=1.5,
      where=m,
      normalizer=valid,
      axis_name=axis_name,
    ),
    (labels, mask_with_labels),
    (rows, classes),
    meshes=TWO,
  )
  scalar_case(
    "distill[jsd,row_where,no_labels,normalizer]",
    lambda a, b, m, axis_name=None: distill(
      a,
      b,
      divergence="jsd",
      beta=0.3,
      where=m,
      normalizer=float(row_mask.sum()),
      axis_name=axis_name,
    ),
    (row_mask,),
    (rows,),
    meshes=("8", "4x2"),
  )
  scalar_case(  # the cross entropy's options: K, the kept classes, counted over the devices
    "distill[labels,class_mask,label_smoothing,z_loss,normalizer]",
    lambda a, b, y, m, axis_name=None: distill(
      a,
      b,
      y,
      temperature=2.0,
      where=m,
      normalizer=valid,
      label_smoothing=0.2,
      z_loss=0.01,
      axis_name=axis_name,
    ),
    (labels, mask_with_labels),
    (rows, classes),
    meshes=TWO,
  )
  scalar_case(
    "distill[forward_kl,labels,mean]",
    lambda a, b, y, axis_name=None: distill(a, b, y, temperature=3.0, axis_name=axis_name),
    (labels,),
    (rows,),
    meshes=("8",),
  )

  f = _fused_inputs()
  n_where = float(f["where"].sum())

  def fused_case(name, meshes, **kw):
    def loss(h, w, b, th, tw, tb, where, axis_name=None):
      return kd.fused_distillation_loss(
        h, w, th, tw, bias=b, target_bias=tb, where=where, axis_name=axis_name, **kw
      )

    args = (f["h"], f["w"], f["b"], f["th"], f["tw"], f["tb"], f["where"])
    head, bias = classes, lambda d: P("vocab")

    def specs(d):
      return (rows(d), head(d), bias(d), rows(d), head(d), bias(d), rows(d))

    cases[name] = Case(loss, args, specs, (0, 1, 2), meshes, False)

  fused_case(
    "fused[forward_kl,T=2,chunk=3,normalizer]",
    ALL,
    temperature=2.0,
    chunk_size=3,
    normalizer=n_where,
  )
  fused_case("fused[jsd,beta=0.3,normalizer]", TWO, divergence="jsd", beta=0.3, normalizer=n_where)
  fused_case(
    "fused[reverse_kl,chunk=1,T=0.5,no_T2,normalizer]",
    ("8", "4x2"),
    divergence="reverse_kl",
    chunk_size=1,
    temperature=0.5,
    scale_by_temperature_squared=False,
    normalizer=n_where,
  )
  fused_case("fused[forward_kl,mean]", ("8",))
  fused_labels = np.arange(BATCH) * 5 % VOCAB
  fused_labels[3] = -100
  fused_case(  # the tokens whole on the 1-D mesh: the labels a constant
    "fused[labels,label_smoothing,z_loss,chunk=3]",
    ("8",),
    labels=fused_labels,
    label_smoothing=0.2,
    z_loss=0.01,
    chunk_size=3,
  )
  return cases


def _compare(got, ref):
  """(relative error over finite entries, whether the non-finite entries match)."""
  return compare_finite(got, ref, ATOL, RTOL)


def run_case(devices, name, case, mesh_name, reference):
  shape, names = MESHES[mesh_name]
  mesh = jax.sharding.Mesh(np.array(devices[: int(np.prod(shape))]).reshape(shape), names)
  data = "data" if "data" in names else None
  loss, args, argnums, per_example = case.loss, case.args, case.argnums, case.per_example
  weights = np.random.default_rng(2).normal(size=BATCH).astype(np.float32)

  def objective(fn):
    def obj(*a):
      out = fn(*a)
      if per_example:  # a weighted sum of the finite per-example values
        return jnp.sum(jnp.where(jnp.isfinite(out), out * weights, 0.0)), out
      return out, out

    return obj

  def sharded_loss(*a):
    out = loss(*a, axis_name="vocab")
    if not per_example and data is not None:
      out = lax.psum(out, data)
    return out

  out_spec = P(data) if per_example else P()
  sharded = jax.shard_map(sharded_loss, mesh=mesh, in_specs=case.specs(data), out_specs=out_spec)
  vg = lambda fn: jax.value_and_grad(objective(fn), argnums=argnums, has_aux=True)  # noqa: E731
  if name not in reference:  # the unsharded program, once per case
    reference[name] = jax.jit(vg(loss))(*args)
  (_, ref_val), ref_grads = reference[name]
  compiled = jax.jit(vg(sharded)).lower(*args).compile()
  (_, val), grads = compiled(*args)
  value_err, match = _compare(val, ref_val)
  grad_errs = []
  for g, r in zip(grads, ref_grads):
    err, m = _compare(g, r)
    grad_errs.append(err)
    match = match and m
  return {
    "case": name,
    "mesh": mesh_name,
    "value_err": value_err,
    "grad_errs": grad_errs,
    "nonfinite_match": match,
    "collectives": collectives(compiled.as_text()),
    "message": "",
  }


def negative_controls(devices):
  """Each shard's own softmax (no axis_name) must differ from the unsharded result."""
  x = _inputs()
  s = np.where(np.isfinite(x["s"]), x["s"], -3.0).astype(np.float32)
  t = np.where(np.isfinite(x["t"]), x["t"], -3.0).astype(np.float32)
  mesh = jax.sharding.Mesh(np.array(devices), ("vocab",))
  out = []
  for axis_name in (None, "vocab"):

    def local(a, b, axis_name=axis_name):
      return kd.kl_div_from_logits(a, b, axis_name=axis_name)[None]

    # Without axis_name each shard has its own result: stack them, keep the first.
    fn = jax.shard_map(local, mesh=mesh, in_specs=P(None, "vocab"), out_specs=P("vocab"))
    got = np.asarray(jax.jit(fn)(s, t))[0]
    ref = np.asarray(kd.kl_div_from_logits(s, t))
    err, _ = _compare(got, ref)
    out.append({"axis_name": axis_name, "value_err": err})

  # The naive way: gather the vocabulary, then the unsharded loss. The HLO
  # check must see its all-gather.
  def gathered(a, b):
    a, b = (jax.lax.all_gather(x, "vocab", axis=1, tiled=True) for x in (a, b))
    return kd.kl_div_from_logits(a, b)[None]

  fn = jax.shard_map(gathered, mesh=mesh, in_specs=P(None, "vocab"), out_specs=P("vocab"))
  text = jax.jit(jax.grad(lambda a, b: jnp.sum(fn(a, b)))).lower(s, t).compile().as_text()
  out.append({"axis_name": "all_gather", "collectives": collectives(text)})
  return out


def second_order(devices):
  """Hessians wrt the student's logits and a JVP, sharded vs unsharded (the (8,) mesh)."""
  x = _inputs()
  s = np.where(np.isfinite(x["s"]), x["s"], -3.0)[:2, :16].astype(np.float32)
  t = x["t"][:2, :16].astype(np.float32)  # -inf teacher classes in row 1
  labels = np.array([3, 14], np.int32)
  mesh = jax.sharding.Mesh(np.array(devices), ("vocab",))
  losses = {
    "kl[reverse,T=1.5]": lambda a, b, y, axis_name=None: jnp.sum(
      kd.kl_div_from_logits(a, b, temperature=1.5, direction="reverse", axis_name=axis_name)
    ),
    "jsd[beta=0.3]": lambda a, b, y, axis_name=None: jnp.sum(
      kd.generalized_jsd(a, b, beta=0.3, axis_name=axis_name)
    ),
    "distill[forward_kl,labels]": lambda a, b, y, axis_name=None: kd.distillation_loss(
      a, b, y, temperature=2.0, axis_name=axis_name
    ),
  }
  tangent = np.random.default_rng(3).normal(size=s.shape).astype(np.float32)
  out = []
  for name, loss in losses.items():
    sharded = jax.shard_map(
      lambda a, b, y, loss=loss: loss(a, b, y, axis_name="vocab"),
      mesh=mesh,
      in_specs=(P(None, "vocab"), P(None, "vocab"), P()),
      out_specs=P(),
    )

    def both(fn):
      def run(a, b, y, v):
        hess = jax.hessian(fn)(a, b, y)
        return hess, jax.jvp(lambda a: fn(a, b, y), (a,), (v,))[1]

      return jax.jit(run)(s, t, labels, tangent)

    (h_ref, j_ref), (h, j) = both(loss), both(sharded)
    out.append(
      {"loss": name, "hessian_err": _compare(h, h_ref)[0], "jvp_err": _compare(j, j_ref)[0]}
    )
  return out


def memory(devices):
  """Per-device compiled temp bytes, vocabulary-parallel over 8 devices vs one device."""
  mesh = jax.sharding.Mesh(np.array(devices), ("vocab",))

  def spec(shape, sharding=None):
    return jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=None if sharding is None else NamedSharding(mesh, sharding)
    )

  def temp(fn, *specs):
    return int(jax.jit(fn).lower(*specs).compile().memory_analysis().temp_size_in_bytes)

  rows = []
  n, v = 2048, 16384

  def kl(axis_name):
    return lambda a, b: jnp.sum(kd.kl_div_from_logits(a, b, temperature=2.0, axis_name=axis_name))

  single = temp(jax.value_and_grad(kl(None)), spec((n, v)), spec((n, v)))
  sharded_fn = jax.shard_map(kl("vocab"), mesh=mesh, in_specs=P(None, "vocab"), out_specs=P())
  sharded = temp(
    jax.value_and_grad(sharded_fn), spec((n, v), P(None, "vocab")), spec((n, v), P(None, "vocab"))
  )
  rows.append({"program": f"kl_div_from_logits [{n}, {v}]", "single": single, "sharded": sharded})

  n, h, v = 512, 128, 16384

  def fused(axis_name):
    return lambda a, w, ta, tw: kd.fused_distillation_loss(
      a, w, ta, tw, temperature=2.0, axis_name=axis_name
    )

  single = temp(
    jax.value_and_grad(fused(None), argnums=(0, 1)),
    spec((n, h)),
    spec((h, v)),
    spec((n, h)),
    spec((h, v)),
  )
  in_specs = (P(), P(None, "vocab"), P(), P(None, "vocab"))
  sharded_fn = jax.shard_map(fused("vocab"), mesh=mesh, in_specs=in_specs, out_specs=P())
  sharded = temp(
    jax.value_and_grad(sharded_fn, argnums=(0, 1)),
    *[spec(s, sp) for s, sp in zip([(n, h), (h, v), (n, h), (h, v)], in_specs)],
  )
  rows.append(
    {"program": f"fused_distillation_loss N={n} H={h} V={v}", "single": single, "sharded": sharded}
  )
  return rows


CASES = [(name, mesh) for name, case in _cases().items() for mesh in case.meshes]
IDS = [f"{name}-{mesh}" for name, mesh in CASES]


@pytest.fixture(scope="module")
def report(cpu_devices):
  """Every case on its meshes, the negative controls, second order and memory."""
  results, reference = [], {}
  for name, case in _cases().items():
    for mesh_name in case.meshes:
      try:
        results.append(run_case(cpu_devices, name, case, mesh_name, reference))
      except Exception as err:  # reported, and failed, by the test
        results.append({"case": name, "mesh": mesh_name, "message": f"{type(err).__name__}: {err}"})
  payload = {"devices": len(cpu_devices), "results": results}
  for key, fn in (
    ("controls", negative_controls),
    ("second_order", second_order),
    ("memory", memory),
  ):
    try:
      payload[key] = fn(cpu_devices)
    except Exception as err:  # reported, and failed, by the test
      payload[key] = f"{type(err).__name__}: {err}"
  payload["by_case"] = {(r["case"], r["mesh"]): r for r in payload["results"]}
  return payload


def _result(report, name, mesh):
  r = report["by_case"].get((name, mesh))
  assert r is not None, f"{name} on mesh {mesh} did not run"
  assert not r["message"], f"{name} on mesh {mesh} raised: {r['message']}"
  return r


@pytest.mark.multidevice
@pytest.mark.parametrize(("name", "mesh"), CASES, ids=IDS)
def test_sharded_equals_unsharded(report, name, mesh):
  r = _result(report, name, mesh)
  # Errors are in units of the tolerance (atol 1e-6 + rtol 1e-5 |expected|).
  assert r["value_err"] <= 1.0, r
  assert max(r["grad_errs"]) <= 1.0, r
  assert r["nonfinite_match"], r


@pytest.mark.multidevice
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
  shape, names = MESHES[mesh]
  forbidden = {VOCAB}
  if len(shape) == 1:
    forbidden.add(VOCAB // shape[names.index("vocab")])
  for op, result in r["collectives"]:
    dims = {int(d) for d in _dims(result)}
    assert not dims & forbidden, f"{op} of vocabulary size: {result}"


def _dims(shape_text: str) -> list[str]:
  return re.findall(r"\d+", " ".join(re.findall(r"\[([\d,]*)\]", shape_text)))


@pytest.mark.multidevice
def test_every_case_and_mesh_ran(report):
  assert {(r["case"], r["mesh"]) for r in report["results"]} == set(CASES)
  meshes = {mesh for _, mesh in CASES}
  assert meshes == set(MESHES)


@pytest.mark.multidevice
def test_negative_controls(report):
  """A shard's own softmax (no axis_name) is far off, and gathering the
  vocabulary shows up as a vocabulary-sized all-gather: both checks can fail."""
  assert isinstance(report["controls"], list), report["controls"]
  by_axis = {c["axis_name"]: c for c in report["controls"]}
  assert by_axis["vocab"]["value_err"] <= 1.0
  assert by_axis[None]["value_err"] > 1e3
  gathers = [res for op, res in by_axis["all_gather"]["collectives"] if "all-gather" in op]
  assert any(VOCAB in {int(d) for d in _dims(res)} for res in gathers), by_axis["all_gather"]


@pytest.mark.multidevice
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


@pytest.mark.multidevice
def test_per_device_temp_memory(report):
  """Compiled per-device temp bytes, 8-way vocabulary parallel vs one device: at most 0.2x."""
  assert isinstance(report["memory"], list), report["memory"]
  for row in report["memory"]:
    assert row["sharded"] <= 0.2 * row["single"], row


# Bad input, in this process (no devices needed).


# Every public call that takes axis_name (_public_calls).
FUNCTIONS = {name: call for name, call in PUBLIC_CALLS.items() if call.axis_name}
SMALL = public_inputs(3, 4, 3, 2, seed=0)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_axis_name_outside_shard_map_raises(name):
  with pytest.raises(ValueError, match=rf"^{name}: axis_name='vocab' is not a mesh axis"):
    FUNCTIONS[name](SMALL, axis_name="vocab")


@pytest.mark.parametrize("name", FUNCTIONS)
def test_axis_name_must_be_a_string(name):
  with pytest.raises(TypeError, match=rf"^{name}: axis_name must be a str"):
    FUNCTIONS[name](SMALL, axis_name=0)
