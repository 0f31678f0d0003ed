"""Divergences between two categorical distributions, each defined once, per class.

Every divergence here is separable over the classes, :math:`D(p, q) = \\sum_i
f(p_i, q_i; \\theta)`, with ``p`` the teacher's and ``q`` the student's
distribution. A divergence is a small plug-in, :class:`Formula`: from the
per-class log-probabilities (:class:`Classes`) it gives the term ``f`` and the
probability-weighted partials

.. math::  a = p\\,\\partial f/\\partial p, \\qquad b = q\\,\\partial f/\\partial q,

and, for its parameters, :math:`\\partial f/\\partial\\theta`. Nothing else: how
rows are reduced, sharded or chunked is the engine's business
(:mod:`kldiv_jax._engine`), which turns ``a`` and ``b`` into the derivatives
wrt the logits through the softmax Jacobian, :math:`\\partial D/\\partial u_j =
b_j - q_j \\sum_i b_i` (``u`` the student's logits over ``T``) and likewise
with ``a``, ``p`` for the teacher. Written with logs, ``a`` and ``b`` stay
finite where a probability is 0 (forward KL: ``a = p (log p - log q + 1)``,
``b = -p``). Every ``f`` here is homogeneous in ``(p, q)``, so ``a + b`` is its
degree times ``f`` (Euler); the tests check it.

Per-class conventions: a class without mass on either side contributes 0 with
zero partials; a class with mass on one side only gives the limit of ``f``,
which is ``+inf`` where the divergence is unbounded (forward KL where the
student has no mass); a term with weight 0 contributes 0 even where it is
infinite (symmetric KL at ``lam = 1`` is reverse KL). Identical classes give
exactly 0: the log-mixture and the alpha-beta terms are written with
``log1p``/``expm1`` of log-ratios, which vanish there.

Parameters are Python floats (static: a formula picks its branch at trace
time) or scalar arrays (traced: every branch is computed and selected with a
double ``where``, so a new value never recompiles and a limit case never
divides by zero).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kldiv_jax._alpha_beta import ab_pass_finish, ab_pass_terms, alpha_beta, alpha_beta_partials
from kldiv_jax._numerics import (
  Param,
  cases,
  in_unit_interval,
  is_static,
  keep,
  log_ratio_mix,
  mix_quotient,
  select,
  times,
  weigh,
)

Terms = tuple[jax.Array, ...]  # (f, a, b)


class Classes(NamedTuple):
  """Per-class log-probabilities (``-inf`` without mass) and probabilities."""

  lp: jax.Array  # log p, the teacher's
  lq: jax.Array  # log q, the student's
  p: jax.Array
  q: jax.Array

  def swap(self) -> "Classes":
    return Classes(self.lq, self.lp, self.q, self.p)


def classes(lp: jax.Array, lq: jax.Array) -> Classes:
  """:class:`Classes` from log-probabilities (for callers that have no probabilities)."""
  return Classes(lp, lq, jnp.exp(lp), jnp.exp(lq))


class Norms(NamedTuple):
  """Per-row normalisers ``[rows, 1]`` of each side: mass or not, ``1/s``, ``log s``."""

  has_u: jax.Array
  inv_su: jax.Array
  log_su: jax.Array
  has_v: jax.Array
  inv_sv: jax.Array
  log_sv: jax.Array

  def swap(self) -> "Norms":
    return Norms(self.has_v, self.inv_sv, self.log_sv, self.has_u, self.inv_su, self.log_su)


class OnePass(NamedTuple):
  """A divergence's row sums from one pass over unnormalised terms, where it has such a form.

  ``terms(u0, v0, eu, ev)`` gives per-class arrays whose row sums, taken in
  the same pass as the sums of exponentials, determine the divergence: ``u0 =
  log q + log su`` (``-inf`` without mass) and ``eu = exp(u0)``, likewise for
  the teacher. ``finish(sums, norms)`` turns them into ``(sum f, sum a, sum
  b, (sum df/dtheta, ...))`` per row, the class sums the engine otherwise
  gets from a second pass over normalised :class:`Classes`. (KL is the
  example: ``sum p (log p - log q) = sum ev (v0 - u0) / sv + log su - log sv``.)

  ``kl_sums`` names each term as one of the two KL sums, ``"v"`` for ``sum ev (v0 -
  u0)`` (:func:`_kl_pass_terms`) and ``"u"`` for ``sum eu (u0 - v0)``: off CPU the engine
  then accumulates them with running maxes in the pass that finds the maxes
  (:func:`kldiv_jax._online_kl.online_kl_sums`). Empty: no such form. ``powers``: the
  terms are alpha-beta's (:func:`kldiv_jax._alpha_beta.ab_pass_terms`) at these static
  ``(alpha, beta)``, accumulated off CPU by :func:`kldiv_jax._online_ab.online_ab_sums`.
  ``cpu``: whether CPU takes the one pass too (else its two passes; the form is then for
  the pass that finds the maxes off CPU). ``checked``: how many leading sums are 0 on
  identical rows (the engine's test for them; ``None``: all).
  """

  terms: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, ...]]
  finish: Callable[[tuple[jax.Array, ...], Norms], tuple]
  kl_sums: tuple[str, ...] = ()
  powers: tuple[float, float] | None = None
  cpu: bool = True
  checked: int | None = None


# ---------------------------------------------------------------- plug-ins


@dataclasses.dataclass(frozen=True)
class Formula:
  """A divergence, per class.

  ``terms(c, params)`` gives ``(f, a, b)`` for :class:`Classes` ``c``;
  ``partials(c, params)`` the tuple of ``df/dtheta`` per parameter. ``params``
  are Python floats or scalar arrays, in the order of ``param_names``;
  ``ranges`` are their closed valid intervals and ``defaults`` their values
  for the string shorthand (``None``: no shorthand). ``smooth``: twice
  differentiable at interior points. ``source``: whose code the formula was
  ported from. ``one_pass(params)``: the :class:`OnePass` form of the row
  sums for these parameters, or ``None`` (then, or without it, the engine
  makes a second pass with ``terms``); a speed-up only, tested to agree.
  ``precise_terms``: the same terms evaluated with more care where that costs more per
  class, for paths with few classes (the top-k path's ``k + 1``); ``None``: ``terms``.
  """

  name: str
  terms: Callable[[Classes, tuple[Param, ...]], Terms]
  param_names: tuple[str, ...] = ()
  defaults: tuple[float, ...] | None = ()
  ranges: tuple[tuple[float, float], ...] = ()
  partials: Callable[[Classes, tuple[Param, ...]], tuple[jax.Array, ...]] | None = None
  smooth: bool = True
  source: str = ""
  one_pass: Callable[[tuple[Param, ...]], OnePass | None] | None = None
  precise_terms: Callable[[Classes, tuple[Param, ...]], Terms] | None = None

  def valid(self, params: tuple[Param, ...]) -> tuple:
    """The range tests of ``params`` for :func:`~kldiv_jax._numerics.nan_unless`.

    ``True`` for a static parameter (checked by :class:`Divergence`),
    :func:`~kldiv_jax._numerics.in_unit_interval` for a traced one in ``[0, 1]``,
    finiteness for an unbounded one.
    """
    return tuple(
      True
      if is_static(x)
      else in_unit_interval(x)
      if (lo, hi) == (0.0, 1.0)
      else (x >= lo) & (x <= hi) & jnp.isfinite(x)
      for x, (lo, hi) in zip(params, self.ranges)
    )


def _swapped(terms):
  """The formula of ``f(q, p)`` from that of ``f(p, q)``: ``a`` and ``b`` trade places."""

  def swapped(c, params):
    f, a, b = terms(c.swap(), params)
    return f, b, a

  return swapped


def _kl_term(p: jax.Array, lp: jax.Array, lr: jax.Array) -> jax.Array:
  """``p (log p - log r)``: 0 where ``p = 0`` whatever ``r``, ``+inf`` where only ``r = 0``."""
  has = p > 0
  return times(p, keep(has, jnp.where(has, lp, 0.0) - lr))


def _forward_kl(c, params):
  # f = p (log p - log q): a = p (log p - log q + 1), b = -p.
  f = _kl_term(c.p, c.lp, c.lq)
  return f, f + c.p, -c.p


_reverse_kl = _swapped(_forward_kl)


def _kl_pass_terms(u0, v0, eu, ev):
  """``ev (v0 - u0)``, 0 where ``ev = 0`` (``u0`` there is selected away), ``+inf`` where only
  ``eu = 0``: ``sv (KL(p || q) - log su + log sv)`` once summed."""
  has = ev > 0
  # ev * select(...), not select(ev * ...): XLA:CPU then folds the product into the sum.
  return (ev * jnp.where(has, v0 - jnp.where(has, u0, 0.0), 0.0),)


def _kl_pass_finish(sums, n):
  # KL = G / sv + log su - log sv; a = f + p and b = -p sum to KL + 1 and -1 (0 if p = 0).
  # log(su / sv) as one log of the ratio: log su and log sv are about log V each, and their
  # difference would keep their rounding, a few eps log V, where the ratio's log is within
  # about eps. Without mass on a side, the normalisers' safe logs, as before.
  (g,) = sums
  both = n.has_u & n.has_v
  ratio = jnp.where(both, n.inv_sv, 1.0) / jnp.where(both, n.inv_su, 1.0)
  log_ratio = jnp.where(both, jnp.log(ratio), n.log_su - n.log_sv)
  kl = jnp.where(n.has_v, n.inv_sv * g + log_ratio, 0.0)
  mass = n.has_v.astype(kl.dtype)
  return kl, kl + mass, -mass, ()


FORWARD_PASS = OnePass(_kl_pass_terms, _kl_pass_finish, ("v",))


def _reverse_pass_finish(sums, n):
  kl, a, b, _ = _kl_pass_finish(sums, n.swap())
  return kl, b, a, ()


REVERSE_PASS = OnePass(
  lambda u0, v0, eu, ev: _kl_pass_terms(v0, u0, ev, eu), _reverse_pass_finish, ("u",)
)


def _jsd_logs(c, beta):
  """``(log(p/m), log(q/m))`` for ``m = beta p + (1 - beta) q``, each 0 without its mass.

  As TRL computes them (``log p - log m``, one ``log`` per class): as fast as
  the hand-written kernel this engine replaced. Near ``p = q`` the difference
  cancels to an absolute error of a few ``eps * |log p|`` (the ``log1p`` form
  of :func:`~kldiv_jax._numerics.log_ratio_mix`, applied to both sides, is
  exact there, at about 15% more time); identical rows are exactly 0 anyway
  (the engine's row flag).
  """
  m = beta * c.p + (1.0 - beta) * c.q
  log_m = jnp.log(jnp.where(m != 0, m, 1.0))  # a NaN m (a NaN row) propagates
  hp, hq = c.p > 0, c.q > 0
  log_pm = jnp.where(hp, jnp.where(hp, c.lp, 0.0) - log_m, 0.0)
  return log_pm, jnp.where(hq, jnp.where(hq, c.lq, 0.0) - log_m, 0.0)


def _jsd_logs_precise(c, beta):
  """:func:`_jsd_logs` from the log-ratio ``d = log q - log p`` alone: ``m / p = 1 + (1 -
  beta) expm1(d)``, so ``log(p/m) = -log1p((1 - beta) expm1(d))`` and ``log(q/m) = d +
  log(p/m)``, factored by the larger side (``expm1`` of a non-positive number).

  Exact where ``p = q`` and as precise as ``d`` elsewhere, where :func:`_jsd_logs` rounds
  ``p``, ``q`` and ``m`` (an absolute error of about ``eps`` in each log-ratio: the whole
  error of a value that is a small difference of large terms, as a top-k tail bucket's).
  An ``expm1`` and a ``log1p`` per class more: for paths with few classes
  (:attr:`Formula.precise_terms`).
  """
  hp, hq = c.p > 0, c.q > 0
  both = hp & hq
  d = jnp.where(both, jnp.where(both, c.lq, 0.0) - jnp.where(both, c.lp, 0.0), 0.0)
  upper = d <= 0  # p >= q: log(p/m) first; else log(q/m) first, from -d
  near = -jnp.log1p(select(upper, 1.0 - beta, beta) * jnp.expm1(-jnp.abs(d)))
  log_pm = jnp.where(upper, near, near - d)
  log_qm = jnp.where(upper, near + d, near)
  # One side without mass: m is the other's share (-log beta or -log(1 - beta)); the side
  # without mass is multiplied by 0.
  log_pm = jnp.where(both, log_pm, jnp.where(hp, -jnp.log(jnp.where(hp, beta, 1.0)), 0.0))
  log_qm = jnp.where(both, log_qm, jnp.where(hq, -jnp.log1p(-jnp.where(hq, beta, 0.0)), 0.0))
  return log_pm, log_qm


def _jsd_interior(c, beta, logs=_jsd_logs):
  # f = beta p log(p/m) + (1 - beta) q log(q/m), m = beta p + (1 - beta) q.
  # d/dp: beta log(p/m) + beta - beta m/m, so a = beta p log(p/m), b likewise: f = a + b.
  log_pm, log_qm = logs(c, beta)
  a = weigh(beta, c.p * log_pm)
  b = weigh(1.0 - beta, c.q * log_qm)
  return a + b, a, b


def _jsd(c, params, logs=_jsd_logs):
  # TRL's generalized_jsd_loss: beta = 0 is KL(p || q), beta = 1 is KL(q || p).
  (beta,) = params
  return cases(
    beta == 0,
    lambda: _forward_kl(c, ()),
    lambda: cases(beta == 1, lambda: _reverse_kl(c, ()), lambda: _jsd_interior(c, beta, logs)),
  )


def _jsd_precise(c, params):
  return _jsd(c, params, _jsd_logs_precise)


def _jsd_partials(c, params):
  # d/dbeta = p log(p/m) - q log(q/m) - (p - q) (the mixture's own term); 0 at TRL's endpoints.
  (beta,) = params

  def interior():
    log_pm, log_qm = _jsd_logs(c, beta)
    return (c.p * log_pm - c.q * log_qm - (c.p - c.q),)

  return cases((beta == 0) | (beta == 1), lambda: (jnp.zeros_like(c.p),), interior)


def _jsd_one_pass(params):
  # TRL's endpoints are forward and reverse KL; the interior needs the normalised mixture.
  (beta,) = params
  if is_static(beta) and beta in (0.0, 1.0):
    return FORWARD_PASS if beta == 0 else REVERSE_PASS
  return None


def _symmetric_one_pass(params):
  (lam,) = params

  def terms(u0, v0, eu, ev):
    return (*_kl_pass_terms(u0, v0, eu, ev), *_kl_pass_terms(v0, u0, ev, eu))

  def finish(sums, n):
    fwd = _kl_pass_finish(sums[:1], n)[:3]
    rev = _reverse_pass_finish(sums[1:], n)[:3]
    f, a, b = (weigh(1.0 - lam, x) + weigh(lam, y) for x, y in zip(fwd, rev))
    return f, a, b, (rev[0] - fwd[0],)

  return OnePass(terms, finish, ("v", "u"))


def _ab_one_pass(params):
  # Static alpha, beta > 0, off CPU: three rescalable sums (kldiv_jax._alpha_beta).
  alpha, beta = params
  if not all(is_static(x) and x > 0 for x in params):
    return None
  alpha, beta = float(alpha), float(beta)

  def terms(u0, v0, eu, ev):
    return ab_pass_terms(alpha, beta, u0, v0)

  def finish(sums, n):
    return (*ab_pass_finish(alpha, beta, sums, n.log_su, n.log_sv), ())

  return OnePass(terms, finish, powers=(alpha, beta), cpu=False, checked=2)


def _symmetric_kl(c, params):
  # (1 - lam) KL(p || q) + lam KL(q || p), DistiLLM's symmetric_kl.
  (lam,) = params
  fwd, rev = _forward_kl(c, ()), _reverse_kl(c, ())
  return tuple(weigh(1.0 - lam, x) + weigh(lam, y) for x, y in zip(fwd, rev))


def _symmetric_kl_partials(c, params):
  return (_reverse_kl(c, ())[0] - _forward_kl(c, ())[0],)


def _skew_kl(c, params):
  # f = p log(p/m), m = alpha p + (1 - alpha) q: df/dq = -(1 - alpha) p/m, so
  # b = -(1 - alpha) pq/m and a = f + p - alpha p^2/m = f + (1 - alpha) pq/m.
  (alpha,) = params
  f = c.p * log_ratio_mix(c.p, c.lp, c.q, c.lq, alpha)
  pq_m = weigh(1.0 - alpha, mix_quotient(c.p, c.q, alpha))
  return f, f + pq_m, -pq_m


def _skew_kl_partials(c, params):
  # df/dalpha = -p (p - q)/m; -p/alpha where q = 0 (-inf at alpha = 0).
  (alpha,) = params
  m = alpha * c.p + (1.0 - alpha) * c.q
  has = (c.p > 0) & (m > 0)
  d = jnp.where(has, -c.p * (c.p - c.q) / jnp.where(has, m, 1.0), 0.0)
  return (jnp.where((c.p > 0) & (m == 0), -jnp.inf, d),)


def _tvd(c, params):
  # f = |p - q| / 2; subgradient sign(0) = 0 where p = q (Liger's kernel takes -1/2 there).
  diff = c.p - c.q
  # jnp.sign as two selects (0 at 0, NaN at NaN): Pallas' TPU lowering of sign asks the
  # attached TPU its generation, which a program compiled for TPU elsewhere does not have.
  sign = jnp.where(diff > 0, 1.0, jnp.where(diff < 0, -1.0, diff))
  return 0.5 * jnp.abs(diff), 0.5 * c.p * sign, -0.5 * c.q * sign


UNIT = ((0.0, 1.0),)
FORMULAS: dict[str, Formula] = {
  f.name: f
  for f in (
    Formula(
      "forward_kl",
      _forward_kl,
      source="DistiLLM distillm/losses.py forward_kl; torchtune ForwardKLLoss",
      one_pass=lambda params: FORWARD_PASS,
    ),
    Formula(
      "reverse_kl",
      _reverse_kl,
      source="DistiLLM distillm/losses.py reverse_kl",
      one_pass=lambda params: REVERSE_PASS,
    ),
    Formula(
      "jsd",
      _jsd,
      ("beta",),
      (0.5,),
      UNIT,
      _jsd_partials,
      source="TRL trl/trainer/gkd_trainer.py GKDTrainer.generalized_jsd_loss",
      one_pass=_jsd_one_pass,
      precise_terms=_jsd_precise,
    ),
    Formula(
      "symmetric_kl",
      _symmetric_kl,
      ("lam",),
      (0.5,),
      UNIT,
      _symmetric_kl_partials,
      source="DistiLLM distillm/losses.py symmetric_kl",
      one_pass=_symmetric_one_pass,
    ),
    Formula(
      "skew_kl",
      _skew_kl,
      ("alpha",),
      (0.1,),
      UNIT,
      _skew_kl_partials,
      source="DistiLLM distillm/losses.py skewed_forward_kl",
    ),
    Formula(
      "skew_reverse_kl",
      _swapped(_skew_kl),
      ("alpha",),
      (0.1,),
      UNIT,
      lambda c, params: _skew_kl_partials(c.swap(), params),
      source="DistiLLM distillm/losses.py skewed_reverse_kl",
    ),
    Formula(
      "tvd", _tvd, smooth=False, source="Liger src/liger_kernel/ops/tvd.py; DistiLLM tv_distance"
    ),
    Formula(
      "alpha_beta",
      alpha_beta,
      ("alpha", "beta"),
      None,
      ((-math.inf, math.inf), (-math.inf, math.inf)),
      alpha_beta_partials,
      source="ABKD distillation_llm/distillm/losses.py ab_div; Cichocki et al. 2011",
      one_pass=_ab_one_pass,
    ),
  )
}
