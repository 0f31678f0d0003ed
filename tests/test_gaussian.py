"""gaussian_kl: against the closed form (float64 NumPy, and torch.distributions live), the VAE
formula and exact decimals."""

import decimal

import _references as refs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import docs_snippet
from jax.test_util import check_grads

from kldiv_jax import gaussian_kl

decimal.getcontext().prec = 60


@jax.jit
def value_and_grads(mean, log_var, prior_mean, prior_log_var):
  def f(*args):
    out = gaussian_kl(*args)
    return jnp.sum(out), out

  (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(
    mean, log_var, prior_mean, prior_log_var
  )
  return out, grads


def test_matches_reference_and_closed_form_gradients(x64, rng, source):
  mean, log_var = rng.normal(size=(4, 6)), rng.normal(size=(4, 6))
  prior_mean, prior_log_var = rng.normal(size=(6,)), rng.normal(size=(6,))  # broadcast
  out, (g_mu, g_lv, g_mu0, g_lv0) = value_and_grads(mean, log_var, prior_mean, prior_log_var)
  np.testing.assert_allclose(
    out, refs.GAUSSIAN_KL[source](mean, log_var, prior_mean, prior_log_var), rtol=1e-12
  )
  var0 = np.exp(prior_log_var)
  np.testing.assert_allclose(g_mu, (mean - prior_mean) / var0, rtol=1e-12)
  np.testing.assert_allclose(g_lv, 0.5 * (np.exp(log_var) / var0 - 1), rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(g_mu0, -np.sum((mean - prior_mean) / var0, 0), rtol=1e-12)
  np.testing.assert_allclose(
    g_lv0,
    np.sum(0.5 * (1 - (np.exp(log_var) + (mean - prior_mean) ** 2) / var0), 0),
    rtol=1e-12,
  )


def test_standard_normal_prior_is_the_vae_term(x64, rng):
  mean, log_var = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
  vae = -0.5 * np.sum(1 + log_var - mean**2 - np.exp(log_var), -1)
  np.testing.assert_allclose(jax.jit(gaussian_kl)(mean, log_var), vae, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_posterior_near_prior_keeps_precision(x64, dtype):
  log_var = np.array([1e-7, -3e-5, 2e-3, 0.3], dtype)
  mean = np.zeros(4, dtype)
  out = jax.jit(lambda m, v: gaussian_kl(m, v, axis=()))(mean, log_var)
  exact = [
    float(decimal.Decimal(float(d)).exp() - 1 - decimal.Decimal(float(d))) / 2 for d in log_var
  ]
  np.testing.assert_allclose(np.asarray(out, np.float64), exact, rtol=8 * np.finfo(dtype).eps)


def test_where_axis_and_vmap(x64, rng, source):
  mean, log_var = rng.normal(size=(3, 4, 5)), rng.normal(size=(3, 4, 5))
  reference = refs.GAUSSIAN_KL[source]
  ref = reference(mean, log_var, 0.0, 0.0, axis=-1)
  element = rng.uniform(size=(5,)) > 0.4
  per_example = np.array([[True, False, True, True]] * 3)
  kl = jax.jit(gaussian_kl, static_argnames="axis")
  np.testing.assert_allclose(kl(mean, log_var, where=per_example), np.where(per_example, ref, 0))
  np.testing.assert_allclose(
    kl(mean, log_var, where=element),
    reference(mean[..., element], log_var[..., element], 0.0, 0.0),
    rtol=1e-12,
  )
  np.testing.assert_allclose(kl(mean, log_var, axis=None), ref.sum(), rtol=1e-12)
  np.testing.assert_allclose(kl(mean, log_var, axis=(1, 2)), ref.sum(-1), rtol=1e-12)
  np.testing.assert_allclose(jax.vmap(kl)(mean, log_var), ref, rtol=1e-12)


def test_masked_example_has_zero_gradient():
  mean = jnp.array([[0.5, 1.0], [jnp.nan, 1.0]])
  log_var = jnp.array([[0.1, -0.2], [0.0, jnp.inf]])
  where = jnp.array([True, False])
  g = jax.jit(jax.grad(lambda m, v: jnp.sum(gaussian_kl(m, v, where=where)), argnums=(0, 1)))(
    mean, log_var
  )
  np.testing.assert_array_equal(g[0][1], 0.0)
  np.testing.assert_array_equal(g[1][1], 0.0)


def test_dtype_and_check_grads(x64, rng):
  out = gaussian_kl(jnp.zeros(3, jnp.bfloat16), jnp.zeros(3, jnp.bfloat16))
  assert out.dtype == jnp.bfloat16 and out == 0
  mean, log_var, prior_mean, prior_log_var = (rng.normal(size=(2, 3)) for _ in range(4))
  log_var[0, 0] = prior_log_var[0, 0] + 1e-3  # the series branch
  check_grads(
    jax.jit(lambda m, v: gaussian_kl(m, v, prior_mean, prior_log_var)),
    (mean, log_var),
    order=2,
    modes=("fwd", "rev"),
  )


def test_bad_input():
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    gaussian_kl(jnp.zeros(3, jnp.int32), jnp.zeros(3))
  with pytest.raises(ValueError, match="cannot be broadcast"):
    gaussian_kl(jnp.zeros((2, 3)), jnp.zeros((3, 2)))
  with pytest.raises(ValueError, match="where has shape"):
    gaussian_kl(jnp.zeros((2, 3)), jnp.zeros((2, 3)), where=jnp.ones((4,), bool))


def test_docs_snippet_runs():
  ns: dict = {}
  exec(docs_snippet("vae.md", "## A VAE loss"), ns)
  assert np.isfinite(ns["loss"]) and ns["grads"]["enc"].shape == (10, 4)
