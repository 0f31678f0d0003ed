"""ULD from each side's top ``k``: the sorted distance without the full sort.

:func:`kldiv_jax.uld_loss` sorts every row of both vocabularies (``V = 151936`` for
Qwen's); only the head of the sorted rows carries mass. Here each side's ``k`` largest
probabilities come from ``lax.top_k`` (a partial selection) and the rest of each side is
its tail mass, compared as one bucket. The bound on what that leaves out is derived on
:func:`uld_loss_from_topk`; the long form is the *Large vocabularies* section of the
cross-tokenizer docs page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._checks import check_int
from kldiv_jax._numerics import nan_unless
from kldiv_jax._uld import check_reduction, reduce_rows, row_operands


def side_topk(z: jax.Array, t: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``(top, tail)``: a side's ``k`` largest probabilities of ``softmax(z / t)`` in
  descending order ``[..., k]`` (zero-padded past its vocabulary) and the mass outside them
  ``[...]`` (``1 - sum(top)``, at least 0). A row without a finite logit has no mass: zeros
  (``uld_loss``'s convention)."""
  u = z / t
  m = lax.stop_gradient(jnp.max(u, axis=-1, keepdims=True))
  has_mass = jnp.isfinite(m)
  m = jnp.where(has_mass, m, 0.0)
  total = jnp.sum(jnp.exp(u - m), axis=-1, keepdims=True)
  top_u, _ = lax.top_k(u, min(k, u.shape[-1]))
  top = jnp.exp(top_u - m) / jnp.where(total > 0, total, 1.0)
  top = jnp.pad(top, [(0, 0)] * (top.ndim - 1) + [(0, k - top.shape[-1])])
  mass = has_mass[..., 0].astype(top.dtype)
  return top, jnp.maximum(mass - jnp.sum(top, axis=-1), 0.0)


def topk_gap(a: jax.Array, tail_a: jax.Array, b: jax.Array, tail_b: jax.Array) -> jax.Array:
  """``sum_{i<=k} |a_i - b_i| + |A - B|`` per row from each side's :func:`side_topk`."""
  return jnp.sum(jnp.abs(a - b), axis=-1) + jnp.abs(tail_a - tail_b)


def topk_distance(zs: jax.Array, zt: jax.Array, ts, tt, k: int) -> jax.Array:
  """:func:`topk_gap` of two sides' logits (see :func:`uld_loss_from_topk`)."""
  return topk_gap(*side_topk(zs, ts, k), *side_topk(zt, tt, k))


def check_k(name: str, k: object) -> int:
  """``k``, the ranks compared one by one: a Python int ``>= 1``."""
  k = check_int(name, "k", k)
  if k < 1:
    raise ValueError(f"{name}: k must be at least 1 (the ranks compared one by one); got {k}.")
  return k


def uld_loss_from_topk(
  student_logits: jax.typing.ArrayLike,
  teacher_logits: jax.typing.ArrayLike,
  *,
  k: int,
  student_temperature: float | jax.typing.ArrayLike = 1.0,
  teacher_temperature: float | jax.typing.ArrayLike = 1.0,
  where: jax.typing.ArrayLike | None = None,
  reduction: str = "mean",
) -> jax.Array:
  r"""ULD's sorted-probability distance from each side's top ``k`` and its tail mass.

  With :math:`a_1 \ge a_2 \ge \dots` the student's probabilities
  :math:`\mathrm{softmax}(s / T_s)` sorted, :math:`b_1 \ge b_2 \ge \dots` the teacher's,
  both zero-padded to :math:`L = \max(V_s, V_t)`, and the tail masses
  :math:`A = \sum_{i > k} a_i`, :math:`B = \sum_{i > k} b_i`:

  .. math::

     D_k = \sum_{i=1}^{k} |a_i - b_i| + |A - B|
     \quad\text{against ULD's}\quad D = \sum_{i=1}^{L} |a_i - b_i| .

  The top ``k`` come from ``lax.top_k``, not a sort of the vocabulary. The bound: past rank
  :math:`k` both sequences are non-increasing, :math:`a_i \le a_k`, :math:`b_i \le b_k`, with
  sums :math:`A`, :math:`B` over :math:`m = L - k` ranks, so (the triangle inequality, and
  Chebyshev's sum inequality for two sequences ordered alike,
  :math:`\sum a_i b_i \ge A B / m`, with :math:`\min(x, y) \ge x y / \max(a_k, b_k)`):

  .. math::

     0 \;\le\; D - D_k \;\le\; 2\min(A, B) - \frac{2 A B}{m \max(a_k, b_k)}
     \;\le\; 2 \min(A, B) .

  :math:`D_k` is a lower bound of :math:`D`, exact when either side's top ``k`` holds all of
  its mass (a tail of 0) and when ``k >= L``; it is 0 when the two sorted rows are equal
  (a loss), which the bound's midpoint, :math:`\max(A, B)` as the tail term, would not be.
  The teacher enters only through its top ``k`` probabilities and its tail mass.

  Derivatives: through the top ``k``'s probabilities and the softmax's normaliser (the
  tail is :math:`1 - \sum_{i \le k} a_i`), exact where the selection and the signs are
  locally constant; at a tie at rank ``k`` ``lax.top_k`` keeps the lower index.

  Args:
    student_logits: ``[..., Vs]``.
    teacher_logits: ``[..., Vt]``, the same shape without the class axis (the aligned rows,
      as in :func:`uld_loss` without groups; merge spans with :func:`uld_loss`).
    k: the ranks compared one by one, a Python int ``>= 1`` (past a side's vocabulary that
      side is zero-padded: ``k >= max(Vs, Vt)`` is ULD itself).
    student_temperature, teacher_temperature: each side's softmax temperature.
    where: a row mask ``[...]``: masked rows give 0 and are not counted.
    reduction: as in :func:`uld_loss`: ``"mean"``, ``"sum"``, ``"none"`` or
      ``"sequence_mean"``.

  Returns:
    A scalar (``"none"``: per row) in the promoted logits dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import uld_loss_from_topk
    >>> student = jnp.log(jnp.array([[0.5, 0.5]]))
    >>> teacher = jnp.log(jnp.array([[0.25, 0.5, 0.25]]))
    >>> uld_loss_from_topk(student, teacher, k=1)  # |0.5-0.5| + |0.5-0.5|
    Array(0., dtype=float32)
    >>> uld_loss_from_topk(student, teacher, k=3)  # ULD: 0 + |0.5-0.25| + |0-0.25|
    Array(0.5, dtype=float32)
  """
  name = "uld_loss_from_topk"
  reduction = check_reduction(name, reduction)
  k = check_k(name, k)
  o = row_operands(
    name, student_logits, teacher_logits, student_temperature, teacher_temperature, where
  )
  per_row = topk_distance(o.zs.astype(o.cdt), o.zt.astype(o.cdt), o.ts, o.tt, k)
  return nan_unless(reduce_rows(per_row, o.valid, reduction), *o.checks).astype(o.out_dtype)
