"""The divergence engine and divergence_from_logits: every divergence, every convention.

References: float64 ports of the authors' code (``tests/_references.py``:
DistiLLM, TRL, Liger, ABKD) for values, JAX autodiff of those ports for the
gradients, 80-digit decimal arithmetic for the alpha-beta limit cases, the
existing kernels for the KL conventions at ``-inf``, and the unsharded engine
for the vocabulary-parallel path (``multidevice`` tests: 8 simulated devices).
"""

import decimal
import logging
import re

import _references as refs  # tests/ is on sys.path (pytest's rootdir import)
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import enable_x64
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import kldiv_jax as kd
from kldiv_jax import Divergence, divergence_from_logits
from kldiv_jax._divergences import FORMULAS, Classes
from kldiv_jax._engine import divergence_rows

INF = np.inf

# (id, name, parameters): every divergence, a few parameters, and the alpha-beta limits, for
# the reference comparisons (values, gradients, -inf conventions).
CASES = [
  ("forward_kl", "forward_kl", {}),
  ("reverse_kl", "reverse_kl", {}),
  ("jsd[0.3]", "jsd", {"beta": 0.3}),
  ("symmetric_kl[0.9]", "symmetric_kl", {"lam": 0.9}),
  ("skew_kl", "skew_kl", {"alpha": 0.1}),
  ("skew_reverse_kl[0.4]", "skew_reverse_kl", {"alpha": 0.4}),
  ("tvd", "tvd", {}),
  ("ab[0.5,0.3]", "alpha_beta", {"alpha": 0.5, "beta": 0.3}),
  ("ab[1.3,-0.4]", "alpha_beta", {"alpha": 1.3, "beta": -0.4}),
  ("ab[-0.3,1.1]", "alpha_beta", {"alpha": -0.3, "beta": 1.1}),
  ("ab[0.7,0]", "alpha_beta", {"alpha": 0.7, "beta": 0.0}),
  ("ab[0,0.6]", "alpha_beta", {"alpha": 0.0, "beta": 0.6}),
  ("ab[0.5,-0.5]", "alpha_beta", {"alpha": 0.5, "beta": -0.5}),
  ("ab[0,0]", "alpha_beta", {"alpha": 0.0, "beta": 0.0}),
]
IDS = [c[0] for c in CASES]
# Each divergence once (the first eight cases), for the properties that do not depend on
# the parameters' values (masks, NaN, dtypes, exact zeros).
EACH = CASES[:8]
EACH_IDS = IDS[:8]
# Second order at interior points: every smooth divergence once, parameters traced (the
# alpha-beta limits, exact to first order in the parameters, are checked wrt the logits).
SMOOTH = [c for c in EACH if FORMULAS[c[1]].smooth]


def _spec(name, params, traced=False, dtype=jnp.float64):
  values = {k: jnp.asarray(v, dtype) if traced else v for k, v in params.items()}
  return Divergence(name, **values)


def _ref(name, params, z, y, temperature=1.0, xp=np):
  return refs.REFERENCES[name](z, y, temperature, xp=xp, **params)


def _pair(rng, shape=(4, 7), scale=2.0):
  return scale * rng.normal(size=shape), scale * rng.normal(size=shape)


@jax.jit
def _value_and_grads(spec, z, y, temperature, weights):
  """Values and the gradients of their weighted sum wrt z, y, T and the traced parameters."""

  def loss(z, y, temperature, spec):
    out = divergence_from_logits(z, y, divergence=spec, temperature=temperature)
    return jnp.sum(jnp.where(jnp.isfinite(out), out * weights, 0.0)), out

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  (_, out), grads = grad(z, y, temperature, spec)
  return out, grads


# ----------------------------------------------------------------- values


@pytest.mark.parametrize(("case", "name", "params"), CASES, ids=IDS)
def test_values_match_the_authors_code(x64, rng, case, name, params):
  z, y = _pair(rng)
  for temperature in (1.0, 2.5):
    got = divergence_from_logits(z, y, divergence=_spec(name, params), temperature=temperature)
    np.testing.assert_allclose(got, _ref(name, params, z, y, temperature), rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize(("case", "name", "params"), EACH, ids=EACH_IDS)
def test_values_float32(rng, case, name, params):
  z, y = _pair(rng, (3, 64))
  got = divergence_from_logits(
    z.astype(np.float32), y.astype(np.float32), divergence=_spec(name, params), temperature=2.0
  )
  ref = _ref(name, params, z.astype(np.float32).astype(np.float64), y.astype(np.float32), 2.0)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)


def test_strings_select_the_default_parameters(rng):
  z, y = (a.astype(np.float32) for a in _pair(rng))
  defaults = {
    "forward_kl": {},
    "reverse_kl": {},
    "jsd": {"beta": 0.5},
    "symmetric_kl": {"lam": 0.5},
    "skew_kl": {"alpha": 0.1},
    "skew_reverse_kl": {"alpha": 0.1},
    "tvd": {},
  }
  for name, params in defaults.items():
    np.testing.assert_array_equal(
      divergence_from_logits(z, y, divergence=name),
      divergence_from_logits(z, y, divergence=Divergence(name, **params)),
    )
    assert Divergence(name) == Divergence(name, **params)


def test_special_cases_coincide(x64, rng):
  z, y = _pair(rng)

  def d(name, **params):
    return np.asarray(divergence_from_logits(z, y, divergence=Divergence(name, **params)))

  fwd, rev = d("forward_kl"), d("reverse_kl")
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)  # noqa: E731
  close(d("alpha_beta", alpha=1.0, beta=0.0), fwd)
  close(d("alpha_beta", alpha=0.0, beta=1.0), rev)
  p, q = np.exp(refs.np_log_softmax(y)), np.exp(refs.np_log_softmax(z))
  close(d("alpha_beta", alpha=0.5, beta=0.5), 2 * np.sum((np.sqrt(p) - np.sqrt(q)) ** 2, -1))
  close(d("jsd", beta=0.0), fwd)
  close(d("jsd", beta=1.0), rev)
  close(d("symmetric_kl", lam=0.0), fwd)
  close(d("symmetric_kl", lam=1.0), rev)
  close(d("skew_kl", alpha=0.0), fwd)
  close(d("skew_reverse_kl", alpha=0.0), rev)
  close(d("skew_kl", alpha=1.0), 0.0)  # KL(p || p)
  close(d("skew_reverse_kl", alpha=1.0), 0.0)


# ----------------------------------------------------------------- gradients


@pytest.mark.parametrize(("case", "name", "params"), CASES, ids=IDS)
def test_gradients_match_autodiff_of_the_reference(x64, rng, case, name, params):
  z, y = _pair(rng, (7, 8))  # the shape of _hostile: _value_and_grads compiled once for both
  weights = rng.normal(size=z.shape[0])
  limit = name == "alpha_beta" and (0.0 in params.values() or sum(params.values()) == 0)
  traced = bool(params) and not limit and case not in ("jsd[0]", "jsd[1]")
  spec = _spec(name, params, traced=traced)
  out, (gz, gy, gt, gspec) = _value_and_grads(spec, z, y, 1.7, weights)

  def ref_loss(z, y, temperature, values):
    return jnp.sum(_ref(name, dict(zip(params, values)), z, y, temperature, xp=jnp) * weights)

  values = [jnp.asarray(v) for v in params.values()] if traced else [*params.values()]
  argnums = (0, 1, 2, 3) if traced else (0, 1, 2)
  expected = jax.grad(ref_loss, argnums=argnums)(z, y, 1.7, values)
  np.testing.assert_allclose(out, _ref(name, params, z, y, 1.7), rtol=1e-11)
  for got, want in zip((gz, gy, gt), expected[:3]):
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
  if traced:
    got = [v for _, v in gspec.params]
    np.testing.assert_allclose(got, expected[3], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("case", "name", "params"), SMOOTH, ids=[c[0] for c in SMOOTH])
def test_check_grads_order_2(x64, rng, case, name, params):
  """Forward and reverse, second order, wrt logits, temperature and parameters (interior)."""
  z, y = _pair(rng, (2, 5), scale=1.0)
  keys = list(params)

  @jax.jit
  def f(z, y, temperature, *values):
    spec = Divergence(name, **dict(zip(keys, values)))
    return divergence_from_logits(z, y, divergence=spec, temperature=temperature)

  # fwd only: reverse mode is checked against autodiff above, jax.hessian (fwd over rev) on 8
  # devices below. alpha-beta's parameters static: its traced form selects among the limits.
  if name == "alpha_beta":
    f = jax.jit(
      lambda z, y, t: divergence_from_logits(z, y, divergence=_spec(name, params), temperature=t)
    )
    check_grads(f, (z, y, 1.3), order=2, modes=("fwd",))
  else:
    check_grads(f, (z, y, 1.3, *params.values()), order=2, modes=("fwd",))


@pytest.mark.parametrize(
  "params", [(0.7, 0.0), (0.0, 0.6), (0.5, -0.5), (0.0, 0.0)], ids=lambda p: f"ab{list(p)}"
)
def test_check_grads_order_2_at_alpha_beta_limits(x64, rng, params):
  """The closed forms are smooth in the logits and the temperature."""
  z, y = _pair(rng, (2, 5), scale=1.0)
  spec = Divergence("alpha_beta", alpha=params[0], beta=params[1])
  f = jax.jit(lambda z, y, t: divergence_from_logits(z, y, divergence=spec, temperature=t))
  check_grads(f, (z, y, 1.3), order=2, modes=("fwd",))


def test_tvd_subgradient_is_zero_where_p_equals_q(x64, rng):
  """Liger's kernel takes -1/2 where p = q; the subgradient here is 0 (identical rows: 0)."""
  z, y = _pair(rng, (7, 8))  # _hostile's shape: one compilation
  z[1] = y[1]
  out, (gz, gy, _, _) = _value_and_grads(Divergence("tvd"), z, y, 1.0, np.ones(len(z)))
  assert out[1] == 0.0
  np.testing.assert_array_equal(gz[1], 0.0)
  np.testing.assert_array_equal(gy[1], 0.0)
  p, q = np.exp(refs.np_log_softmax(y[0])), np.exp(refs.np_log_softmax(z[0]))
  b, a = -0.5 * q * np.sign(p - q), 0.5 * p * np.sign(p - q)
  np.testing.assert_allclose(gz[0], b - q * b.sum(), rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(gy[0], a - p * a.sum(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", list(FORMULAS))
def test_weighted_partials_are_the_derivatives_of_f(x64, rng, name):
  """Per class: a = p df/dp and b = q df/dq (autodiff of f), and a + b = deg f (Euler)."""
  formula = FORMULAS[name]
  params = {"alpha_beta": (0.6, 0.25)}.get(name, (0.3,) * len(formula.param_names))
  lp, lq = np.log(rng.uniform(0.05, 0.9, size=8)), np.log(rng.uniform(0.05, 0.9, size=8))

  def f_of(lp, lq):
    return formula.terms(Classes(lp, lq, jnp.exp(lp), jnp.exp(lq)), params)[0]

  _, a, b = formula.terms(Classes(lp, lq, np.exp(lp), np.exp(lq)), params)
  # d f / d log p = p df/dp.
  da = jax.vmap(jax.grad(f_of, argnums=0))(lp, lq)
  db = jax.vmap(jax.grad(f_of, argnums=1))(lp, lq)
  np.testing.assert_allclose(a, da, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(b, db, rtol=1e-10, atol=1e-14)
  degree = sum(params) if name == "alpha_beta" else 1.0
  np.testing.assert_allclose(a + b, degree * f_of(lp, lq), rtol=1e-10, atol=1e-14)


# ----------------------------------------------------------------- alpha-beta limits


def _decimal_rows(z, y, temperature, alpha, beta):
  return np.array([float(v) for v in refs.ab_decimal(z, y, temperature, alpha, beta)])


@pytest.mark.parametrize(
  "params", [(0.7, 0.0), (0.0, 0.6), (0.5, -0.5), (0.0, 0.0)], ids=lambda p: f"ab{list(p)}"
)
def test_alpha_beta_limits_are_the_limits_of_abkd_general_formula(x64, rng, params):
  """Closed forms == ABKD's general branch 1e-20 off the limit (80-digit decimals),
  and the parameter gradients == its central differences there."""
  z, y = _pair(rng, (2, 6), scale=1.0)
  with decimal.localcontext() as ctx:
    ctx.prec = 80
    tiny = decimal.Decimal("1e-20")
    a, b = (decimal.Decimal(v) for v in params)
    off = (a + tiny, b + 2 * tiny)
  spec = _spec("alpha_beta", dict(zip(("alpha", "beta"), params)), traced=True)
  out, (_, _, _, gspec) = _value_and_grads(spec, z, y, 1.3, np.ones(2))
  np.testing.assert_allclose(out, _decimal_rows(z, y, 1.3, *off), rtol=1e-12)
  h = decimal.Decimal("1e-12")
  for k, got in enumerate(v for _, v in gspec.params):
    plus, minus = list(off), list(off)
    with decimal.localcontext() as ctx:
      ctx.prec = 80
      plus[k] += h
      minus[k] -= h
    up = refs.ab_decimal(z, y, 1.3, *plus)
    down = refs.ab_decimal(z, y, 1.3, *minus)
    want = float(sum((u - d) / (2 * h) for u, d in zip(up, down)))
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_alpha_beta_near_a_limit_is_continuous(x64, rng):
  z, y = _pair(rng, scale=1.0)
  for limit, near in [
    ((0.7, 0.0), (0.7, 1e-7)),
    ((0.0, 0.6), (1e-7, 0.6)),
    ((0.5, -0.5), (0.5, -0.5 + 1e-7)),
  ]:
    at = divergence_from_logits(
      z, y, divergence=_spec("alpha_beta", dict(zip(("alpha", "beta"), limit)))
    )
    by = divergence_from_logits(
      z, y, divergence=_spec("alpha_beta", dict(zip(("alpha", "beta"), near)))
    )
    np.testing.assert_allclose(at, by, rtol=1e-5)


# Log-ratios of a few hundred: a class one side gives e^-200 of the other's mass.
AB_FAR_Z = np.array([[0.0, -200.0, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0], [5.0, -300.0, -100.0, 0.0]])
AB_FAR_PARAMS = [(0.5, 0.5), (1.0, 1.0), (0.6, 0.3), (2.0, 1.5)]
AB_FAR_Y = np.array([[0.0, 0.0, 1.0, 2.0], [0.0, -250.0, 3.0, 1.0], [-300.0, 5.0, 0.0, -100.0]])


@pytest.mark.parametrize(
  ("path", "params"),
  [(p, ab) for p in ("cpu", "accelerator") for ab in AB_FAR_PARAMS]
  + [("traced", (0.5, 0.5)), ("traced", (2.0, 1.5))],
)
def test_alpha_beta_large_log_ratios_are_finite(request, path, params):
  """float32 logits far apart: ABKD's general branch in 80-digit decimals, and the gradients
  wrt both sides of the float64 reference, not NaN (``p^alpha q^beta`` underflowed while
  ``expm1(beta log(p/q))`` overflowed); on the CPU path, the accelerator path and with
  traced parameters."""
  if path == "accelerator":
    request.getfixturevalue("accelerator_branch")
  alpha, beta = params
  spec = _spec("alpha_beta", {"alpha": alpha, "beta": beta}, path == "traced", jnp.float32)
  z, y = AB_FAR_Z.astype(np.float32), AB_FAR_Y.astype(np.float32)

  def loss(z, y):
    return jnp.sum(divergence_from_logits(z, y, divergence=spec))

  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(z, y)
  rows = divergence_from_logits(z, y, divergence=spec)
  want = _decimal_rows(AB_FAR_Z, AB_FAR_Y, 1.0, alpha, beta)
  np.testing.assert_allclose(rows, want, rtol=2e-5)
  np.testing.assert_allclose(value, want.sum(), rtol=2e-5)
  with enable_x64(True):
    ref = jax.grad(
      lambda z, y: jnp.sum(_ref("alpha_beta", {"alpha": alpha, "beta": beta}, z, y, xp=jnp)),
      argnums=(0, 1),
    )(jnp.asarray(AB_FAR_Z), jnp.asarray(AB_FAR_Y))
  for got, want in zip(grads, ref):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want), rtol=2e-5, atol=1e-6)


# ----------------------------------------------------------------- conventions


def _hostile(rng, classes=8):
  """Rows with -inf on either side, an all -inf side, both sides empty, identical rows."""
  z, y = _pair(rng, (7, classes))
  z[0, :3] = -INF  # student mass missing where the teacher has some
  y[1, 2:5] = -INF  # teacher mass missing where the student has some
  z[2] = -INF  # the student is the zero measure
  y[3] = -INF  # the teacher is the zero measure
  z[4] = y[4] = -INF  # both empty
  z[5, :2] = y[5, :2] = -INF  # both without mass on the same classes
  y[6] = z[6]
  return z, y


def _one_sided(name, params, log_probs, empty):
  """Closed forms of the authors' formulas when one side is the zero measure (every logit
  -inf): ``empty`` is "teacher" (p = 0) or "student" (q = 0); ``log_probs`` the other's."""
  teacher = empty == "teacher"
  if name == "jsd" and params["beta"] in (0.0, 1.0):
    name = "forward_kl" if params["beta"] == 0.0 else "reverse_kl"
  if name == "forward_kl":
    return 0.0 if teacher else INF
  if name == "reverse_kl":
    return INF if teacher else 0.0
  if name == "jsd":  # beta KL(p || m) + (1 - beta) KL(q || m), m the present side times its weight
    w = 1.0 - params["beta"] if teacher else params["beta"]
    return -w * np.log(w)
  if name == "symmetric_kl":
    lam = params["lam"]
    return (INF if lam > 0 else 0.0) if teacher else (INF if lam < 1 else 0.0)
  if name in ("skew_kl", "skew_reverse_kl"):
    alpha = params["alpha"]
    weighted_side_present = teacher == (name == "skew_reverse_kl")
    return (-np.log(alpha) if alpha > 0 else INF) if weighted_side_present else 0.0
  if name == "tvd":
    return 0.5
  x, y = (params["alpha"], params["beta"]) if teacher else (params["beta"], params["alpha"])
  s = x + y  # f(0, r) = r^s / (x s) if x > 0 and s > 0, else +inf
  return np.sum(np.exp(s * log_probs)) / (x * s) if x > 0 and s > 0 else INF


@pytest.mark.parametrize(("case", "name", "params"), CASES, ids=IDS)
def test_neg_inf_logits_are_classes_without_mass(x64, rng, case, name, params):
  """A -inf logit is a class without mass: values are the limits of the authors' formulas
  (their value at a logit of -600, equal to that at -300: bounded), +inf where that limit
  is unbounded; a side without any mass is the zero measure (closed forms); gradients are
  finite, those of the reference where the value is finite, 0 on empty and identical rows."""
  z, y = _hostile(rng)
  spec = _spec(name, params)
  out, (gz, gy, gt, _) = _value_and_grads(spec, z, y, 1.0, np.ones(len(z)))
  out = np.asarray(out)
  for g in (gz, gy, gt):
    assert np.all(np.isfinite(g))
  # Rows 0, 1: -inf on one side for some classes.
  far = lambda a, at=-600.0: np.where(np.isfinite(a), a, at)  # noqa: E731
  with np.errstate(all="ignore"):
    ref = _ref(name, params, far(z[:2]), far(y[:2]))
    nearer = _ref(name, params, far(z[:2], -300.0), far(y[:2], -300.0))
  bounded = np.isfinite(ref) & np.isclose(ref, nearer, rtol=1e-9, atol=1e-12)
  assert np.all(np.isinf(out[:2][~bounded]))
  np.testing.assert_allclose(out[:2][bounded], ref[bounded], rtol=1e-9, atol=1e-12)
  keep = np.flatnonzero(bounded)
  rz, ry = jax.grad(lambda a, b: jnp.sum(_ref(name, params, a, b, xp=jnp)), argnums=(0, 1))(
    far(z[keep]), far(y[keep])
  )
  np.testing.assert_allclose(np.asarray(gz)[keep], rz, rtol=1e-7, atol=1e-10)
  np.testing.assert_allclose(np.asarray(gy)[keep], ry, rtol=1e-7, atol=1e-10)
  # Rows 2, 3: the student, then the teacher, is the zero measure.
  lp2, lq3 = refs.np_log_softmax(y[2]), refs.np_log_softmax(z[3])
  np.testing.assert_allclose(out[2], _one_sided(name, params, lp2, "student"), rtol=1e-12)
  np.testing.assert_allclose(out[3], _one_sided(name, params, lq3, "teacher"), rtol=1e-12)
  # Row 4: both empty; row 6: identical. 0, with zero gradients.
  for row in (4, 6):
    assert out[row] == 0.0
    np.testing.assert_array_equal(gz[row], 0.0)
    np.testing.assert_array_equal(gy[row], 0.0)
  # Row 5: both without mass on the same classes = those classes dropped.
  np.testing.assert_allclose(out[5], _ref(name, params, z[5, 2:], y[5, 2:]), rtol=1e-11)


@pytest.mark.parametrize(("case", "name", "params"), EACH, ids=EACH_IDS)
def test_class_mask_equals_dropping_the_classes(x64, rng, case, name, params):
  z, y = _pair(rng, (3, 9))
  mask = np.array([True, False, True, True, False, True, True, True, False])
  spec = _spec(name, params)

  def f(z, y, where=None):
    return divergence_from_logits(z, y, divergence=spec, temperature=1.5, where=where)

  got = f(z, y, mask)
  np.testing.assert_allclose(got, f(z[:, mask], y[:, mask]), rtol=1e-12)
  gz, gy = jax.grad(lambda a, b: jnp.sum(f(a, b, mask)), argnums=(0, 1))(z, y)
  rz, ry = jax.grad(lambda a, b: jnp.sum(f(a, b)), argnums=(0, 1))(z[:, mask], y[:, mask])
  np.testing.assert_array_equal(gz[:, ~mask], 0.0)
  np.testing.assert_array_equal(gy[:, ~mask], 0.0)
  np.testing.assert_allclose(gz[:, mask], rz, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(gy[:, mask], ry, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(("case", "name", "params"), EACH, ids=EACH_IDS)
def test_per_example_mask_and_masked_rows(rng, case, name, params):
  z, y = (a.astype(np.float32) for a in _pair(rng, (4, 6)))
  rows = np.array([True, False, True, False])
  spec = _spec(name, params)
  f = lambda a, b, w: jnp.sum(divergence_from_logits(a, b, divergence=spec, where=w))  # noqa: E731
  out = divergence_from_logits(z, y, divergence=spec, where=rows)
  np.testing.assert_array_equal(out[~rows], 0.0)
  np.testing.assert_allclose(out[rows], divergence_from_logits(z[rows], y[rows], divergence=spec))
  gz, gy = jax.grad(f, argnums=(0, 1))(z, y, rows)
  np.testing.assert_array_equal(gz[~rows], 0.0)
  np.testing.assert_array_equal(gy[~rows], 0.0)


@pytest.mark.parametrize(("case", "name", "params"), EACH, ids=EACH_IDS)
def test_no_nan_is_made_on_the_way(rng, case, name, params):
  """Eager values and gradients at -inf logits and masks under jax.debug_nans: every
  discarded branch was made safe before its partial function."""
  z, y = (a.astype(np.float32) for a in _hostile(rng, classes=5))
  for traced in (False, True):
    spec = _spec(name, params, traced=traced, dtype=jnp.float32)

    def loss(z, y, t, spec=spec):
      out = divergence_rows(z, y, t, (np.array([[True, True, False, True, True]]),), spec)
      return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0))

    with jax.debug_nans(True):
      jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(z), jnp.asarray(y), jnp.float32(1.5))


@pytest.mark.parametrize(("case", "name", "params"), EACH, ids=EACH_IDS)
def test_identical_logits_give_exactly_zero(rng, case, name, params):
  z = rng.normal(size=(64, 50)) * 3
  z[1, :4] = -INF
  z[2, 10:] = -INF
  z[3] = -INF
  mask = rng.random((1, 50)) > 0.2
  for dtype, traced in ((np.float32, False), (jnp.bfloat16, True)):
    a = jnp.asarray(z, dtype)
    spec = _spec(name, params, traced=traced, dtype=jnp.float32)
    for kw in ({}, {"temperature": 0.7, "where": mask}):
      out = divergence_from_logits(a, a, divergence=spec, **kw)
      np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


@pytest.mark.parametrize(("case", "name", "params"), EACH, ids=EACH_IDS)
def test_never_negative_near_identical_logits(rng, case, name, params):
  z = (rng.normal(size=(64, 50)) * 4).astype(np.float32)
  y = z + (1e-6 * rng.normal(size=z.shape)).astype(np.float32)
  out = divergence_from_logits(z, y, divergence=_spec(name, params), temperature=1.3)
  assert np.all(np.asarray(out) >= 0.0)


@pytest.mark.parametrize(("case", "name", "params"), EACH, ids=EACH_IDS)
def test_half_precision_is_computed_in_float32(rng, case, name, params):
  z, y = _pair(rng, (3, 64))
  spec = _spec(name, params)
  for dtype in (jnp.bfloat16, jnp.float16):
    a, b = jnp.asarray(z, dtype), jnp.asarray(y, dtype)
    got = divergence_from_logits(a, b, divergence=spec, temperature=2.0)
    assert got.dtype == dtype
    want = divergence_from_logits(
      a.astype(jnp.float32), b.astype(jnp.float32), divergence=spec, temperature=2.0
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(dtype)))
    g = jax.grad(lambda a, b=b: jnp.sum(divergence_from_logits(a, b, divergence=spec)))(a)
    assert g.dtype == dtype and np.all(np.isfinite(np.asarray(g, np.float32)))


# ----------------------------------------------------------------- hostile input


@pytest.mark.parametrize(("case", "name", "params"), EACH, ids=EACH_IDS)
def test_nan_propagates_from_either_side(rng, case, name, params):
  z, y = (a.astype(np.float32) for a in _pair(rng, (3, 64)))
  z[0, 2] = np.nan
  y[1, 4] = np.nan
  spec = _spec(name, params)
  out = np.asarray(divergence_from_logits(z, y, divergence=spec))
  assert np.isnan(out[0]) and np.isnan(out[1]) and np.isfinite(out[2])
  gz = jax.grad(lambda a: jnp.sum(divergence_from_logits(a, y, divergence=spec)))(z)
  assert np.all(np.isnan(gz[:2])) and np.all(np.isfinite(gz[2]))
  plus = z.copy()
  plus[2, 0] = np.inf  # softmax of +inf is undefined
  assert np.isnan(np.asarray(divergence_from_logits(plus, y, divergence=spec))[2])


@pytest.mark.parametrize(
  ("name", "params"),
  [
    ("jsd", {"beta": 1.5}),
    ("jsd", {"beta": -0.1}),
    ("symmetric_kl", {"lam": 2.0}),
    ("skew_kl", {"alpha": -0.5}),
    ("skew_reverse_kl", {"alpha": 1.01}),
    ("alpha_beta", {"alpha": np.nan, "beta": 0.5}),
    ("alpha_beta", {"alpha": 0.5, "beta": np.inf}),
    ("skew_kl", {"alpha": np.nan}),
  ],
)
def test_invalid_traced_parameters_give_nan(rng, name, params):
  z, y = (a.astype(np.float32) for a in _pair(rng, (2, 5)))
  spec = _spec(name, params, traced=True, dtype=jnp.float32)
  out, _ = _value_and_grads(spec, z, y, jnp.float32(1.0), np.ones(2, np.float32))
  assert np.all(np.isnan(out))
  static = {k: float(v) for k, v in params.items()}
  with pytest.raises(ValueError, match=r"parameter (alpha|beta|lam) must be"):
    Divergence(name, **static)


def test_invalid_traced_temperature_gives_nan(rng):
  z, y = (a.astype(np.float32) for a in _pair(rng, (2, 5)))
  for t in (0.0, -1.0, np.nan, np.inf):
    out = jax.jit(lambda t: divergence_from_logits(z, y, temperature=t))(jnp.float32(t))
    assert np.all(np.isnan(out)), t


def test_new_parameter_values_do_not_recompile(rng, caplog):
  """A traced parameter (in a jitted function's argument, or eagerly) is a value, not a
  compile-time constant: no retrace under jit, no new compilation eagerly."""
  z, y = (a.astype(np.float32) for a in _pair(rng, (3, 6)))

  def run(specs):
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def jitted(spec, t):
      return divergence_from_logits(z, y, divergence=spec, temperature=t)

    for spec in specs:
      jitted(spec, jnp.float32(2.0))

  run([Divergence("skew_kl", alpha=jnp.float32(a)) for a in (0.1, 0.3, 0.0)])
  ab = ((0.5, 0.3), (0.0, 0.7), (0.4, -0.4), (0.0, 0.0))
  run([Divergence("alpha_beta", alpha=jnp.float32(a), beta=jnp.float32(b)) for a, b in ab])

  def eager(alpha):
    spec = Divergence("jsd", beta=jnp.float32(alpha))
    return jax.grad(lambda a: jnp.sum(divergence_from_logits(a, y, divergence=spec)))(z)

  eager(0.2)
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    caplog.clear()
    eager(0.7)
  assert not [r for r in caplog.records if "ompil" in r.getMessage()], caplog.text


# ----------------------------------------------------------------- API


def test_eager_calls_compile_once(rng):
  """Eager value and gradient calls reuse the compiled kernel (``_platform.compiled``)."""
  z, y = (a.astype(np.float32) for a in _pair(rng, (3, 6)))
  spec = Divergence("alpha_beta", alpha=0.5, beta=0.3)

  def call():
    divergence_from_logits(z, y, divergence=spec, temperature=2.0).block_until_ready()
    jax.grad(lambda a: jnp.sum(divergence_from_logits(a, y, divergence=spec)))(z)

  call()
  with refs.count_compiles() as compiles:
    call()
  assert not compiles, compiles


def test_divergence_spec():
  spec = Divergence("skew_kl", alpha=0.2)
  assert spec.params == (("alpha", 0.2),) and spec.key == ("skew_kl", (("alpha", 0.2),))
  assert hash(spec) == hash(Divergence("skew_kl", alpha=0.2)) and repr(spec).startswith(
    "Divergence("
  )
  assert Divergence("jsd") == Divergence("jsd", beta=0.5) != Divergence("jsd", beta=0.4)
  traced = Divergence("alpha_beta", alpha=jnp.float32(0.5), beta=0.25)
  leaves, tree = jax.tree.flatten(traced)
  assert len(leaves) == 1 and jax.tree.unflatten(tree, leaves).key == traced.key
  with pytest.raises(TypeError, match="not hashable"):
    hash(traced)
  with pytest.raises(dataclasses_frozen_error()):
    spec.name = "tvd"


def test_divergence_pickles_and_copies():
  import copy
  import pickle

  for spec in (Divergence("skew_kl", alpha=0.2), Divergence("alpha_beta", alpha=0.5, beta=0.25)):
    for twin in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec), copy.copy(spec)):
      assert twin == spec and twin.key == spec.key and hash(twin) == hash(spec)
  traced = pickle.loads(pickle.dumps(Divergence("jsd", beta=jnp.float32(0.3))))
  assert traced.name == "jsd" and float(traced.traced[0]) == np.float32(0.3)


def dataclasses_frozen_error():
  import dataclasses

  return dataclasses.FrozenInstanceError


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    ({"divergence": "kl"}, ValueError, "divergence must be one of 'forward_kl'"),
    ({"divergence": 3}, TypeError, "divergence must be one of"),
    ({"temperature": "2"}, TypeError, "temperature must be"),
    ({"where": "x"}, TypeError, "where"),
    ({"divergence": "alpha_beta"}, ValueError, "has no default parameters"),
    ({"temperature": 0.0}, ValueError, "temperature must be positive"),
    ({"axis_name": 0}, TypeError, "axis_name must be a str"),
  ],
)
def test_divergence_from_logits_errors(kwargs, error, match):
  x = jnp.ones((2, 3))
  with pytest.raises(error, match=match):
    divergence_from_logits(x, x, **kwargs)


@pytest.mark.parametrize(
  ("args", "error", "match"),
  [
    (("skew", {}), ValueError, "name must be one of"),
    ((3, {}), TypeError, "name must be a string"),
    (("jsd", {"beta": "0.1"}), TypeError, "beta must be a real number"),
    (("skew_kl", {"beta": 0.1}), TypeError, "takes the parameters \\(alpha\\)"),
    (("tvd", {"alpha": 0.1}), TypeError, "takes the parameters \\(none\\)"),
    (("alpha_beta", {"alpha": 0.1}), TypeError, "has no default parameters"),
    (("jsd", {"beta": 2.0}), ValueError, "parameter beta must be in \\[0, 1\\]"),
    (("jsd", {"beta": jnp.ones(2)}), ValueError, "must be a scalar"),
    (("jsd", {"beta": jnp.array(True)}), TypeError, "must be a real number"),
  ],
)
def test_divergence_spec_errors(args, error, match):
  name, params = args
  with pytest.raises(error, match=match):
    Divergence(name, **params)


def test_axis_batch_jit_and_vmap(rng):
  z, y = (a.astype(np.float32) for a in _pair(rng, (3, 4, 6)))
  spec = Divergence("skew_reverse_kl", alpha=0.3)
  f = jax.jit(lambda a, b: divergence_from_logits(a, b, divergence=spec, axis=1, temperature=1.5))
  moved = divergence_from_logits(
    np.moveaxis(z, 1, -1), np.moveaxis(y, 1, -1), divergence=spec, temperature=1.5
  )
  # float32, jitted vs eager: XLA fuses differently (jax 0.7 differs by ~2 ulp).
  np.testing.assert_allclose(f(z, y), moved, rtol=1e-5)
  vmapped = jax.vmap(lambda a, b: divergence_from_logits(a, b, divergence=spec))(z, y)
  np.testing.assert_allclose(vmapped, divergence_from_logits(z, y, divergence=spec), rtol=1e-6)
  flat = divergence_from_logits(z, y[0], divergence=spec, axis=(1, 2))
  whole = np.broadcast_to(y[0], z.shape).reshape(3, 24)
  np.testing.assert_allclose(
    flat, divergence_from_logits(z.reshape(3, 24), whole, divergence=spec), rtol=1e-6
  )
  assert divergence_from_logits(np.zeros((0, 5)), np.zeros((0, 5))).shape == (0,)


def test_exported():
  assert kd.divergence_from_logits is divergence_from_logits and kd.Divergence is Divergence


# ----------------------------------------------------------------- vocabulary parallel
# ``multidevice`` tests (``_multidevice.py``): every divergence, traced parameters, inside
# ``jax.shard_map`` with the classes split over ``"vocab"`` (and the rows over ``"data"`` on
# the (2, 4) mesh), under ``jax.jit`` of ``value_and_grad`` wrt the student's and teacher's
# logits, the temperature and the parameters, compared with the unsharded call; errors in
# units of ``atol 1e-6 + rtol 1e-5 |unsharded|`` (``<= 1`` passes).

ROWS, VOCAB = 6, 56  # 7 classes per device on the (8,) mesh, 14 on (2, 4)
SHARDED = {
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
SHARDED_CASES = [
  (case, mesh)
  for case, (name, _) in SHARDED.items()
  for mesh in (("8", "2x4") if name in ("skew_kl", "alpha_beta") else ("8",))
]


def _sharded_inputs():
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


def _per_example(a, b, m, temperature, spec, axis_name=None):
  return divergence_from_logits(
    a, b, divergence=spec, temperature=temperature, where=m, axis_name=axis_name
  )


def _objective(fn):
  """Values, and the gradients of their weighted sum wrt a, b, temperature and parameters."""
  weights = np.linspace(0.5, 1.5, ROWS).astype(np.float32)

  def obj(*args):
    out = fn(*args)
    return jnp.sum(jnp.where(jnp.isfinite(out), out * weights, 0.0)), out

  return jax.value_and_grad(obj, argnums=(0, 1, 3, 4), has_aux=True)


# The unsharded reference: one jit, so compiled once per divergence (its parameters are
# traced), not once per case and mesh.
_UNSHARDED = jax.jit(_objective(_per_example))


def _run_sharded(devices, name, params, mesh_name):
  shape, axes = {"8": ((8,), ("vocab",)), "2x4": ((2, 4), ("data", "vocab"))}[mesh_name]
  mesh = jax.sharding.Mesh(np.array(devices[: int(np.prod(shape))]).reshape(shape), axes)
  data = "data" if "data" in axes else None
  s, t, mask = _sharded_inputs()
  spec = Divergence(name, **{k: jnp.float32(v) for k, v in params.items()})
  sharded = jax.shard_map(
    lambda a, b, m, temperature, spec: _per_example(a, b, m, temperature, spec, "vocab"),
    mesh=mesh,
    in_specs=(P(data, "vocab"), P(data, "vocab"), P(None, "vocab"), P(), P()),
    out_specs=P(data),
  )
  args = (s, t, mask, jnp.float32(1.7), spec)
  (_, ref_val), ref_grads = _UNSHARDED(*args)
  compiled = jax.jit(_objective(sharded)).lower(*args).compile()
  (_, val), grads = compiled(*args)
  return (val, grads), (ref_val, ref_grads), refs.collectives(compiled.as_text())


@pytest.mark.multidevice
@pytest.mark.parametrize(
  ("case", "mesh"), SHARDED_CASES, ids=[f"{c}-{m}" for c, m in SHARDED_CASES]
)
def test_vocab_parallel_equals_unsharded(cpu_devices, case, mesh):
  """Values and gradients (student, teacher, temperature, parameters) equal the unsharded
  ones; only per-row values cross devices (all-reduces, none of a vocabulary or slice size)."""
  name, params = SHARDED[case]
  got, ref, ops = _run_sharded(cpu_devices, name, params, mesh)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    err, match = refs.compare_finite(g, r)
    assert err <= 1.0 and match, (g, r)
  assert ops and {op for op, _ in ops} <= {"all-reduce", "all-reduce-start"}, ops
  forbidden = {VOCAB // 8, VOCAB // 4, VOCAB}
  for _, result in ops:
    dims = {int(d) for d in re.findall(r"\d+", " ".join(re.findall(r"\[([\d,]*)\]", result)))}
    assert not dims & forbidden, result


@pytest.mark.multidevice
@pytest.mark.parametrize(
  "spec",
  [Divergence("skew_reverse_kl", alpha=0.3), Divergence("alpha_beta", alpha=0.6, beta=0.3)],
  ids=repr,
)
def test_vocab_parallel_second_order(cpu_devices, spec):
  """Hessians wrt the student's logits and a JVP, sharded == unsharded (the (8,) mesh)."""
  s, t, _ = _sharded_inputs()
  s = np.where(np.isfinite(s), s, -3.0)[:2, :16].astype(np.float32)
  t = t[:2, :16]  # -inf teacher classes in row 1
  mesh = jax.sharding.Mesh(np.array(cpu_devices), ("vocab",))
  tangent = np.random.default_rng(3).normal(size=s.shape).astype(np.float32)

  def loss(a, b, axis_name=None):
    return jnp.sum(
      divergence_from_logits(a, b, divergence=spec, temperature=1.5, axis_name=axis_name)
    )

  sharded = jax.shard_map(
    lambda a, b: loss(a, b, "vocab"),
    mesh=mesh,
    in_specs=(P(None, "vocab"), P(None, "vocab")),
    out_specs=P(),
  )

  def both(fn):
    def run(a, b, v):
      return jax.hessian(fn)(a, b), jax.jvp(lambda a: fn(a, b), (a,), (v,))[1]

    return jax.jit(run)(s, t, tangent)

  for got, ref in zip(both(sharded), both(loss)):
    assert refs.compare_finite(got, ref)[0] <= 1.0


@pytest.mark.multidevice
def test_vocab_parallel_per_device_temp_memory(cpu_devices):
  """Per-device compiled temp bytes, 8-way vocabulary parallel, at most 1/5 of one device's."""
  mesh = jax.sharding.Mesh(np.array(cpu_devices), ("vocab",))
  n, v = 2048, 16384

  def shape(s, sharding=None):
    sharding = None if sharding is None else NamedSharding(mesh, sharding)
    return jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)

  def temp(fn, *specs):
    return int(jax.jit(fn).lower(*specs).compile().memory_analysis().temp_size_in_bytes)

  div = Divergence("alpha_beta", alpha=0.5, beta=0.3)

  def loss(axis_name):
    return lambda a, b: jnp.sum(
      divergence_from_logits(a, b, divergence=div, temperature=2.0, axis_name=axis_name)
    )

  single = temp(jax.value_and_grad(loss(None)), shape((n, v)), shape((n, v)))
  sharded_fn = jax.shard_map(loss("vocab"), mesh=mesh, in_specs=P(None, "vocab"), out_specs=P())
  split = shape((n, v), P(None, "vocab"))
  sharded = temp(jax.value_and_grad(sharded_fn), split, split)
  assert sharded <= 0.2 * single, (sharded, single)


ONLINE_CASES = {
  "forward_kl": (Divergence("forward_kl"), (1.0, 0.0)),
  "reverse_kl": (Divergence("reverse_kl"), (0.0, 1.0)),
  "symmetric_kl[0.7]": (Divergence("symmetric_kl", lam=0.7), (0.3, 0.7)),
  "jsd[1]": (Divergence("jsd", beta=1.0), (0.0, 1.0)),
}


@pytest.mark.parametrize("x64_mode", [False, True])
@pytest.mark.parametrize("case", sorted(ONLINE_CASES))
def test_online_softmax_accelerator_path(accelerator_branch, case, x64_mode):
  """The KL family's accelerator statistics (one pass with running maxes: online_kl_sums)
  against float64 NumPy: values on rows with -inf logits, mass on one side only (+inf), a
  class 200 below the max (its mass underflows in float32: none there, as on CPU, also
  where the other side has -inf), a NaN logit and identical rows (exactly 0); gradients
  wrt both logits on the finite rows."""
  spec, (w_fwd, w_rev) = ONLINE_CASES[case]
  rng = np.random.default_rng(1)
  z, y = 3.0 * rng.normal(size=(2, 7, 37)), 3.0 * rng.normal(size=(2, 7, 37))
  z[0, 0, :5] = y[0, 0, :5] = -np.inf  # masked classes on both sides
  z[0, 1, 3] = -np.inf  # teacher mass where the student has none: forward KL +inf
  y[0, 2, 4] = -np.inf  # and the reverse
  z[0, 3, 6], y[0, 3, 7] = -200.0, -200.0
  y[0, 4] = z[0, 4]  # identical rows
  z[0, 5, 0] = np.nan
  z[0, 6, 8], y[0, 6, 8], z[0, 6, 9], y[0, 6, 9] = -np.inf, -200.0, -200.0, -np.inf
  temperature = 1.5
  zr, yr = z.copy(), y.copy()
  if not x64_mode:  # float32: the underflowing masses are none
    yr[0, 6, 8] = zr[0, 6, 9] = -np.inf
  fwd = refs.ref_forward_kl(zr, yr, temperature)
  rev = refs.ref_reverse_kl(zr, yr, temperature)
  with np.errstate(invalid="ignore"):
    want = np.where(w_fwd > 0, w_fwd * fwd, 0.0) + np.where(w_rev > 0, w_rev * rev, 0.0)
  want[0, 5] = np.nan
  with enable_x64(x64_mode):
    dtype = jnp.float64 if x64_mode else jnp.float32
    got = divergence_from_logits(
      jnp.asarray(z, dtype), jnp.asarray(y, dtype), divergence=spec, temperature=temperature
    )
    tol = 1e-12 if x64_mode else 2e-5
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    assert float(got[0, 4]) == 0.0

    zf, yf = z[1], y[1]  # finite rows: gradients
    weights = rng.uniform(0.5, 1.5, size=zf.shape[0])

    def loss(a, b):
      d = divergence_from_logits(a, b, divergence=spec, temperature=temperature)
      return jnp.sum(jnp.asarray(weights, a.dtype) * d)

    gz, gy = jax.grad(loss, argnums=(0, 1))(jnp.asarray(zf, dtype), jnp.asarray(yf, dtype))
    fz, fy = refs.np_logits_value_and_grads(zf, yf, weights, temperature)[1:]
    rz, ry = refs.np_logits_value_and_grads(zf, yf, weights, temperature, direction="reverse")[1:]
    gtol = 1e-10 if x64_mode else 1e-5
    np.testing.assert_allclose(gz, w_fwd * fz + w_rev * rz, rtol=gtol, atol=gtol)
    np.testing.assert_allclose(gy, w_fwd * fy + w_rev * ry, rtol=gtol, atol=gtol)

    # Second derivatives (through the statistics' own rule) against autodiff of log_softmax.
    def formula(a):
      lq, lp = jax.nn.log_softmax(a / temperature), jax.nn.log_softmax(yf[0] / temperature)
      return w_fwd * jnp.sum(jnp.exp(lp) * (lp - lq)) + w_rev * jnp.sum(jnp.exp(lq) * (lq - lp))

    one = lambda a: divergence_from_logits(a, yf[0], divergence=spec, temperature=temperature)  # noqa: E731
    a = jnp.asarray(zf[0], dtype)
    htol = 1e-9 if x64_mode else 1e-4
    np.testing.assert_allclose(jax.hessian(one)(a), jax.hessian(formula)(a), rtol=htol, atol=htol)


OTHER_ONLINE_CASES = {
  "jsd[0.5]": ("jsd", {"beta": 0.5}),
  "tvd": ("tvd", {}),
  "skew_kl[0.1]": ("skew_kl", {"alpha": 0.1}),
  "alpha_beta[0.5,0.3]": ("alpha_beta", {"alpha": 0.5, "beta": 0.3}),
}


@pytest.mark.parametrize(
  ("accelerator_platform", "x64_mode"),
  [("default", False), ("default", True), ("cuda", False)],
  indirect=["accelerator_platform"],
)
@pytest.mark.parametrize("case", sorted(OTHER_ONLINE_CASES))
def test_accelerator_path_other_divergences(accelerator_platform, case, x64_mode):
  """The accelerator statistics of the divergences without a one-pass form (online maxes
  and sums of exponentials, then the class sums with their terms fused in: one variadic
  reduction by default, on GPU each sum from its own copy of the row statistics) against float64
  references: values on rows with classes -inf on both sides, a NaN logit and identical
  rows (exactly 0); gradients wrt the student against autodiff of log_softmax + formula."""
  name, params = OTHER_ONLINE_CASES[case]
  spec = Divergence(name, **params)
  ref = refs.REFERENCES[name]
  rng = np.random.default_rng(2)
  z, y = 2.0 * rng.normal(size=(5, 37)), 2.0 * rng.normal(size=(5, 37))
  z[0, :4] = y[0, :4] = -np.inf
  y[1] = z[1]
  z[2, 5] = np.nan
  temperature = 1.5
  with np.errstate(invalid="ignore"):
    want = np.array(
      [
        ref(z[i, 4:] if i == 0 else z[i], y[i, 4:] if i == 0 else y[i], temperature, **params)
        for i in range(5)
      ]
    )
  with enable_x64(x64_mode):
    dtype = jnp.float64 if x64_mode else jnp.float32
    a, b = jnp.asarray(z, dtype), jnp.asarray(y, dtype)
    got = divergence_from_logits(a, b, divergence=spec, temperature=temperature)
    tol = 1e-11 if x64_mode else 2e-5
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    assert float(got[1]) == 0.0 and np.isnan(float(got[2]))
    weights = jnp.asarray(rng.uniform(0.5, 1.5, size=2), dtype)
    rows = (jnp.asarray(z[3:], dtype), jnp.asarray(y[3:], dtype))
    gz = jax.grad(
      lambda a, b: jnp.sum(
        weights * divergence_from_logits(a, b, divergence=spec, temperature=temperature)
      )
    )(*rows)
  with enable_x64(True):
    wz = jax.grad(
      lambda a: jnp.sum(
        np.asarray(weights, np.float64) * ref(a, y[3:], temperature, xp=jnp, **params)
      )
    )(jnp.asarray(z[3:], jnp.float64))
  gtol = 1e-10 if x64_mode else 1e-5
  np.testing.assert_allclose(np.asarray(gz, np.float64), np.asarray(wz), rtol=gtol, atol=gtol)


def test_accelerator_path_alpha_beta_one_pass(accelerator_branch, x64):
  """Alpha-beta's one pass off CPU (static alpha, beta > 0: three sums rescaled with the
  running maxes, online_ab_sums): float64 values against ABKD's formula in 80-digit decimals
  with classes only one side has mass on, a tiny divergence (rows 1e-6 apart: 1.6e-13, to a
  few ulps of the row sums, which are about 1; how many of its digits survive depends on
  XLA's code generation) and an identical row (exactly 0); second derivatives (the sums'
  two-pass rule) against finite differences."""
  rng = np.random.default_rng(4)
  z, y = 2.0 * rng.normal(size=(4, 9)), 2.0 * rng.normal(size=(4, 9))
  z[0, :2] = -np.inf  # the teacher has mass where the student has none
  y[0, 5] = -np.inf  # and the reverse
  y[1] = z[1] + 1e-6 * rng.normal(size=9)
  y[2] = z[2]
  spec = Divergence("alpha_beta", alpha=0.7, beta=0.4)
  got = divergence_from_logits(z, y, divergence=spec, temperature=1.3)
  finite_z, finite_y = np.where(np.isinf(z), -1e4, z), np.where(np.isinf(y), -1e4, y)
  want = _decimal_rows(finite_z, finite_y, 1.3, 0.7, 0.4)
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=2e-15)
  assert float(got[2]) == 0.0 and float(got[1]) > 0.0
  f = jax.jit(lambda z, y: divergence_from_logits(z, y, divergence=spec, temperature=1.3))
  check_grads(f, (z[3:], y[3:]), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize(
  ("loss", "divergence", "temperature"),
  [
    ("materialised", "forward_kl", 1.0),
    ("materialised", "reverse_kl", 1.0),
    ("materialised", "forward_kl", "array 1.0"),
    ("materialised", "forward_kl", 2.0),
    ("fused", "forward_kl", 1.0),
    ("fused", "forward_kl", 2.0),
  ],
)
def test_unit_temperature_shares_no_exponential(accelerator_branch, loss, divergence, temperature):
  """distillation_loss and the fused head off CPU: the divergence's KL sums and the cross
  entropy's statistics come from reductions over the same logits (one variadic reduction,
  or sibling ones per chunk). At T = 1 (the default; or a constant array) XLA folds ``z / 1``
  and the two sides' logits are one value: no exponential may then feed two of their
  operands. One did (the classes' masses, ``exp(u - u)`` on both sides, merged by XLA's
  CSE), and XLA:GPU wrote it out as an [N, V] float32 temporary (compiled for an H100:
  1 GiB and 3.35x the HBM floor at (2048, 131072) bf16, where T = 2 gave 14 MiB and 1.69x;
  the fused loss, a [chunk, V] float32 array: 1 GiB at 4096 x 65536). Read from the
  optimised module of the accelerator branch compiled for CPU, whose CSE merges the same
  way (its fusions differ: the temporary itself shows only on XLA:GPU, in ``make
  bench-accel``). T = 2: the control."""
  t = jnp.float32(1.0) if temperature == "array 1.0" else temperature
  n, h, v = 64, 16, 512
  labels = jax.ShapeDtypeStruct((n,), jnp.int32)
  if loss == "materialised":
    args, argnums = (jax.ShapeDtypeStruct((n, v), jnp.float32),) * 2 + (labels,), 0

    def fn(s, y, labels):
      return kd.distillation_loss(s, y, labels, temperature=t, divergence=divergence)

  else:
    hidden, head = (
      jax.ShapeDtypeStruct((n, h), jnp.float32),
      jax.ShapeDtypeStruct((h, v), jnp.float32),
    )
    args, argnums = (hidden, head, hidden, head, labels), (0, 1)

    def fn(hs, ws, ht, wt, labels):
      return kd.fused_distillation_loss(
        hs, ws, ht, wt, labels=labels, temperature=t, divergence=divergence, chunk_size=32
      )

  hlo = jax.jit(jax.value_and_grad(fn, argnums)).lower(*args).compile().as_text()
  assert re.search(r"\) reduce\(", hlo), "no variadic reduce: the one-pass path was not taken"
  assert refs.shared_exponentials(hlo) == []


@pytest.mark.parametrize("x64_mode", [False, True])
def test_accelerator_path_tokens_and_distillation(accelerator_branch, x64_mode):
  """token_log_probs (± entropy) and distillation_loss on the accelerator path (one
  online-softmax pass for their statistics) against float64 NumPy: values with -inf
  logits and a NaN row, gradients on finite rows."""
  rng = np.random.default_rng(3)
  z, y = 2.0 * rng.normal(size=(4, 29)), 2.0 * rng.normal(size=(4, 29))
  z[0, :3] = -np.inf
  ids = np.array([5, 1, 7, 2])
  temperature = 1.5
  lq = refs.np_log_softmax(z / temperature)
  want_lp = np.take_along_axis(lq, ids[:, None], -1)[:, 0]
  with np.errstate(invalid="ignore"):
    want_h = -np.sum(np.where(np.isfinite(lq), np.exp(lq) * lq, 0.0), -1)
  zn = z.copy()
  zn[3, 4] = np.nan
  with enable_x64(x64_mode):
    dtype = jnp.float64 if x64_mode else jnp.float32
    tol = 1e-11 if x64_mode else 2e-5
    a = jnp.asarray(zn, dtype)
    lp_only = kd.token_log_probs(a, ids, temperature=temperature)
    lp, h = kd.token_log_probs(a, ids, temperature=temperature, return_entropy=True)
    for got, want in ((lp_only, want_lp), (lp, want_lp), (h, want_h)):
      np.testing.assert_allclose(np.asarray(got[:3], np.float64), want[:3], rtol=tol, atol=tol)
      assert np.isnan(float(got[3]))
    w = rng.uniform(0.5, 1.5, size=4)
    g_lp = jax.grad(lambda a: jnp.sum(w * kd.token_log_probs(a, ids, temperature=temperature)))(
      jnp.asarray(z, dtype)
    )
    g_h = jax.grad(
      lambda a: jnp.sum(
        w * kd.token_log_probs(a, ids, temperature=temperature, return_entropy=True)[1]
      )
    )(jnp.asarray(z, dtype))
    labels = np.array([4, -100, 9, 0])
    value, (gs, gt) = jax.value_and_grad(
      lambda s, t: kd.distillation_loss(s, t, labels[1:], temperature=temperature, alpha=0.3),
      (0, 1),
    )(jnp.asarray(z[1:], dtype), jnp.asarray(y[1:], dtype))
  q = np.exp(lq)
  hit = np.eye(z.shape[1])[ids]
  gtol = 1e-10 if x64_mode else 1e-5
  np.testing.assert_allclose(g_lp, w[:, None] * (hit - q) / temperature, rtol=gtol, atol=gtol)
  with np.errstate(invalid="ignore"):
    dh = np.where(q > 0, -q * (lq + want_h[:, None]), 0.0)
  np.testing.assert_allclose(g_h, w[:, None] * dh / temperature, rtol=gtol, atol=gtol)
  want = refs.np_distillation(
    z[1:], y[1:], labels[1:], temperature=temperature, alpha=0.3, divergence="forward_kl"
  )
  np.testing.assert_allclose(float(value), want[0], rtol=tol, atol=tol)
  np.testing.assert_allclose(gs, want[1], rtol=gtol, atol=gtol)
  np.testing.assert_allclose(gt, want[2], rtol=gtol, atol=gtol)
