"""The KL family's row sums in one pass over both logits (online softmax), for GPU and TPU.

:func:`online_kl_sums` gives both sides' row maxes and sums of exponentials
and the weighted log-ratio sums of the one-pass formulas
(:class:`kldiv_jax._divergences.OnePass`) from one variadic reduction;
:func:`online_kl_ce_sums` adds a cross entropy's statistics to the same pass.
The divergence kernels (:mod:`kldiv_jax._engine`,
:mod:`kldiv_jax._divergence_ce`) use them off CPU; their derivatives are those
of the same sums written as two passes (``_two_pass_kl_sums``).
"""

import jax
import jax.numpy as jnp

from kldiv_jax._divergences import FORWARD_PASS, REVERSE_PASS
from kldiv_jax._numerics import max_shift
from kldiv_jax._online_softmax import joint_reduce, online_softmax_parts, rescale, two_pass_softmax
from kldiv_jax._rows import row_stats
from kldiv_jax._sums import class_sum


def _combine_online(a, b):
  """Two partial :func:`online_kl_sums` states of the same rows, as one."""
  mu, mv = jnp.maximum(a[0], b[0]), jnp.maximum(a[2], b[2])
  out = [mu, jnp.zeros_like(mu), mv, jnp.zeros_like(mv), jnp.zeros_like(mu), jnp.zeros_like(mu)]
  for mu_i, su_i, mv_i, sv_i, gv_i, gu_i in (a, b):
    fu, du = rescale(mu_i, mu)
    fv, dv = rescale(mv_i, mv)
    out[1] = out[1] + su_i * fu
    out[3] = out[3] + sv_i * fv
    # The log-ratios shift by the change of the maxes; a side without mass (or whose
    # mass underflows at the new max, as ``ev > 0`` in _kl_pass_terms) adds nothing.
    out[4] = out[4] + jnp.where(sv_i * fv > 0, fv * (gv_i + sv_i * (dv - du)), 0.0)
    out[5] = out[5] + jnp.where(su_i * fu > 0, fu * (gu_i + su_i * (du - dv)), 0.0)
  return tuple(out)


@jax.custom_jvp
def online_kl_sums(u: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
  """``(mu, su, mv, sv, gv, gu)`` per row ``[rows, 1]`` in one pass over ``u`` and ``v``.

  The row maxes (:func:`~kldiv_jax._numerics.max_shift`-ed) and sums of exponentials of
  :func:`kldiv_jax._rows.row_stats`, and the KL sums of the one-pass formulas, ``gv =
  sum ev (v0 - u0)`` (:func:`kldiv_jax._divergences._kl_pass_terms`) and ``gu = sum eu
  (u0 - v0)``, from one variadic reduction whose combiner carries running maxes and
  rescales the sums when a max grows (online softmax, Milakov & Gimelshein 2018). XLA
  then reads the logits once for all of them, where the max and the sums are two passes.
  Off CPU only: XLA:CPU runs the combiner's exponentials per element.
  """
  return joint_reduce(_online_kl_parts(u, v))[0]


def _online_kl_parts(u, v):
  """:func:`online_kl_sums`' reduction for :func:`kldiv_jax._online_softmax.joint_reduce`."""
  # Each class a partial state of its own: its logits are the maxes; a class with mass
  # on one side only gives +inf to that side's log-ratio sum (as _kl_pass_terms does).
  # Each operand tests for mass its own way (!=, >, ==): XLA:GPU (jax 0.11) wrote a mask
  # that several operands shared out as a [rows, classes] temporary (symmetric KL, which
  # reads both sums, at 1.33x the straightforward code's time on an H200). The masses are
  # ``exp(u - u)`` here and ``u - u + 1`` in online_softmax_parts: never one expression,
  # which XLA would merge where a cross entropy's logits equal ``u`` (temperature 1).
  inf = jnp.asarray(jnp.inf, u.dtype)
  su = jnp.where(u != -inf, jnp.exp(u - u), 0.0)  # 1, or NaN at a NaN or +inf logit
  sv = jnp.where(v != -inf, jnp.exp(v - v), 0.0)
  gv = jnp.where((v > -inf) & (u == -inf), inf, 0.0)
  gu = jnp.where((u > -inf) & (v == -inf), inf, 0.0)
  zero = jnp.zeros((), u.dtype)
  init = (-inf, zero, -inf, zero, zero, zero)

  def finish(res):
    mu, su, mv, sv, gv, gu = res
    return max_shift(mu), su, max_shift(mv), sv, gv, gu

  return (u, su, v, sv, gv, gu), init, _combine_online, finish


@jax.custom_jvp
def online_kl_ce_sums(u, v, w, picked):
  """:func:`online_kl_sums` of ``u``, ``v`` and :func:`kldiv_jax._online_softmax.online_softmax`
  ``(m, s, picked)`` of ``w`` (a cross entropy's logits) in the same single pass."""
  return joint_reduce(_online_kl_parts(u, v), online_softmax_parts(False, w, None, picked))


@online_kl_ce_sums.defjvp
def _online_kl_ce_sums_jvp(primals, tangents):
  u, v, w, picked = primals
  du, dv, dw, dpicked = tangents
  _, kl = jax.jvp(_two_pass_kl_sums, (u, v), (du, dv))
  _, ce = jax.jvp(lambda w, p: two_pass_softmax(False, w, None, p), (w, picked), (dw, dpicked))
  return online_kl_ce_sums(*primals), (kl, ce)


def _two_pass_kl_sums(u, v):
  """:func:`online_kl_sums` the CPU's way (a max pass, then the sums): differentiable."""
  mu, eu, su = row_stats(u)
  mv, ev, sv = row_stats(v)
  u0, v0 = u - mu, v - mv
  (gv,) = FORWARD_PASS.terms(u0, v0, eu, ev)
  (gu,) = REVERSE_PASS.terms(u0, v0, eu, ev)
  total = class_sum
  return mu, su, mv, sv, total(gv), total(gu)


@online_kl_sums.defjvp
def _online_kl_sums_jvp(primals, tangents):
  # Second and higher derivatives only (the first come from the rule of _kernel): the
  # tangents of the same sums written with differentiable reductions.
  _, out_tangents = jax.jvp(_two_pass_kl_sums, primals, tangents)
  return online_kl_sums(*primals), out_tangents
