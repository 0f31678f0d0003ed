"""Closed-form KL divergence between diagonal Gaussians (the VAE ELBO term)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kldiv_jax._checks import Axis, normalize_axis, promote_and_broadcast, split_where
from kldiv_jax._masked_sum import masked_sum
from kldiv_jax._numerics import exp_minus_one_minus


def gaussian_kl(
  mean: jax.typing.ArrayLike,
  log_var: jax.typing.ArrayLike,
  prior_mean: jax.typing.ArrayLike = 0.0,
  prior_log_var: jax.typing.ArrayLike = 0.0,
  *,
  axis: Axis = -1,
  where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
  r"""Per-example ``KL(N(mean, exp(log_var)) || N(prior_mean, exp(prior_log_var)))``, diagonal.

  .. math::

     \mathrm{KL} = \frac12 \sum_i \Big(\log\sigma_{0,i}^2 - \log\sigma_i^2
       + \frac{\sigma_i^2 + (\mu_i - \mu_{0,i})^2}{\sigma_{0,i}^2} - 1\Big)

  summed over ``axis`` (the latent dimensions); the default prior is the
  standard normal (the VAE's KL term). Accurate when the posterior is close
  to the prior; a zero variance gives ``+inf``. See :doc:`/vae`.

  Args:
    mean: the posterior means, e.g. ``[batch, latent]``.
    log_var: the posterior log-variances, broadcastable.
    prior_mean: the prior means, broadcastable (default 0).
    prior_log_var: the prior log-variances, broadcastable (default 0).
    axis: the axis or axes summed over (``None``: all).
    where: an element mask or a per-example mask (:ref:`shared-arguments`).

  Returns:
    The divergence per example, the broadcast shape without ``axis``, promoted dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import gaussian_kl
    >>> gaussian_kl(jnp.array([0.5, -1.0]), jnp.log(jnp.array([0.5, 2.0])))
    Array(0.875, dtype=float32)
    >>> gaussian_kl(jnp.array([0.5]), jnp.array([0.0]), prior_mean=1.0, prior_log_var=jnp.log(2.0))
    Array(0.1591..., dtype=float32)
  """
  name = "gaussian_kl"
  (mu, lv, mu0, lv0), out_dtype = promote_and_broadcast(
    name,
    ("mean", "log_var", "prior_mean", "prior_log_var"),
    mean,
    log_var,
    prior_mean,
    prior_log_var,
  )
  if where is not None:
    # Masked entries are made safe before the arithmetic, so that garbage
    # there (NaN, inf) cannot reach the gradients either.
    axes = normalize_axis(name, axis, mu.ndim)
    element, example = split_where(name, where, mu.shape, axes)
    if element is not None:
      keep = element
    else:
      assert example is not None  # a given mask is an element or a per-example mask
      keep = jnp.broadcast_to(jnp.expand_dims(example, axes), mu.shape)
    mu, lv, mu0, lv0 = (jnp.where(keep, a, 0.0) for a in (mu, lv, mu0, lv0))
  diff = mu - mu0
  terms = 0.5 * (exp_minus_one_minus(lv - lv0) + diff * diff * jnp.exp(-lv0))
  return masked_sum(name, terms, axis, where).astype(out_dtype)
