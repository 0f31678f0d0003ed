r"""Clip-Cov and KL-Cov (verl's ``clip_cov`` and ``kl_cov``): the PPO surrogate with a few
tokens of high covariance between advantage and log-probability singled out.

Both rank the tokens of the whole call (every counted token, all sequences) by

.. math::

   c_t = (A_t - \bar A)\,(\log\pi_t - \overline{\log\pi}),

the means over the counted tokens (no gradient), and pick
:math:`k = \max(\lfloor f\,N\rfloor, 1)` of them, ``f`` the ``cov_fraction`` and ``N`` the
counted tokens (Cui et al., *The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models*, 2505.22617):

- ``"clip-cov"``: among the tokens PPO's clip leaves alone with ``lb < c_t < ub``
  (``cov_bounds``), ``k`` chosen at random (verl: ``torch.randperm``; here the order of
  ``cov_key``'s permutation, or the tokens' row-major order without a key) have their
  loss zeroed: :math:`\ell_t = \max(-rA, -\mathrm{clip}(r)A)\,(1 - s_t)`;
- ``"kl-cov"``: the ``k`` largest :math:`c_t` get a penalty:
  :math:`\ell_t = -rA + s_t\,\beta_{\text{cov}}\lvert\log r\rvert` (``cov_kl_coef``).

``s_t`` is the selection (no gradient). The ratio is not clamped (verl clamps neither).
A selection needs the whole call's tokens: a chunked caller computes it in a first pass
(:func:`cov_selection`), then :func:`cov_token_losses` is elementwise.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

COV_SURROGATES = ("clip-cov", "kl-cov")


def _number(name, option, value, test, expected) -> float:
  """A static (Python) real option: these are configs, not traced values."""
  if isinstance(value, bool) or not isinstance(value, int | float):
    raise TypeError(f"{name}: {option} must be a Python number; got {value!r}.")
  if not test(value):
    raise ValueError(f"{name}: {option} must be {expected}; got {value!r}.")
  return float(value)


def parse_cov(name, fraction, bounds, coef, key):
  """``(cov_fraction, cov_bounds, cov_kl_coef, cov_key)`` checked (errors name ``name``)."""
  fraction = _number(name, "cov_fraction", fraction, lambda x: 0 < x < math.inf, "> 0")
  if not (isinstance(bounds, tuple | list) and len(bounds) == 2):
    raise TypeError(f"{name}: cov_bounds must be a pair (low, high); got {bounds!r}.")
  bounds = tuple(_number(name, "cov_bounds", b, lambda x: not math.isnan(x), "a number")
                 for b in bounds)  # fmt: skip
  coef = _number(name, "cov_kl_coef", coef, math.isfinite, "finite")
  if key is not None:
    dtype = getattr(key, "dtype", None)
    if dtype is None or not (jnp.issubdtype(dtype, jax.dtypes.prng_key) or dtype == jnp.uint32):
      raise TypeError(f"{name}: cov_key must be a jax.random key or None; got {key!r}.")
  return fraction, bounds, coef, key


def cov_priority(shape, key) -> jax.Array:
  """Each token's rank in Clip-Cov's random choice: a permutation of ``cov_key`` over the
  flattened tokens, or their row-major index without a key (int32, ``shape``)."""
  n = 1
  for d in shape:
    n *= d
  p = jnp.arange(n, dtype=jnp.int32) if key is None else jax.random.permutation(key, n)
  return p.astype(jnp.int32).reshape(shape)


def _first(priority, candidates, k):
  """The ``k`` candidates of lowest ``priority`` (every candidate when fewer; ``k >= 1``)."""
  big = jnp.asarray(jnp.inf if jnp.issubdtype(priority.dtype, jnp.floating) else priority.size)
  p = jnp.where(candidates, priority, big.astype(priority.dtype))
  flat = jnp.sort(p.reshape(-1))
  kth = flat[jnp.clip(k - 1, 0, flat.size - 1)]
  return candidates & (p <= kth)


def cov_selection(log_probs, old_log_probs, advantages, weights, options, priority):
  """The tokens :func:`cov_token_losses` singles out (bool, no gradient): ``weights`` the
  call's :class:`~kldiv_jax._surrogates.Weights` (its mask),
  ``priority`` Clip-Cov's order (:func:`cov_priority`)."""
  logp, adv = lax.stop_gradient(log_probs), lax.stop_gradient(advantages)
  mask = weights.mask
  count = jnp.maximum(jnp.sum(mask.astype(logp.dtype)), 1.0)
  mean = lambda x: jnp.sum(jnp.where(mask, x, 0.0)) / count  # noqa: E731
  cov = (adv - mean(adv)) * (logp - mean(logp))
  tokens = jnp.sum(mask.astype(cov.dtype))
  k = jnp.maximum(jnp.floor(options.cov_fraction * tokens), 1.0).astype(jnp.int32)
  if options.surrogate == "kl-cov":
    return _first(-cov, mask, k)
  ratio = jnp.exp(logp - lax.stop_gradient(old_log_probs))
  low, high = options.clip_low, options.clip_high
  clipped = -adv * jnp.clip(ratio, 1.0 - low, 1.0 + high) > -adv * ratio
  lb, ub = options.cov_bounds
  candidates = mask & ~clipped & (cov > lb) & (cov < ub)
  return _first(priority, candidates, k)


def cov_token_losses(log_probs, old_log_probs, advantages, selected: Any, options):
  """``(per-token loss, ratio, flags)``: Clip-Cov's or KL-Cov's loss given the selection;
  ``flags`` the selected tokens (Clip-Cov: zeroed, verl's ``pg_clipfrac``)."""
  delta = log_probs - old_log_probs
  ratio = jnp.exp(delta)
  s: jax.Array = lax.stop_gradient(selected)
  if options.surrogate == "kl-cov":
    abs_delta = delta * jnp.sign(delta)  # the subgradient 0 at 0, as torch's abs
    penalty = jnp.asarray(options.cov_kl_coef, delta.dtype) * abs_delta
    return -advantages * ratio + jnp.where(s, penalty, 0.0), ratio, s
  low, high = options.clip_low, options.clip_high
  pg = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1.0 - low, 1.0 + high))
  return jnp.where(s, 0.0, pg), ratio, s
