"""Divergences against a teacher stored as its top-k tokens (offline distillation).

Distillation datasets store, per token, the teacher's ``k`` most likely token
ids and their log-probabilities instead of a full-vocabulary row. The student
still normalises over its full vocabulary, but only through a log-sum-exp
(a reduction) and a gather of ``k`` logits: no ``[..., vocab]``
log-probabilities are written, and the log-sum-exp's ``custom_jvp``
recomputes the softmax in its tangent, so reverse mode saves no
``[..., vocab]`` residual either. The kernels are the engine's top-k path
(:mod:`kldiv_jax._sparse`); this module validates and lays out.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kldiv_jax._checks import (
  check_choice,
  check_float,
  check_ids,
  check_softcap,
  check_temperature,
  compute_dtype,
  ids_in_range,
  index_array,
  mask_array,
  teacher_classes,
)
from kldiv_jax._divergence_spec import Divergence, as_divergence
from kldiv_jax._numerics import nan_unless, positive_finite
from kldiv_jax._rows import shared_classes
from kldiv_jax._sparse import first_occurrences, topk_rows
from kldiv_jax._vocab_parallel import VOCAB_PARALLEL_PADDING, check_axis_name, global_classes

TAILS = ("renormalize", "bucket")


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


# Where a top-k id counts, and how to pad (in the id errors).
TOPK_PADDING = (
  " (only where the teacher has mass: pad with any id and a -inf log-probability, "
  "or mask the slot with where)"
)


class TopkArgs(NamedTuple):
  """A top-k teacher's arguments, checked (:func:`check_topk_teacher`)."""

  indices: jax.Array  # integer ``[..., k]``
  log_probs: jax.Array  # ``[..., k]``, as given
  bucket: bool  # tail="bucket"
  teacher_vocab: int  # the teacher's (global) vocabulary size
  example: jax.Array | None  # ``where`` as a mask of the tokens ``token_shape``, or None
  slot: jax.Array | None  # ``where`` as a mask of the slots ``token_shape + (k,)``, or None


def check_topk_teacher(
  name, indices, log_probs, tail, where, token_shape, shape_text, vocab, teacher_vocab_size,
  axis_name,
) -> TopkArgs:  # fmt: skip
  """The one parse of a top-k teacher, for :func:`divergence_from_topk` (logits) and
  :func:`kldiv_jax.fused_topk_distillation_loss` (hidden states), errors naming ``name``.

  ``indices`` an integer array ``token_shape + (k,)`` (``shape_text`` names that shape) with
  ``k >= 1``, ``log_probs`` the same shape (its float dtype is the caller's to check, with the
  student's); ``tail`` one of :data:`TAILS`; ``teacher_vocab_size`` by the vocabulary rule
  (:func:`kldiv_jax._checks.teacher_classes`, ``vocab`` the student's global size); ``where``
  a mask of the tokens or of the slots; known ids with mass that ``where`` counts in range
  (:func:`kldiv_jax._checks.check_ids`).
  """
  idx = index_array(name, "topk_indices", indices, "token ids")
  lp = jnp.asarray(log_probs)
  if idx.shape != lp.shape:
    raise ValueError(
      f"{name}: topk_indices and topk_log_probs must have the same shape [..., k]; "
      f"got {idx.shape} and {lp.shape}."
    )
  if idx.ndim != len(token_shape) + 1 or idx.shape[:-1] != tuple(token_shape):
    raise ValueError(
      f"{name}: topk_indices must have shape {shape_text} + (k,) = {tuple(token_shape)} + (k,); "
      f"got {idx.shape}."
    )
  if idx.shape[-1] < 1:
    raise ValueError(f"{name}: the number of top-k entries must be at least 1; got k = 0.")
  check_choice(name, "tail", tail, TAILS)
  example, slot = _split_mask(name, where, tuple(token_shape), idx.shape)
  sharded = None if axis_name is None else VOCAB_PARALLEL_PADDING
  teacher_vocab = teacher_classes(name, teacher_vocab_size, vocab, sharded=sharded)
  check_ids(
    name,
    "topk_indices",
    idx,
    teacher_vocab,
    slot,
    example,
    what="token ids",
    log_probs=lp,
    fix=TOPK_PADDING,
  )
  return TopkArgs(idx, lp, tail == "bucket", teacher_vocab, example, slot)


class TopK(NamedTuple):
  """A top-k teacher laid out as rows: ``ids`` int32 ``[rows, k]`` (0 where unused), ``lp``
  in the compute dtype, ``keep`` the distinct slots with mass, ``dropped`` the slots whose ids
  only the teacher has, ``bad`` the rows with an id out of range (``[rows]``)."""

  ids: jax.Array
  lp: jax.Array
  keep: jax.Array
  dropped: jax.Array
  bad: jax.Array


def topk_teacher(idx, lp, slot, student_classes: int, teacher_classes: int) -> TopK:
  """Lays out a top-k teacher ``[rows, k]`` for :func:`kldiv_jax._sparse.topk_rows`.

  ``student_classes`` is the student's (global) vocabulary size,
  ``teacher_classes`` the teacher's; ids in ``[student, teacher)`` are the
  teacher's own classes, dropped.
  """
  keep = lp != -jnp.inf
  if slot is not None:
    keep = keep & slot
  in_range = ids_in_range(idx, teacher_classes)
  bad = jnp.any(keep & ~in_range, axis=-1)
  ids = jnp.where(keep & in_range, idx, 0).astype(jnp.int32)
  keep = first_occurrences(ids, keep & in_range)
  dropped = keep & (ids >= student_classes)
  keep = keep & ~dropped
  return TopK(jnp.where(keep, ids, 0), lp, keep, dropped, bad)


def topk_per_example(
  name: str,
  spec: Divergence,
  logits: jax.typing.ArrayLike,
  topk_indices: jax.typing.ArrayLike,
  topk_log_probs: jax.typing.ArrayLike,
  temperature: float | jax.typing.ArrayLike,
  where: jax.typing.ArrayLike | None,
  tail: str,
  softcap: float | None,
  teacher_vocab_size: int | None,
  axis_name: str | None,
) -> jax.Array:
  """The body of the top-k losses: validate, lay out as rows, run the top-k path, reduce."""
  out_dtype = check_float(name, ("logits", "topk_log_probs"), logits, topk_log_probs)
  z = jnp.asarray(logits)
  if z.ndim == 0:
    raise ValueError(f"{name}: logits must have a class axis, shape [..., vocab]; got a scalar.")
  temperature, _ = check_temperature(name, temperature)
  cap = check_softcap(name, "softcap", softcap)
  if axis_name is not None:
    check_axis_name(name, axis_name)
  vocab = global_classes(z.shape[-1], axis_name)
  teacher = check_topk_teacher(
    name, topk_indices, topk_log_probs, tail, where, z.shape[:-1], "logits.shape[:-1]", vocab,
    teacher_vocab_size, axis_name,
  )  # fmt: skip
  idx, lp, teacher_vocab = teacher.indices, teacher.log_probs, teacher.teacher_vocab
  example, slot = teacher.example, teacher.slot
  if math.prod(z.shape[:-1]) == 0 or min(z.shape[-1], teacher_vocab) == 0:
    out = jnp.zeros(z.shape[:-1], out_dtype)
    return nan_unless(out, positive_finite(temperature), *spec.valid())
  # An invalid traced temperature is NaN inside the kernel too: the gradients are NaN, where
  # the student's 1/T at T = +-inf would make them 0.
  t = nan_unless(jnp.asarray(temperature, compute_dtype(out_dtype)), positive_finite(temperature))
  out = _topk_kernel(
    spec,
    z,
    idx,
    lp,
    t,
    slot,
    example,
    vocab=vocab,
    teacher_vocab=teacher_vocab,
    tail_bucket=teacher.bucket,
    cap=cap,
    axis_name=axis_name,
    out_dtype=jnp.dtype(out_dtype),
  )
  return nan_unless(out, positive_finite(temperature), *spec.valid())


@functools.partial(
  jax.jit,
  static_argnames=("vocab", "teacher_vocab", "tail_bucket", "cap", "axis_name", "out_dtype"),
)
def _topk_kernel(
  spec,
  z,
  idx,
  lp,
  t,
  slot,
  example,
  *,
  vocab,
  teacher_vocab,
  tail_bucket,
  cap,
  axis_name,
  out_dtype,
):
  """Layout → the top-k path → per example, as one program (an eager call compiles it
  once, not op by op). Checked arguments; ``t`` the temperature in the compute dtype."""
  if teacher_vocab < vocab:  # the student's own classes carry no mass: cut them
    z = shared_classes(z, teacher_vocab)
  batch_shape = z.shape[:-1]
  rows = math.prod(batch_shape)
  k = idx.shape[-1]
  z = z.reshape(rows, z.shape[-1])
  lp = lp.astype(t.dtype).reshape(rows, k)
  idx = idx.reshape(rows, k)
  slot = None if slot is None else slot.reshape(rows, k)
  if example is not None:
    # Selected away (never multiplied), so NaN/inf in a masked row cannot leak.
    ex = example.reshape(rows, 1)
    z = jnp.where(ex, z, 0.0)
    lp = jnp.where(ex, lp, 0.0)
    slot = ex if slot is None else slot & ex
  teacher = topk_teacher(idx, lp, slot, min(vocab, teacher_vocab), teacher_vocab)
  per_row = topk_rows(
    z, teacher.ids, teacher.lp, teacher.keep, teacher.dropped, t, spec, tail_bucket, cap, axis_name
  )
  per_row = nan_unless(per_row, ~teacher.bad)
  if example is not None:
    per_row = jnp.where(example.reshape(rows), per_row, 0.0)
  return per_row.reshape(batch_shape).astype(out_dtype)


def divergence_from_topk(
  logits: jax.typing.ArrayLike,
  topk_indices: jax.typing.ArrayLike,
  topk_log_probs: jax.typing.ArrayLike,
  *,
  divergence: str | Divergence = "forward_kl",
  temperature: float | jax.typing.ArrayLike = 1.0,
  tail: str = "renormalize",
  where: jax.typing.ArrayLike | None = None,
  softcap: float | None = None,
  teacher_vocab_size: int | None = None,
  axis_name: str | None = None,
) -> jax.Array:
  r"""Per-example divergence between a top-k teacher and the student's full softmax.

  The teacher is given by its top-k token ids :math:`i_j` and
  log-probabilities :math:`l_j` (over its whole vocabulary, as distillation
  pipelines and inference servers store them); the student by its logits
  :math:`z` over its whole vocabulary. Both become distributions on
  :math:`k + 1` classes, the top-k tokens and a *tail* holding the rest:

  .. math::

     \log q_j = \frac{z_{i_j}}{T} - \log \sum_{v=1}^{V} e^{z_v / T}, \qquad
     q_{\text{tail}} = 1 - \sum_j q_j,

  and for the teacher, with ``tail="renormalize"`` (the default),
  :math:`p_j = e^{l_j/T} / \sum_{j'} e^{l_{j'}/T}` (the teacher's softmax at
  temperature :math:`T`, restricted to its top-k and renormalised: exact,
  since :math:`l_j = s_j - \log\sum e^{s}`) and :math:`p_{\text{tail}} = 0`;
  with ``tail="bucket"`` (TRL's ``add_tail_bucket``, verl's
  ``forward_kl_topk_tail``), :math:`p_j = e^{l_j}` and
  :math:`p_{\text{tail}} = 1 - \sum_j p_j`, the teacher's own remaining mass.
  The result is :math:`D(p, q)` over those classes, for any divergence of
  :func:`divergence_from_logits`.

  Which tail: with ``"renormalize"`` forward KL is exactly
  :math:`\mathrm{KL}(\hat p \,\|\, q)` over the whole vocabulary (the
  renormalised teacher has no mass elsewhere), as :func:`kl_div_from_topk`
  has always computed; divergences that charge the student for mass where
  the teacher has none (``reverse_kl``, ``symmetric_kl``) are ``+inf`` there
  unless the student puts all its mass on the top-k. ``"bucket"`` keeps the
  teacher's real tail mass, so every divergence is finite and compares the
  total mass outside the top-k too; the teacher's mass outside its top-k is
  unknown at another temperature, so its log-probabilities are taken as
  they are (store them at the distillation temperature, as a server does
  when it samples at :math:`T`) and :math:`T` scales the student only. Stored
  masses that sum above 1 (rounding) are renormalised, with an empty tail.

  Stored top-k lists as they come: a slot whose log-probability is ``-inf``
  has no mass whatever its id (padding); a repeated id is the same token
  and only its first slot counts (lists padded by repetition); ``where``
  masks slots or whole examples. An id with mass outside ``[0,
  teacher_vocab_size)`` raises ``ValueError`` when the values are known
  (outside ``jit``), and makes its example NaN under ``jit`` (values cannot
  be checked there); ids are never wrapped or clamped. A student row of
  only ``-inf`` logits is the zero measure. The student's full log-sum-exp
  never materialises a ``[..., vocab]`` temporary beyond the gradient itself,
  in ``value_and_grad`` too.

  Vocabularies of different sizes (``teacher_vocab_size``): the shared
  classes are the first ``min(V, teacher_vocab_size)`` ids, as in
  :func:`divergence_from_logits`; a top-k id only the teacher has carries no
  mass (its slot leaves the teacher, which is renormalised over the shared
  classes), and the student's classes the teacher lacks are cut.

  Gradients wrt the logits (the softmax recomputed, not stored), the
  teacher's log-probabilities, a traced temperature and traced divergence
  parameters; ``jvp`` and ``jax.hessian`` wrt the logits where the
  divergence is smooth. Identical distributions give exactly 0; the value is
  never below 0.

  Args:
    logits: student logits ``[..., vocab]`` (bf16/f16 are computed in
      float32).
    topk_indices: integer teacher token ids ``[..., k]``, same leading shape.
    topk_log_probs: the teacher's log-probabilities at those ids ``[..., k]``.
    divergence: a name or a :class:`Divergence`, as in
      :func:`divergence_from_logits`.
    temperature: positive softmax temperature ``T`` (a traced scalar is
      allowed: NaN unless positive and finite). No ``T**2`` factor.
    tail: ``"renormalize"`` or ``"bucket"``, see above.
    where: optional boolean per-example ``[...]`` (a masked example gives 0
      with zero gradients, whatever its inputs hold) or per-slot ``[..., k]``
      mask (masked slots leave the teacher's support).
    softcap: soft-cap the student's logits before the temperature,
      ``softcap * tanh(z / softcap)`` (``None``: none, at no cost). The
      teacher's log-probabilities are stored after its own.
    teacher_vocab_size: the teacher's vocabulary size when it differs from
      the student's (``None``: the same).
    axis_name: the mesh axis over which the student's vocabulary is split
      inside ``jax.shard_map`` (vocabulary parallelism): each device passes
      its slice of ``logits``, the top-k arrays whole; each id's logit comes
      from the device that holds it and the log-sum-exp is combined with
      ``lax.pmax``/``lax.psum`` (per-row scalars only). The result is
      replicated over the axis.

  Returns:
    The divergence per example, ``logits.shape[:-1]``, in the promoted dtype
    of ``logits`` and ``topk_log_probs``.

  Raises:
    TypeError: non-floating logits or log-probabilities, non-integer ids, a
      non-boolean ``where``.
    ValueError: mismatched shapes, an unknown ``tail``, an invalid static
      temperature, soft-cap or ``where`` shape, an id out of range (values
      known).

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import divergence_from_topk
    >>> logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    >>> ids = jnp.array([[0, 2]])
    >>> lp = jnp.log(jnp.array([[0.6, 0.2]]))
    >>> divergence_from_topk(logits, ids, lp)  # renormalised: [0.75, 0.25]
    Array([0.3778...], dtype=float32)
    >>> divergence_from_topk(logits, ids, lp, tail="bucket")  # [0.6, 0.2] and a tail of 0.2
    Array([0.0645...], dtype=float32)
    >>> divergence_from_topk(logits, ids, lp, divergence="jsd", tail="bucket")
    Array([0.0143...], dtype=float32)
  """
  name = "divergence_from_topk"
  spec = as_divergence(name, divergence)
  return topk_per_example(
    name,
    spec,
    logits,
    topk_indices,
    topk_log_probs,
    temperature,
    where,
    tail,
    softcap,
    teacher_vocab_size,
    axis_name,
  )


def kl_div_from_topk(
  logits: jax.typing.ArrayLike,
  topk_indices: jax.typing.ArrayLike,
  topk_log_probs: jax.typing.ArrayLike,
  *,
  temperature: float | jax.typing.ArrayLike = 1.0,
  where: jax.typing.ArrayLike | None = None,
  tail: str = "renormalize",
  softcap: float | None = None,
  teacher_vocab_size: int | None = None,
  axis_name: str | None = None,
) -> jax.Array:
  r"""Per-example forward KL from a top-k teacher to the student's full softmax.

  :func:`divergence_from_topk` with ``divergence="forward_kl"``. With the
  default ``tail="renormalize"``, the teacher is *renormalised over its
  top-k support* at temperature ``T``; the student is the full-vocabulary
  softmax:

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
  With ``tail="bucket"`` the teacher keeps its remaining mass ``1 - sum_j
  exp(l_j)`` as one more class, against the student's mass outside the top-k
  (see :func:`divergence_from_topk`).

  Gradient wrt the logits: ``(q - scatter(p)) / T`` per example for the
  renormalised form (``q`` over the full vocabulary, ``p`` scattered onto the
  top-k ids); the softmax ``q`` is recomputed in the backward pass rather
  than stored. Forward mode and second derivatives work (``jax.hessian`` wrt
  the logits). The teacher's log-probabilities and a traced temperature are
  differentiable too.

  Masks, padding (``-inf`` log-probabilities, repeated ids: the first slot
  counts), ids out of range (``ValueError`` outside ``jit``, NaN inside),
  ``softcap``, ``teacher_vocab_size`` and ``axis_name`` as in
  :func:`divergence_from_topk`. A top-k id whose student logit is ``-inf``
  gives ``+inf`` (the true value), as does a student row of only ``-inf``
  logits. The value is never below 0; NaN in the logits or log-probabilities
  propagates.

  Args:
    logits: student logits ``[..., vocab]`` (bf16/f16 are computed in float32).
    topk_indices: integer teacher token ids ``[..., k]``, same leading shape.
    topk_log_probs: the teacher's log-probabilities at those ids ``[..., k]``.
    temperature: positive softmax temperature ``T``, for the teacher and the
      student alike; a Python number is checked at trace time, a traced
      scalar is allowed (schedules) and differentiable (NaN unless positive
      and finite). No ``T**2`` factor is applied.
    where: optional boolean per-example ``[...]`` or per-slot ``[..., k]`` mask.
    tail: ``"renormalize"`` (default) or ``"bucket"``.
    softcap: the student's logit soft-cap, as in :func:`divergence_from_topk`.
    teacher_vocab_size: the teacher's vocabulary size when it differs.
    axis_name: vocabulary parallelism, as in :func:`divergence_from_topk`.

  Returns:
    The KL per example, shape ``logits.shape[:-1]``, in the promoted dtype of
    ``logits`` and ``topk_log_probs``.

  Raises:
    TypeError: non-floating logits or log-probabilities, non-integer indices,
      a non-boolean ``where``.
    ValueError: mismatched shapes, a non-positive or non-scalar static
      temperature, a ``where`` of an incompatible shape, an id out of range
      (values known).

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
  return topk_per_example(
    name,
    Divergence("forward_kl"),
    logits,
    topk_indices,
    topk_log_probs,
    temperature,
    where,
    tail,
    softcap,
    teacher_vocab_size,
    axis_name,
  )
