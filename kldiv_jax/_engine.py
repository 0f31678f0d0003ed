"""The divergence engine: any :mod:`kldiv_jax._divergences` formula over rows of logits.

One ``jax.custom_jvp`` kernel, :func:`divergence_rows`, for every divergence,
with or without a class axis split over a mesh axis (``axis_name``). For rows
``[rows, classes]`` of student logits ``z`` and teacher logits ``y``, with
``u = z / T``, ``v = y / T``, ``q = softmax(u)``, ``p = softmax(v)``:

1. per row and side, a ``stop_gradient`` max and the sum of exponentials
   (``lax.pmax``/``lax.psum`` when sharded: each device's sum is rescaled to
   the global max, so one pass over the data gives both);
2. per row, the sums over classes of the formula's ``f`` (the value) and,
   for the derivative rule, of ``a``, ``b`` and ``df/dtheta`` (``psum``-ed).

The rule then computes the derivatives per class, elementwise, from those
per-row statistics (no residual of the vocabulary's size):

.. math::

   \\frac{\\partial D}{\\partial u_j} = b_j - q_j \\sum_i b_i, \\qquad
   \\frac{\\partial D}{\\partial v_j} = a_j - p_j \\sum_i a_i, \\qquad
   \\frac{\\partial D}{\\partial \\theta} = \\sum_i \\frac{\\partial f_i}{\\partial \\theta},

contracts them with the tangents per row (``psum``-ed when sharded) and adds
the temperature's (``du/dT = -u/T``, :func:`kldiv_jax._rows.logit_tangents`).
Symbolic-zero tangents skip their sums: a teacher under ``stop_gradient`` and
a constant temperature cost nothing. The rule is plain JAX, so ``jvp``,
``jax.hessian`` and higher derivatives work. On CPU the passes run over blocks
of rows (:func:`kldiv_jax._rows.map_rows`); on one device both passes share a
block.

Row conventions: the value is ``sum f`` clamped below at 0 by
:func:`kldiv_jax._numerics.nonnegative` (rounding never makes a divergence
negative), and exactly 0 with zero derivatives where the two rows are
identical after temperature and masks (a per-row flag: under ``jit`` XLA may
round the two sides' identical arithmetic differently). NaN, in the value and
every derivative, where a logit is NaN or ``+inf``; a traced temperature or
parameter out of range is the caller's to test (``nan_unless``, as
:func:`kldiv_jax._divergence_api.divergence_from_logits` does). On a row
whose value is ``+inf``, a derivative that is not finite there is 0 (forward
KL with student mass missing: finite gradient wrt the student, 0 wrt the
teacher). A row without mass on either side is 0 with zero gradients; where
one side is the zero measure, the value is the formula's at 0 (``KL(0 || q) =
0``) and its derivatives are those of that function (0 wrt ``q`` there, where
the former KL kernels gave ``q - p``).

Reusing the per-class math elsewhere: the chunked fused LM-head loss calls
:func:`divergence_rows` per chunk of logits; a path that has log-probabilities
already (top-k) calls the formula itself, ``FORMULAS[name].terms(
classes(log_p, log_q), params)``, and reduces as it needs.
"""

import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._divergences import FORMULAS, Classes, Formula, Norms
from kldiv_jax._numerics import nonnegative
from kldiv_jax._rows import (
  compiled,
  is_zero,
  logit_tangents,
  map_rows,
  normalizer,
  row_stats,
  scaled,
)
from kldiv_jax._vocab_parallel import combine, global_classes

if TYPE_CHECKING:  # the spec's module imports this one
  from kldiv_jax._divergence_api import Divergence


class Stats(NamedTuple):
  """Per-row statistics ``[rows, 1]``: maxes and sums of exponentials, then class sums."""

  mu: jax.Array
  su: jax.Array
  mv: jax.Array
  sv: jax.Array
  same: jax.Array  # the two rows are identical (after temperature and masks)
  sums: tuple[jax.Array, ...]  # sum f, then those of ``Needs``


class Needs(NamedTuple):
  """Which class sums the derivative rule needs besides ``sum f`` (static)."""

  a: bool = False
  b: bool = False
  params: tuple[bool, ...] = ()


def _params(key, traced, dtype):
  """The formula's parameters: static floats as they are, traced ones in ``dtype``."""
  traced = iter(traced)
  return tuple(v if v is not None else next(traced).astype(dtype) for _, v in key[1])


def class_terms(u, mu, su, v, mv, sv, eu=None, ev=None) -> Classes:
  """:class:`Classes` of scaled logits ``u``, ``v`` (``-inf`` without mass) given row stats.

  ``eu``, ``ev`` are ``exp(u - mu)``, ``exp(v - mv)`` when already computed.
  """
  _, inv_su, log_su = normalizer(su)
  _, inv_sv, log_sv = normalizer(sv)
  eu = jnp.exp(u - mu) if eu is None else eu
  ev = jnp.exp(v - mv) if ev is None else ev
  return Classes(v - mv - log_sv, u - mu - log_su, ev * inv_sv, eu * inv_su)


def _class_sums(formula: Formula, params, needs: Needs, c: Classes):
  f, a, b = formula.terms(c, params)
  infinite = f == jnp.inf

  def total(x, partial=True):
    # An infinite partial of an infinite term counts as +inf whatever its sign, so that a
    # row sum is +inf, not NaN (+inf - inf): the rule zeroes it on such rows anyway.
    if partial:
      x = jnp.where(infinite & ~jnp.isfinite(x) & ~jnp.isnan(x), jnp.inf, x)
    return jnp.sum(x, axis=-1, keepdims=True)

  out = [total(f, partial=False)]
  if needs.a:
    out.append(total(a))
  if needs.b:
    out.append(total(b))
  if any(needs.params):
    assert formula.partials is not None  # needs.params: the formula has parameters
    partials = formula.partials(c, params)
    out.extend(total(d) for d, need in zip(partials, needs.params) if need)
  return tuple(out)


def _statistics(formula, params, needs, z, y, temperature, masks, axis_name) -> Stats:
  def local(z, y, *masks):
    u, _ = scaled(z, temperature, masks)
    v, _ = scaled(y, temperature, masks)
    mu, eu, su = row_stats(u)
    mv, ev, sv = row_stats(v)
    same = jnp.all(u == v, axis=-1, keepdims=True)
    return u, v, (mu, su, mv, sv, same), eu, ev

  one_pass = None if formula.one_pass is None else formula.one_pass(params)
  if axis_name is None and one_pass is not None:
    # One pass per block: the sums of exponentials and the formula's unnormalised sums.
    def fn(z, y, *masks):
      u, v, (mu, su, mv, sv, same), eu, ev = local(z, y, *masks)
      terms = one_pass.terms(u - mu, v - mv, eu, ev)
      return (mu, su, mv, sv, same, *(jnp.sum(t, axis=-1, keepdims=True) for t in terms))

    mu, su, mv, sv, same, *sums = map_rows(fn, (z, y, *masks), z.shape[0])
    f, a, b, partials = one_pass.finish(tuple(sums), Norms(*normalizer(su), *normalizer(sv)))
    class_sums = [f, *([a] if needs.a else []), *([b] if needs.b else [])]
    class_sums += [d for d, need in zip(partials, needs.params) if need]
    return Stats(mu, su, mv, sv, same, tuple(class_sums))

  if axis_name is None:

    def fn(z, y, *masks):
      u, v, stats, eu, ev = local(z, y, *masks)
      c = class_terms(u, *stats[:2], v, *stats[2:4], eu, ev)
      return (*stats, *_class_sums(formula, params, needs, c))

    mu, su, mv, sv, same, *class_sums = map_rows(fn, (z, y, *masks), z.shape[0])
    return Stats(mu, su, mv, sv, same, tuple(class_sums))

  rows, classes = z.shape
  num_classes = global_classes(classes, axis_name)
  mu, su, mv, sv, same = map_rows(lambda *a: local(*a)[2], (z, y, *masks), rows, num_classes)
  mu, su = combine(mu, su, axis_name)
  mv, sv = combine(mv, sv, axis_name)
  same = lax.psum((~same).astype(jnp.int32), axis_name) == 0

  def sums(z, y, mu, su, mv, sv, *masks):
    u, _ = scaled(z, temperature, masks)
    v, _ = scaled(y, temperature, masks)
    return _class_sums(formula, params, needs, class_terms(u, mu, su, v, mv, sv))

  out = map_rows(sums, (z, y, mu, su, mv, sv, *masks), rows, num_classes)
  return Stats(mu, su, mv, sv, same, lax.psum(out, axis_name))


class Rows(NamedTuple):
  """Per-row outcomes ``[rows, 1]``: the value and what the derivative rule must know."""

  value: jax.Array
  nan: jax.Array  # NaN on invalid rows, else 0: added to every derivative's coefficient
  zero: jax.Array  # identical rows: every derivative is 0
  infinite: jax.Array  # +inf rows: derivatives that are not finite there are 0


def _rows(stats) -> Rows:
  """The value per row: ``sum f``, never below 0, 0 on identical rows, NaN on rows with a
  NaN or ``+inf`` logit (the options' range tests are the caller's: ``nan_unless``)."""
  ok = jnp.isfinite(stats.su) & jnp.isfinite(stats.sv)
  # log(-1): a NaN only where one is meant to be (jax.debug_nans stays quiet elsewhere).
  nan = jnp.log(jnp.where(ok, 1.0, -1.0))
  value = nonnegative(jnp.where(stats.same, 0.0, stats.sums[0])) + nan
  return Rows(value, nan, stats.same, value == jnp.inf)


def _row_sum_or_zero(total, rows):
  """A class sum, 0 on identical rows and where it is not finite on ``+inf`` rows."""
  zero = rows.zero | (rows.infinite & ~jnp.isfinite(total))
  return zero, jnp.where(zero, 0.0, total)


def _softmax_grad(w, prob, total, rows):
  """``w - prob * sum(w)``: the gradient wrt logits of ``sum f`` given ``w = x df/dx``."""
  zero, total = _row_sum_or_zero(total, rows)
  return jnp.where(zero, 0.0, w - prob * total) + rows.nan


def _tangent(formula, params, z, y, temperature, masks, tangents, stats, needs, rows, axis_name):
  dz, dy, dtemp, dparams = tangents
  out = jnp.zeros_like(rows.value)
  sums = iter(stats.sums[1:])
  sum_a = next(sums) if needs.a else None
  sum_b = next(sums) if needs.b else None
  if needs.a or needs.b:
    u, keep_u = scaled(z, temperature, masks)
    v, keep_v = scaled(y, temperature, masks)
    c = class_terms(u, stats.mu, stats.su, v, stats.mv, stats.sv)
    _, a, b = formula.terms(c, params)
    g_u = _softmax_grad(b, c.q, sum_b, rows) if needs.b else jnp.zeros((), out.dtype)
    g_v = _softmax_grad(a, c.p, sum_a, rows) if needs.a else None
    local = logit_tangents(temperature, (dz, dy, dtemp), g_u, g_v, u, keep_u, v, keep_v)
    out = out + (local if axis_name is None else lax.psum(local, axis_name))
  for need, d in zip(needs.params, dparams):
    if need:
      out = out + (_row_sum_or_zero(next(sums), rows)[1] + rows.nan) * d.astype(out.dtype)
  return out


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel(key, axis_name, z, y, temperature, traced, masks):
  formula = FORMULAS[key[0]]
  params = _params(key, traced, temperature.dtype)
  stats = _statistics(formula, params, Needs(), z, y, temperature, masks, axis_name)
  return _rows(stats).value[:, 0]


def _kernel_jvp(key, axis_name, primals, tangents):
  z, y, temperature, traced, masks = primals
  dz, dy, dtemp, dtraced, _ = tangents
  formula = FORMULAS[key[0]]
  params = _params(key, traced, temperature.dtype)
  # Tangents per parameter, static ones (never differentiated) as symbolic zeros.
  dtraced = iter(dtraced)
  dparams = tuple(next(dtraced) if v is None else None for _, v in key[1])
  needs = Needs(
    a=not (is_zero(dy) and is_zero(dtemp)),
    b=not (is_zero(dz) and is_zero(dtemp)),
    params=tuple(d is not None and not is_zero(d) for d in dparams),
  )
  stats = _statistics(formula, params, needs, z, y, temperature, masks, axis_name)
  rows = _rows(stats)
  tangents = (dz, dy, dtemp, dparams)
  tangent = _tangent(
    formula, params, z, y, temperature, masks, tangents, stats, needs, rows, axis_name
  )
  return rows.value[:, 0], tangent[:, 0]


_kernel.defjvp(_kernel_jvp, symbolic_zeros=True)
_kernel = compiled(_kernel, static_argnums=(0, 1))


def divergence_rows(
  z: jax.Array,
  y: jax.Array,
  temperature: jax.Array,
  masks: tuple[jax.Array, ...],
  divergence: "Divergence",
  axis_name: str | None = None,
) -> jax.Array:
  """``D(softmax(y/T), softmax(z/T))`` per row of ``[rows, classes]`` logits (``[rows]``).

  ``z`` are the student's logits, ``y`` the teacher's (any float dtype: the
  computation runs in ``temperature``'s dtype, at least float32);
  ``temperature`` is a scalar; ``masks`` a tuple of boolean ``[rows or 1,
  classes or 1]`` arrays (masked classes leave both distributions);
  ``divergence`` a :class:`kldiv_jax._divergence_api.Divergence`. With
  ``axis_name``, inside ``jax.shard_map``, the arrays hold this device's
  slice of the classes and the result is replicated over the axis. Compiled
  once per shapes and static arguments when called eagerly (``_rows.compiled``).
  Not tested here: the temperature's and traced parameters' ranges (the
  caller applies ``nan_unless`` with ``positive_finite`` and
  ``divergence.valid()``).
  """
  return _kernel(divergence.key, axis_name, z, y, temperature, divergence.traced, tuple(masks))
