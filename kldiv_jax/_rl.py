"""Per-token KL estimators and sampled tokens' log-probabilities for RL (PPO, GRPO)."""

from __future__ import annotations

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
from kldiv_jax._numerics import (
  at_most,
  clamp,
  exp_minus_one_minus,
  nan_unless,
  positive_finite,
)
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
     k_3 = e^{-\delta} - 1 + \delta ,

  and, with ``old_log_probs``, the estimate :math:`k` weighted by
  :math:`w = \exp(\mathrm{clip}(\log \pi(a) - \log \pi_{\text{old}}(a)))`
  (DeepSeek-V3.2; TRL's ``use_bias_correction_kl``). verl's names and
  clamps (``"low_var_kl"`` is verl's ``"k3"``, not this one), the
  straight-through ``+`` forms and the importance weight: :doc:`/rl`.

  Args:
    log_probs: the policy's log-probabilities of the sampled tokens, e.g.
      ``[batch, seq]``.
    ref_log_probs: the reference policy's, broadcastable.
    estimator: ``"k1"``, ``"k2"``, ``"k3"``, verl's ``"kl"``, ``"abs"``,
      ``"mse"``, ``"low_var_kl"``, or any of them with ``+``.
    clip: bounds on :math:`\delta` before the estimator, ``c`` or ``(low, high)``.
    old_log_probs: the sampling policy's, broadcastable (importance weight).
    importance_clip: bounds on :math:`\log w` before its ``exp``, as ``clip``.
    where: a token mask: masked tokens give 0 and zero gradients.

  Returns:
    The per-token estimates, of the broadcast shape and the promoted input dtype.

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

  from one pass over the vocabulary and a derivative rule that recomputes
  the softmax instead of storing it (:doc:`/rl`). Ids: :doc:`/conventions`;
  the shared arguments: :ref:`shared-arguments`.

  Args:
    logits: ``[..., vocab]``.
    token_ids: integer ids ``[...]`` (the logits' shape without the class axis), aligned with
      the logits: for a causal LM's log-probabilities of its own tokens, shifted
      (``token_ids[t]`` is the token after position ``t``: :func:`shift_labels`, or
      ``logits[:, :-1]`` with ``tokens[:, 1:]``).
    temperature: the softmax temperature ``T`` (Python number or traced).
    softcap: the logit soft-cap (``None``: none).
    where: a per-token mask ``[...]``: masked tokens give 0 and zero gradients.
    ignore_index: a token id meaning "no token" (e.g. -100), left out like ``where``.
    return_entropy: also return the entropy per token.
    axis_name: the mesh axis the vocabulary is split over (vocabulary parallelism).

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

  For tokens :math:`a` sampled from the student, with ``sampling_log_probs``
  of the policy that sampled them (:math:`w = 1` without):

  .. math::

     A = -w\,\big(\log \pi_{\text{student}}(a) - \log \pi_{\text{teacher}}(a)\big),
     \qquad w = \min\big(\pi_{\text{student}}(a) / \pi_{\text{sampling}}(a), C\big),

  without gradient (``stop_gradient``). :doc:`/rl` tells the method
  (Thinking Machines; TRL's ``vllm_importance_sampling_cap`` is :math:`C`).

  Args:
    student_log_probs: the student's log-probs of the sampled tokens, ``[batch, seq]``.
    teacher_log_probs: the teacher's, broadcastable.
    sampling_log_probs: the sampling policy's, broadcastable (``None``: no weight).
    importance_cap: :math:`C > 0` (``None``: the log-ratio clipped at 80 only).
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
    advantage = jnp.exp(at_most(high, out[0] - out[2])) * advantage
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
