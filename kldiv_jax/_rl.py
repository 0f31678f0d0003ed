"""Per-token KL estimators and sampled tokens' log-probabilities for RL (PPO, GRPO)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kldiv_jax._checks import (
  check_bool,
  check_choice,
  check_float,
  check_softcap,
  check_temperature,
  clip_bounds,
  compute_dtype,
  promote_and_broadcast,
  real_scalar,
  split_where,
)
from kldiv_jax._numerics import clamp, exp_minus_one_minus, nan_unless, positive_finite
from kldiv_jax._tokens import token_layout, token_log_prob_rows, token_outputs, token_rows
from kldiv_jax._vocab_parallel import check_axis_name, global_classes

# Schulman's k1, k2, k3 (k3 unclamped, as TRL's), and verl 0.9's ``kl_penalty``
# names (verl/trainer/ppo/core_algos.py, ``kl_penalty_forward``): ``kl`` is k1, ``mse``
# is k2, ``abs`` is |k1|, ``low_var_kl`` is k3 with verl's clamps. A trailing ``+`` is
# verl's straight-through form: the estimator's value with k2's gradient.
_BASES = ("k1", "k2", "k3", "kl", "abs", "mse", "low_var_kl")
ESTIMATORS = (*_BASES, *(f"{b}+" for b in _BASES))


def _estimate(delta: jax.Array, estimator: str) -> jax.Array:
  """The estimator ``estimator`` (no ``+``) of the log-ratio ``delta = log pi - log pi_ref``."""
  if estimator in ("k1", "kl"):
    return delta
  if estimator in ("k2", "mse"):
    return 0.5 * delta * delta
  if estimator == "abs":
    return delta * jnp.sign(delta)  # the subgradient 0 at 0, as torch's abs
  if estimator == "k3":
    return exp_minus_one_minus(-delta)
  # verl's low_var_kl: the log-ratio clamped to [-20, 20], the estimate to [-10, 10].
  return clamp(exp_minus_one_minus(clamp(-delta, -20.0, 20.0)), -10.0, 10.0)


def kl_estimate(
  log_probs: jax.typing.ArrayLike,
  ref_log_probs: jax.typing.ArrayLike,
  *,
  estimator: str = "k3",
  clip: float | tuple[float, float] | None = None,
  old_log_probs: jax.typing.ArrayLike | None = None,
  importance_clip: float | tuple[float, float] | None = None,
  where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
  r"""Per-token estimate of ``KL(policy || reference)`` from sampled tokens' log-probabilities.

  With the log-ratio :math:`\delta = \log \pi(a) - \log \pi_{\text{ref}}(a)`
  of a token :math:`a \sim \pi` (Schulman, *Approximating KL divergence*):

  .. math::

     k_1 = \delta, \qquad k_2 = \tfrac12 \delta^2, \qquad
     k_3 = e^{-\delta} - 1 + \delta .

  All three have expectation close to :math:`\mathrm{KL}(\pi\|\pi_{\text{ref}})`
  under :math:`\pi`: ``k1`` is unbiased but noisy and can be negative,
  ``k2`` is low-variance and biased, ``k3`` (GRPO's penalty; TRL's, unclamped)
  is unbiased and non-negative. ``k3`` is computed without cancellation near
  :math:`\delta = 0`.

  verl's names (``kl_penalty``/``kl_loss_type`` in verl 0.9,
  ``verl/trainer/ppo/core_algos.py``), with verl's values and gradients:
  ``"kl"`` is ``k1``, ``"mse"`` is ``k2``, ``"abs"`` is :math:`|\delta|`
  (gradient 0 at :math:`\delta = 0`, as torch's ``abs``), and
  ``"low_var_kl"`` is ``k3`` clamped as verl does, :math:`\mathrm{clamp}(k_3(
  \mathrm{clamp}(\delta, -20, 20)), -10, 10)` (the gradient 0 where a clamp
  binds). verl also accepts ``"k1"``, ``"k2"``, ``"k3"`` as *aliases* of
  its ``"kl"``, ``"mse"``, ``"low_var_kl"``: here ``"k3"`` is Schulman's
  unclamped :math:`k_3` (14 at :math:`\delta = 15`, where verl's ``"k3"``
  gives 10); for verl's numbers use ``"low_var_kl"``.

  Straight-through forms, a name with ``+`` (verl's ``"k3+"``,
  ``"low_var_kl+"``, ...): the expected *gradient* of ``k1`` and ``k3`` as a
  loss is not that of the KL, while ``k2``'s is, so the ``+`` form gives the
  value of its estimator with the gradient of ``k2`` of the *unclipped*
  log-ratio, :math:`k_2(\delta) - \mathrm{sg}(k_2(\delta)) + \mathrm{sg}(k)`
  (``sg``: ``stop_gradient``; :math:`k` after ``clip`` and verl's clamps),
  exactly as verl computes it: NaN where :math:`\delta` is infinite.
  ``"k2+"`` and ``"mse+"`` equal ``k2`` except with ``clip`` (their gradient
  then ignores it).

  Importance correction (DeepSeek-V3.2; TRL's ``use_bias_correction_kl``):
  when the tokens were sampled from an older policy :math:`\pi_{\text{old}}`
  (``old_log_probs``), the estimate is weighted by the importance ratio,

  .. math::

     w\,k, \qquad w = \exp\big(\mathrm{clip}(\log \pi(a) - \log \pi_{\text{old}}(a))\big),

  which makes its expectation under :math:`\pi_{\text{old}}` the KL under
  :math:`\pi`. The weight carries gradient (as TRL's ``coef_1``). Both
  log-ratios are clipped *before* any ``exp`` (``clip`` for :math:`\delta`,
  ``importance_clip`` for :math:`w`'s), so that with both bounds finite no
  estimate overflows to ``inf`` for finite inputs (trl#3015, OpenRLHF#1335).

  Args:
    log_probs: the policy's log-probabilities of the sampled tokens, e.g.
      ``[batch, seq]``.
    ref_log_probs: the reference policy's, broadcastable.
    estimator: Schulman's ``"k1"``, ``"k2"``, ``"k3"``, verl's ``"kl"``,
      ``"abs"``, ``"mse"``, ``"low_var_kl"``, or any of them with ``+`` (the
      straight-through form).
    clip: bounds the log-ratio :math:`\delta` before the estimator: a number
      ``c`` for ``[-c, c]`` or a pair ``(low, high)``; the gradient is 0
      outside the bounds (as ``torch.clamp``'s, it passes at a bound), except
      in the ``+`` forms. ``low <= high`` (``c >= 0``) is checked when the
      bounds are Python numbers; traced bounds that break it (or are NaN)
      make every estimate NaN.
    old_log_probs: the sampling policy's log-probabilities of the tokens,
      broadcastable: weights the estimate by :math:`\pi / \pi_{\text{old}}`.
    importance_clip: bounds :math:`\log \pi - \log \pi_{\text{old}}`
      before its ``exp``, as ``clip`` does (e.g. ``(-20, 20)`` as verl clamps;
      a tighter ``(log 0.8, log 1.2)`` is a PPO-style trust region).
    where: a boolean token mask, broadcastable to the inputs; masked tokens
      give 0 and zero gradients, whatever their values (``-inf`` padding
      included).

  Returns:
    The per-token estimates, of the broadcast shape and the promoted input
    dtype (computed in at least float32).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kldiv_jax import kl_estimate
    >>> logp = jnp.log(jnp.array([0.5, 0.2, 0.9]))
    >>> ref = jnp.log(jnp.array([0.25, 0.4, 0.9]))
    >>> kl_estimate(logp, ref)
    Array([0.1931..., 0.3068..., 0. ], dtype=float32)
    >>> kl_estimate(logp, ref, estimator="k1", clip=0.5)
    Array([ 0.5, -0.5,  0. ], dtype=float32)
    >>> jax.grad(lambda x: kl_estimate(x, ref, estimator="k3+").sum())(logp)  # k2's: delta
    Array([ 0.6931..., -0.6931...,  0. ], dtype=float32)
    >>> far = jnp.array([-20.0, 15.0])  # log-ratios beyond verl's clamp of the estimate
    >>> kl_estimate(far, 0.0, estimator="k3"), kl_estimate(far, 0.0, estimator="low_var_kl")
    (Array([4.8516515e+08, 1.4000000e+01], dtype=float32), Array([10., 10.], dtype=float32))
    >>> old = jnp.log(jnp.array([0.25, 0.2, 0.9]))
    >>> kl_estimate(logp, ref, old_log_probs=old, importance_clip=20.0)  # k3 * (2, 1, 1)
    Array([0.3862..., 0.3068..., 0. ], dtype=float32)
  """
  name = "kl_estimate"
  check_choice(name, "estimator", estimator, ESTIMATORS)
  bounds = clip_bounds(name, clip)
  weight_bounds = clip_bounds(name, importance_clip, "importance_clip")
  arrays = (log_probs, ref_log_probs) + (() if old_log_probs is None else (old_log_probs,))
  names = ("log_probs", "ref_log_probs", "old_log_probs")[: len(arrays)]
  promoted, out_dtype = promote_and_broadcast(name, names, *arrays)
  logp, ref = promoted[0], promoted[1]
  old = promoted[2] if old_log_probs is not None else None
  # No axis is reduced, so a mask is an element mask (None without ``where``).
  mask, _ = split_where(name, where, logp.shape, ())
  if mask is not None:
    logp = jnp.where(mask, logp, 0.0)
    ref = jnp.where(mask, ref, 0.0)
    old = None if old is None else jnp.where(mask, old, 0.0)
  raw = logp - ref
  delta = raw
  if bounds is not None:
    low, high = (jnp.asarray(b, delta.dtype) for b in bounds)  # a traced bound: any dtype
    delta = clamp(delta, low, high)
  out = _estimate(delta, estimator.rstrip("+"))
  if estimator.endswith("+"):
    # Straight through (verl's kl_penalty): the value of the estimate, the gradient of
    # k2 of the unclipped log-ratio. As verl's, NaN where that log-ratio is infinite.
    k2 = _estimate(raw, "k2")
    out = k2 - lax.stop_gradient(k2) + lax.stop_gradient(out)
  if old is not None:
    log_w = logp - old
    if weight_bounds is not None:
      low, high = (jnp.asarray(b, log_w.dtype) for b in weight_bounds)
      log_w = clamp(log_w, low, high)
    out = jnp.exp(log_w) * out
  if mask is not None:
    out = jnp.where(mask, out, 0.0)
  valid = () if bounds is None else (bounds[0] <= bounds[1],)
  if weight_bounds is not None:
    valid = (*valid, weight_bounds[0] <= weight_bounds[1])
  return nan_unless(out.astype(out_dtype), *valid)


def token_log_probs(
  logits: jax.typing.ArrayLike,
  token_ids: jax.typing.ArrayLike,
  *,
  temperature: float | jax.typing.ArrayLike = 1.0,
  softcap: float | None = None,
  where: jax.typing.ArrayLike | None = None,
  ignore_index: int | None = None,
  return_entropy: bool = False,
  axis_name: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  r"""Each sampled token's log-probability under ``softmax(logits / T)``, and the entropy.

  With :math:`u = \mathrm{softcap}(z) / T` and :math:`p = \mathrm{softmax}(u)`
  per token:

  .. math::

     \log p_y = u_y - \log \sum_v e^{u_v}, \qquad H = -\sum_v p_v \log p_v ,

  the quantities PPO/GRPO need for the policy's and the reference model's
  sampled tokens (with :func:`kl_estimate`), from one pass over the
  vocabulary and a derivative rule that recomputes the softmax instead of
  storing it: no ``log_softmax`` array is written, forward or backward.
  Without ``return_entropy`` (float32/64 logits, no ``softcap`` nor
  ``axis_name``) the rule reuses the forward's ``exp(u - max)``, which XLA
  writes where the gradient goes: as fast as Tunix's ``take_along_axis`` −
  ``logsumexp`` with autodiff, with no temporary of the vocabulary's size when
  the gradient wrt the logits is taken (``benchmarks/bench_rl.py``).
  Values and gradients equal ``jnp.take_along_axis(jax.nn.log_softmax(u),
  y)`` and the entropy of ``p``; the entropy is never below 0 and exactly 0
  for a one-hot distribution (one finite logit, or one far above the rest).

  Args:
    logits: ``[..., vocab]`` (bf16/f16 are computed in float32).
    token_ids: integer ids ``[...]`` (the logits' shape without the class
      axis). An id outside ``[0, vocab)`` (never wrapped or clamped) raises
      ``ValueError`` when the ids are known (an eager call), gives NaN under
      ``jit``; an id whose logit is ``-inf`` gives ``-inf``.
    temperature: positive softmax temperature (a traced scalar is allowed and
      differentiable; NaN unless positive and finite).
    softcap: soft-cap the logits before the temperature,
      ``softcap * tanh(z / softcap)`` (``None``: none, at no cost).
    where: a per-token mask ``[...]``: a masked token gives 0 and zero
      gradients, whatever its logits and id hold (padding).
    ignore_index: a token id meaning "no token" (padding such as -100): such
      tokens give 0 and zero gradients, like masked ones.
    return_entropy: also return the entropy per token.
    axis_name: the mesh axis over which the vocabulary is split inside
      ``jax.shard_map`` (vocabulary parallelism): each device passes its
      slice of the logits, ``token_ids`` whole; the token's logit comes from
      the device that holds it and the statistics are combined with
      ``lax.pmax``/``lax.psum``. The result is replicated over the axis.

  Returns:
    The log-probabilities ``[...]`` in the logits' dtype; with
    ``return_entropy``, ``(log_probs, entropy)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kldiv_jax import token_log_probs
    >>> logits = jnp.array([[2.0, 1.0, 0.0], [0.0, 0.0, -jnp.inf]])
    >>> token_log_probs(logits, jnp.array([0, 1]))
    Array([-0.4076..., -0.6931...], dtype=float32)
    >>> token_log_probs(logits, jnp.array([0, 1]), temperature=2.0, return_entropy=True)
    (Array([-0.6802..., -0.6931...], dtype=float32), Array([1.0201..., 0.6931...], dtype=float32))
  """
  name = "token_log_probs"
  out_dtype = check_float(name, ("logits",), logits)
  z = jnp.asarray(logits)
  if z.ndim == 0:
    raise ValueError(f"{name}: logits must have a class axis, shape [..., vocab]; got a scalar.")
  temperature, _ = check_temperature(name, temperature)
  cap = check_softcap(name, "softcap", softcap)
  return_entropy = check_bool(name, "return_entropy", return_entropy)
  if axis_name is not None:
    check_axis_name(name, axis_name)
  token_shape = z.shape[:-1]
  mask, in_range, safe = token_layout(
    name,
    token_ids,
    token_shape,
    "the logits' shape without the class axis,",
    where,
    ignore_index,
    global_classes(z.shape[-1], axis_name),
  )
  z = z.reshape(safe.shape[0], z.shape[-1])
  t = jnp.asarray(temperature).astype(compute_dtype(out_dtype))
  if z.size == 0:  # no tokens, or no classes: every counted id is out of range (NaN)
    log_p = entropy = jnp.zeros(z.shape[0], t.dtype)
  else:
    if mask is not None:
      z = jnp.where(mask, z, 0.0)  # selected away: NaN in a masked token cannot leak
    if return_entropy or axis_name is not None or cap is not None or z.dtype != t.dtype:
      log_p, entropy = token_rows(z, safe, t, (), axis_name, cap)
    else:  # float32/64 log-probabilities alone: one exp per class (see token_log_prob_rows)
      log_p = entropy = token_log_prob_rows(z, safe, t)
  return token_outputs(
    log_p, entropy, in_range, mask, token_shape, out_dtype, temperature, return_entropy
  )


def _token_arrays(name, names, arrays, where):
  """The arrays promoted and broadcast, and ``where`` as an element mask (or ``None``)."""
  out, out_dtype = promote_and_broadcast(name, names, *arrays)
  mask, _ = split_where(name, where, out[0].shape, ())
  if mask is not None:
    out = [jnp.where(mask, a, 0.0) for a in out]
  return out, mask, out_dtype


def distillation_advantages(
  student_log_probs: jax.typing.ArrayLike,
  teacher_log_probs: jax.typing.ArrayLike,
  *,
  sampling_log_probs: jax.typing.ArrayLike | None = None,
  importance_cap: float | None = None,
  where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
  r"""Per-token advantages of on-policy distillation: the negative reverse-KL estimate.

  For tokens :math:`a` sampled from the student, the per-token advantage is

  .. math::

     A = -\big(\log \pi_{\text{student}}(a) - \log \pi_{\text{teacher}}(a)\big),

  the negative of the single-sample (k1) estimate of
  :math:`\mathrm{KL}(\pi_{\text{student}} \,\|\, \pi_{\text{teacher}})`: a policy
  gradient with this advantage minimises the reverse KL to the teacher
  (Thinking Machines' on-policy distillation; TRL's distillation trainer).
  When the tokens were sampled by another policy (a stale copy, an inference
  engine's numerics), ``sampling_log_probs`` weights each advantage by the
  truncated importance ratio :math:`\min(\pi_{\text{student}}(a) /
  \pi_{\text{sampling}}(a), C)` (TRL's ``vllm_importance_sampling_cap``,
  ``importance_cap`` = :math:`C`; the log-ratio is clipped at :math:`\log C`
  before the ``exp``). Advantages carry no gradient (``stop_gradient``), as a
  policy gradient needs.

  Args:
    student_log_probs: the student's log-probabilities of the sampled tokens
      (e.g. from :func:`token_log_probs`), ``[batch, seq]``.
    teacher_log_probs: the teacher's, broadcastable.
    sampling_log_probs: the sampling policy's, broadcastable; ``None``: the
      student sampled them (no weight).
    importance_cap: the truncation :math:`C > 0` of the importance ratio
      (``None``: not truncated; then the log-ratio is only clipped at 80 so
      the weight stays finite in float32).
    where: a token mask: masked tokens get 0.

  Returns:
    The advantages, of the broadcast shape and promoted dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import distillation_advantages
    >>> student = jnp.log(jnp.array([0.5, 0.2, 0.9]))
    >>> teacher = jnp.log(jnp.array([0.25, 0.4, 0.9]))
    >>> distillation_advantages(student, teacher)
    Array([-0.6931...,  0.6931...,  0. ], dtype=float32)
    >>> sampling = jnp.log(jnp.array([0.25, 0.4, 0.9]))
    >>> distillation_advantages(student, teacher, sampling_log_probs=sampling, importance_cap=1.5)
    Array([-1.0397...,  0.3465...,  0. ], dtype=float32)
  """
  name = "distillation_advantages"
  arrays = (student_log_probs, teacher_log_probs)
  names = ("student_log_probs", "teacher_log_probs")
  if sampling_log_probs is not None:
    arrays, names = (*arrays, sampling_log_probs), (*names, "sampling_log_probs")
  if importance_cap is not None:
    cap, static = real_scalar(name, "importance_cap", importance_cap)
    if static and not (np.isfinite(cap) and cap > 0):
      raise ValueError(f"{name}: importance_cap must be positive and finite; got {cap!r}.")
  out, mask, out_dtype = _token_arrays(name, names, arrays, where)
  advantage = out[1] - out[0]
  valid = ()
  if sampling_log_probs is not None:
    high = 80.0 if importance_cap is None else jnp.log(jnp.asarray(importance_cap, out[0].dtype))
    advantage = jnp.exp(jnp.minimum(out[0] - out[2], high)) * advantage
    if importance_cap is not None and not isinstance(importance_cap, (int, float)):
      valid = (positive_finite(jnp.asarray(importance_cap)),)
  if mask is not None:
    advantage = jnp.where(mask, advantage, 0.0)
  return nan_unless(lax.stop_gradient(advantage).astype(out_dtype), *valid)


def sequence_sum(
  values: jax.typing.ArrayLike, *, where: jax.typing.ArrayLike | None = None
) -> jax.Array:
  """The sum over each sequence's valid tokens (the last axis), ``[batch, seq] -> [batch]``.

  Masked tokens are selected away (a NaN or ``-inf`` there cannot leak).

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import sequence_sum
    >>> sequence_sum(jnp.array([[1.0, 2.0, 9.0]]), where=jnp.array([[True, True, False]]))
    Array([3.], dtype=float32)
  """
  (x,), _, out_dtype = _token_arrays("sequence_sum", ("values",), (values,), where)
  return jnp.sum(x, axis=-1).astype(out_dtype)


def sequence_mean(
  values: jax.typing.ArrayLike, *, where: jax.typing.ArrayLike | None = None
) -> jax.Array:
  """The mean over each sequence's valid tokens (the last axis), ``[batch, seq] -> [batch]``;
  0 for a sequence without valid tokens (GRPO's per-sequence average).

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import sequence_mean
    >>> sequence_mean(jnp.array([[1.0, 2.0, 9.0]]), where=jnp.array([[True, True, False]]))
    Array([1.5], dtype=float32)
  """
  (x,), mask, out_dtype = _token_arrays("sequence_mean", ("values",), (values,), where)
  count = x.shape[-1] if mask is None else jnp.sum(mask, axis=-1)
  return (jnp.sum(x, axis=-1) / jnp.maximum(count, 1)).astype(out_dtype)
