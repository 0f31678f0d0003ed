"""Vocabulary-parallel divergence engine == unsharded, on 8 simulated CPU devices.

Run as a script (``tests/test_engine.py`` does, in one subprocess, because
``--xla_force_host_platform_device_count`` must be set before JAX starts; the
script sets it itself when ``XLA_FLAGS`` lacks it):

    python tests/_engine_worker.py

For every divergence (traced parameters), ``divergence_from_logits`` runs
inside ``jax.shard_map`` with the class axis split over the mesh axis
``"vocab"`` (and, on the (2, 4) mesh, the rows over ``"data"``), under
``jax.jit`` of ``value_and_grad`` wrt the student's and the teacher's logits,
the temperature and the parameters; it is compared with the unsharded call.
Prints one JSON object as the last line of stdout: ``{"devices", "cases",
"local_classes", "results": [{"case", "mesh", "value_err", "grad_errs",
"nonfinite_match", "collectives", "message"}], "second_order": [...],
"memory": [...]}``; errors as in ``_vocab_parallel_worker`` (``<= 1`` passes).
Importing this module has no side effects.
"""

import json
import sys
import traceback

# tests/ is sys.path[0] when this runs as a script; that module imports nothing heavy.
from _vocab_parallel_worker import NUM_DEVICES, _compare, _setup_devices, collectives

ROWS, VOCAB = 6, 56  # 7 classes per device on the (8,) mesh, 14 on (2, 4)
CASES = {
  "forward_kl": ("forward_kl", {}),
  "reverse_kl": ("reverse_kl", {}),
  "jsd[0.3]": ("jsd", {"beta": 0.3}),
  "jsd[traced 0]": ("jsd", {"beta": 0.0}),
  "symmetric_kl[0.3]": ("symmetric_kl", {"lam": 0.3}),
  "skew_kl[0.2]": ("skew_kl", {"alpha": 0.2}),
  "skew_reverse_kl[0.2]": ("skew_reverse_kl", {"alpha": 0.2}),
  "tvd": ("tvd", {}),
  "ab[0.6,0.3]": ("alpha_beta", {"alpha": 0.6, "beta": 0.3}),
  "ab[0.7,0]": ("alpha_beta", {"alpha": 0.7, "beta": 0.0}),
}


def _inputs(np):
  rng = np.random.default_rng(0)
  s = (2.0 * rng.normal(size=(ROWS, VOCAB))).astype(np.float32)
  t = (2.0 * rng.normal(size=(ROWS, VOCAB))).astype(np.float32)
  s[0, :9] = -np.inf  # student mass missing where the teacher has some (two devices)
  t[1, 3:12] = -np.inf  # teacher mass missing
  s[2] = t[2] = -np.inf  # an empty row
  t[3, : VOCAB // 2] = -np.inf  # the teacher empty on the first half of the devices
  t[4] = s[4]  # identical rows
  mask = rng.random((1, VOCAB)) > 0.2
  mask[0, 7:14] = False  # a device's whole slice masked on the (8,) mesh
  return s, t, mask


def run_case(jax, jnp, np, name, params, mesh_name):
  from jax.sharding import PartitionSpec as P

  from kldiv_jax._divergence_api import Divergence, divergence_from_logits

  shape, axes = {"8": ((8,), ("vocab",)), "2x4": ((2, 4), ("data", "vocab"))}[mesh_name]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), axes)
  data = "data" if "data" in axes else None
  s, t, mask = _inputs(np)
  weights = np.linspace(0.5, 1.5, ROWS).astype(np.float32)
  spec = Divergence(name, **{k: jnp.float32(v) for k, v in params.items()})

  def per_example(a, b, m, temperature, spec, axis_name=None):
    return divergence_from_logits(
      a, b, divergence=spec, temperature=temperature, where=m, axis_name=axis_name
    )

  sharded = jax.shard_map(
    lambda a, b, m, temperature, spec: per_example(a, b, m, temperature, spec, "vocab"),
    mesh=mesh,
    in_specs=(P(data, "vocab"), P(data, "vocab"), P(None, "vocab"), P(), P()),
    out_specs=P(data),
  )

  def objective(fn):
    def obj(*args):
      out = fn(*args)
      return jnp.sum(jnp.where(jnp.isfinite(out), out * weights, 0.0)), out

    return jax.value_and_grad(obj, argnums=(0, 1, 3, 4), has_aux=True)

  args = (s, t, mask, jnp.float32(1.7), spec)
  (_, ref_val), ref_grads = jax.jit(objective(per_example))(*args)
  compiled = jax.jit(objective(sharded)).lower(*args).compile()
  (_, val), grads = compiled(*args)
  value_err, match = _compare(np, val, ref_val)
  grad_errs = []
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    err, m = _compare(np, g, r)
    grad_errs.append(err)
    match = match and m
  return {
    "case": f"{name}{params}",
    "mesh": mesh_name,
    "value_err": value_err,
    "grad_errs": grad_errs,
    "nonfinite_match": match,
    "collectives": collectives(compiled.as_text()),
    "message": "",
  }


def second_order(jax, jnp, np):
  """Hessians wrt the student's logits and a JVP, sharded vs unsharded (the (8,) mesh)."""
  from jax.sharding import PartitionSpec as P

  from kldiv_jax._divergence_api import Divergence, divergence_from_logits

  s, t, _ = _inputs(np)
  s = np.where(np.isfinite(s), s, -3.0)[:2, :16].astype(np.float32)
  t = t[:2, :16]  # -inf teacher classes in row 1
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("vocab",))
  tangent = np.random.default_rng(3).normal(size=s.shape).astype(np.float32)
  out = []
  for spec in (
    Divergence("skew_reverse_kl", alpha=0.3),
    Divergence("alpha_beta", alpha=0.6, beta=0.3),
  ):

    def loss(a, b, axis_name=None, spec=spec):
      return jnp.sum(
        divergence_from_logits(a, b, divergence=spec, temperature=1.5, axis_name=axis_name)
      )

    sharded = jax.shard_map(
      lambda a, b, loss=loss: loss(a, b, "vocab"),
      mesh=mesh,
      in_specs=(P(None, "vocab"), P(None, "vocab")),
      out_specs=P(),
    )

    def both(fn):
      def run(a, b, v):
        return jax.hessian(fn)(a, b), jax.jvp(lambda a: fn(a, b), (a,), (v,))[1]

      return jax.jit(run)(s, t, tangent)

    (h_ref, j_ref), (h, j) = both(loss), both(sharded)
    out.append(
      {
        "loss": repr(spec),
        "hessian_err": _compare(np, h, h_ref)[0],
        "jvp_err": _compare(np, j, j_ref)[0],
      }
    )
  return out


def memory(jax, jnp, np):
  """Per-device compiled temp bytes, 8-way vocabulary parallel vs one device."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from kldiv_jax._divergence_api import Divergence, divergence_from_logits

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("vocab",))
  n, v = 2048, 16384

  def spec(shape, sharding=None):
    return jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=None if sharding is None else NamedSharding(mesh, sharding)
    )

  def temp(fn, *specs):
    return int(jax.jit(fn).lower(*specs).compile().memory_analysis().temp_size_in_bytes)

  rows = []
  for div in (Divergence("skew_kl"), Divergence("alpha_beta", alpha=0.5, beta=0.3)):

    def loss(axis_name, div=div):
      return lambda a, b: jnp.sum(
        divergence_from_logits(a, b, divergence=div, temperature=2.0, axis_name=axis_name)
      )

    single = temp(jax.value_and_grad(loss(None)), spec((n, v)), spec((n, v)))
    sharded_fn = jax.shard_map(loss("vocab"), mesh=mesh, in_specs=P(None, "vocab"), out_specs=P())
    sharded = temp(
      jax.value_and_grad(sharded_fn), spec((n, v), P(None, "vocab")), spec((n, v), P(None, "vocab"))
    )
    rows.append({"program": f"{div!r} [{n}, {v}]", "single": single, "sharded": sharded})
  return rows


def main() -> int:
  _setup_devices()
  import jax
  import jax.numpy as jnp
  import numpy as np

  jax.config.update("jax_numpy_rank_promotion", "raise")
  results = []
  for name, params in CASES.values():
    meshes = ("8", "2x4") if name in ("skew_kl", "alpha_beta") else ("8",)
    for mesh_name in meshes:
      try:
        results.append(run_case(jax, jnp, np, name, params, mesh_name))
      except Exception as err:  # reported, and failed, by the test
        traceback.print_exc()
        results.append(
          {"case": f"{name}{params}", "mesh": mesh_name, "message": f"{type(err).__name__}: {err}"}
        )
  payload = {
    "devices": jax.device_count(),
    "names": sorted({name for name, _ in CASES.values()}),
    "local_classes": [VOCAB // NUM_DEVICES, VOCAB // 4, VOCAB],
    "results": results,
  }
  for key, fn in (("second_order", second_order), ("memory", memory)):
    try:
      payload[key] = fn(jax, jnp, np)
    except Exception as err:  # reported, and failed, by the test
      traceback.print_exc()
      payload[key] = [{"error": f"{type(err).__name__}: {err}"}]
  print(json.dumps(payload))
  return 0


if __name__ == "__main__":
  sys.exit(main())
