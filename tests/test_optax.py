"""Optax-compatible per-example losses: parity with optax.losses, masks, axes.

Expected values come from optax itself (where it is finite) and from float64
NumPy (where optax gives NaN, and for the per-example masks optax lacks).
"""

import functools
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import kldiv_jax

DEPRECATED = "The function convex_kl_divergence is deprecated"


def optax_convex(*args, **kwargs):
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=DEPRECATED, category=DeprecationWarning)
    return optax.losses.convex_kl_divergence(*args, **kwargs)


def ours_convex(*args, **kwargs):
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=DEPRECATED, category=DeprecationWarning)
    return kldiv_jax.convex_kl_divergence(*args, **kwargs)


# (ours, optax's, whether the second argument is in log-space)
PAIRS = {
  "kl_divergence": (kldiv_jax.kl_divergence, optax.losses.kl_divergence, False),
  "kl_divergence_with_log_targets": (
    kldiv_jax.kl_divergence_with_log_targets,
    optax.losses.kl_divergence_with_log_targets,
    True,
  ),
  "generalized_kl_divergence": (
    kldiv_jax.generalized_kl_divergence,
    optax.losses.generalized_kl_divergence,
    False,
  ),
  "convex_kl_divergence": (ours_convex, optax_convex, False),
}
ALL_NAMES = list(PAIRS)
# convex_kl_divergence is generalized_kl_divergence (checked below), so the
# costly matrices skip it; the cheap error tests cover every name.
NAMES = [n for n in ALL_NAMES if n != "convex_kl_divergence"]


def np_terms(name, x, t):
  """float64 NumPy elementwise terms of each loss, with the zero-mass convention."""
  x, t = np.broadcast_arrays(np.asarray(x, np.float64), np.asarray(t, np.float64))
  with np.errstate(all="ignore"):
    if name == "kl_divergence_with_log_targets":
      return np.where(t == -np.inf, 0.0, np.exp(t) * (t - x))
    kl = np.where(t == 0, 0.0, t * (np.log(t) - x))
    if name == "generalized_kl_divergence":
      kl = kl + np.exp(x) - t
    return kl


def positive_data(rng, shape, log_space):
  """Strictly positive (unnormalised for the generalized loss) data."""
  x = jnp.asarray(rng.uniform(-3.0, 0.5, size=shape), jnp.float32)
  t = rng.uniform(0.05, 1.0, size=shape)
  t = jnp.asarray(np.log(t) if log_space else t, jnp.float32)
  return x, t


def value_and_grad_x(fn, x, t, **kwargs):
  return jax.value_and_grad(lambda a: jnp.sum(fn(a, t, **kwargs)))(x)


# ---------------------------------------------------------------------------
# Parity with optax on strictly positive data.

AXES = [-1, 0, 1, (0, 2), (-1, -2), None]
# (axis, where-mask shape) for element masks, broadcast against [2, 3, 4] inputs.
ELEMENT_MASKS = [
  (-1, (2, 3, 4)),
  (-1, (1, 1, 4)),
  (-1, (3, 4)),
  (0, (2, 3, 4)),
  ((0, 2), (2, 1, 4)),
  (None, (2, 3, 4)),
]


def values_and_grads(fn, x, t, cases):
  """``{i: (value, d/dx of its sum)}`` for each ``(axis, where)`` in ``cases``, jitted once."""

  @jax.jit
  def run(x, t, masks):
    out = {}
    for i, ((axis, _), where) in enumerate(zip(cases, masks)):

      def total(a, axis=axis, where=where):
        return jnp.sum(fn(a, t, axis=axis, where=where))

      out[i] = fn(x, t, axis=axis, where=where), jax.grad(total)(x)
    return out

  return run(x, t, [where for _, where in cases])


@pytest.mark.parametrize("name", NAMES)
def test_matches_optax_values_and_gradients(name, rng):
  ours, theirs, log_space = PAIRS[name]
  x, t = positive_data(rng, (2, 3, 4), log_space)
  cases = [(axis, None) for axis in AXES]
  got, want = values_and_grads(ours, x, t, cases), values_and_grads(theirs, x, t, cases)
  for i, axis in enumerate(AXES):
    (out, g), (out_want, g_want) = got[i], want[i]
    assert out.shape == out_want.shape and out.dtype == out_want.dtype
    np.testing.assert_allclose(out, out_want, rtol=2e-6, atol=2e-6, err_msg=f"axis={axis}")
    np.testing.assert_allclose(g, g_want, rtol=2e-6, atol=1e-7, err_msg=f"axis={axis}")


@pytest.mark.parametrize("name", NAMES)
def test_element_where_matches_optax(name, rng):
  ours, theirs, log_space = PAIRS[name]
  x, t = positive_data(rng, (2, 3, 4), log_space)
  cases = [(axis, jnp.asarray(rng.uniform(size=shape) < 0.6)) for axis, shape in ELEMENT_MASKS]
  got, want = values_and_grads(ours, x, t, cases), values_and_grads(theirs, x, t, cases)
  for i, (axis, where) in enumerate(cases):
    (out, g), (out_want, g_want) = got[i], want[i]
    msg = f"axis={axis}, where shape {where.shape}"
    np.testing.assert_allclose(out, out_want, rtol=2e-6, atol=2e-6, err_msg=msg)
    np.testing.assert_allclose(g, g_want, rtol=2e-6, atol=1e-7, err_msg=msg)
    # Masked elements get no gradient.
    np.testing.assert_array_equal(np.asarray(g)[~np.broadcast_to(where, x.shape)], 0.0)


@pytest.mark.parametrize("name", NAMES)
def test_element_where_equals_dropping_elements(name, rng, x64):
  ours, _, log_space = PAIRS[name]
  x, t = positive_data(rng, (3, 6), log_space)
  x, t = np.asarray(x, np.float64), np.asarray(t, np.float64)
  where = rng.uniform(size=(3, 6)) < 0.5
  out = ours(jnp.asarray(x), jnp.asarray(t), where=jnp.asarray(where))
  for i in range(3):
    kept = ours(jnp.asarray(x[i][where[i]]), jnp.asarray(t[i][where[i]]))
    np.testing.assert_allclose(out[i], kept, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(
      out[i], np_terms(name, x[i], t[i])[where[i]].sum(), rtol=1e-12, atol=1e-15
    )


@pytest.mark.parametrize("name", NAMES)
def test_axis_equals_moveaxis(name, rng):
  ours, _, log_space = PAIRS[name]
  x, t = positive_data(rng, (3, 4, 5), log_space)
  axes = (0, 1, -2)

  @jax.jit
  def both(x, t):
    return [
      (ours(x, t, axis=k), ours(jnp.moveaxis(x, k, -1), jnp.moveaxis(t, k, -1))) for k in axes
    ]

  for axis, (out, moved) in zip(axes, both(x, t)):
    np.testing.assert_allclose(out, moved, rtol=1e-6, atol=1e-7, err_msg=f"axis={axis}")
    expected = np_terms(name, x, t).sum(axis=axis)
    np.testing.assert_allclose(out, expected, rtol=2e-6, atol=2e-6, err_msg=f"axis={axis}")


@pytest.mark.parametrize("name", NAMES)
def test_broadcast_arguments(name, rng):
  ours, _, log_space = PAIRS[name]
  x, t = positive_data(rng, (2, 3, 4), log_space)
  t1 = t[:1]
  out = ours(x, t1)
  assert out.shape == (2, 3)
  np.testing.assert_allclose(out, np_terms(name, x, t1).sum(-1), rtol=2e-6, atol=2e-6)


# ---------------------------------------------------------------------------
# Finite where optax gives NaN.


def zero_mass_data():
  # Rows: a zero target under a -inf log-prediction (masked logits), a zero target under
  # a finite one, an all-zero target row with -inf predictions, and an ordinary row.
  x = np.log(np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0], [0.1, 0.6, 0.3]]))
  t = np.array([[0.25, 0.75, 0.0], [0.0, 0.4, 0.6], [0.0, 0.0, 0.0], [0.2, 0.2, 0.6]])
  return x, t


@pytest.mark.parametrize("name", NAMES)
def test_finite_where_optax_is_nan(name, x64):
  ours, theirs, log_space = PAIRS[name]
  with np.errstate(divide="ignore"):
    x, t = zero_mass_data()
    t_in = np.log(t) if log_space else t
  xj, tj = jnp.asarray(x), jnp.asarray(t_in)
  optax_out = np.asarray(theirs(xj, tj))
  assert np.isnan(optax_out[0]) or np.isnan(optax_out[2])  # what this test is about
  out = ours(xj, tj)
  expected = np_terms(name, x, t_in).sum(-1)
  assert np.all(np.isfinite(expected))
  np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-15)
  # Optax agrees on the rows it computes.
  ok = np.isfinite(optax_out)
  np.testing.assert_allclose(np.asarray(out)[ok], optax_out[ok], rtol=1e-12)

  def f(a, b):
    return jnp.sum(ours(a, b))

  gx, gt = jax.jit(jax.grad(f, argnums=(0, 1)))(xj, tj)
  assert np.all(np.isfinite(gx)) and np.all(np.isfinite(gt))
  zero = t == 0
  # No gradient at zero mass, except the generalized loss's exp(x) term.
  d_x = np.exp(x) if name == "generalized_kl_divergence" else 0.0
  np.testing.assert_allclose(np.asarray(gx)[zero], np.broadcast_to(d_x, x.shape)[zero], atol=0)
  if name != "generalized_kl_divergence":
    np.testing.assert_array_equal(np.asarray(gt)[zero], 0.0)


def test_normalised_generalized_equals_kl(rng, x64):
  x = np.log(rng.dirichlet(np.ones(5), size=3))
  t = rng.dirichlet(np.ones(5), size=3)
  t[0, 2] = 0.0
  t[0] /= t[0].sum()
  a = kldiv_jax.generalized_kl_divergence(jnp.asarray(x), jnp.asarray(t))
  b = kldiv_jax.kl_divergence(jnp.asarray(x), jnp.asarray(t))
  np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)


def test_convex_kl_divergence_is_the_generalized_one(rng):
  x, t = positive_data(rng, (2, 3, 4), False)
  where = jnp.asarray(rng.uniform(size=(2, 3, 4)) < 0.6)
  ours, theirs, _ = PAIRS["convex_kl_divergence"]
  cases = [(-1, None), ((0, 2), None), (-1, where)]
  got, want = values_and_grads(ours, x, t, cases), values_and_grads(theirs, x, t, cases)
  for i in range(len(cases)):
    np.testing.assert_allclose(got[i][0], want[i][0], rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(got[i][1], want[i][1], rtol=2e-6, atol=1e-7)
  # Both aliases warn, with the same message.
  with pytest.warns(DeprecationWarning, match=DEPRECATED) as theirs_warned:
    optax.losses.convex_kl_divergence(x, t)
  with pytest.warns(DeprecationWarning, match=DEPRECATED) as ours_warned:
    kldiv_jax.convex_kl_divergence(x, t)
  assert str(ours_warned[0].message) == str(theirs_warned[0].message)
  assert ours_warned[0].filename == __file__  # stacklevel: the caller's line


# ---------------------------------------------------------------------------
# Per-example masks (beyond optax).


@pytest.mark.parametrize("name", NAMES)
def test_per_example_where_token_mask(name, rng, x64):
  ours, _, log_space = PAIRS[name]
  batch, seq, vocab = 2, 5, 7
  x = np.asarray(jax.nn.log_softmax(rng.normal(size=(batch, seq, vocab))))
  t = rng.dirichlet(np.ones(vocab), size=(batch, seq))
  t_in = np.log(t) if log_space else t
  mask = np.ones((batch, seq), bool)
  mask[0, 3:] = False  # padding
  mask[1, 1] = False
  out = ours(jnp.asarray(x), jnp.asarray(t_in), where=jnp.asarray(mask))
  assert out.shape == (batch, seq)
  expected = np_terms(name, x, t_in).sum(-1)
  np.testing.assert_allclose(np.asarray(out)[mask], expected[mask], rtol=1e-12)
  np.testing.assert_array_equal(np.asarray(out)[~mask], 0.0)
  # Equals dropping the masked examples: the masked mean over tokens.
  dropped = ours(jnp.asarray(x[mask]), jnp.asarray(t_in[mask]))
  np.testing.assert_allclose(out.sum() / mask.sum(), dropped.mean(), rtol=1e-12)

  def loss(a, b):
    return jnp.sum(ours(a, b, where=jnp.asarray(mask))) / mask.sum()

  gx, gt = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(t_in))
  np.testing.assert_array_equal(np.asarray(gx)[~mask], 0.0)
  np.testing.assert_array_equal(np.asarray(gt)[~mask], 0.0)
  gx_kept = jax.jit(jax.grad(lambda a: jnp.mean(ours(a, jnp.asarray(t_in[mask])))))(
    jnp.asarray(x[mask])
  )
  np.testing.assert_allclose(np.asarray(gx)[mask], gx_kept, rtol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_fully_masked_example_gives_zero(name, rng):
  ours, _, log_space = PAIRS[name]
  x, t = positive_data(rng, (3, 4), log_space)
  where = jnp.array([True, False, True])
  out = ours(x, t, where=where)
  assert out[1] == 0.0
  np.testing.assert_allclose(
    np.asarray(out)[[0, 2]], np_terms(name, x, t).sum(-1)[[0, 2]], rtol=2e-6
  )
  # An element mask that removes the whole row is the same.
  elem = jnp.broadcast_to(where[:, None], (3, 4))
  np.testing.assert_allclose(ours(x, t, where=elem), out, rtol=1e-6)
  g = jax.jit(jax.grad(lambda a, b: jnp.sum(ours(a, b, where=where)), argnums=(0, 1)))(x, t)
  for gi in g:
    np.testing.assert_array_equal(gi[1], 0.0)


@pytest.mark.parametrize("axis", [0, (0, 1)])
def test_per_example_where_with_other_axes(axis, rng, x64):
  x = np.log(rng.dirichlet(np.ones(3), size=(4, 5))).transpose(2, 0, 1)  # [3, 4, 5]
  t = rng.uniform(0.05, 1.0, size=(3, 4, 5))
  out_shape = np.delete(np.array(x.shape), axis).tolist()
  mask = rng.uniform(size=out_shape) < 0.5
  out = kldiv_jax.kl_divergence(jnp.asarray(x), jnp.asarray(t), axis=axis, where=jnp.asarray(mask))
  expected = np.where(mask, np_terms("kl_divergence", x, t).sum(axis=axis), 0.0)
  np.testing.assert_allclose(out, expected, rtol=1e-12)


# ---------------------------------------------------------------------------
# Derivatives and transformations.


def test_check_grads_order_2(rng, x64):
  x = jnp.asarray(rng.uniform(-3.0, 0.0, size=(2, 3)))
  t = jnp.asarray(rng.uniform(0.1, 1.0, size=(2, 3)))
  log_t = jnp.asarray(rng.uniform(-3.0, 0.0, size=(2, 3)))
  where = jnp.array([[True, False, True], [True, True, True]])

  # Every function in one check (check_grads compiles ~17 programs per call); the
  # sums are linear, so one axis or mask per function is enough here.
  @jax.jit
  def f(a, b, c):
    return (
      kldiv_jax.kl_divergence(a, b, where=where),
      kldiv_jax.kl_divergence_with_log_targets(a, c),
      kldiv_jax.generalized_kl_divergence(a, b, axis=None),
    )

  check_grads(f, (x, t, log_t), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("name", ["kl_divergence", "kl_divergence_with_log_targets"])
def test_closed_form_gradients(name, rng, x64):
  ours, _, log_space = PAIRS[name]
  x = rng.uniform(-3.0, 0.0, size=(2, 3))
  t = rng.uniform(0.1, 1.0, size=(2, 3))
  t_in = np.log(t) if log_space else t
  grad = jax.jit(jax.grad(lambda a, b: jnp.sum(ours(a, b)), argnums=(0, 1)))
  gx, gt = grad(jnp.asarray(x), jnp.asarray(t_in))
  np.testing.assert_allclose(gx, -t, rtol=1e-12)
  d_t = t * (np.log(t) - x + 1) if log_space else np.log(t) + 1 - x
  np.testing.assert_allclose(gt, d_t, rtol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_jit_and_vmap(name, rng):
  ours, _, log_space = PAIRS[name]
  x, t = positive_data(rng, (4, 3, 5), log_space)
  eager = ours(x, t)
  np.testing.assert_allclose(jax.jit(ours)(x, t), eager, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(jax.vmap(ours)(x, t), eager, rtol=1e-6, atol=1e-7)
  where = jnp.asarray(rng.uniform(size=(4, 3)) < 0.5)
  per_example = jax.vmap(lambda a, b, w: ours(a, b, where=w))(x, t, where)
  np.testing.assert_allclose(per_example, ours(x, t, where=where), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
def test_no_retrace(name, rng):
  ours, _, log_space = PAIRS[name]

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(a, b, w):
    return jax.value_and_grad(lambda a: jnp.mean(ours(a, b, where=w)))(a)

  try:
    for _ in range(3):
      x, t = positive_data(rng, (2, 3, 4), log_space)
      step(x, t, jnp.asarray(rng.uniform(size=(2, 3)) < 0.5))
  finally:
    chex.clear_trace_counter()


# ---------------------------------------------------------------------------
# dtypes and bad input.


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_dtype_kept(name, dtype, rng):
  ours, _, log_space = PAIRS[name]
  x, t = positive_data(rng, (3, 8), log_space)
  x, t = x.astype(dtype), t.astype(dtype)
  out = ours(x, t)
  assert out.dtype == dtype
  expected = np_terms(name, np.asarray(x, np.float64), np.asarray(t, np.float64)).sum(-1)
  # Computed in float32: only the final rounding to the half dtype is lost.
  eps = float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=eps, atol=eps)


def test_mixed_promotion(rng):
  x, t = positive_data(rng, (2, 3), False)
  assert kldiv_jax.kl_divergence(x.astype(jnp.bfloat16), t.astype(jnp.float16)).dtype == jnp.float32
  assert kldiv_jax.kl_divergence(x.astype(jnp.float16), t).dtype == jnp.float32


@pytest.mark.parametrize("name", ALL_NAMES)
def test_bad_dtypes(name):
  ours = PAIRS[name][0]
  f = jnp.ones((2, 3))
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    ours(jnp.ones((2, 3), jnp.int32), f)
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    ours(f, jnp.ones((2, 3), bool))
  with pytest.raises(TypeError, match="Complex inputs not supported"):
    ours(f, jnp.ones((2, 3), jnp.complex64))


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("axis", [2, -3, (0, 2), (1, -1)])
def test_bad_axis(name, axis):
  ours = PAIRS[name][0]
  with pytest.raises(ValueError, match="axis"):
    ours(jnp.ones((2, 3)), jnp.ones((2, 3)), axis=axis)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_bad_where(name):
  ours = PAIRS[name][0]
  x = jnp.ones((2, 3, 4))
  with pytest.raises(ValueError, match=re.escape("(5,)")):
    ours(x, x, where=jnp.ones((5,), bool))
  with pytest.raises(ValueError, match=re.escape("(3, 2)")):
    ours(x, x, where=jnp.ones((3, 2), bool))
  with pytest.raises(TypeError, match="bool"):
    ours(x, x, where=jnp.ones((2, 3, 4), jnp.float32))
  with pytest.raises(TypeError, match="bool"):
    ours(x, x, where=jnp.ones((2, 3), jnp.int32))


@pytest.mark.parametrize("name", ALL_NAMES)
def test_non_broadcastable(name):
  ours = PAIRS[name][0]
  with pytest.raises(ValueError, match=r"\(3, 5\).*\(5, 3\)"):
    ours(jnp.ones((3, 5)), jnp.ones((5, 3)))


def test_errors_raise_at_trace_time():
  f = jax.jit(functools.partial(kldiv_jax.kl_divergence, axis=3))
  with pytest.raises(ValueError, match="axis 3 is out of range"):
    f(jnp.ones((2, 3)), jnp.ones((2, 3)))
