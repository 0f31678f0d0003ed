"""policy_loss: PPO/GRPO-family policy losses from per-token log-probs (the math: _surrogates)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from kldiv_jax._checks import (
  as_array,
  check_bool,
  check_choice,
  check_int,
  check_normalizer,
  clip_bounds,
  compute_dtype,
  promote_and_broadcast,
  real_scalar,
  result_dtype,
)
from kldiv_jax._cov_clip import COV_SURROGATES, cov_priority, cov_selection, parse_cov
from kldiv_jax._fused_chunks import check_linear
from kldiv_jax._fused_policy import fused_token_loss
from kldiv_jax._id_checks import check_ids, index_array
from kldiv_jax._numerics import nan_unless, nonnegative_finite, positive_finite
from kldiv_jax._rl import ESTIMATORS
from kldiv_jax._rollout_rejection import (
  corrected_weights,
  parse_rollout_options,
  rejection_keep,
  with_rejected_fraction,
  without_rejected,
)
from kldiv_jax._surrogates import (
  AGGREGATIONS,
  SEQUENCE_LEVEL,
  SURROGATES,
  Options,
  PolicyMetrics,
  Weights,
  aggregation_weights,
  reduce_metrics,
  sequence_log_ratio,
  token_layout,
  token_losses,
)
from kldiv_jax._trl_options import check_trl_options, selection
from kldiv_jax._vocab_parallel import check_axis_name

ROLLOUT_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# verl's loss_agg_mode for the surrogates that ignore it (gspo, sapo: always
# seq-mean-token-mean; geo_mean: a plain mean over rows, empty ones included).
_DEFAULT_AGGREGATION = {"gspo": "seq-mean-token-mean", "gspo-token": "seq-mean-token-mean"}
_DEFAULT_AGGREGATION |= {"sapo": "seq-mean-token-mean", "gmpo": "seq-mean-token-mean"}


def _scalar(name, option, value, test, expected):
  """A real scalar option: checked now when static, else its range test (NaN when it fails)."""
  if value is None:
    return None, True
  out, static = real_scalar(name, option, value)
  if static:
    if not test(out):
      raise ValueError(f"{name}: {option} must be {expected}; got {value!r}.")
    return out, True
  return out, test(out)


class _Parsed(NamedTuple):
  """The checked options of a policy loss (:func:`_parse`)."""

  options: Options
  aggregation: str
  normalizer: Any  # None, a float or a traced scalar
  rollout_correction: str | None
  rollout_bounds: tuple
  valid: list  # static True or traced booleans: NaN unless all hold
  rejection: tuple = ()  # parse_rejection's ((mode, low, high), ...)
  rollout_normalize: bool = False
  cov_key: Any = None


def _parse(
  name, shape, *, surrogate, clip_low, clip_high, dual_clip, ratio_cap, sapo_temperatures,
  aggregation, segment_ids, normalizer, beta, kl_estimator, kl_clip, kl_importance_weighted,
  kl_in_loss, entropy_coef, rollout_correction, rollout_bounds,
) -> _Parsed:  # fmt: skip
  """The options of :func:`policy_loss` and :func:`fused_policy_loss` checked once, for
  tokens of ``shape``: errors name ``name``."""
  check_choice(name, "surrogate", surrogate, SURROGATES)
  if aggregation is None:
    aggregation = _DEFAULT_AGGREGATION.get(surrogate, "token-mean")
  check_choice(name, "aggregation", aggregation, AGGREGATIONS)
  check_choice(name, "kl_estimator", kl_estimator, ESTIMATORS)
  if rollout_correction is not None:  # None: no weights (rejection only, metrics)
    check_choice(name, "rollout_correction", rollout_correction, ROLLOUT_MODES)
  kl_clip_bounds = clip_bounds(name, kl_clip, "kl_clip")
  kl_importance_weighted = check_bool(name, "kl_importance_weighted", kl_importance_weighted)
  kl_in_loss = check_bool(name, "kl_in_loss", kl_in_loss)
  nonnegative = "a number >= 0"
  low, v1 = _scalar(name, "clip_low", clip_low, lambda x: x >= 0, nonnegative)
  high, v2 = _scalar(name, "clip_high", clip_high, lambda x: x >= 0, nonnegative)
  low = cast(Any, low)
  high = low if high is None else high
  dual, v3 = _scalar(name, "dual_clip", dual_clip, lambda x: x > 1, "a number > 1")
  cap, v4 = _scalar(name, "ratio_cap", ratio_cap, lambda x: x > 0, "a positive number")
  if surrogate == "cispo-cap" and cap is None:
    raise ValueError(
      f"{name}: surrogate='cispo-cap' needs ratio_cap (TRL's epsilon_high, e.g. 5.0)."
    )
  if len(sapo_temperatures) != 2 or not all(t > 0 for t in sapo_temperatures):
    raise ValueError(
      f"{name}: sapo_temperatures must be two positive numbers; got {sapo_temperatures!r}."
    )
  # The KL coefficient: >= 0 and finite (a negative one would reward moving away from the
  # reference); a traced one out of range makes the loss NaN.
  as_array(name, "beta", beta, "a real number")  # None is no KL coefficient: a TypeError
  beta, v5 = _scalar(name, "beta", beta, nonnegative_finite, "a finite number >= 0")
  beta = cast(Any, beta)  # not None: as_array above refused None
  entropy_coef, _ = real_scalar(name, "entropy_coef", entropy_coef)  # any real (a bonus if > 0)
  valid = [v1, v2, v3, v4, v5]
  if normalizer is not None:
    normalizer = check_normalizer(name, normalizer)
  elif surrogate == "gmpo" and segment_ids is None and len(shape) > 1:
    normalizer = float(np.prod(shape[:-1]))  # verl's geo_mean: a mean over rows
    valid.append(True if isinstance(normalizer, float) else positive_finite(normalizer))
  bounds = tuple(
    None if b is None else real_scalar(name, "rollout_bounds", b)[0] for b in rollout_bounds
  )
  options = Options(
    surrogate, low, high, dual, cap, tuple(sapo_temperatures), beta, kl_estimator,
    kl_clip_bounds, kl_importance_weighted, kl_in_loss, entropy_coef,
  )  # fmt: skip
  return _Parsed(options, aggregation, normalizer, rollout_correction, bounds, valid)


def _parse_more(
  name, parsed: _Parsed, *, vespo_gamma, off_policy_threshold, top_entropy_fraction,
  cov_fraction, cov_bounds, cov_kl_coef, cov_key, rollout_rejection, rollout_normalize,
  has_rollout,
) -> _Parsed:  # fmt: skip
  """``parsed`` with the peers' further options checked: TRL's VESPO, off-policy and
  top-entropy masks (:mod:`_trl_options`), verl's Clip-Cov/KL-Cov and rollout rejection."""
  gamma, threshold, top = check_trl_options(
    name, parsed.options.surrogate, parsed.rollout_correction, vespo_gamma,
    off_policy_threshold, top_entropy_fraction,
  )  # fmt: skip
  fraction, bounds, coef, key = parse_cov(name, cov_fraction, cov_bounds, cov_kl_coef, cov_key)
  rejection, normalize = parse_rollout_options(
    name, rollout_rejection, rollout_normalize, parsed.rollout_correction, has_rollout
  )
  options = parsed.options._replace(
    vespo_gamma=gamma, off_policy_threshold=threshold, top_entropy_fraction=top,
    cov_fraction=fraction, cov_bounds=bounds, cov_kl_coef=coef,
  )  # fmt: skip
  return parsed._replace(
    options=options, rejection=rejection, rollout_normalize=normalize, cov_key=key
  )


def _reject(parsed: _Parsed, weights: Weights, keep) -> Weights:
  return without_rejected(weights, keep, parsed.aggregation, parsed.normalizer)


def _rollout(parsed: _Parsed, old, rollout_log_probs, weights: Weights):
  return corrected_weights(
    old, rollout_log_probs, weights, parsed.rollout_correction, parsed.rollout_bounds,
    parsed.rollout_normalize,
  )  # fmt: skip


def _check_arrays(name: str, required: dict[str, Any], optional: dict[str, Any]) -> None:
  """An error naming the argument unless each array is array-like (``as_array``); an
  ``optional`` one may be ``None``."""
  for k, v in (*required.items(), *((k, v) for k, v in optional.items() if v is not None)):
    as_array(name, k, v)


def _per_sequence(name: str, adv_shape: tuple, shape: tuple) -> bool:
  """Whether ``advantages`` of ``adv_shape`` hold one value per sequence of tokens ``shape``
  (``[..., T]``): the shape ``shape[:-1]`` (TRL's ``[B]``). Otherwise a scalar, or the tokens'
  rank (``[B, 1]`` per sequence, ``[B, T]`` per token, verl's): a lower rank would be read
  per token by broadcasting, which for ``B == T`` is ``[B]`` read per sequence: one shape,
  two meanings, so it raises."""
  if adv_shape == shape[:-1] and adv_shape != ():
    return True
  if adv_shape != () and len(adv_shape) != len(shape):
    per_seq, col = shape[:-1], (*shape[:-1], 1)
    raise ValueError(
      f"{name}: advantages must have shape {per_seq} (one per sequence), {col} (one per "
      f"sequence) or the tokens' {shape} (one per token), or be a scalar; got {adv_shape}. "
      f"A per-token row shared by every sequence: add its axes, shape (1, ..., T)."
    )
  return False


def _layout(name, shape, named, where, segment_ids, parsed: _Parsed, dtypes=(), keep=None):
  """``(arrays, out_dtype, weights, valid)``: the per-token arrays of ``named`` (``None``s
  left out; ``advantages`` may be one per sequence) promoted (with ``dtypes``), broadcast to
  the tokens' ``shape`` and set to 0 outside the mask (``where``, ``keep``, the padding of
  ``segment_ids``); the aggregation weights."""
  if _per_sequence(name, np.shape(named["advantages"]), shape):
    named = named | {"advantages": jnp.asarray(named["advantages"])[..., None]}
  named = {k: v for k, v in named.items() if v is not None}
  arrays, out_dtype = promote_and_broadcast(name, tuple(named), *named.values())
  got = arrays[0].shape
  if jnp.broadcast_shapes(got, shape) != shape:
    raise ValueError(f"{name}: the per-token arrays broadcast to {got}, not the tokens' {shape}.")
  out_dtype = result_dtype(out_dtype, *dtypes)  # standard promotion, in strict mode too
  segment, num_segments, mask, ids_ok = token_layout(name, shape, where, segment_ids, keep)
  # Padding cannot leak, -inf included.
  a = {k: jnp.where(mask, jnp.broadcast_to(x, shape), 0.0) for k, x in zip(named, arrays)}
  dtype = compute_dtype(out_dtype)
  weights = aggregation_weights(
    mask, segment, num_segments, parsed.aggregation, parsed.normalizer, dtype
  )
  return a, out_dtype, weights, [*parsed.valid, ids_ok]


def policy_loss(
  log_probs: jax.typing.ArrayLike,
  old_log_probs: jax.typing.ArrayLike | None,
  advantages: jax.typing.ArrayLike,
  *,
  surrogate: str = "ppo",
  clip_low: float | jax.typing.ArrayLike = 0.2,
  clip_high: float | jax.typing.ArrayLike | None = None,
  dual_clip: float | jax.typing.ArrayLike | None = None,
  ratio_cap: float | jax.typing.ArrayLike | None = None,
  sapo_temperatures: tuple[float, float] = (1.0, 1.05),
  aggregation: str | None = None,
  where: jax.typing.ArrayLike | None = None,
  segment_ids: jax.typing.ArrayLike | None = None,
  normalizer: float | jax.typing.ArrayLike | None = None,
  ref_log_probs: jax.typing.ArrayLike | None = None,
  beta: float | jax.typing.ArrayLike = 0.0,
  kl_estimator: str = "k3",
  kl_clip: float | tuple[float, float] | None = None,
  kl_importance_weighted: bool = False,
  kl_in_loss: bool = True,
  entropy: jax.typing.ArrayLike | None = None,
  entropy_coef: float | jax.typing.ArrayLike = 0.0,
  rollout_log_probs: jax.typing.ArrayLike | None = None,
  rollout_correction: str | None = "token_truncate",
  rollout_bounds: tuple[float | None, float | None] = (None, 2.0),
  vespo_gamma: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
  off_policy_threshold: float | jax.typing.ArrayLike | None = None,
  top_entropy_fraction: float | None = None,
  cov_fraction: float = 2e-4,
  cov_bounds: tuple[float, float] = (1.0, 5.0),
  cov_kl_coef: float = 0.1,
  cov_key: jax.Array | None = None,
  rollout_rejection: Mapping[str, float | tuple[float, float]] | None = None,
  rollout_normalize: bool = False,
) -> tuple[jax.Array, PolicyMetrics]:
  r"""A PPO/GRPO-family policy loss from per-token log-probs, and its metrics.

  .. math::

     L = \sum_t w_t \big(\rho_t\,\ell_t + \beta\,k_t - c_H H_t\big),

  with :math:`\ell_t` the ``surrogate``'s per-token loss (PPO's
  :math:`-\min(r A, \mathrm{clip}(r, 1-\epsilon_l, 1+\epsilon_h) A)`, GSPO,
  GMPO, CISPO, SAPO, GPG, DPPO, VESPO), :math:`r = \pi/\pi_{\text{old}}`,
  :math:`\rho_t` the rollout correction, :math:`k_t` the
  :func:`kl_estimate` to the reference, :math:`H_t` the entropy and
  :math:`w_t` the ``aggregation``'s weights, as verl and TRL compute them.
  The formulas, papers and options: :doc:`/policy-optimisation`.

  Args:
    log_probs: the policy's log-probs of the sampled tokens, ``[..., T]``.
    old_log_probs: the sampling policy's (``None``: ``stop_gradient(log_probs)``).
    advantages: one per sequence, ``[...]`` (TRL's ``[B]``) or ``[..., 1]``; one per token,
      the tokens' ``[..., T]`` (verl's; any array of that rank that broadcasts to it); or a
      scalar. Another rank raises (a ``[T]`` row would mean per token for ``B != T`` and per
      sequence for ``B == T``).
    surrogate: ``"ppo"``, ``"gspo"``, ``"gspo-token"``, ``"gmpo"``, ``"cispo"``,
      ``"cispo-cap"``, ``"sapo"``, ``"gpg"``, ``"dppo-tv"``, ``"dppo-kl"`` or ``"vespo"``.
    clip_low, clip_high, dual_clip, ratio_cap, sapo_temperatures: the bounds
      :math:`\epsilon_l, \epsilon_h \ge 0` (``clip_high`` defaults to ``clip_low``),
      verl's dual-clip ``c > 1``, a cap on :math:`r` (``> 0``), SAPO's
      :math:`(\tau_+, \tau_-)` (both ``> 0``).
    aggregation: ``"token-mean"``, ``"token-sum"``, ``"seq-mean-token-mean"``,
      ``"seq-mean-token-sum"``, ``"seq-mean-token-sum-norm"``, ``"bnpo"``
      (``None``: verl's choice for the surrogate).

      .. warning::
         ``aggregation=None`` is ``"token-mean"`` for ``"ppo"``: TRL's ``"bnpo"`` (and
         ``"dapo"`` with the global token count as ``normalizer``), **not TRL's**
         ``"grpo"``, which is ``aggregation="seq-mean-token-mean", normalizer=rows``
         (every ``loss_type``: :doc:`/cheat-sheet`).
    where: a boolean token mask, broadcastable to the tokens.
    segment_ids: ``[..., T]`` ids of packed sequences (0: padding).
    normalizer: the aggregation's denominator (``None``: this call's).
    ref_log_probs, beta, kl_estimator, kl_clip: the KL penalty
      ``beta * kl_estimate(log_probs, ref_log_probs, estimator=, clip=)``; ``beta`` is the KL
      coefficient (TRL's and verl's ``beta``/``kl_coef``), finite and ``>= 0`` (not JSD's
      ``beta`` in [0, 1]); ``kl_clip`` a bound ``c`` or a pair ``(low, high)``, ``low <= high``.
    kl_importance_weighted: multiply the KL by :math:`r`.
    kl_in_loss: ``False``: report the KL, leave it out of the loss.
    entropy, entropy_coef: per-token entropy and its coefficient (any real: ``> 0`` a bonus).
      Without ``entropy`` the metric ``entropy`` is NaN (nothing measured).
    rollout_log_probs, rollout_correction, rollout_bounds: the weights
      :math:`\rho_t` from :math:`\pi_{\text{old}}/\pi_{\text{rollout}}`
      (``rollout_correction=None``: none, the rollout log-probs only for
      ``rollout_rejection`` and the metric ``rollout_kl``).
    vespo_gamma: ``surrogate="vespo"``'s :math:`(k_+, \lambda_+, k_-, \lambda_-)` (TRL's
      ``vespo_k_pos``, ``vespo_lambda_pos``, ``vespo_k_neg``, ``vespo_lambda_neg``): the loss
      :math:`-\mathrm{sg}(\varphi(w_i))\,A\log\pi_t`, :math:`\varphi(w) = e^{\lambda}
      w^k e^{-\lambda w}` of the sequence's importance weight :math:`w_i` (the exp of the
      *sum* of its log-ratios and of its tokens' log rollout weights, which VESPO takes in
      place of multiplying: token rollout modes only), :math:`(k, \lambda)` by the sign of
      :math:`A \ge 0`.
    off_policy_threshold: DeepSeek-V3.2's off-policy sequence masking (TRL's
      ``off_policy_mask_threshold``): the surrogate of a token with :math:`A < 0` is dropped
      when its sequence's mean :math:`\log\pi_{\text{rollout}} - \mathrm{sg}(\log\pi)`
      (:math:`\pi_{\text{old}}` without ``rollout_log_probs``) exceeds it; the
      denominators and the KL stay.
    top_entropy_fraction: keep the surrogate of the counted tokens whose entropy is at
      least the ``1 - fraction`` quantile of this call's (TRL's ``top_entropy_quantile``;
      a static number in [0, 1], ``None`` or 1: all); the denominators and the KL stay
      (a ``where`` mask would change them). Needs ``entropy`` here.
    cov_fraction, cov_bounds, cov_kl_coef, cov_key: ``"clip-cov"``/``"kl-cov"``'s fraction
      of the counted tokens singled out (verl's ``clip_cov_ratio``/``kl_cov_ratio``, a
      Python number ``> 0``), Clip-Cov's covariance window ``(lb, ub)`` (``clip_cov_lb``,
      ``clip_cov_ub``), KL-Cov's penalty coefficient (``ppo_kl_coef``) and Clip-Cov's random
      choice (a ``jax.random`` key; ``None``: the first candidates in row-major order).
    rollout_rejection: verl's ``rollout_rs``: a mapping of modes (``"token_k1"``,
      ``"token_k2"``, ``"token_k3"``, ``"sequence_{sum,mean}_k{1,2,3}"``,
      ``"sequence_max_k{2,3}"``) to their bound (``k1``: ``(low, high)`` or ``high``); the
      rejected tokens (from :math:`\pi_{\text{old}}` vs :math:`\pi_{\text{rollout}}`) leave
      the mask before aggregation. Needs ``rollout_log_probs``.
    rollout_normalize: divide the rollout weights by their batch mean (verl's
      ``rollout_is_batch_normalize``). :doc:`/policy-optimisation`.

  Returns:
    ``(loss, metrics)``: the scalar loss (the inputs' dtype) and a
    :class:`PolicyMetrics` of float32-or-wider scalars without gradient.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import policy_loss
    >>> logp = jnp.log(jnp.array([[0.5, 0.4, 0.9]]))
    >>> old = jnp.log(jnp.array([[0.25, 0.5, 0.9]]))
    >>> loss, metrics = policy_loss(logp, old, jnp.array([1.0]))  # r = (2, 0.8, 1)
    >>> round(float(loss), 5)  # -(1.2 + 0.8 + 1) / 3
    -1.0
    >>> metrics.clip_high, metrics.ratio_max
    (Array(0.3333..., dtype=float32), Array(2., dtype=float32))
  """
  name = "policy_loss"
  _check_arrays(
    name, {"log_probs": log_probs, "advantages": advantages},
    {"old_log_probs": old_log_probs, "ref_log_probs": ref_log_probs, "entropy": entropy,
     "rollout_log_probs": rollout_log_probs},
  )  # fmt: skip
  shape = tuple(np.shape(log_probs))
  if len(shape) == 0:
    raise ValueError(f"{name}: log_probs must have a token axis, shape [..., T]; got a scalar.")
  parsed = _parse(
    name, shape, surrogate=surrogate, clip_low=clip_low, clip_high=clip_high,
    dual_clip=dual_clip, ratio_cap=ratio_cap, sapo_temperatures=sapo_temperatures,
    aggregation=aggregation, segment_ids=segment_ids, normalizer=normalizer, beta=beta,
    kl_estimator=kl_estimator, kl_clip=kl_clip, kl_importance_weighted=kl_importance_weighted,
    kl_in_loss=kl_in_loss, entropy_coef=entropy_coef, rollout_correction=rollout_correction,
    rollout_bounds=rollout_bounds,
  )  # fmt: skip
  parsed = _parse_more(
    name, parsed, vespo_gamma=vespo_gamma, off_policy_threshold=off_policy_threshold,
    top_entropy_fraction=top_entropy_fraction, cov_fraction=cov_fraction,
    cov_bounds=cov_bounds, cov_kl_coef=cov_kl_coef, cov_key=cov_key,
    rollout_rejection=rollout_rejection, rollout_normalize=rollout_normalize,
    has_rollout=rollout_log_probs is not None,
  )  # fmt: skip
  named = {"log_probs": log_probs, "old_log_probs": old_log_probs, "advantages": advantages}
  named |= {"ref_log_probs": ref_log_probs, "entropy": entropy}
  named |= {"rollout_log_probs": rollout_log_probs}
  a, out_dtype, weights, valid = _layout(name, shape, named, where, segment_ids, parsed)
  logp = a["log_probs"]
  old = jax.lax.stop_gradient(logp) if old_log_probs is None else a["old_log_probs"]
  options = parsed.options
  if options.top_entropy_fraction is not None and entropy is None:
    raise ValueError(f"{name}: top_entropy_fraction needs the per-token entropy= (none given).")
  rollout, before = None, weights
  if rollout_log_probs is not None:
    rollout = _rollout(parsed, old, a["rollout_log_probs"], weights)
    if parsed.rejection:
      kept = rejection_keep(old, a["rollout_log_probs"], weights, parsed.rejection)
      weights = _reject(parsed, weights, kept)
  seq_lr = selected = None
  if options.surrogate in SEQUENCE_LEVEL:
    seq_lr = sequence_log_ratio(logp, old, a["advantages"], weights, options, rollout)
  if options.surrogate in COV_SURROGATES:
    priority = cov_priority(shape, parsed.cov_key)
    selected = cov_selection(logp, old, a["advantages"], weights, options, priority)
  sampling = old if rollout_log_probs is None else a["rollout_log_probs"]
  keep = selection(logp, sampling, a["advantages"], a.get("entropy"), weights, options)
  loss_terms, metric_terms = token_losses(
    logp, old, a["advantages"], weights.loss, weights.token, weights.mask, options,
    seq_log_ratio=seq_lr, ref_log_probs=a.get("ref_log_probs"), entropy=a.get("entropy"),
    rollout_weights=rollout, keep=keep, sequence_weights=weights.sequence,
    cov_selected=selected, rollout_log_probs=a.get("rollout_log_probs"),
  )  # fmt: skip
  loss = nan_unless(jnp.sum(loss_terms), *valid).astype(out_dtype)
  metrics = with_rejected_fraction(reduce_metrics(metric_terms, weights), before, weights)
  return loss, _no_entropy(metrics, entropy is None)


def _no_entropy(metrics: PolicyMetrics, missing: bool) -> PolicyMetrics:
  """``metrics`` with a NaN entropy where none was measured (not a 0 that looks measured)."""
  if not missing:
    return metrics
  nan = jnp.full_like(metrics.entropy, jnp.nan)
  return metrics._replace(entropy=nan, entropy_loss=nan)


# Options' scalar fields, passed per token to the fused engine (its per-token function is static).
_SCALARS = ("clip_low", "clip_high", "dual_clip", "ratio_cap", "beta", "entropy_coef")
_SCALARS += ("off_policy_threshold",)


@dataclasses.dataclass(frozen=True)
class _TokenTerms:
  """``per_token_fn`` of :func:`fused_policy_loss`: :func:`token_losses` of the engine's
  log-probs and entropy, with the metric terms as aux. Hashable: the static options only
  (``options``' scalars are placeholders; their values come per token in ``args``)."""

  options: Options
  num_segments: int
  on_policy: bool
  rollout: str | None  # the rollout correction when it needs the log-probs (on-policy)
  rollout_normalize: bool = False
  rejection: tuple = ()  # on-policy rollout rejection: the weights recomputed here
  aggregation: str = "token-mean"

  def __call__(self, log_p, entropy, args):
    o = self.options._replace(**args["scalars"])
    old = jax.lax.stop_gradient(log_p) if self.on_policy else args["old_log_probs"]
    unused = jnp.zeros((), log_p.dtype)  # the counts: reduce_metrics' business, outside
    w = Weights(args["loss"], args["token"], args["mask"], args.get("segment"),
                self.num_segments, unused, unused)  # fmt: skip
    adv = args["advantages"]
    rollout = args.get("rollout_weights")
    if self.rollout is not None:
      rollout_lp, bounds = args["rollout_log_probs"], args["rollout_bounds"]
      rollout = corrected_weights(old, rollout_lp, w, self.rollout, bounds, self.rollout_normalize)
    if self.rejection:  # the weights from the kept tokens (two-pass: all tokens here)
      w = self._rejected(w, old, args)
    seq_lr = selected = None
    if o.surrogate in SEQUENCE_LEVEL:
      seq_lr = sequence_log_ratio(log_p, old, adv, w, o, rollout)
    if o.surrogate in COV_SURROGATES:
      selected = cov_selection(log_p, old, adv, w, o, args["cov_priority"])
    keep = selection(log_p, args.get("sampling_log_probs", old), adv, entropy, w, o)
    loss_terms, metric_terms = token_losses(
      log_p, old, adv, w.loss, w.token, w.mask, o, seq_log_ratio=seq_lr,
      ref_log_probs=args.get("ref_log_probs"), entropy=entropy, rollout_weights=rollout,
      keep=keep, sequence_weights=args["sequence"] if w.sequence is None else w.sequence,
      cov_selected=selected, rollout_log_probs=args.get("rollout_log_probs"),
    )  # fmt: skip
    if not self.rejection:
      return loss_terms, metric_terms
    # The counts as per-token terms (their sums), and the weights, for the metrics outside.
    m = w.mask.astype(log_p.dtype)
    per_seq = jax.ops.segment_sum(m, w.segment, self.num_segments)[w.segment]
    counts = metric_terms._replace(tokens=m, sequences=m / jnp.maximum(per_seq, 1.0))
    return loss_terms, (counts, w.loss, w.token)

  def _rejected(self, w: Weights, old, args) -> Weights:
    keep = rejection_keep(old, args["rollout_log_probs"], w, self.rejection)
    n = args.get("normalizer")  # the same value per token
    normalizer = None if n is None else jnp.sum(n) / max(n.size, 1)
    return without_rejected(w, keep, self.aggregation, normalizer)


def fused_policy_loss(
  hidden: jax.typing.ArrayLike,
  weight: jax.typing.ArrayLike,
  token_ids: jax.typing.ArrayLike,
  old_log_probs: jax.typing.ArrayLike | None,
  advantages: jax.typing.ArrayLike,
  *,
  bias: jax.typing.ArrayLike | None = None,
  surrogate: str = "ppo",
  clip_low: float | jax.typing.ArrayLike = 0.2,
  clip_high: float | jax.typing.ArrayLike | None = None,
  dual_clip: float | jax.typing.ArrayLike | None = None,
  ratio_cap: float | jax.typing.ArrayLike | None = None,
  sapo_temperatures: tuple[float, float] = (1.0, 1.05),
  aggregation: str | None = None,
  where: jax.typing.ArrayLike | None = None,
  segment_ids: jax.typing.ArrayLike | None = None,
  normalizer: float | jax.typing.ArrayLike | None = None,
  ref_log_probs: jax.typing.ArrayLike | None = None,
  beta: float | jax.typing.ArrayLike = 0.0,
  kl_estimator: str = "k3",
  kl_clip: float | tuple[float, float] | None = None,
  kl_importance_weighted: bool = False,
  kl_in_loss: bool = True,
  entropy_coef: float | jax.typing.ArrayLike = 0.0,
  rollout_log_probs: jax.typing.ArrayLike | None = None,
  rollout_correction: str | None = "token_truncate",
  rollout_bounds: tuple[float | None, float | None] = (None, 2.0),
  temperature: float | jax.typing.ArrayLike = 1.0,
  softcap: float | None = None,
  ignore_index: int | None = None,
  axis_name: str | None = None,
  chunk_size: int | None = None,
  logits_dtype: jax.typing.DTypeLike | None = None,
  vespo_gamma: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
  off_policy_threshold: float | jax.typing.ArrayLike | None = None,
  top_entropy_fraction: float | None = None,
  cov_fraction: float = 2e-4,
  cov_bounds: tuple[float, float] = (1.0, 5.0),
  cov_kl_coef: float = 0.1,
  cov_key: jax.Array | None = None,
  rollout_rejection: Mapping[str, float | tuple[float, float]] | None = None,
  rollout_normalize: bool = False,
  implementation: str | None = None,
) -> tuple[jax.Array, PolicyMetrics]:
  r""":func:`policy_loss` from hidden states and the LM head, with no ``[tokens, vocab]`` array.

  The loss and metrics of ``policy_loss(log_probs, old_log_probs,
  advantages, entropy=entropy, ...)`` with ``log_probs, entropy =
  token_log_probs(hidden @ weight + bias, token_ids, return_entropy=True, ...)``,
  ``chunk_size`` tokens at a time. Passes, memory, bf16: :doc:`/policy-optimisation`;
  reverse mode only, zero gradients for ``temperature`` and the per-token
  inputs: :ref:`derivatives`; ``axis_name``: :ref:`vocab-parallel`.

  Args:
    hidden, weight: hidden states ``[..., T, H]``, the LM head ``[H, V]``; ``bias``: ``[V]``.
    token_ids: the sampled tokens ``[..., T]``, aligned with ``hidden`` (``token_ids[t]``
      predicted from ``hidden[t]``: for a causal LM, shifted, :func:`shift_labels`).
    temperature, softcap, ignore_index, axis_name, chunk_size, logits_dtype, implementation:
      as in :func:`fused_token_log_probs` (``logits_dtype=jnp.float32``: bf16 inputs' chunk
      logits and their gradient in float32, :ref:`fused-logits-dtype`; ``"pallas"``: the
      opt-in GPU kernels, the loss in two passes around them); the other options as in
      :func:`policy_loss` (``top_entropy_fraction`` on the entropy measured here).

  Returns:
    ``(loss, metrics)`` as :func:`policy_loss`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kldiv_jax import fused_policy_loss, policy_loss, token_log_probs
    >>> k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    >>> h, w = jax.random.normal(k1, (2, 5, 4)), jax.random.normal(k2, (4, 10))
    >>> ids = jax.random.randint(k3, (2, 5), 0, 10)
    >>> old, adv = jnp.full((2, 5), -2.0), jnp.array([1.0, -1.0])
    >>> loss, metrics = fused_policy_loss(h, w, ids, old, adv, clip_high=0.28, chunk_size=4)
    >>> lp, ent = token_log_probs(h @ w, ids, return_entropy=True)
    >>> want, _ = policy_loss(lp, old, adv, clip_high=0.28, entropy=ent)
    >>> bool(jnp.allclose(loss, want, atol=1e-6)), int(metrics.tokens)
    (True, 10)
  """
  name = "fused_policy_loss"
  head_dtype = check_linear(name, "student", hidden, weight, bias)
  shape = tuple(np.shape(hidden)[:-1])
  if len(shape) == 0:
    raise ValueError(f"{name}: hidden must have a token axis, shape [..., T, H]; got a vector.")
  _check_arrays(
    name, {"token_ids": token_ids, "advantages": advantages},
    {"old_log_probs": old_log_probs, "ref_log_probs": ref_log_probs,
     "rollout_log_probs": rollout_log_probs},
  )  # fmt: skip
  if tuple(np.shape(token_ids)) != shape:
    raise ValueError(
      f"{name}: token_ids must have shape hidden.shape[:-1] = {shape}; got {np.shape(token_ids)}."
    )
  parsed = _parse(
    name, shape, surrogate=surrogate, clip_low=clip_low, clip_high=clip_high,
    dual_clip=dual_clip, ratio_cap=ratio_cap, sapo_temperatures=sapo_temperatures,
    aggregation=aggregation, segment_ids=segment_ids, normalizer=normalizer, beta=beta,
    kl_estimator=kl_estimator, kl_clip=kl_clip, kl_importance_weighted=kl_importance_weighted,
    kl_in_loss=kl_in_loss, entropy_coef=entropy_coef, rollout_correction=rollout_correction,
    rollout_bounds=rollout_bounds,
  )  # fmt: skip
  parsed = _parse_more(
    name, parsed, vespo_gamma=vespo_gamma, off_policy_threshold=off_policy_threshold,
    top_entropy_fraction=top_entropy_fraction, cov_fraction=cov_fraction,
    cov_bounds=cov_bounds, cov_kl_coef=cov_kl_coef, cov_key=cov_key,
    rollout_rejection=rollout_rejection, rollout_normalize=rollout_normalize,
    has_rollout=rollout_log_probs is not None,
  )  # fmt: skip
  keep = None
  if ignore_index is not None:
    keep = jnp.asarray(token_ids) != check_int(name, "ignore_index", ignore_index)

  # Layout: the per-token arrays on the tokens' shape, flattened to the engine's [N].
  on_policy = old_log_probs is None
  named = {"old_log_probs": old_log_probs, "advantages": advantages}
  named |= {"ref_log_probs": ref_log_probs, "rollout_log_probs": rollout_log_probs}
  a, out_dtype, weights, valid = _layout(
    name, shape, named, where, segment_ids, parsed, (head_dtype,), keep
  )
  # Known ids in the tokens' own layout, so that an error names their position there (the
  # engine sees them flattened).
  shards = 1 if axis_name is None else check_axis_name(name, axis_name)
  check_ids(
    name, "token_ids", index_array(name, "token_ids", token_ids, "token ids"),
    np.shape(weight)[-1] * shards, where, ignore_index=ignore_index, has_ignore_index=True,
  )  # fmt: skip
  o = parsed.options
  sequence_rollout = rollout_log_probs is not None and (
    (parsed.rollout_correction or "")[:3] == "seq" or parsed.rollout_normalize
  )
  sequence_rollout = sequence_rollout or bool(parsed.rejection)  # on-policy: all tokens at once
  two_pass = o.surrogate in (*SEQUENCE_LEVEL, *COV_SURROGATES) or (on_policy and sequence_rollout)
  # TRL's masks need whole sequences (the off-policy KL) or the whole call (the quantile).
  two_pass |= o.off_policy_threshold is not None or o.top_entropy_fraction is not None
  dtype = weights.loss.dtype
  n = weights.loss.size
  per_token = lambda x: jnp.broadcast_to(jnp.asarray(x, dtype), (n,))  # noqa: E731
  scalars = {k: getattr(o, k) for k in _SCALARS if getattr(o, k) is not None}
  before = weights
  if rollout_log_probs is not None and not on_policy:
    old, rollout_lp = a["old_log_probs"], a["rollout_log_probs"]
    rollout = _rollout(parsed, old, rollout_lp, weights)
    if rollout is not None:
      a["rollout_weights"] = rollout
    if parsed.rejection:
      weights = _reject(parsed, weights, rejection_keep(old, rollout_lp, weights, parsed.rejection))
  if o.surrogate in COV_SURROGATES:
    a["cov_priority"] = cov_priority(shape, parsed.cov_key)
  args: dict[str, Any] = {"loss": weights.loss, "token": weights.token, "mask": weights.mask}
  args |= a
  args["sequence"] = weights.sequence
  if o.off_policy_threshold is not None and rollout_log_probs is not None:
    args["sampling_log_probs"] = a["rollout_log_probs"]
  if two_pass:
    args["segment"] = weights.segment
  args = jax.tree.map(lambda x: x.reshape(n), args)
  args["scalars"] = {k: per_token(v) for k, v in scalars.items()}
  if rollout_log_probs is not None and on_policy:
    args["rollout_bounds"] = tuple(
      None if b is None else per_token(b) for b in parsed.rollout_bounds
    )
  rejection = parsed.rejection if on_policy else ()
  if rejection and parsed.normalizer is not None:
    args["normalizer"] = per_token(parsed.normalizer)
  placeholders = {k: 0.0 for k in scalars}
  static_fn = _TokenTerms(
    o._replace(**placeholders), weights.num_segments, on_policy,
    parsed.rollout_correction if rollout_log_probs is not None and on_policy else None,
    parsed.rollout_normalize, rejection, parsed.aggregation,
  )  # fmt: skip
  coef = o.entropy_coef
  with_entropy = not (isinstance(coef, float) and coef == 0.0)
  with_entropy |= o.top_entropy_fraction is not None

  # Kernel: the engine, then the metrics from its per-token outputs.
  h = jnp.asarray(hidden).reshape(n, np.shape(hidden)[-1])
  loss, outs = fused_token_loss(
    h, weight, bias, jnp.asarray(token_ids).reshape(n), static_fn, args,
    where=weights.mask.reshape(n), temperature=temperature, softcap=softcap,
    axis_name=axis_name, chunk_size=chunk_size, with_entropy=with_entropy, has_aux=True,
    two_pass=two_pass, name=name, loss_dtype=out_dtype, logits_dtype=logits_dtype,
    implementation=implementation,
  )  # fmt: skip
  terms, loss_w, token_w = outs.aux if rejection else (outs.aux, args["loss"], args["token"])
  if rejection:  # the weights of the tokens kept, from the kernel
    counts = weights._replace(tokens=jnp.sum(terms.tokens), sequences=jnp.sum(terms.sequences))
    weights = counts._replace(loss=loss_w, token=token_w)
  ent = outs.entropy.astype(dtype)
  terms = terms._replace(entropy=token_w * ent, entropy_loss=loss_w * ent)
  return nan_unless(loss, *valid), with_rejected_fraction(
    reduce_metrics(terms, weights), before, weights
  )
