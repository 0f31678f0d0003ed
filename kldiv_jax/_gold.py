"""GOLD's hybrid cross-tokenizer loss: a divergence on the shared vocabulary, ULD on the rest.

TRL 1.16.0's ``ULDLoss._compute_hybrid_uld_loss`` (``trl/experimental/gold/gold_trainer.py``,
``uld_use_hybrid_loss=True``): the vocabulary entries both tokenizers have (the same token
string) are compared entry by entry with GOLD's generalised JSD, the others by ULD's sorted
distance (:func:`kldiv_jax._uld.sorted_l1`). The divergence is any of kldiv_jax's, its
per-class term taken from :data:`kldiv_jax._divergences.FORMULAS` (written once there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kldiv_jax._checks import check_unit_interval, real_scalar
from kldiv_jax._distill import loss_divergence
from kldiv_jax._divergence_spec import Divergence
from kldiv_jax._divergences import Classes
from kldiv_jax._id_checks import check_ids, index_array
from kldiv_jax._numerics import is_static, nan_unless, nonnegative_finite
from kldiv_jax._uld import (
  PROBABILITY_FLOOR,
  check_reduction,
  probability_rows,
  reduce_rows,
  row_operands,
  sorted_l1,
)


def _vocabulary_ids(name, arg, ids, num_classes):
  out = index_array(name, arg, ids, "vocabulary ids")
  if out.ndim != 1:
    raise ValueError(f"{name}: {arg} must be a 1-D array of vocabulary ids; got {out.shape}.")
  check_ids(name, arg, out, num_classes, what="vocabulary ids")
  return out


def _weights(name, matched_weight, unmatched_weight, num_matched, teacher_vocab):
  """GOLD's weights: fixed (both given) or adaptive (both ``None``: the matched share of the
  teacher's vocabulary and the rest); ``(w_matched, w_unmatched, range tests)``."""
  if (matched_weight is None) != (unmatched_weight is None):
    raise ValueError(
      f"{name}: matched_weight and unmatched_weight go together (both None: GOLD's adaptive "
      f"weights; both numbers: fixed); got {matched_weight!r} and {unmatched_weight!r}."
    )
  if matched_weight is None:
    w = num_matched / max(1, teacher_vocab)
    return w, 1.0 - w, ()
  out, checks = [], []
  for option, value in (("matched_weight", matched_weight), ("unmatched_weight", unmatched_weight)):
    x, static = real_scalar(name, option, value)
    if static and not (x >= 0 and x < float("inf")):
      raise ValueError(f"{name}: {option} must be a non-negative, finite number; got {value!r}.")
    out.append(x)
    checks.append(nonnegative_finite(x))
  return out[0], out[1], tuple(checks)


def gold_loss(
  student_logits: jax.typing.ArrayLike,
  teacher_logits: jax.typing.ArrayLike,
  *,
  student_ids: jax.typing.ArrayLike,
  teacher_ids: jax.typing.ArrayLike,
  divergence: str | Divergence = "jsd",
  beta: float | jax.typing.ArrayLike = 0.5,
  matched_weight: float | jax.typing.ArrayLike | None = None,
  unmatched_weight: float | jax.typing.ArrayLike | None = None,
  student_temperature: float | jax.typing.ArrayLike = 1.0,
  teacher_temperature: float | jax.typing.ArrayLike = 1.0,
  where: jax.typing.ArrayLike | None = None,
  reduction: str = "mean",
  student_groups: jax.typing.ArrayLike | None = None,
  teacher_groups: jax.typing.ArrayLike | None = None,
  student_tokens: jax.typing.ArrayLike | None = None,
  teacher_tokens: jax.typing.ArrayLike | None = None,
  merge_strategy: str = "observed",
) -> jax.Array:
  r"""GOLD's hybrid loss: a divergence on the shared vocabulary, ULD on the rest.

  With the probabilities :math:`q` (student) and :math:`p` (teacher) of :func:`uld_loss`
  (merged over token spans with groups), the :math:`M` shared entries
  ``teacher_ids[k] -> student_ids[k]`` (:func:`matched_vocabulary`) and the others
  :math:`\bar q`, :math:`\bar p`, per row:

  .. math::

     L = w_m \sum_{k=1}^{M} f\big(\hat p_{t_k}, \hat q_{s_k}\big)
         + w_u\, \mathrm{ULD}(\bar p, \bar q),
     \qquad \hat x = \max(x, 10^{-8}),

  with :math:`f` the per-class term of ``divergence`` (GOLD's generalised JSD by default,
  ``beta`` its mixture weight: ``config.beta``), applied to the matched probabilities as they
  are (a sub-distribution, not renormalised) and floored as TRL floors them. Weights:
  ``matched_weight``/``unmatched_weight`` fixed, or both ``None`` for GOLD's adaptive
  :math:`w_m = M / V_t`, :math:`w_u = 1 - w_m`. The ULD term is 0 when either side has no
  unmatched entry (TRL's). Ties and ``-inf``: as :func:`uld_loss`; the matched entries
  were zeroed out of the sort, so they tie with zero probabilities, at zero gradient.

  Args:
    student_logits, teacher_logits: as :func:`uld_loss`.
    student_ids, teacher_ids: ``[M]`` integer ids of the shared entries, pairwise
      (:func:`matched_vocabulary`); traced or concrete (concrete ones are range-checked).
    divergence: a name or a :class:`Divergence` (``"jsd"``: its ``beta`` from ``beta``).
    beta: the JSD's mixture weight, in ``[0, 1]`` (GOLD's ``beta``; 0 is forward KL, 1
      reverse KL).
    matched_weight, unmatched_weight: GOLD's ``uld_hybrid_matched_weight`` and
      ``uld_hybrid_unmatched_weight`` (both ``None``: adaptive).
    student_temperature, teacher_temperature, where, reduction: as :func:`uld_loss`.
    student_groups, teacher_groups, student_tokens, teacher_tokens, merge_strategy: as
      :func:`uld_loss` (the alignment and its span merging).

  Returns:
    A scalar (``"none"``: per row) in the promoted logits dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import gold_loss
    >>> student = jnp.array([[2.0, 1.0, 0.0]])
    >>> teacher = jnp.array([[0.0, 2.0, 1.0, -1.0]])
    >>> gold_loss(student, teacher, student_ids=jnp.array([0, 1]), teacher_ids=jnp.array([1, 2]))
    Array(0.0175..., dtype=float32)

  References:
    TRL 1.16.0 ``GOLDTrainer``/``ULDLoss`` (``trl/experimental/gold/``), after Patiño et al.,
    *Unlocking On-Policy Distillation for Any Model Family* (Hugging Face, 2025).
  """
  name = "gold_loss"
  reduction = check_reduction(name, reduction)
  beta, _ = check_unit_interval(name, "beta", beta)
  spec = loss_divergence(name, divergence, beta)
  rows = row_operands(
    name, student_logits, teacher_logits, student_temperature, teacher_temperature, where,
    student_groups, teacher_groups, student_tokens, teacher_tokens, merge_strategy,
  )  # fmt: skip
  ps, pt = probability_rows(rows, merge_strategy)
  vs, vt = ps.shape[-1], pt.shape[-1]
  sid = _vocabulary_ids(name, "student_ids", student_ids, vs)
  tid = _vocabulary_ids(name, "teacher_ids", teacher_ids, vt)
  if sid.shape != tid.shape:
    raise ValueError(
      f"{name}: student_ids and teacher_ids must pair up (the same length); got "
      f"{sid.shape} and {tid.shape}."
    )
  w_m, w_u, w_checks = _weights(name, matched_weight, unmatched_weight, tid.shape[0], vt)
  q, p = ps, pt
  # The matched entries, floored: TRL's log(clamp_min(1e-8)) before generalized_jsd_loss.
  qm = jnp.maximum(jnp.take(q, sid, axis=-1, mode="clip"), PROBABILITY_FLOOR)
  pm = jnp.maximum(jnp.take(p, tid, axis=-1, mode="clip"), PROBABILITY_FLOOR)
  # Traced parameters in the compute dtype (a bfloat16 beta under strict promotion).
  params = tuple(v if is_static(v) else jnp.asarray(v).astype(q.dtype) for _, v in spec.params)
  f, _, _ = spec.formula.terms(Classes(jnp.log(pm), jnp.log(qm), pm, qm), params)
  matched = jnp.sum(f, axis=-1)
  # The unmatched entries: the matched ones zeroed, which sorts them below the others.
  s_mask = jnp.zeros(vs, jnp.bool_).at[sid].set(True, mode="drop")
  t_mask = jnp.zeros(vt, jnp.bool_).at[tid].set(True, mode="drop")
  both = (jnp.sum(~s_mask) > 0) & (jnp.sum(~t_mask) > 0)
  unmatched = sorted_l1(jnp.where(s_mask, 0.0, q), jnp.where(t_mask, 0.0, p))
  unmatched = jnp.where(both, unmatched, 0.0)
  dtype = matched.dtype
  per_row = _weigh(w_m, matched, dtype) + _weigh(w_u, unmatched, dtype)
  out = reduce_rows(per_row, rows.valid, reduction)
  checks = (*rows.checks, *w_checks, *spec.valid())
  return nan_unless(out, *checks).astype(rows.out_dtype)


def _weigh(w, x, dtype):
  return w * x if isinstance(w, float) else jnp.asarray(w).astype(dtype) * x
