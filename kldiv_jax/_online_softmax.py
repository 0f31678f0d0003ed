"""Row statistics of logits in one pass (online softmax), for GPU and TPU.

:func:`online_softmax` gives a row's max and sum of exponentials (and, on
request, a centred sum, a raw max and a label's logit) from one variadic
reduction whose combiner carries the running max (Milakov & Gimelshein 2018);
:func:`joint_reduce` runs several such reductions as one pass over the data.
XLA:CPU runs the combiner's ``exp`` per element: the CPU path keeps the two
passes of :func:`kldiv_jax._rows.row_stats` (:func:`two_pass_softmax`, which
also gives the derivatives).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._numerics import max_shift
from kldiv_jax._rows import row_stats
from kldiv_jax._sums import class_reduce, class_sum


def rescale(m, total):
  """``(exp(m - total), m - total)`` for a partial max ``m`` of a row whose max is
  ``total``: ``(1, 0)`` where they are equal (``-inf`` ones too); NaN propagates."""
  same = m == total
  return jnp.where(same, 1.0, jnp.exp(m - total)), jnp.where(same, 0.0, m - total)


def online_softmax(u, raw=None, picked=None, centred=False):
  """Row statistics of ``u`` (``-inf`` without mass) in one pass: ``(m, s, ...)``, ``[rows, 1]``.

  ``m`` the row max (:func:`~kldiv_jax._numerics.max_shift`-ed, ``stop_gradient``) and
  ``s = sum exp(u - m)``, as :func:`kldiv_jax._rows.row_stats` gives them; then with
  ``centred`` ``sum exp(u - m) (u - m)``, with ``raw`` (an array of ``u``'s shape) its row max
  (``stop_gradient``, not shifted), with ``picked`` its row sum (plain: a label's logit).
  One variadic reduction whose combiner carries the running max and rescales the sums
  when it grows (online softmax, Milakov & Gimelshein 2018): XLA reads ``u`` once, where
  the max and the sums are two passes. For GPU and TPU: XLA:CPU runs the combiner's
  ``exp`` per element. A NaN or ``+inf`` in ``u`` makes ``s`` NaN, as in ``row_stats``.
  Differentiable (the derivatives of the two-pass sums).
  """
  return _online_softmax(centred, u, raw, picked)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _online_softmax(centred, u, raw, picked):
  return joint_reduce(online_softmax_parts(centred, u, raw, picked))[0]


def online_softmax_parts(centred, u, raw, picked):
  """:func:`online_softmax`'s reduction as ``(operands, inits, combiner, finish)`` for
  :func:`joint_reduce`."""
  has = u != -jnp.inf
  zero = jnp.zeros((), u.dtype)
  inf = jnp.asarray(jnp.inf, u.dtype)
  # Each class's mass: 1, or NaN at a NaN or +inf logit (``u - u``), without an ``exp``: the
  # KL parts (``_online_kl._online_kl_parts``) write theirs ``exp(u - u)``. At a constant
  # temperature of 1, XLA folds ``z / 1``: a cross entropy's logits are then the divergence's
  # student logits, and two equal expressions were merged (CSE) into one exponential read by
  # two operands of the joint reduction, which XLA:GPU would not fuse into it (an expensive
  # producer read twice) and wrote out as an [N, V] float32 temporary (distillation_loss at
  # T = 1 compiled for an H100: 1 GiB and 3.35x the HBM floor at (2048, 131072) bf16).
  # Written differently, nothing is shared (test_engine's guard reads the compiled module).
  ops = [u, jnp.where(has, u - u + 1.0, 0.0)]
  init = [-inf, zero]
  if centred:
    ops.append(jnp.zeros_like(u))
    init.append(zero)
  if raw is not None:
    ops.append(raw.astype(u.dtype))
    init.append(-inf)
  if picked is not None:
    ops.append(picked.astype(u.dtype))
    init.append(zero)

  def combine(a, b):
    m = jnp.maximum(a[0], b[0])
    out = [m, jnp.zeros_like(m)]
    cs = jnp.zeros_like(m)
    for part in (a, b):
      f, d = rescale(part[0], m)
      out[1] = out[1] + part[1] * f
      if centred:  # the centred terms shift by the change of the max; no mass adds nothing
        cs = cs + jnp.where(part[1] * f > 0, f * (part[2] + part[1] * d), 0.0)
    i = 2
    if centred:
      out.append(cs)
      i += 1
    if raw is not None:
      out.append(jnp.maximum(a[i], b[i]))
      i += 1
    if picked is not None:
      out.append(a[i] + b[i])
    return tuple(out)

  def finish(res):
    return (max_shift(res[0]), *res[1:])

  return tuple(ops), tuple(init), combine, finish


def joint_reduce(*parts):
  """Several row reductions ``(operands, inits, combiner, finish)`` over the last axis as
  one variadic ``lax.reduce`` (one pass over the data: XLA:TPU does not merge sibling
  reductions), each result ``finish``-ed (``[rows, 1]`` arrays), one tuple per part."""
  ops = tuple(x for p in parts for x in p[0])
  init = tuple(x for p in parts for x in p[1])
  sizes = [len(p[0]) for p in parts]

  def combine(a, b):
    out, i = [], 0
    for (_, _, comb, _), k in zip(parts, sizes):
      out.extend(comb(a[i : i + k], b[i : i + k]))
      i += k
    return tuple(out)

  res = [x[:, None] for x in class_reduce(ops, init, combine)]
  outs, i = [], 0
  for (_, _, _, finish), k in zip(parts, sizes):
    outs.append(tuple(finish(res[i : i + k])))
    i += k
  return tuple(outs)


def two_pass_softmax(centred, u, raw, picked):
  """:func:`online_softmax` as a max pass and then the sums: differentiable."""
  m, e, s = row_stats(u)
  out = [m, s]
  if centred:
    out.append(class_sum(e * jnp.where(u != -jnp.inf, u - m, 0.0)))
  if raw is not None:
    out.append(lax.stop_gradient(jnp.max(raw.astype(u.dtype), axis=-1, keepdims=True)))
  if picked is not None:
    out.append(class_sum(picked.astype(u.dtype)))
  return tuple(out)


@_online_softmax.defjvp
def _online_softmax_jvp(centred, primals, tangents):
  # Derivatives of the statistics (a rule differentiated again: hessians) from the same
  # sums written with differentiable reductions; the maxes are constants.
  _, out_tangents = jax.jvp(functools.partial(two_pass_softmax, centred), primals, tangents)
  return _online_softmax(centred, *primals), out_tangents
