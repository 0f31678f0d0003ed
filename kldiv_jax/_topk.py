"""KL divergence against a teacher stored as its top-k tokens (offline distillation).

Distillation datasets store, per token, the teacher's ``k`` most likely token
ids and their log-probabilities instead of a full-vocabulary row. The student
still normalises over its full vocabulary, but only through a log-sum-exp
(a reduction) and a gather of ``k`` logits: no ``[..., vocab]``
log-probabilities are written. The log-sum-exp has a ``custom_jvp`` that
recomputes the softmax in its tangent, so reverse mode saves no
``[..., vocab]`` residual either: for float32 logits on CPU the compiled
``value_and_grad`` writes the gradient and nothing else of that size.
bf16/f16 logits currently cost two float32 ``[..., vocab]`` temporaries on
XLA:CPU (an upcast copy for the reduction and the float32 gradient before its
cast back).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from kldiv_jax._checks import (
  check_float,
  check_temperature,
  compute_dtype,
  ids_in_range,
  index_array,
  mask_array,
)
from kldiv_jax._compat import take_along_last_axis_filled
from kldiv_jax._numerics import (
  divide_logits,
  max_shift,
  nan_unless,
  nonnegative,
  positive_finite,
)
from kldiv_jax._pointwise import kl_log_kernel
from kldiv_jax._rows import normalizer, row_stats


def _divide(z: jax.Array, temperature, is_static: bool) -> jax.Array:
  """``z / T``: a plain division for a static ``T``, else :func:`divide_logits`."""
  if is_static:
    return z / temperature if temperature != 1.0 else z
  return divide_logits(z, temperature)


def _logsumexp(x: jax.Array) -> jax.Array:
  """``log sum exp x`` over the last axis with a ``stop_gradient`` max; ``-inf`` for an all
  ``-inf`` row (:func:`~kldiv_jax._rows.row_stats`, :func:`~kldiv_jax._rows.normalizer`)."""
  m, _, s = row_stats(x)
  has, _, log_s = normalizer(s)
  return jnp.where(has, log_s + m, -jnp.inf)


@jax.custom_jvp
def _full_logsumexp(z: jax.Array, scale: jax.Array) -> jax.Array:
  """``log sum exp(z * scale)`` over the last axis, ``[..., 1]``, in ``scale``'s dtype.

  ``z`` is the raw logits (any float dtype, cast inside every fusion that
  reads it) and ``scale = 1 / T``. The max is taken on the raw logits, so no
  upcast copy is written. The rule recomputes the softmax in the tangent
  instead of saving it: reverse mode writes no ``[..., vocab]`` residual.
  """
  m = jnp.max(z, axis=-1, keepdims=True).astype(scale.dtype) * scale
  m = lax.stop_gradient(max_shift(m))
  return jnp.log(jnp.sum(jnp.exp(z.astype(scale.dtype) * scale - m), axis=-1, keepdims=True)) + m


def _full_logsumexp_jvp(primals, tangents):
  z, scale = primals
  dz, dscale = tangents
  lse = _full_logsumexp(z, scale)
  x = z.astype(scale.dtype) * scale
  # d lse = sum_v softmax_v d(x_v), x = z * scale; 0 * -inf guarded at masked logits.
  q = jnp.exp(x - max_shift(lse))
  tangent = jnp.zeros_like(lse)
  if not isinstance(dz, SymbolicZero):
    tangent = tangent + jnp.sum(q * dz.astype(q.dtype), axis=-1, keepdims=True) * scale
  if not isinstance(dscale, SymbolicZero):
    zq = jnp.where(q > 0, z.astype(q.dtype), 0.0) * q
    tangent = tangent + jnp.sum(zq, axis=-1, keepdims=True) * dscale
  return lse, tangent


_full_logsumexp.defjvp(_full_logsumexp_jvp, symbolic_zeros=True)


def _check_shapes(name, logits, indices, log_probs):
  if logits.ndim == 0:
    raise ValueError(f"{name}: logits must have a class axis, shape [..., vocab]; got a scalar.")
  if indices.shape != log_probs.shape:
    raise ValueError(
      f"{name}: topk_indices and topk_log_probs must have the same shape [..., k]; "
      f"got {indices.shape} and {log_probs.shape}."
    )
  if indices.ndim != logits.ndim or indices.shape[:-1] != logits.shape[:-1]:
    raise ValueError(
      f"{name}: topk_indices must have shape logits.shape[:-1] + (k,) = "
      f"{logits.shape[:-1]} + (k,); got {indices.shape} for logits of shape {logits.shape}."
    )
  k, vocab = indices.shape[-1], logits.shape[-1]
  if not 1 <= k <= vocab:
    raise ValueError(
      f"{name}: the number of top-k entries must be in [1, vocab] = [1, {vocab}]; got k = {k}."
    )


def _split_mask(name, where, batch_shape, slot_shape):
  """``(example_mask, slot_mask)`` from ``where`` (one of them ``None``)."""
  if where is None:
    return None, None
  w = mask_array(name, where)
  target, kind = (slot_shape, "slot") if w.ndim == len(slot_shape) else (batch_shape, "example")
  try:
    ok = jnp.broadcast_shapes(w.shape, target) == tuple(target)
  except ValueError:
    ok = False
  if w.ndim > len(slot_shape) or not ok:
    raise ValueError(
      f"{name}: where has shape {w.shape}; expected a per-example mask broadcastable "
      f"to logits.shape[:-1] = {batch_shape} or a per-slot mask broadcastable to "
      f"topk_indices.shape = {slot_shape}."
    )
  w = jnp.broadcast_to(w, target)
  return (w, None) if kind == "example" else (None, w)


def _repeated_ids(idx: jax.Array, keep: jax.Array) -> jax.Array:
  """Whether an example holds one id at two slots with mass (``keep``), ``[...]``.

  One sort of the ids per example (``[..., k]``, small beside the
  vocabulary), slots with mass first among equal ids: a repeat is then two
  neighbours with mass and the same id.
  """
  if idx.shape[-1] < 2:
    return jnp.zeros(idx.shape[:-1], jnp.bool_)
  ids, no_mass = lax.sort((idx, (~keep).astype(jnp.int8)), dimension=idx.ndim - 1, num_keys=2)
  with_mass = no_mass == 0
  same = (ids[..., 1:] == ids[..., :-1]) & with_mass[..., 1:] & with_mass[..., :-1]
  return jnp.any(same, axis=-1)


def kl_div_from_topk(
  logits: jax.typing.ArrayLike,
  topk_indices: jax.typing.ArrayLike,
  topk_log_probs: jax.typing.ArrayLike,
  *,
  temperature: float | jax.typing.ArrayLike = 1.0,
  where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
  r"""Per-example forward KL from a top-k teacher to the student's full softmax.

  The teacher is given by its top-k token ids ``i_j`` and log-probabilities
  ``l_j`` (at temperature 1, over the full vocabulary, as distillation
  pipelines store them). The teacher is *renormalised over its top-k
  support* at temperature ``T``; the student is the full-vocabulary softmax:

  .. math::

     p_j = \frac{e^{l_j / T}}{\sum_{j'} e^{l_{j'} / T}}, \qquad
     \log q_i = \frac{z_i}{T} - \log \sum_{v=1}^{V} e^{z_v / T}, \qquad
     \mathrm{KL} = \sum_{j=1}^{k} p_j \,(\log p_j - \log q_{i_j}).

  Since ``l_j = s_j - log sum_v exp(s_v)`` for the teacher's logits ``s``,
  ``p`` is exactly ``softmax(s / T)`` restricted to the top-k tokens and
  renormalised, and the result is the true KL divergence between that
  truncated teacher and the student: ``>= 0``, and 0 iff the student puts
  all its mass on the top-k tokens in the teacher's proportions. With
  ``k = vocab`` it is the full KL ``KL(softmax(s / T) || softmax(z / T))``.

  Why renormalise: the alternative, ``sum_j exp(l_j) (l_j - log q_{i_j})``
  with the rest of the teacher's mass ignored, is not a divergence (it can
  be negative, and its minimiser over ``q`` is not the teacher), it is not
  defined for ``T != 1`` without choosing a normalisation anyway, and its
  scale depends on how much mass the top-k lists happen to cover. A third
  option, lumping the missing mass into one "rest" class, needs the
  student's tail mass too; the renormalised form is what TRL/Liger-style
  offline top-k distillation uses and is exactly a KL.

  Gradient wrt the logits: ``(q - scatter(p)) / T`` per example (``q``
  over the full vocabulary, ``p`` scattered onto the top-k ids); the softmax
  ``q`` is recomputed in the backward pass rather than stored. Forward mode
  and second derivatives work (``jax.hessian`` wrt the logits). The
  teacher's log-probabilities and a traced temperature are differentiable
  too.

  Masking:

  * ``where`` of the per-example shape ``logits.shape[:-1]`` (or
    broadcastable to it, with fewer dimensions than ``topk_indices``): a
    masked example gives 0 with zero gradients, whatever its logits hold.
  * ``where`` of the rank of ``topk_indices`` (broadcastable to its shape):
    a per-slot mask, e.g. for padded top-k lists. Masked slots leave the
    teacher's support (the rest is renormalised).
  * A slot whose log-probability is ``-inf`` has no mass either (finite
    values and gradients; ``exp(-inf) * -inf`` is guarded). An example
    whose slots are all masked or ``-inf`` gives 0.

  Indices: a masked or ``-inf`` slot may hold any id (padding such as -1 or
  -100 is ignored, values and gradients alike). At a slot with mass, an id
  outside ``[0, vocab)`` (negative ids included: they are *not* wrapped)
  gathers NaN (``jnp``'s ``mode="fill"``), so the example's value is NaN
  rather than silently clamped or wrapped; nor are ids beyond the int32 range
  (``int64``, ``uint32``, NumPy ``int64`` without x64). Ids with mass must be distinct,
  as top-k produces: an example holding one id at two slots with mass gives
  NaN (a repeated id is not a distribution over ids; merge its masses first
  if that is what it means). A top-k id whose student logit is ``-inf``
  gives ``+inf`` (the true value), as does a student row of only ``-inf``
  logits (``KL(p || 0)``, as in :func:`kl_div_from_logits`). The value is
  never below 0; NaN in the logits or log-probabilities propagates, and a
  traced temperature that is not positive and finite gives NaN.

  Args:
    logits: student logits ``[..., vocab]`` (bf16/f16 are computed in float32).
    topk_indices: integer teacher token ids ``[..., k]``, same leading shape.
    topk_log_probs: the teacher's log-probabilities at those ids ``[..., k]``.
    temperature: positive softmax temperature ``T``, for the teacher and the
      student alike; a Python number is checked at trace time, a traced
      scalar is allowed (schedules) and differentiable (NaN unless positive
      and finite). No ``T**2`` factor is applied.
    where: optional boolean per-example ``[...]`` or per-slot ``[..., k]`` mask.

  Returns:
    The KL per example, shape ``logits.shape[:-1]``, in the promoted dtype of
    ``logits`` and ``topk_log_probs``.

  Raises:
    TypeError: non-floating logits or log-probabilities, non-integer indices,
      a non-boolean ``where``.
    ValueError: mismatched shapes, ``k`` not in ``[1, vocab]``, a non-positive
      or non-scalar static temperature, a ``where`` of an incompatible shape.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import kl_div_from_topk
    >>> logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    >>> ids = jnp.array([[0, 2]])
    >>> lp = jnp.log(jnp.array([[0.6, 0.2]]))  # renormalised: [0.75, 0.25]
    >>> kl_div_from_topk(logits, ids, lp)
    Array([0.3778...], dtype=float32)
    >>> kl_div_from_topk(logits, ids, lp, temperature=2.0)
    Array([0.4965...], dtype=float32)
  """
  name = "kl_div_from_topk"
  out_dtype = check_float(name, ("logits", "topk_log_probs"), logits, topk_log_probs)
  z = jnp.asarray(logits)
  lp = jnp.asarray(topk_log_probs)
  idx = index_array(name, "topk_indices", topk_indices, "token ids")
  _check_shapes(name, z, idx, lp)
  temperature, is_static = check_temperature(name, temperature)
  example, slot = _split_mask(name, where, z.shape[:-1], idx.shape)

  cdt = compute_dtype(out_dtype)
  if not is_static:
    temperature = jnp.asarray(temperature).astype(cdt)
  lp = lp.astype(cdt)
  if example is not None:
    # Selected away (never multiplied), so NaN/inf in a masked row cannot leak.
    z = jnp.where(example[..., None], z, 0.0)
    lp = jnp.where(example[..., None], lp, 0.0)

  # Teacher: log-softmax over the slots with mass; -inf elsewhere.
  keep = lp != -jnp.inf
  if slot is not None:
    keep = keep & slot
  if example is not None:
    keep = keep & example[..., None]
  t = jnp.where(keep, _divide(jnp.where(keep, lp, 0.0), temperature, is_static), -jnp.inf)
  lse_t = _logsumexp(t)
  log_p = jnp.where(keep, t - max_shift(lse_t), -jnp.inf)

  # Student: full-vocabulary log-sum-exp, log-probabilities gathered at the ids.
  # Slots without mass gather id 0: their padding ids (-1, -100) would gather
  # a NaN that the selects below hide from the value but not from jax.debug_nans
  # nor from the derivative wrt a traced temperature.
  scale = 1.0 / (jnp.asarray(temperature, cdt) if is_static else temperature)
  lse_s = _full_logsumexp(z, scale)
  if jnp.iinfo(idx.dtype).max > jnp.iinfo(jnp.int32).max:
    # The gather indexes in int32: an id beyond it would wrap onto a valid one.
    idx = jnp.where(ids_in_range(idx, z.shape[-1]), idx.astype(jnp.int32), -1)
  picked = take_along_last_axis_filled(z, jnp.where(keep, idx, 0))
  picked = _divide(picked.astype(cdt), temperature, is_static)
  # An all -inf student row (lse -inf) is the zero measure: log q = -inf, KL = +inf.
  log_q = jnp.where(keep, picked - max_shift(lse_s), 0.0)

  kl = nonnegative(jnp.sum(kl_log_kernel(log_q, log_p), axis=-1))
  kl = nan_unless(kl, ~_repeated_ids(idx, keep))
  if example is not None:
    kl = jnp.where(example, kl, 0.0)
  return nan_unless(kl.astype(out_dtype), positive_finite(temperature))
