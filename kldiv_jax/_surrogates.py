r"""The per-token core of the policy losses: aggregation weights, surrogates, metric terms.

The contract (what :func:`kldiv_jax.policy_loss` runs, and what a chunked
caller such as the fused LM-head loss runs a chunk at a time):

1. ``weights = aggregation_weights(shape, where=, segment_ids=, aggregation=,
   normalizer=)`` once, from the masks alone (no log-probs): per-token loss
   weights ``weights.loss`` such that the scalar loss is
   ``sum(weights.loss * per_token_loss)``, per-token metric weights
   ``weights.token`` (``mask / tokens``), and the sequence layout.
2. For the sequence-level surrogates only (``"gspo"``, ``"gspo-token"``,
   ``"gmpo"``), ``seq_log_ratio = sequence_log_ratio(log_probs,
   old_log_probs, advantages, weights, options)``: each token's sequence's
   mean (clipped, for GMPO) log-ratio, broadcast back to the tokens. It needs
   whole sequences: a chunked caller computes it in a first pass. Its
   gradient flows into every token of the sequence (``"gspo"``, ``"gmpo"``);
   ``"gspo-token"`` stops it.
3. ``loss_terms, metric_terms = token_losses(log_probs, old_log_probs,
   advantages, weights.loss, weights.token, weights.mask, options, ...)``:
   elementwise in every argument, so a chunk of tokens (any slice of the
   token arrays, the weights sliced alike) gives that chunk's terms and
   ``jax.vjp`` of ``loss_terms.sum()`` with respect to the chunk's
   ``log_probs`` (and ``entropy``, ``seq_log_ratio``) is its gradient.
   ``metric_terms`` is a :class:`PolicyMetrics` of per-token arrays, already
   weighted: :data:`METRIC_REDUCTIONS` says how each field reduces (``sum``
   for every mean, ``min``/``max`` for the ratio's extremes);
   :func:`reduce_metrics` does it, :func:`combine_metrics` merges two
   chunks' partial reductions.

All arrays come in with one shape and one float dtype (float32 or wider), and
masked tokens' inputs must already be finite (select them to 0: a ``-inf``
padding log-prob times a weight of 0 is NaN).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._checks import as_array, mask_array
from kldiv_jax._cov_clip import COV_SURROGATES, cov_token_losses
from kldiv_jax._numerics import at_most
from kldiv_jax._rl import kl_estimate
from kldiv_jax._trl_options import vespo_log_weight, vespo_phi

SURROGATES = (
  "ppo",
  "gspo",
  "gspo-token",
  "gmpo",
  "cispo",
  "cispo-cap",
  "sapo",
  "gpg",
  "dppo-tv",
  "dppo-kl",
  "vespo",
  *COV_SURROGATES,
)
SEQUENCE_LEVEL = ("gspo", "gspo-token", "gmpo", "vespo")
AGGREGATIONS = (
  "token-mean",
  "token-sum",
  "seq-mean-token-mean",
  "seq-mean-token-sum",
  "seq-mean-token-sum-norm",
  "bnpo",
)
# verl clamps the token log-ratio to +-20 before its exp (vanilla, CISPO, SAPO, DPPO;
# rollout_corr_helper's SAFETY_BOUND) and GSPO's combined log-ratio at 10 from above.
LOG_RATIO_BOUND = 20.0
GSPO_LOG_RATIO_CAP = 10.0


class Options(NamedTuple):
  """The static (or scalar) options of the surrogate and the penalty terms."""

  surrogate: str = "ppo"
  clip_low: float | jax.Array = 0.2
  clip_high: float | jax.Array = 0.2
  dual_clip: float | jax.Array | None = None
  ratio_cap: Any = None  # float | jax.Array | None
  sapo_temperatures: tuple = (1.0, 1.05)
  beta: float | jax.Array = 0.0
  kl_estimator: str = "k3"
  kl_clip: float | tuple | None = None
  kl_importance_weighted: bool = False
  kl_in_loss: bool = True
  entropy_coef: float | jax.Array = 0.0
  vespo_gamma: tuple = (2.0, 3.0, 3.0, 2.0)  # (k_pos, lambda_pos, k_neg, lambda_neg)
  off_policy_threshold: Any = None  # float | jax.Array | None
  top_entropy_fraction: float | None = None
  cov_fraction: float = 2e-4  # clip-cov, kl-cov (kldiv_jax._cov_clip)
  cov_bounds: tuple = (1.0, 5.0)
  cov_kl_coef: float = 0.1


class Weights(NamedTuple):
  """Per-token aggregation weights and the sequence layout (from the masks alone)."""

  loss: jax.Array  # the scalar loss is sum(loss * per-token loss)
  token: jax.Array  # mask / max(tokens, 1): the per-token mean's weights (metrics)
  mask: jax.Array  # bool: the counted tokens
  segment: jax.Array  # int32: each token's sequence, an index in [0, num_segments)
  num_segments: int  # static
  tokens: jax.Array  # the number of counted tokens
  sequences: jax.Array  # the number of sequences with a counted token
  sequence: Any = None  # mask / (n_i * sequences): the mean over sequences' weights (metrics)


class PolicyMetrics(NamedTuple):
  """What :func:`kldiv_jax.policy_loss` reports beside the loss (scalars, no gradient).

  Means are over the counted tokens of the call (not the ``normalizer``). ``entropy`` is NaN
  where no entropy was measured (:func:`kldiv_jax.policy_loss` without ``entropy=``), so
  that a logged value is never a 0 that looks measured; :func:`kldiv_jax.fused_policy_loss`
  always measures it.
  """

  pg_loss: jax.Array  # the surrogate's part of the loss (aggregated, before beta*KL/entropy)
  kl: jax.Array  # mean KL estimate to the reference (0 without ref_log_probs)
  entropy: jax.Array  # mean entropy (NaN where none was measured)
  approx_kl: jax.Array  # mean of log pi_old - log pi (verl's ppo_kl)
  clip_low: jax.Array  # fraction clipped at the lower bound with A < 0
  clip_high: jax.Array  # fraction clipped at the upper bound with A > 0 (CISPO: capped)
  clip_dual: jax.Array  # fraction clipped by dual-clip's c with A < 0 (DPPO: truncated)
  ratio_mean: jax.Array  # the importance ratio pi / pi_old: mean, min, max
  ratio_min: jax.Array
  ratio_max: jax.Array
  tokens: jax.Array  # counted tokens
  sequences: jax.Array  # sequences with a counted token
  # Over sequences (TRL's sequence-level metrics): each sequence's fraction of its counted
  # tokens clipped (GSPO: its one flag), averaged over the sequences with a counted token;
  # the smallest and largest of those fractions; VESPO's weight phi averaged alike (else 0).
  clip_low_seq: jax.Array
  clip_high_seq: jax.Array
  clip_low_seq_min: jax.Array
  clip_high_seq_max: jax.Array
  vespo_phi_seq: jax.Array
  # verl's: aggregated as the loss is (agg_loss), bypass mode's ppo_kl, rollout_rs.
  kl_loss: jax.Array  # the KL estimate aggregated as the loss (verl's kl_loss; 0 without ref)
  entropy_loss: jax.Array  # the entropy aggregated as the loss (verl's entropy_loss; NaN: none)
  rollout_kl: jax.Array  # mean of log pi_rollout - log pi (verl's bypass-mode ppo_kl; 0: none)
  rejected: jax.Array  # fraction of the tokens rollout_rejection left out (verl's masked_fraction)


# How each PolicyMetrics field's per-token terms reduce, in field order (tokens and
# sequences come from Weights, rejected from the masks; "seq_min"/"seq_max": the extremes of
# the per-sequence sums of terms weighted by Weights.sequence, over the sequences with a
# counted token).
METRIC_REDUCTIONS: tuple[str, ...] = ("sum",) * 8 + ("min", "max", "sum", "sum")
METRIC_REDUCTIONS += ("sum", "sum", "seq_min", "seq_max", "sum")  # the sequence-level ones
METRIC_REDUCTIONS += ("sum",) * 4  # kl_loss, entropy_loss, rollout_kl, rejected


def _segment_sum(x, weights: Weights):
  """Each sequence's sum of ``x``, ``[num_segments]``."""
  return jax.ops.segment_sum(x.reshape(-1), weights.segment.reshape(-1), weights.num_segments)


def _per_token(per_segment, weights: Weights):
  return per_segment[weights.segment]


def sequence_layout(shape, mask, segment_ids):
  """Each token's sequence index and the number of indices (static).

  Without ``segment_ids`` a sequence is a row of the last axis; with them
  (``[..., T]``, MaxText's packing: 0 is padding) it is a (row, id) pair, ids
  in ``[0, T]``; an id outside gives NaN (``valid``).
  """
  rows = 1
  for d in shape[:-1]:
    rows *= d
  length = shape[-1] if shape else 1
  row = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32).reshape(*shape[:-1], 1), shape)
  if segment_ids is None:
    return row, max(rows, 1), mask, True
  ids = segment_ids.astype(jnp.int32)
  valid = jnp.all((ids >= 0) & (ids <= length))
  segment = row * (length + 1) + jnp.clip(ids, 0, length)
  return segment, max(rows * (length + 1), 1), mask & (ids != 0), valid


def token_layout(name, shape, where=None, segment_ids=None, keep=None):
  """:func:`sequence_layout` of the tokens ``shape`` (``[..., T]``) from the user's ``where``
  (a boolean mask broadcastable to them), ``keep`` (bool, the tokens' shape) and
  ``segment_ids`` (integers of the tokens' shape); errors name ``name`` and the argument."""
  mask = jnp.ones(shape, bool)
  if where is not None:
    w = mask_array(name, where)
    if jnp.broadcast_shapes(w.shape, shape) != shape:
      raise ValueError(f"{name}: where has shape {w.shape}, which does not broadcast to {shape}.")
    mask = jnp.broadcast_to(w, shape)
  mask = mask if keep is None else mask & keep
  ids = None
  if segment_ids is not None:
    ids = jnp.asarray(as_array(name, "segment_ids", segment_ids))
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{name}: segment_ids must be an integer array; got dtype {ids.dtype}.")
    if ids.shape != shape:
      raise ValueError(f"{name}: segment_ids must have the tokens' shape {shape}; got {ids.shape}.")
  return sequence_layout(shape, mask, ids)


def aggregation_weights(
  mask, segment, num_segments, aggregation, normalizer=None, dtype=jnp.float32
) -> Weights:
  r"""Per-token loss weights ``w`` such that the loss is ``sum(w * l)``.

  With ``m`` the mask, ``n_i`` sequence ``i``'s counted tokens and ``N`` the
  ``normalizer``:

  - ``"token-mean"``, ``"bnpo"``: ``w = m / N``, ``N`` defaulting to the
    number of counted tokens;
  - ``"seq-mean-token-mean"``: ``w = m / (n_i N)``, ``N`` defaulting to the
    number of sequences with a counted token (verl; TRL's grpo divides by the
    number of rows, empty ones included: pass it);
  - ``"seq-mean-token-sum"``: ``w = m / N``, ``N`` as above;
  - ``"seq-mean-token-sum-norm"``: ``w = m / N``, ``N`` defaulting to that
    number of sequences times the sequence length ``T`` (verl 0.9's
    ``global_batch_size * loss_scale_factor``; verl 0.8 divided by ``T``
    alone; Dr. GRPO and TRL's ``dr_grpo``: ``rows * max_completion_length``);
  - ``"token-sum"``: ``w = m / N``, ``N`` defaulting to 1 (verl 0.9).
  """
  m = mask.astype(dtype)
  tokens = jnp.sum(m)
  per_seq = jax.ops.segment_sum(m.reshape(-1), segment.reshape(-1), num_segments)
  sequences = jnp.sum((per_seq > 0).astype(dtype))
  length = mask.shape[-1] if mask.ndim else 1
  default = {
    "token-mean": tokens,
    "bnpo": tokens,
    "seq-mean-token-mean": sequences,
    "seq-mean-token-sum": sequences,
    "seq-mean-token-sum-norm": sequences * float(length),
    "token-sum": jnp.ones((), dtype),
  }[aggregation]
  denominator = jnp.maximum(default, 1.0) if normalizer is None else jnp.asarray(normalizer, dtype)
  loss = m / denominator
  if aggregation == "seq-mean-token-mean":
    loss = loss / jnp.maximum(per_seq[segment], 1.0)
  token = m / jnp.maximum(tokens, 1.0)
  sequence = m / (jnp.maximum(per_seq[segment], 1.0) * jnp.maximum(sequences, 1.0))
  return Weights(loss, token, mask, segment, num_segments, tokens, sequences, sequence)


def segment_mean(x, weights: Weights):
  """Each token's sequence's mean of ``x`` over its counted tokens (0 for none)."""
  m = weights.mask
  total = _segment_sum(jnp.where(m, x, 0.0), weights)
  count = _segment_sum(m.astype(x.dtype), weights)
  return _per_token(total / jnp.maximum(count, 1.0), weights)


def _bounds(options: Options, dtype):
  return jnp.asarray(options.clip_low, dtype), jnp.asarray(options.clip_high, dtype)


def sequence_log_ratio(
  log_probs, old_log_probs, advantages, weights: Weights, options: Options, rollout_weights=None
):
  r"""Each token's sequence's mean log-ratio, broadcast to the tokens.

  GSPO: :math:`\frac1{|y|}\sum_t (\log\pi_t - \log\pi_{\text{old},t})`. GMPO
  (verl's ``geo_mean``): the mean of the per-token log-ratios clipped in log
  space to ``[-clip_low, clip_high]`` on the side the advantage's sign
  selects, :math:`\mathrm{sgn}(A)\min(\mathrm{sgn}(A)\,\delta,
  \mathrm{sgn}(A)\,\mathrm{clip}(\delta))`. VESPO: the clamped *sum* with the log of the
  ``rollout_weights``, no gradient (:func:`kldiv_jax._trl_options.vespo_log_weight`).
  """
  if options.surrogate == "vespo":
    return vespo_log_weight(log_probs, old_log_probs, weights, rollout_weights)
  delta = log_probs - old_log_probs
  if options.surrogate == "gmpo":
    low, high = _bounds(options, delta.dtype)
    sign = jnp.sign(advantages)
    delta = sign * jnp.minimum(sign * delta, sign * jnp.clip(delta, -low, high))
  return segment_mean(delta, weights)


def _clipped_surrogate(ratio, advantages, options: Options):
  """PPO's clipped surrogate with clip-higher, verl's dual clip and TRL's ``delta`` cap."""
  low, high = _bounds(options, ratio.dtype)
  capped = ratio if options.ratio_cap is None else at_most(options.ratio_cap, ratio)
  loss1 = -advantages * capped
  loss2 = -advantages * jnp.clip(ratio, 1.0 - low, 1.0 + high)
  clipped = jnp.maximum(loss1, loss2)
  dual = jnp.zeros_like(ratio, dtype=bool)
  if options.dual_clip is not None:
    loss3 = -advantages * options.dual_clip
    dual = (clipped > loss3) & (advantages < 0)
    clipped = jnp.where(advantages < 0, jnp.minimum(loss3, clipped), clipped)
  clip_low = (ratio < 1.0 - low) & (advantages < 0)
  clip_high = (ratio > 1.0 + high) & (advantages > 0)
  return clipped, clip_low, clip_high, dual


def _dppo_valid(log_probs, old_log_probs, advantages, options: Options):
  """DPPO's trust region (verl's ``dppo_tv``/``dppo_kl``): which tokens keep their gradient.

  Written as "not outside", so that a NaN log-probability keeps its token (and the loss
  NaN) instead of being masked away as outside the region.
  """
  low, high = _bounds(options, log_probs.dtype)
  p, p_old = jnp.exp(log_probs), jnp.exp(old_log_probs)
  if options.surrogate == "dppo-tv":
    positive, negative = ~(p - p_old > high), ~(p - p_old < -low)
  else:  # the binary KL of (p_old, 1 - p_old) to (p, 1 - p), with verl's 1e-8
    bkl = p_old * (old_log_probs - log_probs) + (1.0 - p_old) * jnp.log(
      (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
    )
    positive, negative = ~((bkl > high) & (p > p_old)), ~((bkl > low) & (p < p_old))
  return lax.stop_gradient(jnp.where(advantages > 0, positive, negative))


def token_losses(
  log_probs,
  old_log_probs,
  advantages,
  loss_weights,
  token_weights,
  mask,
  options: Options,
  *,
  seq_log_ratio: Any = None,
  ref_log_probs=None,
  entropy=None,
  rollout_weights=None,
  keep=None,
  sequence_weights=None,
  cov_selected=None,
  rollout_log_probs=None,
):
  """Per-token loss terms (weighted: the loss is their sum) and metric terms.

  Elementwise in every array argument (see the module docstring). ``mask``
  is the counted tokens (``Weights.mask``); ``seq_log_ratio`` is required by
  the sequence-level surrogates (:func:`sequence_log_ratio`);
  ``rollout_weights`` multiply the surrogate's per-token loss (as verl's
  ``rollout_is_weights`` and TRL's ``importance_sampling_ratio``; VESPO folds them into its
  sequence weight instead); ``keep`` (0/1, no gradient) multiplies it too (TRL's off-policy
  and top-entropy masks: the denominators stay); ``sequence_weights`` (``Weights.sequence``)
  weigh the metrics over sequences (0 without); ``cov_selected`` is required by
  ``"clip-cov"``/``"kl-cov"`` (:func:`kldiv_jax._cov_clip.cov_selection`);
  ``rollout_log_probs`` (metric only) gives ``rollout_kl``.
  """
  s = options.surrogate
  delta = log_probs - old_log_probs
  safe_delta = jnp.clip(delta, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
  ratio = jnp.exp(safe_delta)
  false = jnp.zeros_like(mask)
  clip_low = clip_high = dual = false
  phi = None  # VESPO's weight (a metric)
  if s in ("ppo", "gspo", "gspo-token"):
    if s == "gspo":  # the sequence's ratio, its gradient spread over the tokens (TRL's)
      ratio = jnp.exp(at_most(GSPO_LOG_RATIO_CAP, seq_log_ratio))
    elif s == "gspo-token":  # sg[s_i] * pi_t / sg[pi_t] (verl's gspo)
      log_ratio = log_probs - lax.stop_gradient(log_probs) + lax.stop_gradient(seq_log_ratio)
      ratio = jnp.exp(at_most(GSPO_LOG_RATIO_CAP, log_ratio))
    pg, clip_low, clip_high, dual = _clipped_surrogate(ratio, advantages, options)
  elif s == "gmpo":  # -A exp(mean clipped log-ratio), a sequence mean of the tokens' A
    ratio = jnp.exp(seq_log_ratio)
    pg = -advantages * ratio
    low, high = _bounds(options, delta.dtype)
    clipped = delta != jnp.clip(delta, -low, high)
    clip_low, clip_high = clipped & (advantages < 0), clipped & (advantages > 0)
  elif s in ("cispo", "cispo-cap"):  # sg(clipped ratio) * A * log pi
    if s == "cispo":  # verl: clamped to [1 - clip_low, 1 + clip_high]
      low, high = _bounds(options, delta.dtype)
      weight = jnp.clip(ratio, 1.0 - low, 1.0 + high)
      clip_low = ratio < 1.0 - low
      clip_high = ratio > 1.0 + high
    else:  # TRL: min(r, cap), TRL's epsilon_high being the cap
      weight = at_most(options.ratio_cap, ratio)
      clip_high = (ratio > options.ratio_cap) & (advantages > 0)
    pg = -lax.stop_gradient(weight) * advantages * log_probs
  elif s == "sapo":  # a sigmoid gate in place of the clip
    tau_pos, tau_neg = options.sapo_temperatures
    tau = jnp.where(advantages > 0, tau_pos, tau_neg).astype(ratio.dtype)
    pg = -jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages
  elif s == "gpg":
    pg = -log_probs * advantages
  elif s == "vespo":  # -sg(phi(w_i)) * A * log pi, w_i the sequence's importance weight
    phi = vespo_phi(seq_log_ratio, advantages, options.vespo_gamma)
    pg = -phi * advantages * log_probs
  elif s in COV_SURROGATES:
    pg, ratio, clip_high = cov_token_losses(
      log_probs, old_log_probs, advantages, cov_selected, options
    )
  else:  # dppo-tv, dppo-kl
    cap = 20.0 if options.ratio_cap is None else options.ratio_cap
    valid = _dppo_valid(log_probs, old_log_probs, advantages, options)
    pg = -advantages * lax.stop_gradient(at_most(cap, ratio)) * log_probs * valid
    clip_high = ~valid
    dual = (ratio > cap) & valid
  if keep is not None:
    pg = pg * lax.stop_gradient(keep)
  if rollout_weights is not None and s != "vespo":
    pg = pg * lax.stop_gradient(rollout_weights)
  total = pg
  kl = jnp.zeros_like(pg)
  if ref_log_probs is not None:
    kl = kl_estimate(log_probs, ref_log_probs, estimator=options.kl_estimator, clip=options.kl_clip)
    if options.kl_importance_weighted:  # TRL's use_bias_correction_kl: KL * r, r carrying gradient
      kl = kl * ratio
    if options.kl_in_loss:
      total = total + jnp.asarray(options.beta, kl.dtype) * kl  # a traced beta: any float
  if entropy is not None:
    total = total - jnp.asarray(options.entropy_coef, total.dtype) * entropy
  zero = jnp.zeros_like(pg)
  loss_terms = jnp.where(mask, loss_weights * total, 0.0)

  def mean(x):
    return lax.stop_gradient(jnp.where(mask, token_weights * x, 0.0))

  r = lax.stop_gradient(ratio)
  seq_w = zero if sequence_weights is None else sequence_weights

  def seq_mean(x):
    return lax.stop_gradient(jnp.where(mask, seq_w * x, 0.0))

  low_seq, high_seq = seq_mean(clip_low.astype(pg.dtype)), seq_mean(clip_high.astype(pg.dtype))
  metric_terms = PolicyMetrics(
    pg_loss=lax.stop_gradient(jnp.where(mask, loss_weights * pg, 0.0)),
    kl=mean(kl),
    entropy=zero if entropy is None else mean(entropy),
    approx_kl=mean(-safe_delta),
    clip_low=mean(clip_low.astype(pg.dtype)),
    clip_high=mean(clip_high.astype(pg.dtype)),
    clip_dual=mean(dual.astype(pg.dtype)),
    ratio_mean=mean(r),
    ratio_min=jnp.where(mask, r, jnp.inf),
    ratio_max=jnp.where(mask, r, -jnp.inf),
    tokens=zero,
    sequences=zero,
    clip_low_seq=low_seq,
    clip_high_seq=high_seq,
    clip_low_seq_min=low_seq,
    clip_high_seq_max=high_seq,
    vespo_phi_seq=zero if phi is None else seq_mean(phi),
    kl_loss=lax.stop_gradient(jnp.where(mask, loss_weights * kl, 0.0)),
    entropy_loss=zero
    if entropy is None
    else lax.stop_gradient(jnp.where(mask, loss_weights * entropy, 0.0)),
    rollout_kl=zero if rollout_log_probs is None else mean(rollout_log_probs - log_probs),
    rejected=zero,
  )
  return loss_terms, metric_terms


_REDUCE = {"sum": jnp.sum, "min": jnp.min, "max": jnp.max}
# The sequence extremes combine as min/max when each chunk holds whole sequences.
_COMBINE = {"sum": jnp.add, "min": jnp.minimum, "max": jnp.maximum}
_COMBINE |= {"seq_min": jnp.minimum, "seq_max": jnp.maximum}


def _sequence_extreme(x, weights: Weights, reduction: str):
  """The smallest (``"seq_min"``) or largest per-sequence sum of ``x`` (terms weighted by
  ``Weights.sequence``) times the number of sequences: 0 without sequences."""
  per_seq = _segment_sum(x, weights) * jnp.maximum(weights.sequences, 1.0)
  counted = _segment_sum(weights.mask.astype(x.dtype), weights) > 0
  fill = jnp.inf if reduction == "seq_min" else -jnp.inf
  out = _REDUCE[reduction[4:]](jnp.where(counted, per_seq, fill))
  return jnp.where(jnp.any(counted), out, 0.0)


def reduce_metrics(metric_terms: PolicyMetrics, weights: Weights) -> PolicyMetrics:
  """The per-token metric terms reduced to scalars (ratio extremes: 0 without tokens)."""
  out = [
    _sequence_extreme(x, weights, r) if r.startswith("seq_") else _REDUCE[r](x)
    for r, x in zip(METRIC_REDUCTIONS, metric_terms, strict=True)
  ]
  out = PolicyMetrics(*out)._replace(tokens=weights.tokens, sequences=weights.sequences)
  finite = weights.tokens > 0
  return out._replace(
    ratio_min=jnp.where(finite, out.ratio_min, 0.0),
    ratio_max=jnp.where(finite, out.ratio_max, 0.0),
  )


def combine_metrics(a: PolicyMetrics, b: PolicyMetrics) -> PolicyMetrics:
  """Two chunks' partial reductions merged (before :func:`reduce_metrics`' 0 for no tokens)."""
  return PolicyMetrics(
    *(_COMBINE[r](x, y) for r, x, y in zip(METRIC_REDUCTIONS, a, b, strict=True))
  )


def rollout_weights(old_log_probs, rollout_log_probs, weights: Weights, mode, bounds):
  r"""Importance weights :math:`\pi_{\text{old}} / \pi_{\text{rollout}}` for an inference engine's samples.

  ``mode`` (TRL's ``vllm_importance_sampling_mode``): ``"token_*"`` per
  token, ``"sequence_*"`` the product over the sequence (the exp of the sum
  of log-ratios); ``"*_truncate"`` clamps to ``bounds`` (TIS; verl's
  ``rollout_is_threshold`` is the upper bound), ``"*_mask"`` zeroes the
  weights outside them. Log-ratios are clamped to +-20 before the exp (verl's
  ``SAFETY_BOUND``). No gradient.
  """
  delta = jnp.where(weights.mask, old_log_probs - rollout_log_probs, 0.0)
  if mode.startswith("sequence"):
    delta = _per_token(_segment_sum(delta, weights), weights)
  w = jnp.exp(jnp.clip(delta, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
  low, high = bounds
  if mode.endswith("truncate"):
    w = jnp.clip(w, low, high)
  else:
    keep = jnp.ones_like(weights.mask)  # "not outside": a NaN weight keeps its token (NaN)
    if low is not None:
      keep = keep & ~(w < low)
    if high is not None:
      keep = keep & ~(w > high)
    w = jnp.where(keep, w, 0.0)
  return lax.stop_gradient(w)
