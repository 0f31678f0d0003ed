"""Universal Logit Distillation across tokenizers: :func:`uld_loss` and :func:`merge_spans`.

ULD (Boizard et al., 2024) compares a student row and a teacher row of different
vocabularies by their probabilities sorted in descending order, the shorter padded with
zeros: an L1 distance (a 1-D Wasserstein distance) that needs no vocabulary
correspondence. The formulas are TRL 1.16.0's ``ULDLoss``
(``trl/experimental/gold/gold_trainer.py``): the sorted L1 of its plain path, and
``_merge_probabilities_with_alignment_groups`` for the token spans of ``use_extended_uld``
(:func:`merge_spans`). The aligned layout and the reductions are shared with
:func:`kldiv_jax.gold_loss` (:mod:`kldiv_jax._gold`), which adds GOLD's hybrid.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kldiv_jax._checks import (
  check_choice,
  check_float,
  compute_dtype,
  mask_array,
  real_scalar,
  result_dtype,
)
from kldiv_jax._id_checks import check_ids, index_array
from kldiv_jax._numerics import nan_unless, positive_finite
from kldiv_jax._uld_sorted import probabilities, uld_rows

REDUCTIONS = ("none", "sum", "mean", "sequence_mean")
STRATEGIES = ("observed", "bayesian")
ALIGNMENT_ARGS = ("student_groups", "teacher_groups", "student_tokens", "teacher_tokens")
# TRL's floor of a merged token's scalar probability and of the hybrid's matched
# probabilities (``clamp_min(1e-8)`` in both places, gold_trainer.py).
PROBABILITY_FLOOR = 1e-8


def sorted_l1(p: jax.Array, q: jax.Array) -> jax.Array:
  """``sum |sort(p) - sort(q)|`` over the last axis, both sorted in descending order and the
  shorter padded with zeros; ``[..., Vp]``, ``[..., Vq]`` -> ``[...]``.

  Sorted as the negatives in ascending order (a stable sort): equal probabilities keep
  their index order, so each tied entry takes the slot of its index rank and its gradient
  is that slot's ``sign``. Padding before the sort is padding after it: a zero sorts below
  every probability.
  """
  v = max(p.shape[-1], q.shape[-1])
  widths = [(0, 0)] * (p.ndim - 1)
  p = jnp.pad(p, (*widths, (0, v - p.shape[-1])))
  q = jnp.pad(q, (*widths, (0, v - q.shape[-1])))
  # |d|' = sign(d), 0 at d = 0: torch's l1_loss subgradient.
  return jnp.sum(jnp.abs(jnp.sort(-p, axis=-1) - jnp.sort(-q, axis=-1)), axis=-1)


def check_temperature_of(name: str, option: str, value: object):
  """A side's temperature ``(value, range test)``: a static one positive and finite."""
  t, static = real_scalar(name, option, value)
  if static and not (np.isfinite(t) and t > 0):
    raise ValueError(f"{name}: {option} must be positive and finite; got {value!r}.")
  return t, positive_finite(t)


def _groups_array(name, arg, value):
  """Groups ``[..., G, L]`` of positions (``-1``: padding) as an integer array."""
  g = index_array(name, arg, value, "token positions")
  if g.ndim < 2:
    raise ValueError(
      f"{name}: {arg} must have shape [..., num_groups, group_size] (positions, -1 padding); "
      f"got shape {g.shape}."
    )
  return g


def _check_positions(name, arg, groups, length):
  """Known groups hold positions in ``[0, length)`` or ``-1``."""
  check_ids(name, arg, groups, length, what="positions", ignore_index=-1)


def merge_rows(probs, tokens, groups, strategy):
  """:func:`merge_spans` on checked arrays: ``[..., T, V]``, ``[..., T]``, ``[..., G, L]``."""
  valid = groups >= 0
  count = jnp.sum(valid, axis=-1)  # [..., G]
  safe = jnp.where(valid, groups, 0).astype(jnp.int32)
  safe_tokens = jnp.clip(tokens, 0, probs.shape[-1] - 1).astype(jnp.int32)
  # The probability of each position's own token, floored as TRL floors it.
  own = jnp.take_along_axis(probs, safe_tokens[..., None], axis=-1)[..., 0]  # [..., T]
  own = jnp.maximum(own, PROBABILITY_FLOOR)
  flat = safe.reshape(*safe.shape[:-2], -1)
  scalars = jnp.take_along_axis(own, flat, axis=-1).reshape(safe.shape)  # [..., G, L]
  slot = jnp.broadcast_to(jnp.arange(groups.shape[-1]), groups.shape)
  last = jnp.maximum(count - 1, 0)
  if strategy == "observed":  # the first position's distribution, the later tokens' scalars
    base = safe[..., 0]
    scalar = valid & (slot > 0)
  else:  # "bayesian": the last position's distribution, the earlier tokens' scalars
    base = jnp.take_along_axis(safe, last[..., None], axis=-1)[..., 0]
    scalar = valid & (slot < last[..., None])
  factor = jnp.prod(jnp.where(scalar, scalars, 1.0), axis=-1)  # [..., G]
  rows = jnp.take_along_axis(probs, base[..., None], axis=-2)  # [..., G, V]
  return jnp.where((count > 0)[..., None], rows * factor[..., None], 0.0)


def merge_spans(
  probs: jax.typing.ArrayLike,
  tokens: jax.typing.ArrayLike,
  groups: jax.typing.ArrayLike,
  *,
  strategy: str = "observed",
) -> jax.Array:
  r"""Merges each group of token positions into one (unnormalised) distribution.

  For a group of positions :math:`i_1 < \dots < i_k` with tokens :math:`y`:

  * ``"observed"``: :math:`p_{i_1} \prod_{j=2}^{k} \max(p_{i_j}[y_{i_j}], 10^{-8})` — the
    first position's distribution times the probabilities of the later actual tokens;
  * ``"bayesian"``: :math:`p_{i_k} \prod_{j=1}^{k-1} \max(p_{i_j}[y_{i_j}], 10^{-8})` — the
    last position's distribution (conditioned on the actual prefix) times the earlier ones'
    (the chain rule; give the rows that *predict* the tokens, the causal shift).

  A one-position group is that row; an empty group (all ``-1``) is zeros. TRL 1.16.0's
  ``ULDLoss._merge_probabilities_with_alignment_groups`` (``trl/experimental/gold``), with
  the groups as padded arrays (:func:`align_tokens`) so that a jitted step takes them.

  Args:
    probs: probabilities ``[..., T, V]`` (a softmax of one side's logits).
    tokens: that side's token ids ``[..., T]`` (the actual tokens at those rows; those of
      grouped positions in ``[0, V)``).
    groups: positions into ``T`` ``[..., G, L]``, each group's positions ascending then
      ``-1`` padding.
    strategy: ``"observed"`` or ``"bayesian"`` (GOLD's ``uld_token_merge_strategy``).

  Returns:
    The merged distributions ``[..., G, V]``, in the dtype of ``probs``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import merge_spans
    >>> probs = jnp.array([[0.5, 0.5], [0.2, 0.8]])
    >>> merge_spans(probs, jnp.array([0, 1]), jnp.array([[0, 1]]))
    Array([[0.4, 0.4]], dtype=float32)
    >>> merge_spans(probs, jnp.array([0, 1]), jnp.array([[0, 1]]), strategy="bayesian")
    Array([[0.1, 0.4]], dtype=float32)
  """
  name = "merge_spans"
  check_choice(name, "strategy", strategy, STRATEGIES)
  dtype = check_float(name, ("probs",), probs)
  p = jnp.asarray(probs)
  tok = index_array(name, "tokens", tokens, "token ids")
  g = _groups_array(name, "groups", groups)
  if p.ndim < 2 or tok.shape != p.shape[:-1] or g.shape[:-2] != p.shape[:-2]:
    raise ValueError(
      f"{name}: expected probs [..., T, V], tokens [..., T] and groups [..., G, L] with the "
      f"same leading axes; got probs {p.shape}, tokens {tok.shape}, groups {g.shape}."
    )
  _check_positions(name, "groups", g, p.shape[-2])
  p = p.astype(compute_dtype(dtype))
  return merge_rows(p, tok, g, strategy).astype(dtype)


class Operands(NamedTuple):
  """A ULD-family loss's checked operands (:func:`row_operands`)."""

  zs: jax.Array  # the logits as given, [..., Vs] and [..., Vt]
  zt: jax.Array
  ts: jax.Array  # the temperatures, in the compute dtype
  tt: jax.Array
  valid: jax.Array  # [rows...]: the rows that count
  align: tuple | None  # (student_groups, teacher_groups, student_tokens, teacher_tokens)
  cdt: jnp.dtype  # the compute dtype
  out_dtype: jnp.dtype
  checks: tuple  # the traced temperatures' range tests (NaN when one fails)


def row_operands(
  name, student_logits, teacher_logits, student_temperature, teacher_temperature, where,
  student_groups=None, teacher_groups=None, student_tokens=None, teacher_tokens=None,
  merge_strategy="observed",
) -> Operands:  # fmt: skip
  """Validate a ULD-family loss's operands and lay out its rows (errors name ``name``).

  Without groups each position is a row (the shapes without the class axis must agree,
  GOLD's positional ULD after truncation to the shorter side). With groups (all four of
  ``*_groups`` and ``*_tokens``) the logits are ``[..., T, V]`` and the rows the groups
  ``[..., G]``; a group counts when both sides' are non-empty (TRL drops the others).
  """
  names = ("student_logits", "teacher_logits")
  out_dtype = check_float(name, names, student_logits, teacher_logits)
  cdt = compute_dtype(result_dtype(out_dtype))
  zs, zt = (jnp.asarray(x) for x in (student_logits, teacher_logits))
  ts, ok_s = check_temperature_of(name, "student_temperature", student_temperature)
  tt, ok_t = check_temperature_of(name, "teacher_temperature", teacher_temperature)
  check_choice(name, "merge_strategy", merge_strategy, STRATEGIES)
  for arg, z in zip(names, (zs, zt)):
    if z.ndim == 0 or z.shape[-1] == 0:
      raise ValueError(f"{name}: {arg} must have a class axis, [..., vocab]; got {z.shape}.")
  align = _alignment(name, zs, zt, student_groups, teacher_groups, student_tokens, teacher_tokens)
  if align is None:
    if zs.shape[:-1] != zt.shape[:-1]:
      raise ValueError(
        f"{name}: student_logits and teacher_logits must have the same shape without the "
        f"class axis (one row per aligned position; slice both to the shorter side); got "
        f"{zs.shape} and {zt.shape}."
      )
    valid = jnp.ones(zs.shape[:-1], jnp.bool_)
  else:
    valid = (align[0][..., 0] >= 0) & (align[1][..., 0] >= 0)
  if where is not None:
    w = mask_array(name, where)
    if w.shape != valid.shape:
      raise ValueError(
        f"{name}: where must be a row mask of shape {valid.shape} (the rows: the logits' "
        f"shape without the class axis, or [..., G] with groups); got {w.shape}."
      )
    valid = valid & w
  ts, tt = (jnp.asarray(x).astype(cdt) for x in (ts, tt))
  return Operands(zs, zt, ts, tt, valid, align, cdt, out_dtype, (ok_s, ok_t))


def probability_rows(o: Operands, merge_strategy: str) -> tuple[jax.Array, jax.Array]:
  """Each row's probabilities, student and teacher ``[rows..., V]`` (with groups, the spans
  merged by :func:`merge_rows`); rows outside ``o.valid`` are selected away before the
  softmax."""
  if o.align is None:
    return _probabilities(o.zs, o.ts, o.valid, o.cdt), _probabilities(o.zt, o.tt, o.valid, o.cdt)
  gs, gt, ys, yt = o.align
  ps = _probabilities(o.zs, o.ts, _used(gs, o.valid, o.zs.shape[-2]), o.cdt)
  pt = _probabilities(o.zt, o.tt, _used(gt, o.valid, o.zt.shape[-2]), o.cdt)
  return merge_rows(ps, ys, gs, merge_strategy), merge_rows(pt, yt, gt, merge_strategy)


def _alignment(name, zs, zt, *arrays):
  """``(student_groups, teacher_groups, student_tokens, teacher_tokens)`` checked, or
  ``None`` without an alignment (all four or none)."""
  given = [a is not None for a in arrays]
  if not any(given):
    return None
  if not all(given):
    got = ", ".join(n for n, g in zip(ALIGNMENT_ARGS, given, strict=True) if g)
    raise ValueError(
      f"{name}: {', '.join(ALIGNMENT_ARGS)} go together (the groups of "
      f"kldiv_jax.align_tokens and each side's token ids); got {got} only."
    )
  gs = _groups_array(name, "student_groups", arrays[0])
  gt = _groups_array(name, "teacher_groups", arrays[1])
  ys = index_array(name, "student_tokens", arrays[2], "token ids")
  yt = index_array(name, "teacher_tokens", arrays[3], "token ids")
  lead = zs.shape[:-2]
  ok = (
    zs.ndim >= 2 and zt.ndim >= 2 and zt.shape[:-2] == lead
    and ys.shape == zs.shape[:-1] and yt.shape == zt.shape[:-1]
    and gs.shape[:-1] == (*lead, gs.shape[-2]) and gt.shape[:-1] == gs.shape[:-1]
  )  # fmt: skip
  if not ok:
    raise ValueError(
      f"{name}: with groups, expected student_logits [..., Ts, Vs], teacher_logits "
      "[..., Tt, Vt], student_tokens [..., Ts], teacher_tokens [..., Tt], student_groups "
      "[..., G, Ls] and teacher_groups [..., G, Lt] (the same leading axes and G); got "
      f"{zs.shape}, {zt.shape}, {ys.shape}, {yt.shape}, {gs.shape}, {gt.shape}."
    )
  _check_positions(name, "student_groups", gs, zs.shape[-2])
  _check_positions(name, "teacher_groups", gt, zt.shape[-2])
  return gs, gt, ys, yt


def _probabilities(z, t, keep, cdt):
  """The softmax of the rows ``keep`` holds; the others are selected away before it (0), so
  that a NaN there reaches neither the value nor the gradients."""
  return probabilities(jnp.where(keep[..., None], z, 0.0).astype(cdt), t)


def _used(groups, valid, length):
  """Which of ``length`` positions the ``valid`` groups read, ``[..., length]`` (a scatter:
  no ``[G, L, length]`` comparison)."""
  read = valid[..., None] & (groups >= 0)
  at = jnp.where(read, groups, length).reshape(-1, groups.shape[-2] * groups.shape[-1])

  def scatter(at):
    return jnp.zeros(length, jnp.bool_).at[at].set(True, mode="drop")

  return jax.vmap(scatter)(at).reshape(*groups.shape[:-2], length)


def check_reduction(name: str, reduction: object) -> str:
  check_choice(name, "reduction", reduction, REDUCTIONS)
  return str(reduction)


def reduce_rows(per_row: jax.Array, valid: jax.Array, reduction: str) -> jax.Array:
  """``"none"``: per row (0 where not valid); ``"sum"``; ``"mean"`` over the valid rows;
  ``"sequence_mean"``: each sequence's mean over its valid rows (the last row axis; 0 for
  none), then the mean over the sequences (TRL's ``ULDLoss``)."""
  per_row = jnp.where(valid, per_row, 0.0)  # selected: a masked row's NaN cannot leak
  if reduction == "none":
    return per_row
  if reduction == "sum":
    return jnp.sum(per_row)
  if reduction == "mean":
    return jnp.sum(per_row) / jnp.maximum(jnp.sum(valid), 1).astype(per_row.dtype)
  seq = per_row.reshape((-1, *per_row.shape[-1:])) if per_row.ndim else per_row.reshape(1, 1)
  count = valid.reshape(seq.shape).sum(axis=-1)
  return jnp.mean(jnp.sum(seq, axis=-1) / jnp.maximum(count, 1).astype(seq.dtype))


def uld_loss(
  student_logits: jax.typing.ArrayLike,
  teacher_logits: jax.typing.ArrayLike,
  *,
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
  r"""Universal Logit Distillation: the L1 distance of the sorted probabilities.

  With :math:`q = \mathrm{softmax}(s / T_s)` (``Vs`` classes) and
  :math:`p = \mathrm{softmax}(t / T_t)` (``Vt`` classes), each sorted in descending order
  and the shorter padded with zeros to :math:`V = \max(V_s, V_t)`:

  .. math::  \mathrm{ULD}(p, q) = \sum_{k=1}^{V} \big|q_{(k)} - p_{(k)}\big| ,

  a 1-D Wasserstein distance between the two sets of probabilities that needs no
  vocabulary correspondence. With the alignment of :func:`align_tokens` (``*_groups``,
  ``*_tokens``), each side's token spans are merged first (:func:`merge_spans`,
  ``merge_strategy``) and the rows are the groups: GOLD's ``use_extended_uld``.

  Derivatives: exact wherever the order is locally constant. At a tie (equal probabilities
  on one side, i.e. equal logits) the sort is stable: each tied entry takes the slot of its
  index rank and gets that slot's :math:`\mathrm{sign}(q_{(k)} - p_{(k)})` (0 where equal,
  ``l1_loss``'s subgradient) — TRL's gradient with a stable sort. TRL's
  ``Tensor.sort(descending=True)`` is not stable on long rows (CPU), so its gradient wrt
  tied logits can be a permutation of this one within the tie; the value, each tie's sum
  and every untied entry agree. ``-inf`` logits are classes without mass; a row without any
  finite logit has no mass (zeros), not NaN.

  Memory: without groups the rows are sorted in chunks, each side once, and only the sorted
  signs are kept (``int8``, in the original order) for a backward pass that recomputes the
  softmax: a ``jax.custom_vjp``, reverse mode only (``grad``, ``value_and_grad``, ``vjp``),
  whose temporaries stay below one ``[N, V]`` float32 array (:mod:`kldiv_jax._uld_sorted`;
  the *Large vocabularies* section of :doc:`/cross-tokenizer`). With groups the merged rows
  are sorted whole, and forward mode works too.

  Args:
    student_logits: ``[..., Vs]``; with groups ``[..., Ts, Vs]``.
    teacher_logits: ``[..., Vt]`` (the same shape without the class axis); with groups
      ``[..., Tt, Vt]``.
    student_temperature, teacher_temperature: each side's softmax temperature (GOLD's
      ``uld_student_temperature``, ``uld_teacher_temperature``; Python numbers or traced).
    where: a row mask ``[...]`` (with groups ``[..., G]``): masked rows give 0 and are not
      counted.
    reduction: ``"mean"`` over the valid rows, ``"sum"``, ``"none"`` (per row), or
      ``"sequence_mean"``: each sequence's mean over its valid rows (the last row axis),
      then the mean over sequences, TRL's (a sequence without rows counts as 0).
    student_groups, teacher_groups: ``[..., G, Ls]``, ``[..., G, Lt]`` positions (``-1``
      padding) of :func:`align_tokens`; a group counts when both sides are non-empty.
    student_tokens, teacher_tokens: each side's token ids ``[..., Ts]``, ``[..., Tt]``, the
      token of each logits row: for ``"observed"`` the token at that position (TRL's
      slicing), for ``"bayesian"`` the token it predicts (``input_ids[:, 1:]`` beside
      ``logits[:, :-1]``, the groups' positions shifted by -1): :doc:`/cross-tokenizer`.
    merge_strategy: ``"observed"`` or ``"bayesian"`` (:func:`merge_spans`).

  Returns:
    A scalar (``"none"``: per row) in the promoted logits dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import uld_loss
    >>> student = jnp.log(jnp.array([[0.7, 0.2, 0.1]]))
    >>> teacher = jnp.log(jnp.array([[0.1, 0.6, 0.2, 0.1]]))
    >>> round(float(uld_loss(student, teacher)), 6)  # |.7-.6| + |.2-.2| + |.1-.1| + |0-.1|
    0.2

  References:
    Boizard et al., *Towards Cross-Tokenizer Distillation: the Universal Logit Distillation
    Loss for LLMs* (2024), arXiv:2402.12030. TRL 1.16.0 ``ULDLoss``
    (``trl/experimental/gold/gold_trainer.py``).
  """
  name = "uld_loss"
  reduction = check_reduction(name, reduction)
  o = row_operands(
    name, student_logits, teacher_logits, student_temperature, teacher_temperature, where,
    student_groups, teacher_groups, student_tokens, teacher_tokens, merge_strategy,
  )  # fmt: skip
  if o.align is None:  # positions: the chunked sort from the logits (bounded memory)
    per_row = uld_rows(o.zs.astype(o.cdt), o.zt.astype(o.cdt), o.ts, o.tt, o.valid)
  else:
    per_row = sorted_l1(*probability_rows(o, merge_strategy))
  return nan_unless(reduce_rows(per_row, o.valid, reduction), *o.checks).astype(o.out_dtype)
