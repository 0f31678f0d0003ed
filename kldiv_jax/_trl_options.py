r"""TRL's GRPO options beyond the surrogates: VESPO's gamma weights and the two token selections.

What :func:`kldiv_jax.policy_loss` runs for ``surrogate="vespo"``,
``off_policy_threshold=`` and ``top_entropy_fraction=`` (TRL 1.16's
``loss_type="vespo"``, ``off_policy_mask_threshold`` and
``top_entropy_quantile``, ``GRPOTrainer._compute_loss``). Each needs whole
sequences (a sequence sum or mean) or the whole call (a quantile): the fused
loss runs them in its two-pass route. Every function here is elementwise
once its sequence statistics are broadcast back to the tokens, and gives no
gradient (the weights and masks are constants of the step, as in TRL).

The sequence layout is duck-typed (``weights.mask``, ``weights.segment``,
``weights.num_segments``: :class:`kldiv_jax._surrogates.Weights`), so that
this module does not import the surrogates that use it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._checks import real_scalar

# TRL's VESPO clamps the sequence log-weight (and each log importance weight) to
# [log 1e-8, 20], the token log-ratio to +-20, and lambda to at least 1e-4.
VESPO_LOG_WEIGHT_MIN = math.log(1e-8)
VESPO_LOG_WEIGHT_MAX = 20.0
VESPO_LAMBDA_MIN = 1e-4
TOKEN_LOG_RATIO_BOUND = 20.0


def _sequence_sum(x, weights):
  """Each token's sequence's sum of ``x`` over its counted tokens."""
  x = jnp.where(weights.mask, x, 0.0)
  seg = weights.segment.reshape(-1)
  total = jax.ops.segment_sum(x.reshape(-1), seg, weights.num_segments)
  return total[weights.segment]


def _sequence_mean(x, weights):
  count = _sequence_sum(jnp.ones_like(x), weights)
  return _sequence_sum(x, weights) / jnp.maximum(count, 1.0)


def vespo_log_weight(log_probs, old_log_probs, weights, rollout_weights=None):
  r"""VESPO's sequence log importance weight, broadcast to the tokens (no gradient).

  .. math::

     \log w_i = \sum_{t \in i} \mathrm{clip}(\log\pi_t - \log\pi_{\text{old},t}, \pm 20)
              + \sum_{t \in i} \mathrm{clip}(\log\rho_t, \log 10^{-8}, 20),

  a *sum* over the sequence's counted tokens (GSPO's is a mean), :math:`\rho_t` the rollout
  correction's per-token weights (TRL's vLLM ``importance_sampling_ratio``, token modes).
  """
  delta = jnp.clip(log_probs - old_log_probs, -TOKEN_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND)
  if rollout_weights is not None:
    high = math.exp(VESPO_LOG_WEIGHT_MAX)
    delta = delta + jnp.log(jnp.clip(rollout_weights, math.exp(VESPO_LOG_WEIGHT_MIN), high))
  return lax.stop_gradient(_sequence_sum(delta, weights))


def vespo_phi(log_weight, advantages, gamma):
  r"""VESPO's gamma weight :math:`\varphi(w) = e^{\lambda} w^{k} e^{-\lambda w}` (:math:`\varphi(1) = 1`).

  ``gamma = (k_pos, lambda_pos, k_neg, lambda_neg)``: :math:`(k, \lambda)` for
  :math:`A \ge 0` and for :math:`A < 0`; :math:`\log w` clamped to
  :math:`[\log 10^{-8}, 20]` and :math:`\lambda` to at least :math:`10^{-4}`, an overflowing
  :math:`\varphi` taken as 0 (TRL's ``get_gamma_weights``). No gradient. A NaN (from a NaN
  log-probability) stays NaN, so that the loss says so (TRL's ``nan_to_num`` makes it 0).
  """
  k_pos, lam_pos, k_neg, lam_neg = gamma
  dtype = log_weight.dtype
  log_w = jnp.clip(log_weight, VESPO_LOG_WEIGHT_MIN, VESPO_LOG_WEIGHT_MAX)
  nonnegative = advantages >= 0
  k = jnp.where(nonnegative, k_pos, k_neg).astype(dtype)
  lam = jnp.maximum(jnp.where(nonnegative, lam_pos, lam_neg), VESPO_LAMBDA_MIN).astype(dtype)
  phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
  return lax.stop_gradient(jnp.where(jnp.isinf(phi), 0.0, phi))


def off_policy_keep(log_probs, sampling_log_probs, advantages, weights, threshold):
  r"""DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``): 1 to keep.

  A token is kept unless its advantage is negative and its sequence's mean
  :math:`\log\pi_{\text{sampling}} - \mathrm{sg}(\log\pi)` over the counted tokens exceeds
  ``threshold`` (a NaN difference counts as 0, as TRL's ``nan_to_num``).
  """
  kl = sampling_log_probs - lax.stop_gradient(log_probs)
  kl = jnp.where(jnp.isnan(kl), 0.0, kl)
  keep = (advantages >= 0) | (_sequence_mean(kl, weights) <= threshold)
  return lax.stop_gradient(keep.astype(log_probs.dtype))


def top_entropy_keep(entropy, weights, fraction):
  r"""The highest-entropy tokens (TRL's ``top_entropy_quantile``): 1 to keep.

  A counted token is kept when its entropy is at least the ``1 - fraction`` quantile
  (linear interpolation, as ``torch.quantile``) of the counted tokens' entropies of the
  call. No gradient.
  """
  h = lax.stop_gradient(entropy)
  threshold = jnp.nanquantile(jnp.where(weights.mask, h, jnp.nan), 1.0 - fraction)
  return ((h >= threshold) & weights.mask).astype(h.dtype)


def selection(log_probs, sampling_log_probs, advantages, entropy, weights, options):
  """The off-policy sequence mask times the top-entropy mask that ``options`` (``Options``)
  ask for: ``None`` for neither."""
  keep = None
  if options.off_policy_threshold is not None:
    keep = off_policy_keep(
      log_probs, sampling_log_probs, advantages, weights, options.off_policy_threshold
    )
  if options.top_entropy_fraction is not None:
    top = top_entropy_keep(entropy, weights, options.top_entropy_fraction)
    keep = top if keep is None else keep * top
  return keep


def check_trl_options(name, surrogate, rollout_correction, vespo_gamma, off_policy_threshold,
                      top_entropy_fraction):  # fmt: skip
  """``(vespo_gamma, off_policy_threshold, top_entropy_fraction)`` checked: errors name ``name``."""
  gamma = tuple(vespo_gamma) if isinstance(vespo_gamma, (tuple, list)) else None
  if (
    gamma is None
    or len(gamma) != 4
    or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in gamma)
    or gamma[1] < 0
    or gamma[3] < 0
  ):
    raise ValueError(
      f"{name}: vespo_gamma must be four finite numbers (k_pos, lambda_pos, k_neg, lambda_neg), "
      f"the lambdas >= 0; got {vespo_gamma!r}."
    )
  gamma = tuple(float(x) for x in gamma)
  if surrogate == "vespo" and (rollout_correction or "").startswith("sequence"):
    raise ValueError(
      f"{name}: surrogate='vespo' takes the per-token rollout corrections ('token_truncate' or "
      f"'token_mask'), which it folds into its sequence weight (as TRL); got "
      f"rollout_correction={rollout_correction!r}."
    )
  threshold = off_policy_threshold
  if threshold is not None:
    threshold, _ = real_scalar(name, "off_policy_threshold", threshold)
  fraction = top_entropy_fraction
  if fraction is not None:
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
    if not ok or not 0.0 <= fraction <= 1.0:
      raise ValueError(
        f"{name}: top_entropy_fraction must be a number in [0, 1] (a static Python float) or "
        f"None; got {top_entropy_fraction!r}."
      )
    fraction = None if fraction == 1.0 else float(fraction)
  return gamma, threshold, fraction
