"""The alpha-beta divergence (ABKD), per class, with its limit cases in closed form.

Cichocki, Cruces and Amari, *Generalized Alpha-Beta Divergences and Their
Application to Robust Nonnegative Matrix Factorization*, Entropy 13 (2011),
Eq. (4)-(5); used for distillation by ABKD (Wang et al., ICML 2025), whose
``ab_div`` (``ghwang-s/abkd``, ``distillation_llm/distillm/losses.py``) is the
general branch here. For ``p`` the teacher's distribution and ``q`` the student's:

.. math::

   f = -\\frac{1}{\\alpha\\beta}\\Big(p^\\alpha q^\\beta - \\frac{\\alpha}{\\alpha+\\beta} p^{\\alpha+\\beta}
       - \\frac{\\beta}{\\alpha+\\beta} q^{\\alpha+\\beta}\\Big).

The limits ``beta = 0``, ``alpha = 0``, ``alpha + beta = 0`` and ``alpha = beta =
0`` are Cichocki et al.'s closed forms (the continuous limits). ABKD's own
limit branches scale them by ``1/alpha`` (resp. ``1/beta``) instead of
``1/alpha**2``, which is continuous only at ``alpha = 1``; we follow the paper.
Forward KL is ``(1, 0)``, reverse KL ``(0, 1)`` and ``(1/2, 1/2)`` four times the
squared Hellinger distance.
"""

import math

import jax.numpy as jnp

from kldiv_jax._numerics import cases, exp_expm1, is_static, nonzero, series, split_small

# With d = log p - log q, T = p^a q^b and E(c, x) = expm1(c x)/c (x at c = 0):
#   a_ = p df/dp = (p^s - T)/b = T E(b, d),  b_ = q df/dq = T E(a, -d),  s = a + b,
# and f = (a_ + b_)/s (Euler), that is f = q^s (E(s, d) - E(a, d))/b: a divided
# difference of E in c. The limits are closed forms: b = 0 gives q^a E_c(a, d)
# (E_c = dE/dc); s = 0 gives (E(a, d) - d)/a; a = b = 0 gives d^2/2 (both of those).


# Taylor coefficients (k = 0, 1, ...) of three expm1-type ratios, used for |x| < 1/2
# (16 terms: below float64 rounding there); the closed forms, beyond.
_SERIES = 16
_G = tuple(1 / math.factorial(k + 2) for k in range(_SERIES))  # (e^x - 1 - x) / x^2
_H = tuple((k + 1) / math.factorial(k + 2) for k in range(_SERIES))  # (x e^x - e^x + 1) / x^2
_L = tuple((k + 1) * (k + 2) / math.factorial(k + 3) for k in range(_SERIES))  # see _ab_l


def _scaled_expm1(l0, c, x, top):
  """``exp(l0) * E(c, x)``: ``exp(l0) expm1(c x) / c``, and ``exp(l0) x`` at ``c = 0``;
  ``top`` is ``l0 + c x`` (:func:`~kldiv_jax._numerics.exp_expm1`)."""
  if is_static(c) and c == 0:
    return jnp.exp(l0) * x
  out = exp_expm1(l0, c * x, top) / nonzero(c)
  return out if is_static(c) else jnp.where(c == 0, jnp.exp(l0) * x, out)


def _ab_k(c, d, lq):
  """``q^c E_c(c, d) = (p^c (c d - 1) + q^c) / c^2``; ``d^2 / 2`` at ``c = 0``."""
  small, xs, xl = split_small(c * d)
  direct = (jnp.exp(c * lq + xl) * (xl - 1.0) + jnp.exp(c * lq)) / (nonzero(c) ** 2)
  return jnp.where(small, jnp.exp(c * lq) * d * d * series(xs, _H), direct)


def _ab_l(c, d, lq):
  """``q^c d^2E/dc^2 = (p^c (x^2 - 2x + 2) - 2 q^c) / c^3``, ``x = c d``; ``d^3 / 3`` at 0."""
  small, xs, xl = split_small(c * d)
  direct = (jnp.exp(c * lq + xl) * (xl * xl - 2.0 * xl + 2.0) - 2.0 * jnp.exp(c * lq)) / (
    nonzero(c) ** 3
  )
  return jnp.where(small, jnp.exp(c * lq) * d**3 * series(xs, _L), direct)


def _ab_g(alpha, d):
  """``(expm1(alpha d) - alpha d) / alpha^2``: the ``alpha + beta = 0`` case; ``d^2/2`` at 0."""
  small, xs, xl = split_small(alpha * d)
  return jnp.where(small, d * d * series(xs, _G), (jnp.expm1(xl) - xl) / (nonzero(alpha) ** 2))


def _ab_one_sided(c, alpha, beta):
  """Where one side has no mass: ``(has, f, a, b, df/dalpha, df/dbeta)``, the limits.

  With ``x`` the exponent of the side without mass, ``y`` the other's and
  ``l`` its log-mass: ``f = e^{s l} / (x s)`` if ``x > 0`` and ``s = x + y > 0``,
  else ``+inf``; that side's weighted partial is 0 then (``-1/x`` at ``s = 0``,
  ``-e^{y l}/y`` at ``x = 0``, ``-inf`` otherwise) and the other side's
  ``e^{s l} / x`` (``+inf`` if ``x <= 0``). One ``exp`` per class serves both sides.
  """
  has_p, has_q = c.lp > -jnp.inf, c.lq > -jnp.inf
  no_p = ~has_p & has_q
  one = no_p | (has_p & ~has_q)
  x, y = jnp.where(no_p, alpha, beta), jnp.where(no_p, beta, alpha)
  log_m = jnp.where(no_p, c.lq, jnp.where(one, c.lp, 0.0))
  s = alpha + beta
  finite = (x > 0) & (s > 0)
  power = jnp.exp(s * log_m)
  big = power / nonzero(x * s)
  f = jnp.where(finite, big, jnp.inf)
  absent = jnp.where((x > 0) & (s == 0), -1.0 / nonzero(x), -jnp.inf)
  if not all(is_static(v) and v != 0 for v in (alpha, beta)):  # some exponent may be 0
    absent = jnp.where((x == 0) & (y > 0), -jnp.exp(y * log_m) / nonzero(y), absent)
  absent = jnp.where(finite, 0.0, absent)
  present = jnp.where(x > 0, power / nonzero(x), jnp.inf)
  dx = jnp.where(finite, big * (log_m - 1.0 / nonzero(x) - 1.0 / nonzero(s)), 0.0)
  dy = jnp.where(finite, big * (log_m - 1.0 / nonzero(s)), 0.0)
  swap = lambda u, v: (jnp.where(no_p, u, v), jnp.where(no_p, v, u))  # noqa: E731
  return (one, f, *swap(absent, present), *swap(dx, dy))


def _ab_interior(c, alpha, beta):
  both = (c.lp > -jnp.inf) & (c.lq > -jnp.inf)
  lp, lq = jnp.where(both, c.lp, 0.0), jnp.where(both, c.lq, 0.0)
  d = lp - lq
  log_t = (0.0 if is_static(alpha) and alpha == 0 else alpha * lp) + (
    0.0 if is_static(beta) and beta == 0 else beta * lq
  )
  return both, lp, lq, d, log_t


def _ab_sides(c, alpha, beta, interior, pick):
  """``interior`` values, the one-sided limits (``pick``-ed entries of
  :func:`_ab_one_sided`) where a side has no mass, 0 where neither has."""
  both = _ab_interior(c, alpha, beta)[0]
  one, *sided = _ab_one_sided(c, alpha, beta)
  return tuple(jnp.where(both, x, jnp.where(one, sided[k], 0.0)) for x, k in zip(interior, pick))


def _ab_terms(c, alpha, beta):
  _, lp, lq, d, log_t = _ab_interior(c, alpha, beta)
  s = alpha + beta
  a = _scaled_expm1(log_t, beta, d, s * lp)
  b = _scaled_expm1(log_t, alpha, -d, s * lq)
  f = cases(
    beta == 0,
    lambda: _ab_k(alpha, d, lq),
    lambda: cases(s == 0, lambda: _ab_g(alpha, d), lambda: (a + b) / nonzero(s)),
  )
  return f, a, b


def _factored(alpha: float, beta: float, lp, lq, has_p, has_q):
  """``(log T, e, T expm1(beta d), T expm1(-alpha d))`` per class for static ``alpha, beta >
  0``, ``T = p^alpha q^beta`` and ``d = log p - log q`` (log-masses ``lp``, ``lq``, relative
  to any per-row constants; ``-inf`` without mass).

  Each side's log-mass is the other's where it has none (0 where neither has): then ``log T``
  is ``s log r`` where only ``r`` has mass, and ``d = 0`` there. Nested selects on ``has_p``
  and ``has_q`` only (a mask of both, used by every select, is one XLA:CPU would write out in
  full). ``T`` alone underflows, and ``expm1`` overflows, for a log-ratio of a few hundred
  (NaN then) where both products are finite: each is factored by the larger of ``T`` and
  ``p^s`` (resp. ``q^s``), whose exponent is written directly (``s log p``: as ``log T +
  beta d``, a sum of large terms that cancel, it loses digits; :func:`exp_expm1`). ``e``
  is that first factor: ``T`` where ``d <= 0`` (every class where one side has no mass).
  """
  s = alpha + beta
  lp_ = jnp.where(has_p, lp, jnp.where(has_q, lq, 0.0))
  lq_ = jnp.where(has_q, lq, jnp.where(has_p, lp, 0.0))
  d = lp_ - lq_
  log_t = alpha * lp_ + beta * lq_
  xa = beta * d
  e = jnp.exp(jnp.where(xa > 0, s * lp_, log_t))
  g = jnp.where(xa > 0, -1.0, 1.0) * e * jnp.expm1(-jnp.abs(xa))
  return log_t, e, g, exp_expm1(log_t, -alpha * d, s * lq_)


def _ab_positive(c, alpha: float, beta: float):
  """``(f, a, b)`` for static ``alpha, beta > 0``, with two ``exp`` per class.

  Then ``p^s`` and ``q^s`` are at most 1 (``s = alpha + beta > 0``): ``a = T expm1(beta
  d) / beta``, ``b = T expm1(-alpha d) / alpha`` with ``T = p^alpha q^beta``, as
  :func:`_factored` writes them. Its first ``exp`` is ``r^s`` (``r`` the side with mass)
  where one side has none: there ``f = r^s / (x s)`` with ``x`` the other
  side's exponent, whose weighted partial is 0 and ``r``'s is ``r^s / x`` (the limits of
  :func:`_ab_one_sided`).
  """
  s = alpha + beta
  has_p, has_q = c.lp > -jnp.inf, c.lq > -jnp.inf
  _, e, g, h = _factored(alpha, beta, c.lp, c.lq, has_p, has_q)
  a_in, b_in = g / beta, h / alpha
  a = jnp.where(has_p, jnp.where(has_q, a_in, e / beta), 0.0)
  b = jnp.where(has_q, jnp.where(has_p, b_in, e / alpha), 0.0)
  f_p = jnp.where(has_q, (a_in + b_in) / s, e / (beta * s))
  return jnp.where(has_p, f_p, jnp.where(has_q, e / (alpha * s), 0.0)), a, b


# ---------------------------------------------------------------- the one-pass row sums
# For static alpha, beta > 0, with u0 = log q + log su and v0 = log p + log sv (each side's
# log-mass relative to its row max, -inf without mass) and E = e^{alpha v0 + beta u0}, the
# row sums of the weighted partials are, with K = log su - log sv and N = sv^-alpha su^-beta
# (so that p^alpha q^beta = N E and d = log p - log q = (v0 - u0) + K),
#   sum a = (sv^-s G + N expm1(beta K) T) / beta,  sum b = (su^-s H + N expm1(-alpha K) T) / alpha,
# N e^{beta K} = sv^-s and N e^{-alpha K} = su^-s, with G = sum E expm1(beta (v0 - u0)) and
# H = sum E expm1(-alpha (v0 - u0)) and T = sum E over the classes where both sides have
# mass; G also holds e^{s v0} where only the teacher has mass (its a = p^s / beta), H
# e^{s u0} where only the student has. sum f = (sum a + sum b) / s (Euler). expm1(x + y) =
# e^y expm1(x) + expm1(y) keeps the digits of a small divergence, and the three sums rescale
# when a row max grows: the pass that finds the maxes can take them (online softmax).


def ab_pass_terms(alpha: float, beta: float, u0, v0):
  """``(G, H, T)`` per class (above), for static ``alpha, beta > 0``."""
  has_u, has_v = u0 != -jnp.inf, v0 != -jnp.inf
  log_e, e, g, h = _factored(alpha, beta, v0, u0, has_v, has_u)
  both = has_u & has_v
  zero = jnp.zeros((), e.dtype)
  pick = lambda m, x: jnp.where(m, x, zero)  # noqa: E731
  only_v, only_u = has_v & ~has_u, has_u & ~has_v
  t = pick(both, jnp.exp(log_e))
  return jnp.where(only_v, e, pick(both, g)), jnp.where(only_u, e, pick(both, h)), t


def ab_pass_finish(alpha: float, beta: float, sums, log_su, log_sv):
  """``(sum f, sum a, sum b)`` per row from the sums of :func:`ab_pass_terms`."""
  g, h, t = sums
  s = alpha + beta
  k = log_su - log_sv
  log_n = -alpha * log_sv - beta * log_su
  # N e^{beta K} = sv^-s and N e^{-alpha K} = su^-s: at most 1 (a row max counts 1).
  wv, wu = jnp.exp(-s * log_sv), jnp.exp(-s * log_su)
  sum_a = (wv * g + exp_expm1(log_n, beta * k, -s * log_sv) * t) / beta
  sum_b = (wu * h + exp_expm1(log_n, -alpha * k, -s * log_su) * t) / alpha
  return (sum_a + sum_b) / s, sum_a, sum_b


def alpha_beta(c, params):
  alpha, beta = params
  if all(is_static(x) and x > 0 for x in params):
    return _ab_positive(c, float(alpha), float(beta))
  return _ab_sides(c, alpha, beta, _ab_terms(c, alpha, beta), (0, 1, 2))


def alpha_beta_partials(c, params):
  # f = q^s (E(s, d) - E(alpha, d)) / beta, so with K(c) = q^c E_c(c, d):
  #   df/dalpha = log q f + (K(s) - q^beta K(alpha)) / beta,  df/dbeta = log q f + (K(s) - f) / beta;
  # at beta = 0, f = K(alpha): df/dalpha = log q K + L, df/dbeta = log q K + L/2 (L = q^a E_cc).
  alpha, beta = params
  _, _, lq, d, _ = _ab_interior(c, alpha, beta)
  f = _ab_terms(c, alpha, beta)[0]
  s = alpha + beta

  def at_beta_zero():
    k, ell = _ab_k(alpha, d, lq), _ab_l(alpha, d, lq)
    return lq * k + ell, lq * k + 0.5 * ell

  def general():
    k_s, k_a = _ab_k(s, d, lq), _ab_k(alpha, d, lq)
    return lq * f + (k_s - jnp.exp(beta * lq) * k_a) / nonzero(beta), lq * f + (k_s - f) / nonzero(
      beta
    )

  return _ab_sides(c, alpha, beta, cases(beta == 0, at_beta_zero, general), (3, 4))
