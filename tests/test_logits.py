"""kl_div_from_logits and generalized_jsd: values, gradients, masks, dtypes, errors.

References (``_references.py``): float64 NumPy values and closed-form
gradients, TRL's ``generalized_jsd_loss`` ported to NumPy, the same textbook
formulas run by torch autograd (``[torch]``, live), and JAX autodiff of a plain
``log_softmax`` reference.
"""

import functools

import _references as refs
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import (
  INF,
  TOLERANCES,
  enable_x64,
  np_log_softmax,
  ref_forward_kl,
  ref_reverse_kl,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from kldiv_jax import generalized_jsd, kl_div_from_logits


@functools.partial(jax.jit, static_argnums=(0, 1))
def _value_and_grads(fn, static, z, y, weights, dynamic):
  def loss(z, y):
    out = fn(z, y, **dict(static), **dynamic)
    return jnp.sum(out * weights), out

  (_, out), (gz, gy) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(z, y)
  return out, gz, gy


def value_and_grads(fn, z, y, weights=1.0, *, dynamic=None, **static):
  """``fn(z, y, **static, **dynamic)`` and the gradients of its weighted sum.

  Jitted, so each distinct ``fn``/static options/shape compiles once (eager
  mode compiles every primitive separately, which is slower on CI).
  """
  return _value_and_grads(fn, tuple(sorted(static.items())), z, y, weights, dynamic or {})


def ref_kl(z, y, temperature=1.0, direction="forward", axis=-1):
  """Plain JAX reference for autodiff comparisons (finite logits only)."""
  lq = jax.nn.log_softmax(z / temperature, axis=axis)
  lp = jax.nn.log_softmax(y / temperature, axis=axis)
  if direction == "reverse":
    lp, lq = lq, lp
  return jnp.sum(jnp.exp(lp) * (lp - lq), axis=axis)


def ref_jsd(z, y, beta, temperature=1.0):
  lq = jax.nn.log_softmax(z / temperature)
  lp = jax.nn.log_softmax(y / temperature)
  lm = jnp.logaddexp(lp + jnp.log(beta), lq + jnp.log1p(-beta))
  return jnp.sum(beta * jnp.exp(lp) * (lp - lm) + (1 - beta) * jnp.exp(lq) * (lq - lm), -1)


def _pair(rng, shape=(4, 7), scale=2.0):
  return rng.normal(size=shape) * scale, rng.normal(size=shape) * scale


# ------------------------------------------------------- values and gradients


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_kl_matches_reference(x64, rng, source, direction, temperature):
  z, y = _pair(rng)
  w = rng.uniform(0.5, 1.5, size=4)
  val, gz, gy = value_and_grads(
    kl_div_from_logits, z, y, w, direction=direction, dynamic={"temperature": temperature}
  )
  r_val, r_gz, r_gy = refs.LOGITS[source](z, y, w, temperature, direction=direction)
  np.testing.assert_allclose(val, r_val, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(gz, r_gz, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(gy, r_gy, rtol=1e-10, atol=1e-14)


def test_forward_gradient_is_q_minus_p_over_t(x64, rng):
  z, y = _pair(rng)
  w = np.ones(4)
  _, gz, _ = value_and_grads(
    kl_div_from_logits, z, y, w, direction="forward", dynamic={"temperature": 2.0}
  )
  q = np.exp(np_log_softmax(z / 2.0))
  p = np.exp(np_log_softmax(y / 2.0))
  np.testing.assert_allclose(gz, (q - p) / 2.0, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_gjsd_matches_trl(x64, rng, source, beta, temperature):
  z, y = _pair(rng)
  w = rng.uniform(0.5, 1.5, size=4)
  val, gz, gy = value_and_grads(
    generalized_jsd, z, y, w, beta=beta, dynamic={"temperature": temperature}
  )
  r_val, r_gz, r_gy = refs.LOGITS[source](z, y, w, temperature, beta=beta)
  np.testing.assert_allclose(val, r_val, rtol=1e-11, atol=1e-15)
  np.testing.assert_allclose(gz, r_gz, rtol=1e-9, atol=1e-14)
  np.testing.assert_allclose(gy, r_gy, rtol=1e-9, atol=1e-14)


def test_gjsd_half_is_symmetric_and_bounded(x64, rng):
  z, y = _pair(rng, scale=5.0)
  w = np.ones(4)

  def jsd(a, b, beta):
    return value_and_grads(generalized_jsd, a, b, w, dynamic={"beta": beta})[0]

  half = jsd(z, y, 0.5)
  np.testing.assert_allclose(half, jsd(y, z, 0.5), rtol=1e-12)
  assert np.all(half >= 0) and np.all(half <= np.log(2.0))
  # The formula tends to 0 as beta -> 0; TRL's endpoint is forward KL.
  assert np.all(jsd(z, y, 1e-9) < 1e-7)
  np.testing.assert_allclose(jsd(z, y, 0.0), ref_forward_kl(z, y), rtol=1e-12)


def _jsd_tb(z, y, t, b):
  return generalized_jsd(z, y, beta=b, temperature=t)


def _all_divergences(z, y, t):
  # One program for the three kernels keeps the (compile-bound) check cheap; a
  # wrong derivative in any term fails it.
  return (
    kl_div_from_logits(z, y, temperature=t)
    + 2.0 * kl_div_from_logits(z, y, temperature=t, direction="reverse")
    + 3.0 * generalized_jsd(z, y, beta=0.35, temperature=t)
  )


def test_check_grads_order2(x64, rng):
  z, y = _pair(rng, shape=(2, 5))
  check_grads(jax.jit(_all_divergences), (z, y, 1.7), order=2, modes=("fwd", "rev"))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _second_order(ours, ref, z, y, s):
  """Hessians wrt both logits, gradient wrt the scalar ``s``, a jvp: ours and ref."""
  out = []
  for f in (ours, ref):
    out.append(
      (
        jax.hessian(f, argnums=(0, 1))(z, y, s),
        jax.grad(f, argnums=2)(z, y, s),
        jax.jvp(lambda a, f=f: f(a, y, s), (z,), (y,))[1],
      )
    )
  return out


def _kl_sum(direction):
  def f(z, y, t):
    return jnp.sum(kl_div_from_logits(z, y, temperature=t, direction=direction))

  def ref(z, y, t):
    return jnp.sum(ref_kl(z, y, t, direction))

  return f, ref


def _jsd_sum(z, y, b):
  return jnp.sum(generalized_jsd(z, y, beta=b, temperature=1.5))


def _jsd_ref_sum(z, y, b):
  return jnp.sum(ref_jsd(z, y, b, 1.5))


@pytest.mark.parametrize(
  "pair",
  [_kl_sum("forward"), _kl_sum("reverse"), (_jsd_sum, _jsd_ref_sum)],
  ids=["forward", "reverse", "jsd"],
)
def test_second_order_matches_autodiff_of_reference(x64, rng, pair):
  z, y = _pair(rng, shape=(2, 5))
  ours, ref = _second_order(*pair, z, y, 0.4 if pair[0] is _jsd_sum else 1.5)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-13)


# ---------------------------------------------------------- -inf and masking


def test_neg_inf_logits_conventions(x64):
  z = np.array(
    [
      [0.0, 1.0, -INF, 2.0],  # both -inf at class 2
      [0.5, -INF, 1.0, 0.0],  # student -inf where the teacher has mass
      [0.0, -INF, 1.0, 2.0],  # student -inf where the teacher has none
      [-INF, -INF, -INF, -INF],  # student without mass
    ]
  )
  y = np.array(
    [
      [1.0, 0.0, -INF, 0.5],
      [0.0, 1.0, 2.0, 0.0],
      [1.0, -INF, 0.0, -1.0],
      [0.0, 1.0, 2.0, 3.0],
    ]
  )
  w = np.ones(4)
  fwd, gz, gy = value_and_grads(kl_div_from_logits, z, y, w, direction="forward")
  rev = value_and_grads(kl_div_from_logits, z, y, w, direction="reverse")[0]
  drop = [0, 1, 3]  # row 0 without the class both sides mask
  np.testing.assert_allclose(fwd[0], ref_forward_kl(z[0, drop], y[0, drop]), rtol=1e-12)
  np.testing.assert_allclose(rev[0], ref_reverse_kl(z[0, drop], y[0, drop]))
  assert fwd[1] == INF  # teacher mass where the student has none
  np.testing.assert_allclose(rev[1], ref_reverse_kl(z[1], y[1]), rtol=1e-12)
  np.testing.assert_allclose(fwd[2], ref_forward_kl(z[2], y[2]), rtol=1e-12)
  assert fwd[3] == INF and rev[3] == 0.0  # KL(p || 0) = inf, KL(0 || p) = 0
  assert np.all(np.isfinite(gz)) and np.all(np.isfinite(gy))
  # Where the KL is finite, the gradients equal those without the -inf classes.
  gz0, gy0 = jax.jit(jax.grad(lambda a, b: jnp.sum(ref_kl(a, b)), argnums=(0, 1)))(
    z[0, drop], y[0, drop]
  )
  np.testing.assert_allclose(gz[0, drop], gz0, rtol=1e-12)
  np.testing.assert_allclose(gy[0, drop], gy0, rtol=1e-12)
  assert gz[0, 2] == 0 and gy[0, 2] == 0
  q = np.exp(np_log_softmax(z[2]))
  p = np.exp(np_log_softmax(y[2]))
  np.testing.assert_allclose(gz[2], q - p, rtol=1e-12, atol=1e-15)
  # -inf student logits where the teacher has mass: gradient -p (torch's -t).
  np.testing.assert_allclose(gz[1, 1], -np.exp(np_log_softmax(y[1]))[1], rtol=1e-12)
  # JSD is finite wherever either side has mass, and so are its gradients.
  jsd, *jsd_grads = value_and_grads(generalized_jsd, z[:3], y[:3], w[:3], beta=0.3)
  assert all(np.all(np.isfinite(g)) for g in jsd_grads)
  np.testing.assert_allclose(jsd, refs.ref_jsd(z[:3], y[:3], beta=0.3), rtol=1e-12)


@pytest.mark.parametrize("fn", [kl_div_from_logits, generalized_jsd])
def test_all_masked_rows_give_zero(fn):
  z = jnp.array([[-jnp.inf] * 3, [0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
  y = jnp.array([[-jnp.inf] * 3, [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
  where = jnp.array([[True] * 3, [False] * 3, [True] * 3])  # every class of row 1 masked
  out, gz, gy = value_and_grads(fn, z, y, jnp.ones(3), dynamic={"where": where})
  np.testing.assert_array_equal(out[:2], 0.0)
  assert np.isfinite(out[2]) and out[2] > 0
  np.testing.assert_array_equal(gz[:2], 0.0)
  np.testing.assert_array_equal(gy[:2], 0.0)


@pytest.mark.parametrize("fn", [kl_div_from_logits, generalized_jsd])
def test_class_mask_equals_dropping_classes(x64, rng, fn):
  z, y = _pair(rng, shape=(3, 6))
  keep = np.array([True, False, True, True, False, True])
  w = np.ones(3)
  t = {"temperature": 1.5}
  out, gz, gy = value_and_grads(fn, z, y, w, dynamic={"where": keep, **t})
  out0, gz0, gy0 = value_and_grads(fn, z[:, keep], y[:, keep], w, dynamic=t)
  np.testing.assert_allclose(out, out0, rtol=1e-12)
  np.testing.assert_allclose(gz[:, keep], gz0, rtol=1e-12)
  np.testing.assert_allclose(gy[:, keep], gy0, rtol=1e-12)
  np.testing.assert_array_equal(gz[:, ~keep], 0.0)
  np.testing.assert_array_equal(gy[:, ~keep], 0.0)
  if fn is kl_div_from_logits:  # jax.nn.log_softmax(where=...) semantics
    lq = jax.nn.log_softmax(z / 1.5, where=keep)
    lp = jax.nn.log_softmax(y / 1.5, where=keep)
    ref = jnp.sum(jnp.where(keep, jnp.exp(lp) * (lp - lq), 0.0), -1)
    np.testing.assert_allclose(out, ref, rtol=1e-12)


@pytest.mark.parametrize("fn", [kl_div_from_logits, generalized_jsd])
def test_per_example_mask_zeroes_garbage_and_nan_propagates(fn):
  z = jnp.array([[0.0, 1.0, 2.0], [jnp.nan, jnp.inf, -jnp.inf], [1.0, 0.0, 0.0], [0, jnp.nan, 1]])
  y = jnp.array([[1.0, 0.0, 0.0], [jnp.inf, 0.0, -jnp.inf], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
  where = jnp.array([True, False, True, True])
  out, gz, gy = value_and_grads(fn, z, y, jnp.ones(4), dynamic={"where": where})
  assert out[1] == 0.0 and np.isnan(out[3])
  rows = np.array([0, 2])
  np.testing.assert_allclose(
    out[rows], value_and_grads(fn, z[rows], y[rows], jnp.ones(2))[0], rtol=1e-6
  )
  np.testing.assert_array_equal(gz[1], 0.0)
  np.testing.assert_array_equal(gy[1], 0.0)
  assert np.all(np.isfinite(gz[:3])) and np.all(np.isfinite(gy[:3]))


def test_traced_temperature_with_neg_inf_logits_has_finite_gradient(x64):
  z = np.array([0.0, -INF, 1.0, 2.0])
  y = np.array([1.0, -INF, 0.0, 0.5])
  keep = np.isfinite(z)
  g_kl, g_jsd, ref_kl_t, ref_jsd_t = jax.jit(
    lambda z, y, t: [
      jax.grad(f)(t)
      for f in (
        lambda t: kl_div_from_logits(z, y, temperature=t),
        lambda t: _jsd_tb(z, y, t, 0.5),
        lambda t: kl_div_from_logits(z[keep], y[keep], temperature=t),
        lambda t: _jsd_tb(z[keep], y[keep], t, 0.5),
      )
    ]
  )(z, y, 2.0)
  np.testing.assert_allclose(g_kl, ref_kl_t, rtol=1e-12)
  np.testing.assert_allclose(g_jsd, ref_jsd_t, rtol=1e-12)
  assert np.isfinite(g_kl) and g_kl != 0


def test_large_logits_are_stable():
  rng = np.random.default_rng(1)
  z = (rng.normal(size=(3, 50)) * 1e4).astype(np.float32)
  y = z + (rng.normal(size=(3, 50)) * 1e3).astype(np.float32)
  out, gz, _ = value_and_grads(kl_div_from_logits, z, y, np.ones(3, np.float32))
  np.testing.assert_allclose(out, ref_forward_kl(z, y), rtol=1e-4, atol=1e-2)
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(gz))


# ------------------------------------------------ shapes, axes, transformations


def test_axis_and_broadcasting(x64, rng):
  z, y = _pair(rng, shape=(3, 4, 5))
  kl = jax.jit(kl_div_from_logits, static_argnames="axis")
  jsd = jax.jit(generalized_jsd, static_argnames="axis")
  np.testing.assert_allclose(
    kl(z, y, axis=1),
    ref_forward_kl(np.moveaxis(z, 1, -1), np.moveaxis(y, 1, -1)),
    rtol=1e-12,
  )
  np.testing.assert_allclose(
    jsd(z, y, axis=(1, 2)), refs.ref_jsd(z.reshape(3, 20), y.reshape(3, 20), beta=0.5), rtol=1e-12
  )
  np.testing.assert_allclose(
    kl(z, y[0, 0]), ref_forward_kl(z, np.broadcast_to(y[0, 0], z.shape)), rtol=1e-12
  )
  np.testing.assert_allclose(
    kl(z, y, axis=None), ref_forward_kl(z.reshape(-1), y.reshape(-1)), rtol=1e-12
  )


@pytest.mark.parametrize("fn", [kl_div_from_logits, generalized_jsd])
def test_jit_vmap_and_no_retrace(rng, fn):
  z, y = (a.astype(np.float32) for a in _pair(rng, shape=(3, 4, 6)))
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def jitted(z, y, t):
    return fn(z, y, temperature=t)

  ref = ref_forward_kl(z, y, 2.0) if fn is kl_div_from_logits else refs.ref_jsd(z, y, 2.0, beta=0.5)
  np.testing.assert_allclose(jitted(z, y, 2.0), ref, rtol=1e-5, atol=1e-7)
  jitted(z + 1.0, y, 3.0)  # new values, no retrace
  vmapped = jax.jit(jax.vmap(lambda a, b: fn(a, b, temperature=2.0)))
  np.testing.assert_allclose(vmapped(z, y), jitted(z, y, 2.0), rtol=1e-6, atol=1e-7)


def _blocked_program(z, y, keep, keep_rows, v):
  """Values, gradients (three mask layouts) and a Hessian-vector product."""

  def loss(fn, a, b, **kw):
    return jnp.sum(fn(a, b, temperature=1.5, **kw) ** 2)

  out = []
  for fn, kw in [
    (kl_div_from_logits, {}),
    (kl_div_from_logits, {"where": keep_rows}),
    (generalized_jsd, {"where": keep}),
  ]:
    out.append(fn(z, y, temperature=1.5, **kw))
    out.append(jax.grad(functools.partial(loss, fn), argnums=(0, 1))(z, y, **kw))
  grad = jax.grad(functools.partial(loss, kl_div_from_logits))
  out.append(jax.jvp(lambda a: grad(a, y), (z,), (v,))[1])
  return out


def _blocked_reference(z, y, keep, keep_rows, v):
  def loss(f, a, b):
    return jnp.sum(f(a, b) ** 2)

  def kl(a, b):
    return ref_kl(a, b, 1.5)

  def kl_rows(a, b):
    return jnp.where(keep_rows, ref_kl(a, b, 1.5), 0.0)

  def jsd(a, b):
    lq = jax.nn.log_softmax(a / 1.5, where=keep)
    lp = jax.nn.log_softmax(b / 1.5, where=keep)
    lm = jnp.logaddexp(lp + jnp.log(0.5), lq + jnp.log(0.5))
    terms = 0.5 * jnp.exp(lp) * (lp - lm) + 0.5 * jnp.exp(lq) * (lq - lm)
    return jnp.sum(jnp.where(keep, terms, 0.0), -1)

  out = []
  for f in (kl, kl_rows, jsd):
    out.append(f(z, y))
    out.append(jax.grad(functools.partial(loss, f), argnums=(0, 1))(z, y))
  grad = jax.grad(functools.partial(loss, kl))
  out.append(jax.jvp(lambda a: grad(a, y), (z,), (v,))[1])
  return out


def test_blocked_rows_match_reference(x64, rng):
  # 2**16 classes: blocks of 2 rows (the last one shifted back), on CPU.
  z, y = _pair(rng, shape=(5, 1 << 16))
  keep = rng.uniform(size=z.shape) > 0.2
  args = (z, y, keep, np.array([True, False, True, True, False]), rng.normal(size=z.shape))
  if jax.default_backend() == "cpu":
    assert "dynamic_slice" in str(jax.make_jaxpr(_blocked_program)(*args))
  ours = jax.jit(_blocked_program)(*args)
  ref = jax.jit(_blocked_reference)(*args)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-15)


def test_traced_beta_selects_trl_endpoints(x64, rng):
  z, y = _pair(rng, shape=(2, 5))
  jsd = jax.jit(lambda b: generalized_jsd(z, y, beta=b))
  out = jax.vmap(jsd)(jnp.array([0.0, 0.25, 1.0]))
  for i, b in enumerate([0.0, 0.25, 1.0]):
    np.testing.assert_allclose(out[i], refs.ref_jsd(z, y, beta=b), rtol=1e-12)
    np.testing.assert_allclose(jsd(b), refs.ref_jsd(z, y, beta=b), rtol=1e-12)
  assert np.all(np.isnan(jsd(1.5)))


# --------------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
  ("fn", "dtype"),
  [
    (kl_div_from_logits, jnp.bfloat16),
    (kl_div_from_logits, jnp.float16),
    (kl_div_from_logits, jnp.float32),
    (generalized_jsd, jnp.bfloat16),
  ],
)
def test_low_precision_dtype_and_gradient_error(rng, dtype, fn):
  z, y = (jnp.asarray(a, dtype) for a in _pair(rng, shape=(4, 32)))
  out, gz, gy = value_and_grads(fn, z, y, jnp.ones(4, dtype), dynamic={"temperature": 2.0})
  assert out.dtype == dtype and gz.dtype == dtype and gy.dtype == dtype
  # Reference: float64 autodiff on the same (rounded) inputs; the only error
  # left is the final rounding to the low-precision dtype.
  with enable_x64(True):
    z64, y64 = np.asarray(z, np.float64), np.asarray(y, np.float64)
    ref_fn = ref_kl if fn is kl_div_from_logits else _ref_jsd_half
    r_out, r_gz, r_gy = value_and_grads(ref_fn, z64, y64, np.ones(4), dynamic={"temperature": 2.0})
  rtol, _ = TOLERANCES[jnp.dtype(dtype).name]
  np.testing.assert_allclose(np.asarray(out, np.float64), r_out, rtol=rtol, atol=rtol * 1e-2)
  for g, r in ((gz, r_gz), (gy, r_gy)):
    np.testing.assert_allclose(
      np.asarray(g, np.float64), r, rtol=rtol, atol=rtol * np.max(np.abs(r))
    )


def _ref_jsd_half(z, y, temperature):
  return ref_jsd(z, y, 0.5, temperature)


def test_mixed_dtypes_promote(rng):
  z = jnp.asarray(rng.normal(size=(2, 4)), jnp.bfloat16)
  y = jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)
  out, gz, gy = value_and_grads(kl_div_from_logits, z, y, jnp.ones(2))
  assert out.dtype == jnp.float32 and gz.dtype == jnp.bfloat16 and gy.dtype == jnp.float32


# ------------------------------------------------------------------ properties


@jax.jit
def _properties(z, y, shift, t):
  return (
    kl_div_from_logits(z, y, temperature=t),
    generalized_jsd(z, y, temperature=t),
    kl_div_from_logits(z, z + shift, temperature=t),
  )


@settings(max_examples=30, deadline=None)
@given(
  st.lists(st.floats(-20, 20), min_size=5, max_size=5),
  st.floats(-5, 5),
  st.floats(0.2, 5.0),
)
def test_kl_nonnegative_and_shift_invariant(values, shift, temperature):
  z = np.asarray(values, np.float32)
  kl, jsd, same = _properties(z, z[::-1], np.float32(shift), np.float32(temperature))
  assert kl >= -1e-6 and jsd >= -1e-6 and jsd <= np.log(2.0) + 1e-6
  assert abs(same) < 1e-5


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    ({"direction": "backward"}, ValueError, "direction must be one of"),
    ({"temperature": 0.0}, ValueError, "temperature must be positive"),
    ({"temperature": -1}, ValueError, "temperature must be positive"),
    ({"temperature": np.array([1.0, 2.0])}, ValueError, "scalar"),
    ({"temperature": jnp.array([1.0, 2.0])}, ValueError, "scalar"),
    ({"where": np.ones((2, 4), np.bool_)}, ValueError, "where has shape"),
    ({"where": np.ones((2, 3))}, TypeError, "boolean"),
    ({"axis": 2}, ValueError, "out of range"),
  ],
)
def test_bad_input_kl(kwargs, error, match):
  with pytest.raises(error, match=match):
    kl_div_from_logits(jnp.zeros((2, 3)), jnp.zeros((2, 3)), **kwargs)


@pytest.mark.parametrize("beta", [-0.1, 1.5, np.nan])
def test_bad_beta(beta):
  with pytest.raises(ValueError, match=r"beta must be a number in \[0, 1\]"):
    generalized_jsd(jnp.zeros(3), jnp.zeros(3), beta=beta)


def test_bad_shapes_and_dtypes():
  with pytest.raises(ValueError, match="same number of classes"):
    kl_div_from_logits(jnp.zeros((2, 3)), jnp.zeros((2, 1)))  # (3 and 4 share their first 3)
  with pytest.raises(ValueError, match="same number of classes"):
    generalized_jsd(jnp.zeros((2, 3)), jnp.zeros((2, 1)))
  with pytest.raises(ValueError, match="cannot be broadcast"):
    kl_div_from_logits(jnp.zeros((2, 3)), jnp.zeros((4, 3)))
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    kl_div_from_logits(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match="class axis"):
    kl_div_from_logits(1.0, 2.0)
