r"""Rollout rejection sampling and batch-normalised rollout weights (verl's ``rollout_rs`` and
``rollout_is_batch_normalize``, ``verl/trainer/ppo/rollout_corr_helper.py``).

With :math:`\delta_t = \log\pi_{\text{old}} - \log\pi_{\text{rollout}}` clamped to
:math:`\pm 20`, the per-token statistics are :math:`k_1 = -\delta`,
:math:`k_2 = \delta^2/2`, :math:`k_3 = e^{\delta} - 1 - \delta`; a mode rejects a token
(``"token_k*"``) or the whole sequence (``"sequence_sum_k*"``, ``"sequence_mean_k*"``,
``"sequence_max_k*"``: the statistic's sum, mean or max over the sequence's counted tokens)
when its statistic is above the mode's upper bound, or, for ``k1``, outside
:math:`[\log l, \log u]` (``l, u`` bounds on :math:`\pi_{\text{rollout}}/\pi_{\text{old}}`).
Several modes reject what any of them rejects. A NaN statistic rejects nothing (the loss is
NaN; verl drops the token).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._checks import (
  as_array,
  check_bool,
  compute_dtype,
  promote_and_broadcast,
)
from kldiv_jax._surrogates import (
  LOG_RATIO_BOUND,
  Weights,
  _per_token,
  _segment_sum,
  aggregation_weights,
  rollout_weights,
  token_layout,
)

REJECTION_MODES = (
  "token_k1",
  "token_k2",
  "token_k3",
  "sequence_sum_k1",
  "sequence_sum_k2",
  "sequence_sum_k3",
  "sequence_mean_k1",
  "sequence_mean_k2",
  "sequence_mean_k3",
  "sequence_max_k2",
  "sequence_max_k3",
)


def _bound(name, mode, value) -> float:
  if isinstance(value, bool) or not isinstance(value, int | float):
    raise TypeError(
      f"{name}: rollout_rejection[{mode!r}] must hold Python numbers (a static config); "
      f"got {value!r}."
    )
  if not (value > 0 and math.isfinite(value)):
    raise ValueError(f"{name}: rollout_rejection[{mode!r}] bounds must be > 0; got {value!r}.")
  return float(value)


def parse_rejection(name: str, spec: Any) -> tuple:
  """``rollout_rejection`` checked: a mapping (or pairs) ``mode -> bound``, ``bound`` an upper
  bound ``u`` (``k1``: also a pair ``(l, u)``; a lone ``u`` means ``(1/u, u)``, as verl).
  Returns ``((mode, low_log_or_None, high), ...)``, the ``k1`` bounds as logs."""
  if spec is None:
    return ()
  wrong = TypeError(
    f"{name}: rollout_rejection must map modes to bounds, e.g. {{'sequence_mean_k3': 0.01}}; "
    f"got {spec!r}."
  )
  if not isinstance(spec, Mapping | tuple | list):
    raise wrong
  items = list(spec.items()) if isinstance(spec, Mapping) else list(spec)
  out = []
  for item in items:
    if not (isinstance(item, tuple) and len(item) == 2):
      raise wrong
    mode, bound = item
    if mode not in REJECTION_MODES:
      raise ValueError(
        f"{name}: rollout_rejection modes must be in {REJECTION_MODES}; got {mode!r}."
      )
    if mode.endswith("k1"):
      low, high = (
        bound if isinstance(bound, tuple | list) else (1.0 / _bound(name, mode, bound), bound)
      )
      low, high = _bound(name, mode, low), _bound(name, mode, high)
      if low > high:
        raise ValueError(f"{name}: rollout_rejection[{mode!r}] needs low <= high; got {bound!r}.")
      out.append((mode, math.log(low), math.log(high)))
    else:
      out.append((mode, None, _bound(name, mode, bound)))
  if not out:
    raise ValueError(f"{name}: rollout_rejection must name at least one mode; got {spec!r}.")
  return tuple(out)


def parse_rollout_options(name, rejection, normalize, correction, has_rollout):
  """``(rejection, normalize)`` checked (:func:`parse_rejection`), against the rollout
  correction mode ``correction`` and whether rollout log-probs came."""
  rejection = parse_rejection(name, rejection)
  normalize = check_bool(name, "rollout_normalize", normalize)
  if normalize and correction is None:
    raise ValueError(f"{name}: rollout_normalize needs a rollout_correction; got None.")
  if (rejection or normalize) and not has_rollout:
    raise ValueError(
      f"{name}: rollout_rejection and rollout_normalize need rollout_log_probs (the sampling "
      f"engine's log-probs)."
    )
  return rejection, normalize


def corrected_weights(old_log_probs, rollout_log_probs, weights: Weights, mode, bounds, normalize):
  """The rollout weights of ``mode`` (``None``: none), batch-normalised if ``normalize``;
  ``weights`` those before any rejection (verl computes both from the original mask)."""
  if mode is None:
    return None
  w = rollout_weights(old_log_probs, rollout_log_probs, weights, mode, bounds)
  return batch_normalize(w, weights, mode.startswith("sequence")) if normalize else w


def without_rejected(weights: Weights, keep, aggregation, normalizer) -> Weights:
  """``weights`` with the rejected tokens (``~keep``) left out of the mask, counts included."""
  w = weights
  return aggregation_weights(
    w.mask & keep, w.segment, w.num_segments, aggregation, normalizer, w.loss.dtype
  )


def with_rejected_fraction(metrics, before: Weights, after: Weights):
  """``metrics`` with the fraction of ``before``'s tokens that ``after`` left out."""
  out = (before.tokens - after.tokens) / jnp.maximum(before.tokens, 1.0)
  return metrics._replace(rejected=out.astype(metrics.rejected.dtype))


def rejection_keep(old_log_probs, rollout_log_probs, weights: Weights, modes: tuple):
  """The tokens no mode rejects (bool, no gradient); ``weights`` before the rejection."""
  mask = weights.mask
  delta = jnp.where(mask, lax.stop_gradient(old_log_probs - rollout_log_probs), 0.0)
  delta = jnp.clip(delta, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
  stats = {"k1": -delta, "k2": 0.5 * delta * delta, "k3": jnp.expm1(delta) - delta}
  count = _per_token(_segment_sum(mask.astype(delta.dtype), weights), weights)
  keep = jnp.ones_like(mask)
  for mode, low, high in modes:
    stat = jnp.where(mask, stats[mode[-2:]], 0.0)
    if mode.startswith("sequence_sum") or mode.startswith("sequence_mean"):
      stat = _per_token(_segment_sum(stat, weights), weights)
      if mode.startswith("sequence_mean"):
        stat = stat / jnp.maximum(count, 1.0)
    elif mode.startswith("sequence_max"):
      neg = jnp.where(mask, stat, -jnp.inf)
      top = jnp.full((weights.num_segments,), -jnp.inf, stat.dtype)
      top = top.at[weights.segment.reshape(-1)].max(neg.reshape(-1))
      stat = _per_token(jnp.where(top == -jnp.inf, 0.0, top), weights)
    keep = keep & ~(stat > high)
    if low is not None:
      keep = keep & ~(stat < low)
  return keep


def batch_normalize(w, weights: Weights, sequence: bool):
  """Rollout weights divided by their mean (verl's ``rollout_is_batch_normalize``): over the
  counted tokens, or (``sequence``) over the sequences, each counted once; unchanged when
  the mean is not above ``1e-8``."""
  m = weights.mask
  per_seq = _segment_sum(m.astype(w.dtype), weights)
  if sequence:
    share = jnp.where(m, 1.0 / jnp.maximum(_per_token(per_seq, weights), 1.0), 0.0)
    sequences = jnp.sum((per_seq > 0).astype(w.dtype))
    mean = jnp.sum(jnp.where(m, w * share, 0.0)) / jnp.maximum(sequences, 1.0)
  else:
    mean = jnp.sum(jnp.where(m, w, 0.0)) / jnp.maximum(jnp.sum(per_seq), 1.0)
  return jnp.where(mean > 1e-8, w / jnp.where(mean > 1e-8, mean, 1.0), w)


def rollout_rejection_mask(
  log_probs: jax.typing.ArrayLike,
  rollout_log_probs: jax.typing.ArrayLike,
  modes: Mapping[str, float | tuple[float, float]],
  *,
  where: jax.typing.ArrayLike | None = None,
  segment_ids: jax.typing.ArrayLike | None = None,
) -> jax.Array:
  r"""The tokens that rollout rejection sampling keeps (verl's ``rollout_rs``), a bool mask.

  The ``rollout_rejection`` of :func:`policy_loss` on its own, with
  :math:`\delta = \log\pi - \log\pi_{\text{rollout}}` (``log_probs`` without gradient): for
  verl's bypass mode with ``loss_type="ppo_clip"``, whose rejection compares the *current*
  policy to the rollout policy while the PPO ratio's old policy is the rollout policy, pass
  ``where=rollout_rejection_mask(jax.lax.stop_gradient(log_probs), rollout_log_probs, modes,
  where=mask)`` to :func:`policy_loss` with ``old_log_probs=rollout_log_probs``. The modes,
  bounds and statistics: :doc:`/policy-optimisation`.

  Args:
    log_probs, rollout_log_probs: ``[..., T]`` log-probs of the sampled tokens.
    modes: a mapping of modes (``"token_k1"``, ``"sequence_mean_k3"``, ...) to bounds, as
      :func:`policy_loss`'s ``rollout_rejection``.
    where: a boolean token mask, broadcastable to the tokens.
    segment_ids: ``[..., T]`` ids of packed sequences (0: padding).

  Returns:
    ``[..., T]`` bool: ``where`` less the rejected tokens.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import rollout_rejection_mask
    >>> logp = jnp.log(jnp.array([[0.5, 0.4, 0.9], [0.5, 0.5, 0.5]]))
    >>> rollout = jnp.log(jnp.array([[0.5, 0.1, 0.9], [0.5, 0.5, 0.5]]))
    >>> rollout_rejection_mask(logp, rollout, {"token_k2": 0.5})  # (log 4)^2 / 2 = 0.96
    Array([[ True, False,  True],
           [ True,  True,  True]], dtype=bool)
    >>> rollout_rejection_mask(logp, rollout, {"sequence_max_k2": 0.5})
    Array([[False, False, False],
           [ True,  True,  True]], dtype=bool)
  """
  name = "rollout_rejection_mask"
  parsed = parse_rejection(name, modes)
  if not parsed:
    raise ValueError(f"{name}: modes must name at least one mode; got {modes!r}.")
  for arg, value in (("log_probs", log_probs), ("rollout_log_probs", rollout_log_probs)):
    as_array(name, arg, value)
  (logp, rollout), _ = promote_and_broadcast(
    name, ("log_probs", "rollout_log_probs"), log_probs, rollout_log_probs
  )
  shape = logp.shape
  if len(shape) == 0:
    raise ValueError(f"{name}: log_probs must have a token axis, shape [..., T]; got a scalar.")
  segment, num_segments, mask, _ = token_layout(name, shape, where, segment_ids)
  dtype = compute_dtype(logp.dtype)
  weights = aggregation_weights(mask, segment, num_segments, "token-mean", None, dtype)
  logp, rollout = logp.astype(dtype), rollout.astype(dtype)
  return mask & rejection_keep(logp, rollout, weights, parsed)
