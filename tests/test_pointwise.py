"""kl_div_pointwise: edge values, derivatives, transformations and dtypes.

Expected values come from float64 NumPy and the closed forms of the reference
(``../shared/reference/torch-kl-div.md``), never from kldiv_jax itself.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import np_pointwise
from jax.test_util import check_grads

from kldiv_jax import kl_div_pointwise

INF = np.inf
NAN = np.nan


def np_grads(x, t, log_target=False):
  """Closed-form (d/dx, d/dt) per element, 0 at zero mass (reference doc)."""
  x = np.asarray(x, np.float64)
  t = np.asarray(t, np.float64)
  with np.errstate(all="ignore"):
    if log_target:
      zero = t == -INF
      p = np.exp(t)
      dx, dt = -p, p * (t - x + 1.0)
    else:
      zero = t == 0
      dx, dt = -t, np.log(t) + 1.0 - x
  return np.where(zero, 0.0, dx), np.where(zero, 0.0, dt)


# Derivative tests run jitted: eager mode compiles every primitive separately,
# which costs more than one small program on the 2-core CI machine.
@functools.partial(jax.jit, static_argnames="log_target")
def grads(x, t, log_target=False):
  """Reverse-mode elementwise derivatives of kl_div_pointwise."""

  def f(a, b):
    return jnp.sum(kl_div_pointwise(a, b, log_target=log_target))

  return jax.grad(f, argnums=(0, 1))(x, t)


# ---------------------------------------------------------------------------
# The reference table "Where torch is not finite, and what kldiv_jax does".
# Columns: x, t (probability), value, d/dx, d/dt.
TABLE_PROB = [
  (-1.0, 0.0, 0.0, 0.0, 0.0),
  (-INF, 0.0, 0.0, 0.0, 0.0),
  (3.0, 0.0, 0.0, 0.0, 0.0),
  (-INF, 0.5, INF, -0.5, INF),
  (-1.0, 0.5, 0.5 * (np.log(0.5) + 1.0), -0.5, np.log(0.5) + 2.0),
]
# Same with the target in log-space.
TABLE_LOG = [
  (-1.0, -INF, 0.0, 0.0, 0.0),
  (-INF, -INF, 0.0, 0.0, 0.0),
  (3.0, -INF, 0.0, 0.0, 0.0),
  (-INF, np.log(0.5), INF, -0.5, INF),
  (-1.0, np.log(0.5), 0.5 * (np.log(0.5) + 1.0), -0.5, 0.5 * (np.log(0.5) + 2.0)),
]


@pytest.mark.parametrize(
  ("log_target", "row"),
  [(False, r) for r in TABLE_PROB] + [(True, r) for r in TABLE_LOG],
)
def test_reference_table_values_and_both_gradients(log_target, row):
  x, t, value, d_x, d_t = row
  x32, t32 = jnp.float32(x), jnp.float32(t)
  out = kl_div_pointwise(x32, t32, log_target=log_target)
  np.testing.assert_allclose(out, value, rtol=2e-6)
  gx, gt = grads(x32, t32, log_target)
  np.testing.assert_allclose(gx, d_x, rtol=2e-6, atol=0)
  np.testing.assert_allclose(gt, d_t, rtol=2e-6, atol=0)


def test_plus_inf_value_when_input_is_minus_inf_and_target_has_mass():
  x = jnp.full((3,), -jnp.inf)
  t = jnp.array([0.1, 0.5, 1.0])
  out = kl_div_pointwise(x, t)
  assert np.all(np.isposinf(out))
  out_log = kl_div_pointwise(x, jnp.log(t), log_target=True)
  assert np.all(np.isposinf(out_log))


def _jacfwd_input_at_minus_inf(log_target, jit):
  x = jnp.array([-jnp.inf, -1.0])
  t = jnp.array([0.5, 0.25])
  if log_target:
    t = jnp.log(t)
  jac = jax.jacfwd(lambda a: kl_div_pointwise(a, t, log_target=log_target))
  jac = jax.jit(jac) if jit else jac
  np.testing.assert_allclose(np.diag(jac(x)), [-0.5, -0.25], rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("log_target", [False, True])
def test_forward_mode_input_derivative_at_minus_inf_input(log_target, jit):
  # d/dx = -t at x = -inf even though d/dt = +inf there: the zero tangent of t
  # must not turn it into inf * 0 = NaN (eager mode does not fold it away).
  _jacfwd_input_at_minus_inf(log_target, jit)


@pytest.mark.parametrize("log_target", [False, True])
def test_zero_targets_random_inputs(log_target, rng):
  x = rng.normal(size=(4, 6))
  x[0, :2] = -np.inf
  t = rng.dirichlet(np.ones(6), size=4)
  t[:, ::2] = 0.0
  t /= t.sum(-1, keepdims=True)
  with np.errstate(divide="ignore"):
    t_in = np.log(t) if log_target else t
  x32, t32 = jnp.asarray(x, jnp.float32), jnp.asarray(t_in, jnp.float32)
  out = kl_div_pointwise(x32, t32, log_target=log_target)
  expected = np_pointwise(np.asarray(x32), np.asarray(t32), log_target)
  np.testing.assert_allclose(out, expected, rtol=2e-6, atol=1e-6)
  assert np.all(np.asarray(out)[:, ::2] == 0.0)
  gx, gt = grads(x32, t32, log_target)
  ex, et = np_grads(np.asarray(x32), np.asarray(t32), log_target)
  # x = -inf with t > 0 at [0, 1] gives d/dt = +inf, the true derivative.
  np.testing.assert_allclose(gx, ex, rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(gt, et, rtol=2e-6, atol=1e-6)
  assert np.all(np.asarray(gx)[:, ::2] == 0.0)
  assert np.all(np.asarray(gt)[:, ::2] == 0.0)


@pytest.mark.parametrize("log_target", [False, True])
def test_all_zero_rows_with_masked_inputs(log_target):
  x = jnp.array([[-jnp.inf, -jnp.inf, 0.0], [-1.0, -2.0, -3.0]])
  zero = -jnp.inf if log_target else 0.0
  t = jnp.full((2, 3), zero)
  out = kl_div_pointwise(x, t, log_target=log_target)
  np.testing.assert_array_equal(out, np.zeros((2, 3)))
  gx, gt = grads(x, t, log_target)
  np.testing.assert_array_equal(gx, np.zeros((2, 3)))
  np.testing.assert_array_equal(gt, np.zeros((2, 3)))


# NaN propagation: an invalid value is never turned into a finite number.
@pytest.mark.parametrize(
  ("x", "t"),
  [(NAN, 0.5), (NAN, 0.0), (-1.0, NAN), (-INF, NAN), (-1.0, -0.5), (-INF, -0.5)],
)
def test_invalid_values_give_nan_probability_target(x, t):
  xa, ta = jnp.float32(x), jnp.float32(t)
  assert np.isnan(kl_div_pointwise(xa, ta))
  _, gt = grads(xa, ta)
  assert np.isnan(gt)


def test_plus_inf_input_is_invalid_even_at_zero_target():
  # +inf is no log-probability: NaN, not the zero-mass 0.
  assert np.isnan(kl_div_pointwise(jnp.float32(np.inf), jnp.float32(0.0)))
  assert np.isnan(kl_div_pointwise(jnp.float32(np.inf), jnp.float32(-np.inf), log_target=True))


@pytest.mark.parametrize(("x", "t"), [(NAN, -1.0), (NAN, -INF), (-1.0, NAN), (-INF, NAN)])
def test_invalid_values_give_nan_log_target(x, t):
  xa, ta = jnp.float32(x), jnp.float32(t)
  assert np.isnan(kl_div_pointwise(xa, ta, log_target=True))
  _, gt = grads(xa, ta, True)
  assert np.isnan(gt)


def test_nan_stays_local():
  x = jnp.array([-1.0, jnp.nan, -2.0])
  t = jnp.array([0.5, 0.3, 0.0])
  out = np.asarray(kl_div_pointwise(x, t))
  assert np.isnan(out[1])
  np.testing.assert_allclose(out[[0, 2]], [0.5 * (np.log(0.5) + 1.0), 0.0], rtol=2e-6)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0), (2, 0, 4)])
@pytest.mark.parametrize("log_target", [False, True])
def test_empty_arrays(shape, log_target):
  x = jnp.zeros(shape)
  t = jnp.zeros(shape)
  out = kl_div_pointwise(x, t, log_target=log_target)
  assert out.shape == shape and out.dtype == jnp.float32
  gx, gt = grads(x, t, log_target)
  assert gx.shape == shape and gt.shape == shape


# ---------------------------------------------------------------------------
# Derivatives.


@pytest.mark.parametrize("log_target", [False, True])
def test_second_derivatives_finite_at_zero_targets(log_target):
  x = jnp.array([-1.0, -jnp.inf, 2.0, -0.5])
  zero = -jnp.inf if log_target else 0.0
  t = jnp.array([zero, zero, zero, 0.25 if not log_target else np.log(0.25)])

  def f(a, b):
    return jnp.sum(kl_div_pointwise(a, b, log_target=log_target))

  hess = jax.jit(jax.hessian(f, argnums=(0, 1)))(x, t)
  for row in hess:
    for block in row:
      assert np.all(np.isfinite(np.asarray(block)))
  # Pure second derivatives vanish at zero mass; so does every term off the diagonal.
  for i, j in [(0, 0), (1, 1)]:
    np.testing.assert_array_equal(np.asarray(hess[i][j])[:3], 0.0)
  for i, j in [(0, 0), (0, 1), (1, 0), (1, 1)]:
    block = np.asarray(hess[i][j])
    np.testing.assert_array_equal(block - np.diag(np.diag(block)), 0.0)
  if log_target:
    # d/dx = -e^t and d/dt = e^t (t - x + 1) are both flat at t = -inf.
    np.testing.assert_array_equal(np.asarray(hess[0][1])[:3], 0.0)
    np.testing.assert_array_equal(np.asarray(hess[1][0])[:3], 0.0)
  # The interior element: d²/dt² = 1/t, d²/dtdx = -1 (log_target: e^t(t-x+2), -e^t).
  tt, xx = float(t[3]), float(x[3])
  if log_target:
    d_tt, d_tx = np.exp(tt) * (tt - xx + 2.0), -np.exp(tt)
  else:
    d_tt, d_tx = 1.0 / tt, -1.0
  np.testing.assert_allclose(hess[1][1][3, 3], d_tt, rtol=2e-6)
  np.testing.assert_allclose(hess[0][1][3, 3], d_tx, rtol=2e-6)
  np.testing.assert_allclose(hess[1][0][3, 3], d_tx, rtol=2e-6)
  np.testing.assert_allclose(hess[0][0][3, 3], 0.0, atol=0)


@pytest.mark.parametrize("log_target", [False, True])
def test_forward_mode_finite_at_zero_targets(log_target):
  x = jnp.array([-1.0, -jnp.inf, 0.3])
  zero = -jnp.inf if log_target else 0.0
  t = jnp.full((3,), zero)

  def f(a, b):
    return kl_div_pointwise(a, b, log_target=log_target)

  def g(b):
    return jnp.sum(f(x, b))

  @jax.jit
  def derivatives(x, t):
    out, tangent = jax.jvp(f, (x, t), (jnp.ones(3), jnp.ones(3)))
    jacs = [jac(f, argnums=i)(x, t) for jac in (jax.jacfwd, jax.jacrev) for i in (0, 1)]
    # forward-over-reverse and forward-over-forward second derivatives.
    second = [jax.jacfwd(jax.grad(g))(t), jax.jacfwd(jax.jacfwd(g))(t)]
    return [out, tangent, *jacs, *second]

  for value in derivatives(x, t):
    np.testing.assert_array_equal(value, 0.0)


@pytest.mark.parametrize("log_target", [False, True])
def test_closed_form_gradients_interior(log_target, rng, x64):
  x = np.log(rng.dirichlet(np.ones(5), size=3))
  t = rng.dirichlet(np.ones(5), size=3)
  t_in = np.log(t) if log_target else t
  gx, gt = grads(jnp.asarray(x), jnp.asarray(t_in), log_target)
  ex, et = np_grads(x, t_in, log_target)
  np.testing.assert_allclose(gx, ex, rtol=1e-12)
  np.testing.assert_allclose(gt, et, rtol=1e-12)

  # d²/dt²: 1/t for probability targets, e^t (t - x + 2) for log targets.
  def f(b):
    return jnp.sum(kl_div_pointwise(jnp.asarray(x), b, log_target=log_target))

  hess = jax.jit(jax.hessian(f))(jnp.asarray(t_in)).reshape(15, 15)
  diag = 1.0 / t_in if not log_target else np.exp(t_in) * (t_in - x + 2.0)
  np.testing.assert_allclose(hess, np.diag(diag.ravel()), rtol=1e-12, atol=1e-14)


def test_check_grads_order_2_interior(rng, x64):
  # Interior: targets well inside (0, 1) so finite differences stay valid.
  x = jnp.asarray(rng.uniform(-3.0, 0.0, size=(2, 4)))
  t = jnp.asarray(rng.uniform(0.1, 1.0, size=(2, 4)))
  log_t = jnp.asarray(rng.uniform(-3.0, 0.0, size=(2, 4)))

  # Both target spaces in one check: check_grads compiles ~17 programs per call.
  @jax.jit
  def f(a, b, c):
    return kl_div_pointwise(a, b), kl_div_pointwise(a, c, log_target=True)

  check_grads(f, (x, t, log_t), order=2, modes=("fwd", "rev"))


# ---------------------------------------------------------------------------
# Transformations.


def test_jit_equals_eager_and_numpy(rng):
  x = jnp.asarray(np.log(rng.dirichlet(np.ones(5), size=3)), jnp.float32)
  t = jnp.asarray(rng.dirichlet(np.ones(5), size=3), jnp.float32)
  eager = kl_div_pointwise(x, t)
  jitted = jax.jit(kl_div_pointwise, static_argnames="log_target")(x, t)
  np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(eager, np_pointwise(x, t), rtol=2e-6, atol=1e-7)


def test_vmap_equals_batched_call(rng):
  x = jnp.asarray(np.log(rng.dirichlet(np.ones(5), size=(4, 3))), jnp.float32)
  t = jnp.asarray(rng.dirichlet(np.ones(5), size=(4, 3)), jnp.float32)
  batched = kl_div_pointwise(x, t)
  np.testing.assert_allclose(jax.vmap(kl_div_pointwise)(x, t), batched, rtol=1e-6)
  # One argument unbatched (broadcast inside the function).
  per = jax.vmap(kl_div_pointwise, in_axes=(0, None))(x, t[0])
  np.testing.assert_allclose(per, np_pointwise(x, np.asarray(t[0])[None]), rtol=2e-6, atol=1e-7)
  # vmap of a gradient.
  g = jax.jit(jax.vmap(jax.grad(lambda a, b: jnp.sum(kl_div_pointwise(a, b)))))(x, t)
  np.testing.assert_allclose(g, -np.asarray(t), rtol=1e-6)


def test_broadcasting_shape(rng):
  x = jnp.asarray(rng.normal(size=(3, 1, 5)), jnp.float32)
  t = jnp.asarray(rng.uniform(size=(4, 1)), jnp.float32)
  out = kl_div_pointwise(x, t)
  assert out.shape == (3, 4, 5)
  np.testing.assert_allclose(out, np_pointwise(x, t), rtol=2e-6, atol=1e-6)


def test_no_retrace_same_shapes(rng):
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(a, b):
    return kl_div_pointwise(a, b)

  for _ in range(4):
    a = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
    b = jnp.asarray(rng.uniform(size=(3, 4)), jnp.float32)
    f(a, b).block_until_ready()
  chex.clear_trace_counter()


# ---------------------------------------------------------------------------
# dtypes.


def assert_within_output_rounding(out, expected, slack):
  """|out - expected| <= half an ulp of ``out``'s dtype at ``expected`` + slack."""
  nmant = jnp.finfo(out.dtype).nmant
  got = np.asarray(out.astype(jnp.float32), np.float64)
  tiny = float(jnp.finfo(out.dtype).tiny)
  mag = np.maximum(np.abs(expected), tiny)
  half_ulp = 2.0 ** (np.floor(np.log2(mag)) - nmant - 1)
  err = np.abs(got - expected)
  assert np.all(err <= half_ulp + slack), (err - half_ulp - slack).max()


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("log_target", [False, True])
def test_half_precision_computed_in_float32(dtype, log_target, rng):
  x = jnp.asarray(np.log(rng.dirichlet(np.ones(8), size=16)), dtype)
  t = jnp.asarray(rng.dirichlet(np.ones(8), size=16) * 3.0, dtype)
  if log_target:
    t = jnp.log(t.astype(jnp.float32)).astype(dtype)
  out = kl_div_pointwise(x, t, log_target=log_target)
  assert out.dtype == dtype
  x64_, t64_ = np.asarray(x, np.float64), np.asarray(t, np.float64)
  expected = np_pointwise(x64_, t64_, log_target)
  p = np.exp(t64_) if log_target else t64_
  scale = np.abs(p) * (np.abs(np.log(p)) + np.abs(x64_))
  assert_within_output_rounding(out, expected, slack=8 * 2.0**-24 * scale)


@pytest.mark.parametrize(
  ("dx", "dt", "expected"),
  [
    (jnp.float32, jnp.float32, jnp.float32),
    (jnp.float16, jnp.float16, jnp.float16),
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    (jnp.bfloat16, jnp.float16, jnp.float32),
    (jnp.float16, jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.float32, jnp.float32),
  ],
)
def test_dtype_promotion(dx, dt, expected):
  x = jnp.full((2, 3), -1.0, dx)
  t = jnp.full((2, 3), 0.5, dt)
  out = kl_div_pointwise(x, t)
  assert out.dtype == expected
  np.testing.assert_allclose(out.astype(jnp.float32), 0.5 * (np.log(0.5) + 1.0), rtol=1e-3)


def test_dtype_promotion_float64(x64):
  x = jnp.full((2,), -1.0, jnp.float32)
  t = jnp.full((2,), 0.5, jnp.float64)
  assert kl_div_pointwise(x, t).dtype == jnp.float64
  # A python scalar is weakly typed and keeps the array's dtype.
  assert kl_div_pointwise(jnp.ones(2, jnp.float16), 0.5).dtype == jnp.float16


@pytest.mark.parametrize("bad", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
def test_integral_inputs_rejected(bad):
  good = jnp.ones((2,), jnp.float32)
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    kl_div_pointwise(jnp.ones((2,), bad), good)
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    kl_div_pointwise(good, jnp.ones((2,), bad))


def test_complex_inputs_rejected():
  with pytest.raises(TypeError, match="Complex inputs not supported"):
    kl_div_pointwise(jnp.ones(2, jnp.complex64), jnp.ones(2))


def test_non_broadcastable_shapes_name_both():
  with pytest.raises(ValueError, match=r"\(3, 5\).*\(5, 3\)"):
    kl_div_pointwise(jnp.ones((3, 5)), jnp.ones((5, 3)))


@pytest.mark.parametrize("x", [-1.0, -jnp.inf])
def test_hessian_symmetric_at_zero_mass(x):
  # Closed form: d2/dx2 = 0, d2/dxdt = -1 (torch's mixed partial, also at
  # t = 0), and d2/dt2 pinned to 0 at zero mass; the matrix is symmetric.
  f = lambda a, b: kl_div_pointwise(a, b).sum()  # noqa: E731
  h = jax.hessian(f, argnums=(0, 1))(jnp.array([x]), jnp.array([0.0]))
  got = np.array([[float(h[i][j][0, 0]) for j in range(2)] for i in range(2)])
  np.testing.assert_array_equal(got, [[0.0, -1.0], [-1.0, 0.0]])


# ---------------------------------------------------------------------------
# XLA:CPU runs an elementwise-plus-sum over a few thousand elements or more as
# one fused (YNNPACK) kernel, whose max returns its second operand when either
# is NaN; the small arrays above never reach it. One special element per row of
# (rows, 1024): (x, t) with t a probability (its log with log_target).
FUSED_CASES = [
  (NAN, 0.0),  # NaN input at zero mass
  (-1.0, NAN),  # NaN target
  (NAN, 0.5),  # NaN input where the target has mass
  (-INF, 0.0),  # masked input at zero mass: 0
  (INF, 0.0),  # +inf is no log-probability: NaN
  (-INF, 0.5),  # mass where the input has none: +inf
  (-2.0, 0.0),
  (-1.0, -0.5),  # negative probability: NaN (log_target: a valid log-probability)
]


@pytest.mark.parametrize("log_target", [False, True])
def test_conventions_hold_in_the_fused_cpu_reduction(log_target, rng):
  from kldiv_jax import kl_div, kl_divergence, kl_divergence_with_log_targets

  rows, v = len(FUSED_CASES), 1024
  x = np.array(jax.nn.log_softmax(rng.standard_normal((rows, v))), np.float32)
  t = np.array(jax.nn.softmax(rng.standard_normal((rows, v))), np.float32)
  if log_target:
    t = np.log(t)
  for i, (xi, ti) in enumerate(FUSED_CASES):
    x[i, 7] = xi
    with np.errstate(all="ignore"):
      t[i, 7] = np.log(ti) if log_target and ti != -0.5 else ti
  expected = np_pointwise(x, t, log_target).sum(axis=-1)
  per_example = kl_divergence_with_log_targets if log_target else kl_divergence
  rows_sum = jax.vmap(lambda a, b: kl_div(a, b, reduction="sum", log_target=log_target))
  for got in (jax.jit(per_example)(x, t), jax.jit(rows_sum)(x, t)):
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=2e-5)
  # And in a whole-array sum: one NaN anywhere makes it NaN.
  total = jax.jit(lambda a, b: kl_div(a, b, reduction="sum", log_target=log_target))
  assert np.isnan(float(total(x, t)))
  finite = [i for i, r in enumerate(expected) if np.isfinite(r)]
  np.testing.assert_allclose(float(total(x[finite], t[finite])), expected[finite].sum(), rtol=2e-5)
