"""Per-row class sums of a divergence formula, given each side's row statistics.

The pieces the engine's statistics (:mod:`kldiv_jax._engine`) and the whole-row TPU kernel
(:mod:`kldiv_jax._whole_rows`) share: the per-class :class:`Classes` from row maxes and
normalisers (:func:`normalized`), the terms whose row sums the derivative rule needs
(:func:`summands`, :class:`Needs`), their sums per platform (:func:`class_sums`,
:func:`class_sums_apart`), and the identical-rows test (:func:`identical_rows`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._divergences import Classes, Formula, Norms
from kldiv_jax._numerics import at_least
from kldiv_jax._online_softmax import joint_reduce
from kldiv_jax._rows import normalizer
from kldiv_jax._sums import class_sum


def identical_rows(u: jax.Array, v: jax.Array) -> jax.Array:
  """Whether each row of ``u`` equals that of ``v`` (``[rows, 1]``), ``-inf`` equal to ``-inf``.

  A sum of ``|u - v|`` with ``-inf`` raised to the most negative float (whose
  ``exp`` is 0 too, so the distributions are equal either way): without a
  select, so that XLA:CPU reduces it as fast as a sum of exponentials (a
  boolean ``all`` or a select inside the reduction costs 3 to 6 times more).
  A NaN makes the row not identical (it is NaN anyway).
  """
  return class_sum(identical_gap(u, v)) == 0


def identical_gap(u, v):
  """``|u - v|`` per class, ``-inf`` raised to the lowest float: its row sum is 0 exactly
  where :func:`identical_rows` is true."""
  lowest = float(jnp.finfo(u.dtype).min)
  return jnp.abs(at_least(lowest, u) - at_least(lowest, v))


def plain_sums(*arrays):
  """Row sums of ``arrays`` as a part of :func:`kldiv_jax._online_softmax.joint_reduce`."""
  init = tuple(jnp.zeros((), a.dtype) for a in arrays)
  return arrays, init, lambda a, b: tuple(x + y for x, y in zip(a, b)), tuple


class Needs(NamedTuple):
  """Which class sums the derivative rule needs besides ``sum f`` (static)."""

  a: bool = False
  b: bool = False
  params: tuple[bool, ...] = ()

  def num_sums(self) -> int:
    """How many class sums: ``sum f`` and those named."""
    return 1 + self.a + self.b + sum(self.params)


def formula_params(key, traced, dtype):
  """The formula's parameters: static floats as they are, traced ones in ``dtype``."""
  traced = iter(traced)
  return tuple(v if v is not None else next(traced).astype(dtype) for _, v in key[1])


def class_terms(u, mu, su, v, mv, sv, eu=None, ev=None) -> Classes:
  """:class:`Classes` of scaled logits ``u``, ``v`` (``-inf`` without mass) given row stats.

  ``eu``, ``ev`` are ``exp(u - mu)``, ``exp(v - mv)`` when already computed.
  The per-row normalisers are computed once per row: behind
  ``lax.optimization_barrier``, XLA cannot fuse them into the elementwise
  pass, which would recompute a ``log`` and a division for every class.
  """
  _, inv_su, log_su = normalizer(su)
  _, inv_sv, log_sv = normalizer(sv)
  mu, inv_su, log_su, mv, inv_sv, log_sv = lax.optimization_barrier(
    (mu, inv_su, log_su, mv, inv_sv, log_sv)
  )
  return normalized(u, v, mu, inv_su, log_su, mv, inv_sv, log_sv, eu, ev)


def normalized(u, v, mu, inv_su, log_su, mv, inv_sv, log_sv, eu=None, ev=None) -> Classes:
  """:class:`Classes` of ``u``, ``v`` from their row maxes and normalisers."""
  eu = jnp.exp(u - mu) if eu is None else eu
  ev = jnp.exp(v - mv) if ev is None else ev
  return Classes(v - mv - log_sv, u - mu - log_su, ev * inv_sv, eu * inv_su)


def class_sums(formula: Formula, params, needs: Needs, c: Classes, barrier=True):
  """Row sums of ``f`` and of the partials ``needs`` names: on CPU (``barrier``) each
  its own ``jnp.sum`` of terms written out per block, off CPU one variadic reduction."""
  out = summands(formula, params, needs, c, barrier)
  if barrier:
    return tuple(class_sum(x) for x in out)
  return joint_reduce(plain_sums(*out))[0]


def class_sums_apart(formula: Formula, params, needs: Needs, u, v, *stats):
  """:func:`class_sums` off CPU for XLA:GPU: each sum from its own copy of the row
  statistics ``stats`` (:func:`normalized`'s ``mu, inv_su, log_su, mv, inv_sv, log_sv``).

  XLA:GPU does not fuse an elementwise value that several reductions share when it holds
  transcendentals (JSD's ``log m``, TVD's ``|p - q|`` that the ``+inf`` rule below reads
  again): it writes it out, an ``[N, V]`` temporary read back by the sums. Behind its own
  ``optimization_barrier`` (a distinct scalar, used, keeps XLA's CSE from merging the
  copies) each sum recomputes its terms from ``u`` and ``v``, and XLA:GPU still merges the
  sums into one kernel (sibling multi-output fusion: the logits read once). XLA:TPU fuses
  the shared terms into one variadic reduction instead (:func:`class_sums`).
  """
  sums = []
  for k in range(needs.num_sums()):
    *copy, tag = lax.optimization_barrier((*stats, jnp.asarray(k, u.dtype)))
    copy[0] = copy[0] + 0.0 * tag  # never simplified away (0 * x is not 0 for floats)
    x = summands(formula, params, needs, normalized(u, v, *copy), False)[k]
    sums.append(class_sum(x))
  return tuple(sums)


def summands(formula: Formula, params, needs: Needs, c: Classes, barrier):
  """The per-class terms whose row sums :func:`class_sums` takes (``[rows, classes]``)."""
  f, a, b = formula.terms(c, params)
  if barrier:
    # Written out per block (in cache) before the sums: XLA:CPU would otherwise recompute
    # a shared transcendental (alpha-beta's expm1) in each sum's fusion. (Off CPU that
    # would be a [rows, classes] temporary: the terms are fused into the sums there.)
    f, a, b = lax.optimization_barrier((f, a if needs.a else f, b if needs.b else f))
  infinite = f == jnp.inf

  def total(x, partial=True):
    # An infinite partial of an infinite term counts as +inf whatever its sign, so that a
    # row sum is +inf, not NaN (+inf - inf): the rule zeroes it on such rows anyway.
    if partial:
      x = jnp.where(infinite & ~jnp.isfinite(x) & ~jnp.isnan(x), jnp.inf, x)
    return x

  out = [total(f, partial=False)]
  if needs.a:
    out.append(total(a))
  if needs.b:
    out.append(total(b))
  if any(needs.params):
    assert formula.partials is not None  # needs.params: the formula has parameters
    partials = formula.partials(c, params)
    out.extend(total(d) for d, need in zip(partials, needs.params) if need)
  return out


def softmax_grad(w, prob, zero_total, nan):
  """``w - prob * sum(w)``: the gradient wrt logits of ``sum f`` given ``w = x df/dx``.

  ``zero_total`` is ``(zero, sum w)`` per row (``sum w``, and whether the rule zeroes the
  row: :func:`kldiv_jax._engine._row_sum_or_zero`); ``nan`` the rows' NaN term.
  """
  zero, total = zero_total
  return jnp.where(zero, 0.0, w - prob * total) + nan


def rule_grads(formula: Formula, params, u, v, stats, a, b, nan):
  """``(g_u, g_v)``: the engine's derivative rule per class, the derivatives of a row's
  ``sum f`` wrt the scaled logits ``u`` (student) and ``v`` (teacher), ``[rows, classes]``.

  :math:`\\partial D / \\partial u_j = b_j - q_j \\sum_i b_i` and
  :math:`\\partial D / \\partial v_j = a_j - p_j \\sum_i a_i`, from the per-row outcomes
  (``[rows, 1]`` each): ``stats``, :func:`normalized`'s ``(mu, inv_su, log_su, mv, inv_sv,
  log_sv)``; ``a``, ``b``: ``(zero, sum a)`` and ``(zero, sum b)``, or ``()`` where the rule
  does not need that side (its derivative is then ``None``); ``nan`` the rows' NaN term.
  The engine's XLA pass (:func:`kldiv_jax._engine.tangent_rows`) and the GPU kernel of the
  same pass (:mod:`kldiv_jax._gpu_grad`, per tile) both call it.
  """
  c = normalized(u, v, *stats)
  _, terms_a, terms_b = formula.terms(c, params)
  g_u = softmax_grad(terms_b, c.q, b, nan) if b else None
  g_v = softmax_grad(terms_a, c.p, a, nan) if a else None
  return g_u, g_v


def norms(su, sv) -> Norms:
  return Norms(*normalizer(su), *normalizer(sv))
