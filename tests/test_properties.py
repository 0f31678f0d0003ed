"""Property tests (hypothesis): invariants every KL loss must satisfy.

Shapes are fixed per test so that each property compiles once; hypothesis
varies the values (including exact zeros in the targets).
"""

import functools
import warnings

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from _references import enable_x64
from hypothesis import given, settings

import kldiv_jax
from kldiv_jax import KLDivLoss, kl_div, kl_div_pointwise, kl_divergence

SETTINGS = settings(max_examples=30, deadline=None)
SHAPE = (3, 5)
REDUCTIONS = ("none", "sum", "mean", "batchmean")


def _normalise(w):
  w = np.asarray(w, np.float64).copy()
  w[..., 0] += 1e-3  # every row has some mass
  return w / w.sum(axis=-1, keepdims=True)


# Probability vectors over the last axis; targets may have exact zeros.
weights_with_zeros = hnp.arrays(
  np.float64, SHAPE, elements=st.one_of(st.just(0.0), st.floats(1e-4, 1.0))
)
positive_weights = hnp.arrays(np.float64, SHAPE, elements=st.floats(1e-3, 1.0))
targets = weights_with_zeros.map(_normalise)
predictions = positive_weights.map(_normalise)


@SETTINGS
@given(p=targets, q=predictions)
def test_kl_nonnegative_pinsker_and_zero_iff_equal(p, q):
  with enable_x64(True):
    kl = np.asarray(kl_divergence(jnp.log(q), p))
    kl_self = np.asarray(kl_divergence(jnp.log(jnp.asarray(p)), p))
  assert np.all(kl >= -1e-12)
  # Pinsker's inequality: KL(p || q) >= ||p - q||_1^2 / 2, so KL = 0 only if p = q.
  l1 = np.abs(p - q).sum(-1)
  assert np.all(kl >= 0.5 * l1**2 - 1e-12)
  np.testing.assert_allclose(kl_self, 0.0, atol=1e-13)


@SETTINGS
@given(p=targets, q=predictions)
def test_kl_nonnegative_float32_all_apis(p, q):
  x = jnp.log(jnp.asarray(q, jnp.float32))
  t = jnp.asarray(p, jnp.float32)
  # float32 rounding of the inputs: p and q are each normalised to ~1e-7.
  tol = 1e-5
  assert np.all(np.asarray(kl_divergence(x, t)) >= -tol)
  assert np.all(np.asarray(kldiv_jax.generalized_kl_divergence(x, t)) >= -tol)
  assert float(kl_div(x, t, reduction="batchmean")) >= -tol
  assert np.all(np.asarray(kl_div_pointwise(x, t)).sum(-1) >= -tol)


@functools.cache
def _jitted(reduction, log_target):
  loss = KLDivLoss(reduction=reduction, log_target=log_target)
  return loss, jax.jit(loss)


@SETTINGS
@given(
  p=targets,
  q=predictions,
  reduction=st.sampled_from(REDUCTIONS),
  log_target=st.booleans(),
)
def test_jit_equals_eager(p, q, reduction, log_target):
  x = jnp.log(jnp.asarray(q, jnp.float32))
  t = jnp.asarray(p, jnp.float32)
  if log_target:
    t = jnp.log(t)
  loss, jitted = _jitted(reduction, log_target)
  with warnings.catch_warnings():
    # 'mean' warns, eagerly and when jit traces.
    warnings.filterwarnings("ignore", message="reduction: 'mean'")
    eager = loss(x, t)
    compiled = jitted(x, t)
  np.testing.assert_allclose(compiled, eager, rtol=1e-6, atol=1e-7)


_vmapped_kl = jax.jit(jax.vmap(kl_divergence))
_vmapped_sum = jax.jit(jax.vmap(functools.partial(kl_div, reduction="sum", log_target=True)))


@SETTINGS
@given(p=targets, q=predictions)
def test_vmap_equals_batched(p, q):
  x = jnp.log(jnp.asarray(q, jnp.float32))
  t = jnp.asarray(p, jnp.float32)
  batched = kl_divergence(x, t)
  np.testing.assert_allclose(_vmapped_kl(x, t), batched, rtol=1e-6, atol=1e-7)
  log_t = jnp.log(t)
  rows = kl_div(x, log_t, reduction="none", log_target=True).sum(-1)
  np.testing.assert_allclose(_vmapped_sum(x, log_t), rows, rtol=1e-6, atol=1e-6)


@functools.partial(jax.jit, static_argnames="log_target")
def _value_and_grads(x, t, log_target):
  def f(a, b):
    return jnp.sum(kl_div_pointwise(a, b, log_target=log_target))

  return jax.value_and_grad(f, argnums=0)(x, t)


@SETTINGS
@given(p=targets, q=predictions)
def test_log_target_agrees_with_probability_target(p, q):
  with enable_x64(True):
    x = jnp.log(jnp.asarray(q))
    t = jnp.asarray(p)
    log_t = jnp.log(t)  # -inf at the zeros
    prob = kl_div_pointwise(x, t)
    logs = kl_div_pointwise(x, log_t, log_target=True)
    np.testing.assert_allclose(logs, prob, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(np.asarray(logs)[p == 0], 0.0)
    v1, g1 = _value_and_grads(x, t, False)
    v2, g2 = _value_and_grads(x, log_t, True)
    np.testing.assert_allclose(v2, v1, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(g2, g1, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(
      kldiv_jax.kl_divergence_with_log_targets(x, log_t),
      kl_divergence(x, t),
      rtol=1e-12,
      atol=1e-15,
    )


@SETTINGS
@given(p=targets, q=predictions)
def test_gradients_finite_with_zero_targets(p, q):
  x = jnp.log(jnp.asarray(q, jnp.float32))
  t = jnp.asarray(p, jnp.float32)
  for log_target, target in ((False, t), (True, jnp.log(t))):
    _, g = _value_and_grads(x, target, log_target)
    assert np.all(np.isfinite(g))
    # d/dx = -p: the closed form, exactly 0 where p = 0.
    np.testing.assert_allclose(g, -p, rtol=1e-5, atol=1e-6)
