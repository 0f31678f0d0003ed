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

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kldiv_jax._checks import (
  check_choice,
  check_float,
  check_softcap,
  check_temperature,
  compute_dtype,
  mask_array,
  real_scalar,
)
from kldiv_jax._divergence_spec import Divergence, as_divergence
from kldiv_jax._id_checks import check_ids, ids_in_range, index_array, teacher_classes
from kldiv_jax._numerics import nan_unless, positive_finite
from kldiv_jax._rows import shared_classes
from kldiv_jax._sparse import first_occurrences, topk_rows
from kldiv_jax._vocab_parallel import VOCAB_PARALLEL_PADDING, check_axis_name, global_classes

TAILS = ("renormalize", "bucket")
# The least tail mass of either side with tail="bucket": TRL's (add_tail_bucket clamps the
# top-k's log-mass at -1e-7, trl/experimental/sdpo/loss_utils.py).
TAIL_FLOOR = 1e-7


def check_tail_floor(name: str, value: object) -> float:
  """``tail_floor``: a static real number in ``[0, 1)`` (a numerical guard, fixed at trace
  time like ``softcap``)."""
  floor, static = real_scalar(name, "tail_floor", value)
  if not static:
    raise TypeError(
      f"{name}: tail_floor must be a Python number (a static constant); got a traced array."
    )
  if not 0.0 <= floor < 1.0:
    raise ValueError(f"{name}: tail_floor must be a number in [0, 1); got {value!r}.")
  return float(floor)


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
  floor: float  # the least tail mass with the bucket (0.0: none; renormalised: 0.0)
  teacher_vocab: int  # the teacher's (global) vocabulary size
  example: jax.Array | None  # ``where`` as a mask of the tokens ``token_shape``, or None
  slot: jax.Array | None  # ``where`` as a mask of the slots ``token_shape + (k,)``, or None


def check_topk_teacher(
  name, indices, log_probs, tail, where, token_shape, shape_text, vocab, teacher_vocab_size,
  axis_name, tail_floor=TAIL_FLOOR,
) -> TopkArgs:  # fmt: skip
  """The one parse of a top-k teacher, for :func:`divergence_from_topk` (logits) and
  :func:`kldiv_jax.fused_topk_distillation_loss` (hidden states), errors naming ``name``.

  ``indices`` an integer array ``token_shape + (k,)`` (``shape_text`` names that shape) with
  ``k >= 1``, ``log_probs`` the same shape (its float dtype is the caller's to check, with the
  student's); ``tail`` one of :data:`TAILS`, ``tail_floor`` by :func:`check_tail_floor`;
  ``teacher_vocab_size`` by the vocabulary rule
  (:func:`kldiv_jax._id_checks.teacher_classes`, ``vocab`` the student's global size); ``where``
  a mask of the tokens or of the slots; known ids with mass that ``where`` counts in range
  (:func:`kldiv_jax._id_checks.check_ids`); ``1 <= k <=`` the teacher's vocabulary, and a
  student vocabulary of at least 1 class (trace-time errors).
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
  floor = check_tail_floor(name, tail_floor)
  example, slot = _split_mask(name, where, tuple(token_shape), idx.shape)
  sharded = None if axis_name is None else VOCAB_PARALLEL_PADDING
  teacher_vocab = teacher_classes(name, teacher_vocab_size, vocab, sharded=sharded)
  k = idx.shape[-1]
  if vocab == 0:
    raise ValueError(
      f"{name}: the student's vocabulary is empty (0 classes: its class axis has size 0), so "
      "no top-k id can be in it; expected at least 1 class."
    )
  if k > teacher_vocab:
    raise ValueError(
      f"{name}: topk_indices holds k = {k} entries per token, more than the teacher's "
      f"{teacher_vocab} classes; expected k <= {teacher_vocab} (pass teacher_vocab_size= "
      "when the teacher's vocabulary is longer than the student's)."
    )
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
  bucket = tail == "bucket"
  return TopkArgs(idx, lp, bucket, floor if bucket else 0.0, teacher_vocab, example, slot)


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
  tail_floor: float = TAIL_FLOOR,
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
    teacher_vocab_size, axis_name, tail_floor,
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
    floor=teacher.floor,
    cap=cap,
    axis_name=axis_name,
    out_dtype=jnp.dtype(out_dtype),
  )
  return nan_unless(out, positive_finite(temperature), *spec.valid())


@functools.partial(
  jax.jit,
  static_argnames=(
    "vocab",
    "teacher_vocab",
    "tail_bucket",
    "floor",
    "cap",
    "axis_name",
    "out_dtype",
  ),
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
  floor,
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
    z, teacher.ids, teacher.lp, teacher.keep, teacher.dropped, t, spec, tail_bucket, cap,
    axis_name, floor,
  )  # fmt: skip
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
  tail_floor: float = TAIL_FLOOR,
  where: jax.typing.ArrayLike | None = None,
  softcap: float | None = None,
  teacher_vocab_size: int | None = None,
  axis_name: str | None = None,
) -> jax.Array:
  r"""Per-example divergence between a top-k teacher and the student's full softmax.

  The teacher is given by its top-k ids :math:`i_j` and log-probabilities
  :math:`l_j`, the student by its logits :math:`z`; both become distributions
  on :math:`k + 1` classes, the top-k tokens and a *tail* holding the rest:

  .. math::

     \log q_j = \frac{z_{i_j}}{T} - \log \sum_{v=1}^{V} e^{z_v / T}, \qquad
     q_{\text{tail}} = 1 - \sum_j q_j,

  and for the teacher, with ``tail="renormalize"`` (the default),
  :math:`p_j = e^{l_j/T} / \sum_{j'} e^{l_{j'}/T}` and :math:`p_{\text{tail}} = 0`;
  with ``tail="bucket"``, :math:`p_j = e^{l_j}` and
  :math:`p_{\text{tail}} = 1 - \sum_j p_j`. The result is :math:`D(p, q)` over
  those classes, for any divergence of :func:`divergence_from_logits`.
  Renormalised, forward KL is :func:`kl_div_from_topk` and reverse KL may be ``+inf``.
  With the bucket :math:`T` scales the student only, and both tails are floored, as TRL's
  ``add_tail_bucket`` does:

  .. math::

     p_{\text{tail}} \leftarrow \max\big(p_{\text{tail}}, 1 - e^{-\epsilon}\big), \qquad
     q_{\text{tail}} \leftarrow \max\big(q_{\text{tail}}, 1 - e^{-\epsilon}\big),

  :math:`\epsilon` = ``tail_floor`` (``1e-7``, TRL's; the top-k's masses unchanged, so a
  floored side sums to at most :math:`1 + \epsilon`). Where the top-k holds all of the
  teacher's mass to rounding (a peaked teacher, a top-k covering the vocabulary, masses
  summing to 1 or more) the teacher's tail would otherwise be empty, and every divergence
  that charges the student's tail for mass the teacher lacks (reverse KL, symmetric KL, JSD at
  ``beta=1``) ``+inf``; with the floor every divergence is finite for finite logits.
  ``tail_floor=0`` keeps the exact tails (an empty one where the top-k's rounding leaves
  less than ``4 k`` ulps).
  Which tail: :doc:`/large-vocabularies`; padding, repeated ids, ids out of
  range: :doc:`/conventions`; the shared arguments and the derivatives:
  :ref:`shared-arguments`, :ref:`derivatives`; ``axis_name``: :ref:`vocab-parallel`.

  Args:
    logits: student logits ``[..., vocab]``.
    topk_indices, topk_log_probs: the teacher's integer ids and log-probabilities ``[..., k]``.
    divergence: a name or a :class:`Divergence`, as in :func:`divergence_from_logits`.
    temperature: the softmax temperature ``T`` (Python number or traced); no ``T**2``.
    tail: ``"renormalize"`` or ``"bucket"``.
    tail_floor: with ``tail="bucket"``, the least tail mass of either side (about
      ``tail_floor``: :math:`1 - e^{-\epsilon}`), a Python number in ``[0, 1)``; ``0``: none.
      Unused when renormalised.
    where: a per-example ``[...]`` or a per-slot ``[..., k]`` mask.
    softcap, teacher_vocab_size: the student's logit soft-cap; the teacher's vocabulary size.
    axis_name: the mesh axis the student's vocabulary is split over.

  Returns:
    The divergence per example ``logits.shape[:-1]``, in the promoted dtype.

  Raises:
    TypeError: non-floating logits or log-probabilities, non-integer ids, a non-bool ``where``.
    ValueError: mismatched shapes, an invalid static option, an id out of range (values known),
      more top-k entries than the teacher has classes, an empty vocabulary.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import divergence_from_topk
    >>> logits, ids = jnp.array([[2.0, 1.0, 0.0, -1.0]]), jnp.array([[0, 2]])
    >>> lp = jnp.log(jnp.array([[0.6, 0.2]]))
    >>> divergence_from_topk(logits, ids, lp)  # renormalised: [0.75, 0.25]
    Array([0.3778...], dtype=float32)
    >>> divergence_from_topk(logits, ids, lp, divergence="jsd", tail="bucket")  # tail 0.2
    Array([0.0143...], dtype=float32)
  """
  name = "divergence_from_topk"
  spec = as_divergence(name, divergence)
  teacher = (topk_indices, topk_log_probs)
  options = (temperature, where, tail, softcap, teacher_vocab_size, axis_name, tail_floor)
  return topk_per_example(name, spec, logits, *teacher, *options)


def kl_div_from_topk(
  logits: jax.typing.ArrayLike,
  topk_indices: jax.typing.ArrayLike,
  topk_log_probs: jax.typing.ArrayLike,
  *,
  temperature: float | jax.typing.ArrayLike = 1.0,
  where: jax.typing.ArrayLike | None = None,
  tail: str = "renormalize",
  tail_floor: float = TAIL_FLOOR,
  softcap: float | None = None,
  teacher_vocab_size: int | None = None,
  axis_name: str | None = None,
) -> jax.Array:
  r"""Per-example forward KL from a top-k teacher to the student's full softmax.

  :func:`divergence_from_topk` with ``divergence="forward_kl"`` (the rest alike);
  with the default ``tail="renormalize"``, the teacher renormalised over its
  top-k against the student's full softmax, both at temperature ``T``:

  .. math::

     p_j = \frac{e^{l_j / T}}{\sum_{j'} e^{l_{j'} / T}}, \qquad
     \log q_i = \frac{z_i}{T} - \log \sum_{v=1}^{V} e^{z_v / T}, \qquad
     \mathrm{KL} = \sum_{j=1}^{k} p_j \,(\log p_j - \log q_{i_j}).

  With ``k = vocab`` it is the full KL. The gradient: :ref:`derivatives`.

  Args:
    logits: student logits ``[..., vocab]``.
    topk_indices, topk_log_probs: the teacher's integer ids and log-probabilities ``[..., k]``.
    temperature, where, tail, tail_floor, softcap, teacher_vocab_size, axis_name: as in
      :func:`divergence_from_topk`.

  Returns:
    The KL per example ``logits.shape[:-1]``, in the promoted dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import kl_div_from_topk
    >>> logits, ids = jnp.array([[2.0, 1.0, 0.0, -1.0]]), jnp.array([[0, 2]])
    >>> lp = jnp.log(jnp.array([[0.6, 0.2]]))  # renormalised: [0.75, 0.25]
    >>> kl_div_from_topk(logits, ids, lp, temperature=2.0)
    Array([0.4965...], dtype=float32)
  """
  name = "kl_div_from_topk"
  spec = Divergence("forward_kl")
  teacher = (topk_indices, topk_log_probs)
  options = (temperature, where, tail, softcap, teacher_vocab_size, axis_name, tail_floor)
  return topk_per_example(name, spec, logits, *teacher, *options)
