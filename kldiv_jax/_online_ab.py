"""Alpha-beta's row sums in one pass over both logits (online softmax), for GPU and TPU.

:func:`online_ab_sums` gives both sides' row maxes and sums of exponentials and the three
sums of :func:`kldiv_jax._alpha_beta.ab_pass_terms` (static ``alpha, beta > 0``) from one
variadic reduction whose combiner carries the running maxes and rescales the sums when a
max grows, as :func:`kldiv_jax._online_kl.online_kl_sums` does for the KL family: XLA reads
the logits once for all of them. Its derivatives are those of the same sums written as two
passes (``_two_pass_ab_sums``).
"""

import functools

import jax
import jax.numpy as jnp

from kldiv_jax._alpha_beta import ab_pass_terms
from kldiv_jax._numerics import max_shift
from kldiv_jax._online_softmax import joint_reduce, rescale
from kldiv_jax._rows import row_stats
from kldiv_jax._sums import class_sum


def _combiner(alpha: float, beta: float):
  """Two partial states ``(mu, su, mv, sv, G, H, T)`` of the same rows, as one.

  Rescaled to the new maxes (``du = mu_i - mu <= 0``, likewise ``dv``): ``T`` by
  ``e^{alpha dv + beta du}``, and ``G``, ``H`` as their log-ratios shift by ``dv - du``:
  ``G' = e^{s dv} G + T e^{alpha dv + beta du} expm1(beta (dv - du))`` (``expm1(x + y) = e^y
  expm1(x) + expm1(y)``; the one-sided terms G holds rescale by ``e^{s dv}`` too), ``H``
  likewise with ``-alpha`` and ``e^{s du}``.
  """
  s = alpha + beta

  def combine(a, b):
    mu, mv = jnp.maximum(a[0], b[0]), jnp.maximum(a[2], b[2])
    zero = jnp.zeros_like(mu)
    out = [mu, zero, mv, zero, zero, zero, zero]
    for mu_i, su_i, mv_i, sv_i, g_i, h_i, t_i in (a, b):
      fu, du = rescale(mu_i, mu)
      fv, dv = rescale(mv_i, mv)
      # Three exponentials and two expm1 besides the rescaling of su and sv: e^{s dv},
      # e^{s du} and T's factor e^{alpha dv + beta du} (exp_expm1's larger factor is one of
      # them). A state without mass on a side holds no class with both (T = 0) but an
      # infinite du or dv: its second terms are NaN there, selected away.
      ev, eu, et = jnp.exp(s * dv), jnp.exp(s * du), jnp.exp(alpha * dv + beta * du)
      shift = dv - du
      both = (mu_i != -jnp.inf) & (mv_i != -jnp.inf)
      g = jnp.where(shift > 0, -ev, et) * jnp.expm1(-jnp.abs(beta * shift)) * t_i
      h = jnp.where(shift < 0, -eu, et) * jnp.expm1(-jnp.abs(alpha * shift)) * t_i
      out[1] = out[1] + su_i * fu
      out[3] = out[3] + sv_i * fv
      out[4] = out[4] + ev * g_i + jnp.where(both, g, 0.0)  # ev = 0 only where g_i = 0
      out[5] = out[5] + eu * h_i + jnp.where(both, h, 0.0)
      out[6] = out[6] + et * t_i
    return tuple(out)

  return combine


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def online_ab_sums(alpha: float, beta: float, u: jax.Array, v: jax.Array) -> tuple:
  """``(mu, su, mv, sv, G, H, T)`` per row ``[rows, 1]`` in one pass over ``u`` (the
  student's scaled logits) and ``v`` (the teacher's): the row maxes
  (:func:`~kldiv_jax._numerics.max_shift`-ed) and sums of exponentials of
  :func:`kldiv_jax._rows.row_stats`, and the row sums of
  :func:`kldiv_jax._alpha_beta.ab_pass_terms` relative to those maxes. Off CPU only (XLA:CPU
  runs the combiner's exponentials per element). A NaN or ``+inf`` logit makes ``su`` or
  ``sv`` NaN, as in ``row_stats``.
  """
  # Each class a partial state of its own: its logits are the maxes (u0 = v0 = 0). Its sums
  # of exponentials are 1 where it has mass (NaN at a NaN or +inf logit); G is 1 where only
  # the teacher has mass, H where only the student has, T where both have. Each mask is
  # written its own way (the same on finite and -inf logits): XLA:GPU writes out a mask
  # that several of the reduction's operands share, an [N, V] temporary read back by the
  # reduction, where a mask per operand is fused into it.
  su = jnp.where(u != -jnp.inf, (u - u) + 1.0, 0.0)
  sv = jnp.where(v != -jnp.inf, (v - v) + 1.0, 0.0)
  low = jnp.finfo(u.dtype).min
  only_v = (v >= low) & (u < low)
  only_u = (u > -jnp.inf) & ~(v > -jnp.inf)
  both = ~jnp.isneginf(u) & ~jnp.isneginf(v)
  ops = (u, su, v, sv, *(m.astype(u.dtype) for m in (only_v, only_u, both)))
  inf, zero = jnp.asarray(jnp.inf, u.dtype), jnp.zeros((), u.dtype)
  init = (-inf, zero, -inf, zero, zero, zero, zero)

  def finish(res):
    mu, su, mv, sv, *sums = res
    return (max_shift(mu), su, max_shift(mv), sv, *sums)

  return joint_reduce((ops, init, _combiner(alpha, beta), finish))[0]


def _two_pass_ab_sums(alpha, beta, u, v):
  """:func:`online_ab_sums` as a max pass and then the sums: differentiable."""
  mu, _, su = row_stats(u)
  mv, _, sv = row_stats(v)
  sums = ab_pass_terms(alpha, beta, u - mu, v - mv)
  return (mu, su, mv, sv, *(class_sum(x) for x in sums))


@online_ab_sums.defjvp
def _online_ab_sums_jvp(alpha, beta, primals, tangents):
  # Second and higher derivatives only (the first come from the engine's rule).
  _, out_tangents = jax.jvp(functools.partial(_two_pass_ab_sums, alpha, beta), primals, tangents)
  return online_ab_sums(alpha, beta, *primals), out_tangents
