"""The engine's top-k path: any divergence between a top-k teacher and a full-softmax student.

A teacher stored as its top-k token ids ``i_j`` and log-probabilities ``l_j``
(at temperature 1, over its whole vocabulary) is compared with the student's
softmax over its whole vocabulary on ``k + 1`` classes: the ``k`` top-k
tokens and one *tail* class holding the rest of the mass.

* Student: ``log q_j = soft_cap(z_{i_j}) / T - logsumexp(soft_cap(z) / T)``,
  and the tail ``logsumexp`` over the classes outside the top-k minus the
  same normaliser: in log space, never ``1 - sum_j q_j`` (which rounds to 0,
  and makes a divergence ``+inf``, for a tail below the top-k's rounding or
  logits shifted by a constant), except where the tail holds more than half of
  the mass: there ``log1p(-sum_j q_j)``, more precise than the difference of two
  log-sums of ``log V``'s size (:func:`_large_tail`). The tail's log-sum-exp is a reduction with
  a ``jax.custom_jvp`` (:func:`tail_lse`) that recomputes the tail's softmax
  in its tangent, so neither pass keeps a ``[rows, vocab]`` residual; the
  full log-sum-exp adds the ``k`` top-k logits to it. With ``axis_name``
  each device reduces its slice of the vocabulary and only per-row scalars
  cross devices.
* Teacher, ``tail=False`` (renormalised): ``p_j = softmax(l / T)_j`` over the
  top-k, and no mass in the tail. For forward KL this is exactly
  ``KL(p || q)`` over the whole vocabulary (``p`` is 0 outside the top-k).
* Teacher, ``tail=True`` (the tail bucket, TRL's ``add_tail_bucket``, verl's
  ``forward_kl_topk_tail``): ``p_j = exp(l_j)`` and the tail ``1 - sum_j p_j``,
  as ``log1mexp`` of the top-k's log-sum-exp (:func:`tail_log`).
  The teacher's mass outside the top-k is unknown at another temperature, so
  the log-probabilities are taken as the teacher's at the distillation
  temperature (as a server computes them when it samples at ``T``) and ``T``
  scales the student only.

The divergence over those ``k + 1`` classes is the formula's
(:data:`kldiv_jax._divergences.FORMULAS`), with the same per-class partials
``a = p df/dp`` and ``b = q df/dq`` as the dense engine: one
``jax.custom_jvp`` (:func:`support_divergence`) whose tangent is ``sum a dlog p
+ sum b dlog q``, so derivatives of any order exist where the formula is
smooth. The ``k``-sized arithmetic around it (renormalisation, tail masses,
duplicates) is plain JAX.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._class_sums import formula_params, identical_rows
from kldiv_jax._compat import take_along_last_axis_filled
from kldiv_jax._divergences import FORMULAS, classes
from kldiv_jax._numerics import at_most, max_shift, nonnegative, soft_cap
from kldiv_jax._online_softmax import online_softmax
from kldiv_jax._platform import compiled, gpu_or_other, map_rows, per_platform
from kldiv_jax._rows import is_zero, normalizer, row_stats, times_slope
from kldiv_jax._sums import class_sum
from kldiv_jax._vocab_parallel import class_offset, combine, global_classes

# ---------------------------------------------------------------- student

# Top-k slots whose tail mask is built by elementwise comparisons; more are scattered.
_COMPARED_SLOTS = 64


def tail_classes(z: jax.Array, ids: jax.Array, keep: jax.Array, axis_name) -> jax.Array:
  """Whether each class of ``z`` ``[rows, classes]`` is in the tail: no kept top-k slot
  holds its id, ``[rows, classes]`` bool.

  ``ids`` are global ids ``[rows, k]`` (in range where ``keep``); with
  ``axis_name`` the classes are this device's slice and the ids of the other
  slices mark nothing here. Up to :data:`_COMPARED_SLOTS` slots, compared slot
  by slot (``k`` elementwise comparisons per class, which XLA fuses into the
  reduction that reads the mask: no ``[rows, classes]`` scatter), except on GPU;
  more slots (a teacher keeping hundreds of classes, or all of them) are scattered
  into the mask, as a program of ``k`` comparisons grows with ``k`` and takes
  minutes and gigabytes to compile at ``k = 131072``. On GPU (CUDA, ROCm) the mask
  is always scattered (:func:`_scattered_tail`), chosen at lowering as the other
  per-platform kernels are.
  """
  classes = z.shape[-1]
  local = ids if axis_name is None else ids - class_offset(axis_name, classes).astype(ids.dtype)
  if local.shape[-1] > _COMPARED_SLOTS:
    return _scattered_tail(z.shape, local, keep)
  scattered = functools.partial(_scattered_tail, z.shape)
  compared = functools.partial(_compared_tail, z.shape)
  return gpu_or_other(scattered, compared, local, keep)


def _scattered_tail(shape, local, keep):
  """:func:`tail_classes` as a scatter into a ``[rows, classes]`` mask: for many slots, and
  on GPU, where it ran 3x faster than the comparisons with their gradient (an H200)."""
  # A slot without mass, or another device's id, points past the classes: dropped.
  outside = ~keep | (local < 0) | (local >= shape[-1])
  local = jnp.where(outside, shape[-1], local)
  rows = lax.broadcasted_iota(local.dtype, local.shape, 0)
  return jnp.ones(shape, jnp.bool_).at[rows, local].set(False, mode="drop")


def _compared_tail(shape, local, keep):
  """:func:`tail_classes` as ``k`` comparisons per class, fused into the reading reduction."""
  local = jnp.where(keep, local, -1)  # a slot without mass marks no class
  iota = lax.broadcasted_iota(local.dtype, shape, 1)
  tail = jnp.ones(shape, jnp.bool_)
  for j in range(local.shape[-1]):
    tail = tail & (iota != local[:, j : j + 1])
  return tail


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def tail_lse(cap, axis_name, z: jax.Array, scale: jax.Array, shift: jax.Array, ids, keep):
  """``log sum exp(soft_cap(z_v) * scale - shift)`` over the tail classes ``v`` (no kept
  top-k id), ``[rows, 1]``: the student's tail mass in log space, never ``1 - sum_j q_j``.

  ``z`` is the raw logits (any float dtype, cast inside the fusions that read
  it), ``scale = 1 / T``, ``shift`` a per-row constant ``[rows, 1]`` (no
  derivative: the caller's ``stop_gradient`` max of the top-k's scaled
  logits, so that large logits lose no digits), ``ids``/``keep`` the top-k
  (:func:`tail_classes`); the result is in ``scale``'s dtype, ``-inf`` for an
  empty tail. A tail far below the top-k (``1e-30`` of the mass; down to
  float32's smallest normal number relative to the row's max) is exact, not
  rounded to 0. With the top-k logits, whose log-sum-exp is ``k``-sized, it
  gives the full log-sum-exp (:func:`student_log_probs`): one pass over the
  classes for both, as the full log-sum-exp alone took before. The rule
  recomputes the tail's softmax in the tangent instead of saving it: reverse
  mode writes no ``[rows, vocab]`` residual.
  """
  return _tail_stats(cap, axis_name, z, scale, shift, ids, keep)[0]


def _tail_stats(cap, axis_name, z, scale, shift, ids, keep):
  """``(tail_lse, m, log_s)``: the tail's softmax is ``exp((x - m) - log_s)`` on the tail
  classes (:func:`_scaled_tail`; ``x - m`` is exact for large logits).

  Per block of rows on CPU (:func:`kldiv_jax._platform.map_rows`): XLA:CPU writes the masked
  logits as a ``[rows, vocab]`` temporary before a reduction, a block's at a time there;
  ``m`` is then the whole row's max. Off CPU ``m`` is the tail's own max, from the same pass
  as the sum (:func:`kldiv_jax._online_softmax.online_softmax`): one read of the logits.
  """

  def stats(z, ids, keep, scale):
    # The max of the raw logits (the cap is increasing): no upcast copy of bf16 logits.
    # The whole row's: a tail down to float32's smallest normal (1e-38) of the top-k's
    # mass stays exact.
    top = jnp.max(z, axis=-1, keepdims=True)
    m = lax.stop_gradient(max_shift(soft_cap(top.astype(scale.dtype), cap) * scale))
    x = _scaled_tail(cap, axis_name, z, scale, ids, keep)
    return m, class_sum(jnp.exp(x - m))

  def one_pass(z, ids, keep, scale):
    # Off CPU: the tail's own max and sum in one reduction (online softmax).
    return online_softmax(_scaled_tail(cap, axis_name, z, scale, ids, keep))[:2]

  # Half the rows of a block: a block writes two temporaries (the mask and the masked logits),
  # one block's worth together.
  classes = 2 * global_classes(z.shape[-1], axis_name)
  args = (z, ids, keep, scale.reshape(1, 1))
  m, s = map_rows(stats, args, z.shape[0], classes, accel=one_pass)
  if axis_name is not None:
    m, s = combine(m, s, axis_name)
  has, _, log_s = normalizer(s)
  return jnp.where(has, log_s + (m - shift), -jnp.inf), m, log_s


def _scaled_tail(cap, axis_name, z, scale, ids, keep):
  """``soft_cap(z) * scale`` on the tail classes, ``-inf`` elsewhere."""
  tail = tail_classes(z, ids, keep, axis_name)
  return jnp.where(tail, soft_cap(z.astype(scale.dtype), cap) * scale, -jnp.inf)


def _tail_lse_jvp(cap, axis_name, primals, tangents):
  z, scale, shift, ids, keep = primals
  dz, dscale = tangents[:2]
  lse, m, log_s = _tail_stats(cap, axis_name, z, scale, shift, ids, keep)
  # d lse = sum_v w_v dx_v over the tail, w its softmax (0 elsewhere: x = -inf there),
  # x = soft_cap(z) * scale; 0 * -inf guarded at masked logits and top-k classes.
  x = _scaled_tail(cap, axis_name, z, scale, ids, keep)
  w = jnp.exp((x - m) - log_s)
  tangent = jnp.zeros_like(lse)
  if not is_zero(dz):
    g = times_slope(w * scale, x / scale, cap)
    tangent = tangent + class_sum(g * dz.astype(w.dtype))
  if not is_zero(dscale):
    xw = jnp.where(w > 0, x, 0.0) * w
    tangent = tangent + class_sum(xw) / scale * dscale
  if axis_name is not None:
    tangent = lax.psum(tangent, axis_name)
  return lse, tangent


tail_lse.defjvp(_tail_lse_jvp, symbolic_zeros=True)
tail_lse = compiled(tail_lse, static_argnums=(0, 1), inline=False)


def gather_logits(z: jax.Array, ids: jax.Array, axis_name: str | None) -> jax.Array:
  """The raw logits ``z[row, ids]`` (``ids`` int32 global ids in range), ``[rows, k]``.

  With ``axis_name``, each device gathers the ids its slice holds and the
  parts are ``psum``-ed (one id, one device). The derivative: :func:`_pick`.
  """
  if axis_name is None:
    return _pick(z, ids)
  local = ids - class_offset(axis_name, z.shape[-1]).astype(ids.dtype)
  here = (local >= 0) & (local < z.shape[-1])
  picked = _pick(z, jnp.where(here, local, 0))
  return lax.psum(jnp.where(here, picked, jnp.zeros((), z.dtype)), axis_name)


@jax.custom_jvp
def _pick(z: jax.Array, ids: jax.Array) -> jax.Array:
  """``z[row, ids]`` for ids in ``[0, classes)``, ``[rows, k]``: a gather.

  Its tangent is the same gather on CPU and GPU; on TPU, for up to :data:`_COMPARED_SLOTS`
  slots, it is written as ``k`` masked row sums (``sum_v [v = i_j] dz_v``), whose
  transpose, reverse mode's gradient ``sum_j [v = i_j] g_j``, is elementwise: XLA fuses
  it into the pass that writes the rest of the logits' gradient, where a gather's
  transpose is a scatter into a ``[rows, vocab]`` buffer of its own (written, copied to
  the scatter's layout, scattered, converted: four more passes over the logits per
  chunk of a fused loss). Forward mode pays ``k`` reductions there instead of a gather.
  """
  return take_along_last_axis_filled(z, ids)


def _compared(dz: jax.Array, ids: jax.Array) -> jax.Array:
  """``dz[row, ids]`` as masked row sums (few slots; a gather for more)."""
  if ids.shape[-1] > _COMPARED_SLOTS:
    return take_along_last_axis_filled(dz, ids)
  iota = lax.broadcasted_iota(ids.dtype, dz.shape, 1)
  zero = jnp.zeros((), dz.dtype)
  picked = [
    jnp.sum(jnp.where(iota == ids[:, j : j + 1], dz, zero), axis=-1) for j in range(ids.shape[-1])
  ]
  return jnp.stack(picked, axis=-1)


@_pick.defjvp
def _pick_jvp(primals, tangents):
  z, ids = primals
  # On GPU the gather (a scatter in reverse mode), as on CPU: the masked sums ran 3x slower
  # than the straightforward gather's gradient on an H200; TPU keeps them.
  gather = take_along_last_axis_filled
  accel = functools.partial(gpu_or_other, gather, _compared)
  return _pick(z, ids), per_platform(gather, accel, tangents[0], ids)


# ---------------------------------------------------------------- the support


def first_occurrences(ids: jax.Array, keep: jax.Array) -> jax.Array:
  """``keep`` without the slots whose id an earlier kept slot of the row already holds.

  Stored top-k lists are sometimes padded by repeating an entry; a repeated
  id is the same token, so its first slot stands for it. One stable sort of
  ``[rows, k]`` (small beside the vocabulary); slots without mass get ids no
  kept slot has.
  """
  k = ids.shape[-1]
  if k < 2:
    return keep
  slot = lax.broadcasted_iota(jnp.int32, ids.shape, ids.ndim - 1)
  key = jnp.where(keep, ids.astype(jnp.int32), -1 - slot)
  order = jnp.argsort(key, axis=-1, stable=True)
  sorted_ids = jnp.take_along_axis(key, order, axis=-1)
  repeat = jnp.concatenate(
    [jnp.zeros_like(sorted_ids[..., :1], jnp.bool_), sorted_ids[..., 1:] == sorted_ids[..., :-1]],
    axis=-1,
  )
  inverse = jnp.argsort(order, axis=-1)
  return keep & ~jnp.take_along_axis(repeat, inverse, axis=-1)


def tail_log(x: jax.Array, k: int) -> jax.Array:
  """``log(1 - exp(x))``: the log of the mass left outside a top-k whose masses sum to
  ``exp(x)``, ``x <= 0``; ``-inf`` (an empty tail) where that mass is below ``4 k`` ulps of 1.

  The teacher's tail, from its stored top-k log-probabilities: a sum of ``k``
  probabilities is exact to about ``k`` ulps, so a smaller tail is rounding: counting it
  as mass would make a divergence that charges one side for mass the other lacks (reverse
  KL) ``+inf`` between two identical top-k lists covering the vocabulary. ``x`` is clamped
  below that first, so the derivative stays finite where the tail is empty: a zero
  cotangent there gives 0, not NaN. ``log1mexp`` (Maechler, "Accurately computing
  log(1 - exp(-|a|))", 2012): ``log(-expm1(x))`` near 0, ``log1p(-exp(x))`` below
  ``-log 2``, so a tail holding almost all the mass keeps its digits too. NaN stays NaN.
  """
  top = jnp.log1p(jnp.asarray(-4.0 * k * jnp.finfo(x.dtype).eps, x.dtype))
  x_ = at_most(top, x)
  near = x_ > -jnp.log(2.0)
  out = jnp.where(
    near,
    jnp.log(-jnp.expm1(jnp.where(near, x_, top))),
    jnp.log1p(-jnp.exp(jnp.where(near, -1.0, x_))),
  )
  return jnp.where(x >= top, -jnp.inf, out)


def floored_tail(log_probs: jax.Array, floor: float) -> jax.Array:
  """``[rows, k + 1]`` log-probabilities whose last class (the tail) holds at least
  ``-expm1(-floor)`` (about ``floor``) of the mass, the top-k's unchanged.

  TRL's ``add_tail_bucket`` (``trl/experimental/sdpo/loss_utils.py``), which clamps the
  top-k's log-mass at ``-1e-7`` before ``log(-expm1(.))``: its tail is ``max(1 - sum_j p_j,
  -expm1(-floor))``, as here, applied to both sides. A tail that the top-k's rounding
  empties (a peaked teacher, a top-k covering the vocabulary) then keeps a little mass on
  both sides, so a divergence charging one side for mass the other lacks (reverse KL, JSD's
  mixture) stays finite. A select, not a ``maximum``: an empty tail's tangent is not read.
  """
  low = math.log(-math.expm1(-floor))
  last = log_probs[:, -1:]
  last = jnp.where(last < low, jnp.asarray(low, log_probs.dtype), last)  # NaN stays NaN
  return jnp.concatenate([log_probs[:, :-1], last], axis=-1)


def _logsumexp(x: jax.Array) -> jax.Array:
  """``log sum exp`` of ``[rows, k]`` with a ``stop_gradient`` max; ``-inf`` for an all
  ``-inf`` row."""
  m, _, s = row_stats(x)
  has, _, log_s = normalizer(s)
  return jnp.where(has, log_s + m, -jnp.inf)


def teacher_log_probs(lp: jax.Array, keep: jax.Array, dropped: jax.Array, temperature, tail):
  """The teacher's log-probabilities on ``k + 1`` classes, ``[rows, k + 1]``.

  ``keep`` marks the slots with mass; ``dropped`` those whose ids the student
  lacks (a longer teacher vocabulary): their mass leaves the teacher, which is
  renormalised over the shared classes. See the module docstring for ``tail``.
  """
  if not tail:
    t = jnp.where(keep, jnp.where(keep, lp, 0.0) / temperature, -jnp.inf)
    log_p = jnp.where(keep, t - max_shift(_logsumexp(t)), -jnp.inf)
    return jnp.concatenate([log_p, jnp.full_like(log_p[:, :1], -jnp.inf)], axis=-1)
  # Shared mass 1 - (dropped mass); the top-k's total, above 1 only by rounding.
  t = jnp.where(keep, lp, -jnp.inf)
  k = lp.shape[-1]
  gone = _logsumexp(jnp.where(dropped, lp, -jnp.inf))
  log_shared = tail_log(gone, k)
  total = _logsumexp(jnp.concatenate([t, jnp.where(dropped, lp, -jnp.inf)], axis=-1))
  over = total > 0  # the stored masses sum above 1: renormalised, empty tail
  log_p = jnp.where(keep, t - jnp.where(over, total, log_shared), -jnp.inf)
  log_tail = jnp.where(over, -jnp.inf, tail_log(total, k) - log_shared)
  return jnp.concatenate([log_p, log_tail], axis=-1)


def student_log_probs(z, ids, keep, temperature, cap, axis_name):
  """The student's log-probabilities on the top-k ids and the tail, ``[rows, k + 1]``.

  ``ids`` hold ids in range where ``keep`` (int32; the others gather id 0 and
  are selected away). The tail is the log-sum-exp over the classes outside
  the top-k (:func:`tail_lse`), and the normaliser the log-sum-exp of the
  tail and the ``k`` top-k logits: both in log space, so no mass is a
  difference of two sums (a shift of the logits changes nothing; a tail
  holding ``1e-30`` of the mass is that, not 0). An all ``-inf`` student row
  is the zero measure: every class ``-inf``.
  """
  picked = gather_logits(z, jnp.where(keep, ids, 0), axis_name)

  def log_tail(scale, shift):
    return tail_lse(cap, axis_name, z, scale, shift, ids, keep)

  return topk_student(picked, keep, temperature, cap, log_tail)


def topk_student(picked, keep, temperature, cap, log_tail):
  """:func:`student_log_probs` from the student's raw logits at the top-k ids, ``picked``
  ``[rows, k]``, and ``log_tail(scale, shift)``: :func:`tail_lse` of its logits (``[rows,
  1]``), or the opt-in GPU kernels' (:mod:`kldiv_jax._gpu_fused_topk`, whose logits never
  leave the chip)."""
  scale = 1.0 / temperature
  has = keep & (picked != -jnp.inf)
  dtype = jnp.result_type(scale)
  top = soft_cap(jnp.where(has, picked, 0.0).astype(dtype), cap) * scale
  top = jnp.where(has, top, -jnp.inf)
  # Everything relative to the top-k's max, so that logits far from 0 keep their digits.
  shift = lax.stop_gradient(max_shift(jnp.max(top, axis=-1, keepdims=True)))
  log_tail = log_tail(jnp.asarray(scale, dtype), shift)
  both = jnp.concatenate([top - shift, log_tail], axis=-1)
  log_q = both - max_shift(_logsumexp(both))
  return jnp.concatenate([log_q[:, :-1], _large_tail(log_q)], axis=-1)


def _large_tail(log_q: jax.Array) -> jax.Array:
  """The tail's log-probability (``log_q[:, -1:]``), as ``log1p(-sum_j q_j)`` where it holds
  more than half of the mass.

  ``log_tail - logsumexp(top-k, log_tail)`` is a difference of two log-sums of the
  size of ``log V``, each rounded to a few ``eps log V``: when the top-k holds little of the
  mass (a flat student) that absolute error is the tail's log-probability's, and the value,
  a small difference of large tail terms, inherits it (2 to 6 times the straightforward
  formula's error at V = 8192, ``benchmarks/bench_precision.py --sweep``). Where the
  top-k's mass ``S = sum_j q_j`` is below one half, ``log1p(-S)`` carries ``S / (1 - S)``
  of ``S``'s relative error instead, ``eps log V`` at most: at least twice as precise, and
  far more for a small top-k mass. Elsewhere (a tail under one half, empty, ``-inf`` or NaN
  rows) the log-sum form stands, which keeps a tiny tail's digits.
  """
  old = log_q[:, -1:]
  large = old > -math.log(2.0)  # false for -inf (no mass) and NaN
  held = _logsumexp(log_q[:, :-1])  # log S, below -log 2 where `large`
  new = jnp.log1p(-jnp.exp(jnp.where(large, held, -1.0)))
  return jnp.where(large, new, old)


# ---------------------------------------------------------------- the divergence


def _support_value(key, traced, lp, lq):
  """``(value, same, nan, formula, params, classes, (f, a, b))`` of :func:`support_divergence`."""
  formula = FORMULAS[key[0]]
  params = formula_params(key, traced, lp.dtype)
  c = classes(lp, lq)
  # k + 1 classes: the careful evaluation costs nothing here.
  terms = (formula.precise_terms or formula.terms)(c, params)
  same = identical_rows(lp, lq)[:, 0]
  nan = _nan_rows(lp, lq)
  value = jnp.where(same, 0.0, nonnegative(jnp.sum(terms[0], axis=-1))) + nan
  return value, same, nan, formula, params, c, terms


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def support_divergence(key, lp: jax.Array, lq: jax.Array, traced: tuple) -> jax.Array:
  """``sum f(p, q)`` per row of ``[rows, classes]`` log-probabilities (``-inf``: no mass).

  Never below 0; exactly 0 with zero derivatives where the rows are equal;
  on a ``+inf`` row, a derivative that is not finite there is 0 (as the dense
  engine, :mod:`kldiv_jax._engine`).
  """
  return _support_value(key, traced, lp, lq)[0]


def _nan_rows(lp, lq):
  """NaN on rows with a NaN log-probability (a NaN logit or stored log-probability), else 0:
  the formulas read a NaN probability as no mass (``p > 0`` fails)."""
  ok = ~jnp.any(jnp.isnan(lp) | jnp.isnan(lq), axis=-1)
  # log(-1): a NaN only where one is meant to be (jax.debug_nans stays quiet elsewhere).
  return jnp.log(jnp.where(ok, 1.0, -1.0)).astype(lp.dtype)


def _support_jvp(key, primals, tangents):
  lp, lq, traced = primals
  dlp, dlq, dtraced = tangents
  value, same, nan, formula, params, c, (_, a, b) = _support_value(key, traced, lp, lq)
  infinite = value == jnp.inf

  def contract(w, dx):
    w = jnp.where(jnp.isfinite(w) | ~infinite[:, None], w, 0.0)
    return jnp.sum(jnp.where(w == 0, 0.0, w * dx.astype(w.dtype)), axis=-1)

  tangent = jnp.zeros_like(value)
  if not is_zero(dlp):
    tangent = tangent + contract(a, dlp)
  if not is_zero(dlq):
    tangent = tangent + contract(b, dlq)
  if any(not is_zero(d) for d in dtraced):
    assert formula.partials is not None  # traced parameters: the formula has some
    # The partials of the traced parameters, in order, beside their tangents.
    partials = [d for d, (_, v) in zip(formula.partials(c, params), key[1]) if v is None]
    for d_f, d in zip(partials, dtraced):
      if not is_zero(d):
        tangent = tangent + contract(d_f, jnp.broadcast_to(d, d_f.shape))
  return value, jnp.where(same, 0.0, tangent) + nan


support_divergence.defjvp(_support_jvp, symbolic_zeros=True)


def topk_rows(
  z: jax.Array,
  ids: jax.Array,
  lp: jax.Array,
  keep: jax.Array,
  dropped: jax.Array,
  temperature,
  divergence,
  tail: bool,
  cap: float | None = None,
  axis_name: str | None = None,
  floor: float = 0.0,
) -> jax.Array:
  """The divergence per row between a top-k teacher and the student's softmax (``[rows]``).

  ``z`` the student's raw logits ``[rows, vocab]`` (this device's slice with
  ``axis_name``); ``ids`` int32 global ids ``[rows, k]``, in range where
  ``keep``; ``lp`` the teacher's log-probabilities (compute dtype);
  ``keep`` the slots with mass (distinct ids: :func:`first_occurrences`);
  ``dropped`` slots whose ids only the teacher has; ``divergence`` a
  :class:`kldiv_jax._divergence_spec.Divergence`. A row without a slot with
  mass gives 0 with zero gradients. ``floor`` (with ``tail``, a static float ``>= 0``): each
  side's tail mass is at least ``-expm1(-floor)`` (:func:`floored_tail`).
  """
  log_q = student_log_probs(z, ids, keep, temperature, cap, axis_name)
  return topk_divergence(log_q, lp, keep, dropped, temperature, divergence, tail, floor)


def topk_divergence(log_q, lp, keep, dropped, temperature, divergence, tail, floor):
  """:func:`topk_rows` from the student's log-probabilities on the top-k and the tail
  (:func:`student_log_probs`, ``[rows, k + 1]``): the teacher's, the floors, the rows
  without a teacher, the divergence."""
  log_p = teacher_log_probs(lp, keep, dropped, temperature, tail)
  if tail and floor > 0:
    log_p, log_q = floored_tail(log_p, floor), floored_tail(log_q, floor)
  # A row without a slot with mass (a masked token, all padding) has no teacher: 0, with
  # zero gradients (two identical rows, all the mass in the tail).
  has = jnp.any(keep | dropped, axis=-1, keepdims=True)
  empty = jnp.where(
    lax.broadcasted_iota(jnp.int32, log_q.shape, 1) == log_q.shape[1] - 1, 0.0, -jnp.inf
  )
  log_p = jnp.where(has, log_p, empty)
  log_q = jnp.where(has, log_q, empty)
  traced = tuple(x.astype(log_q.dtype) for x in divergence.traced)
  return support_divergence(divergence.key, log_p, log_q, traced)
