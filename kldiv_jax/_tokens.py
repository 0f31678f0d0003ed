"""Sampled tokens' log-probabilities and the softmax's entropy, per row of logits.

The kernel of :func:`kldiv_jax.token_log_probs`: for rows ``[rows, classes]`` of
logits ``z``, ``u = soft_cap(z) / T`` and ``p = softmax(u)``, one pass gives the
row max ``m``, the sum of exponentials ``s``, the sampled token's ``u`` and, for
the entropy, ``sum exp(u - m) (u - m)``:

.. math::

   \\log p_y = u_y - m - \\log s, \\qquad
   H = -\\sum_i p_i \\log p_i = \\log s - \\frac{1}{s}\\sum_i e^{u_i - m}(u_i - m).

The ``jax.custom_jvp`` rule recomputes ``p`` elementwise from those per-row
statistics (no residual of the vocabulary's size):
``d log p_y = du_y - sum p du`` and ``dH = -sum p (log p + H) du``. With
``axis_name`` each device holds a slice of the classes; the statistics are
combined with ``lax.pmax``/``lax.psum`` and the token's ``u`` comes from the
device that holds it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kldiv_jax._checks import check_int, compute_dtype, mask_array
from kldiv_jax._id_checks import check_ids, ids_differ, ids_in_range, index_array
from kldiv_jax._numerics import (
  divide_logits,
  max_shift,
  nan_unless,
  nonnegative,
  positive_finite,
  soft_cap,
)
from kldiv_jax._online_softmax import online_softmax
from kldiv_jax._platform import compiled, map_rows, per_platform
from kldiv_jax._rows import is_zero, label_hit, normalizer, times_slope
from kldiv_jax._sums import class_sum
from kldiv_jax._vocab_parallel import class_offset, global_classes


def _capped(z, masks, cap, dtype):
  """``(soft_cap(z), keep)`` in ``dtype``: the capped logits and which classes have mass."""
  z = z.astype(dtype)
  keep = z != -jnp.inf
  for m in masks:
    keep = keep & m
  return soft_cap(z, cap), keep


def _shifted(zc, keep, top, temperature):
  """``x = (soft_cap(z) - top) / T``: exactly 0 at the row's largest logit (the shift comes
  before the division, so no rounding of ``z / T`` can move it), ``-inf`` without mass."""
  return jnp.where(keep, jnp.where(keep, zc - top, 0.0) / temperature, -jnp.inf)


def _row_max(zc, keep):
  """The row max of the capped logits with mass, ``-inf`` without any."""
  return jnp.max(jnp.where(keep, zc, -jnp.inf), axis=-1, keepdims=True)


def local_ids(ids, axis_name, width):
  """Global class ids as ids of this device's ``width`` classes (others hit nothing)."""
  return ids if axis_name is None else ids - class_offset(axis_name, width).astype(ids.dtype)


def _normalizer(at_max, rest):
  """``(s != 0, 1/s, log s)`` of ``s = at_max + rest``, ``at_max`` the sum of ``e`` over the
  classes at the row's largest logit (``n`` of them, each ``e = 1``; 0 where not summed
  apart) and ``rest`` the others': ``log s = log n + log1p(rest / n)`` keeps the digits of a
  small ``rest``."""
  has, inv_s, log_s = normalizer(at_max + rest)
  apart = at_max > 0
  n = jnp.where(apart, at_max, 1.0)
  return has, inv_s, jnp.where(apart, jnp.log(n) + jnp.log1p(rest / n), log_s)


def token_stats(axis_name, cap, z, ids, temperature, masks):
  dtype = temperature.dtype
  ids = local_ids(ids, axis_name, z.shape[1])

  def sums(z, ids, top, *masks):
    # The classes at the row's largest logit (x = 0, e = 1 each, with their derivatives)
    # are summed apart from the others: a float32 ``1 + S`` would lose the low digits of a
    # small ``S``, which the entropy of a peaked row (about ``S``) is made of.
    zc, keep = _capped(z, masks, cap, dtype)
    x = _shifted(zc, keep, top, temperature)
    e = jnp.exp(x)
    at_top = x == 0
    at_max = class_sum(jnp.where(at_top, e, 0.0))
    rest = class_sum(jnp.where(at_top, 0.0, e))
    picked = class_sum(jnp.where(label_hit(ids, x.shape), x, 0.0))
    centred = class_sum(e * jnp.where(keep, x, 0.0))
    return at_max, rest, picked, centred

  num_classes = global_classes(z.shape[1], axis_name)
  if axis_name is None:

    def fn(z, ids, *masks):
      top = lax.stop_gradient(max_shift(_row_max(*_capped(z, masks, cap, dtype))))
      return (top, *sums(z, ids, top, *masks))

    def online(z, ids, *masks):
      # Off CPU, one pass (online_softmax): the sums of exp(u - max u), u = zc / T,
      # taken as those of x = (zc - top) / T (the same up to rounding).
      zc, keep = _capped(z, masks, cap, dtype)
      raw = jnp.where(keep, zc, -jnp.inf)
      hit = label_hit(ids, zc.shape)
      u = divide_logits(zc, temperature, keep)
      m, s, centred, top, zy = online_softmax(u, raw, jnp.where(hit, raw, 0.0), centred=True)
      top = max_shift(top)
      # Sums of exp(u - m) restated as the sums of x = u - top / T that the picked logit and
      # the rule use: the same values (m is top / T up to rounding), and derivatives wrt T
      # of every order that agree with them (m is a constant there, top / T is not).
      delta = m - top / temperature
      scale = jnp.exp(delta)
      s, centred = s * scale, (centred + delta * s) * scale
      # The one-pass sum is not split at the top class: its groups keep the digits.
      at_max = jnp.zeros_like(s)
      return top, at_max, s, _shifted(zy, zy != -jnp.inf, top, temperature), centred

    top, at_max, rest, picked, centred = map_rows(
      fn, (z, ids, *masks), z.shape[0], num_classes, accel=online
    )
  else:

    def tops(z, *masks):
      return (_row_max(*_capped(z, masks, cap, dtype)),)

    (top,) = map_rows(tops, (z, *masks), z.shape[0], num_classes)
    top = lax.stop_gradient(max_shift(lax.pmax(top, axis_name)))
    at_max, rest, picked, centred = map_rows(sums, (z, ids, top, *masks), z.shape[0], num_classes)
    at_max, rest, picked, centred = lax.psum((at_max, rest, picked, centred), axis_name)
  has, inv_s, log_s = _normalizer(at_max, rest)
  log_p = jnp.where(has, picked - log_s, 0.0)
  entropy = jnp.where(has, nonnegative(log_s - centred * inv_s), 0.0)
  return log_p[:, 0], entropy[:, 0], (top, log_s, ids)


def class_derivatives(z, local_ids, temperature, masks, cap, stats):
  """Per class, the derivatives of ``log p_y`` and of ``H`` wrt ``u = soft_cap(z) / T``,
  ``hit - p`` and ``-p (log p + H)`` (each sums to 0 over the classes), from the per-row
  ``stats = (top, log s, H)`` of :func:`token_stats`; also ``(soft_cap(z), x, keep)``.
  """
  top, log_s, entropy = stats
  zc, keep = _capped(z, masks, cap, temperature.dtype)
  x = _shifted(zc, keep, top, temperature)
  lp = jnp.where(keep, x - log_s, 0.0)  # log p, 0 without mass
  p = jnp.where(keep, jnp.exp(lp), 0.0)
  hit = label_hit(local_ids, x.shape).astype(p.dtype)
  return hit - p, -p * (lp + entropy.reshape(-1, 1)), zc, x, keep


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel(axis_name, cap, z, ids, temperature, masks):
  log_p, entropy, _ = token_stats(axis_name, cap, z, ids, temperature, masks)
  return log_p, entropy


def _kernel_jvp(axis_name, cap, primals, tangents):
  z, ids, temperature, masks = primals
  dz, _, dtemp, _ = tangents
  log_p, entropy, (top, log_s, local_ids) = token_stats(axis_name, cap, z, ids, temperature, masks)
  zeros = jnp.zeros_like(log_p)
  if is_zero(dz) and is_zero(dtemp):
    return (log_p, entropy), (zeros, zeros)
  g_lp, g_h, zc, x, keep = class_derivatives(
    z, local_ids, temperature, masks, cap, (top, log_s, entropy)
  )
  d_lp = jnp.zeros_like(log_p[:, None])
  d_h = jnp.zeros_like(d_lp)
  if not is_zero(dz):
    du = times_slope(dz.astype(g_lp.dtype), zc, cap)  # the tangent of soft_cap(z), T times du
    d_lp = d_lp + class_sum(g_lp * du) / temperature
    d_h = d_h + class_sum(g_h * du) / temperature
  if not is_zero(dtemp):
    # du/dT = -u/T; the gradients sum to 0, so the shifted x gives the same (exactly).
    x0 = jnp.where(keep, x, 0.0)
    scale = -dtemp / temperature
    d_lp = d_lp + class_sum(g_lp * x0) * scale
    d_h = d_h + class_sum(g_h * x0) * scale
  if axis_name is not None:
    d_lp, d_h = lax.psum((d_lp, d_h), axis_name)
  return (log_p, entropy), (d_lp[:, 0], d_h[:, 0])


_kernel.defjvp(_kernel_jvp, symbolic_zeros=True)
_kernel = compiled(_kernel, static_argnums=(0, 1))


def token_rows(
  z: jax.Array,
  ids: jax.Array,
  temperature: jax.Array,
  masks: tuple[jax.Array, ...] = (),
  axis_name: str | None = None,
  cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
  """``(log p_y, H)`` per row of ``[rows, classes]`` logits at temperature ``temperature``.

  ``ids`` are ``[rows, 1]`` int32 global class indices in range (the caller
  tests it); ``masks`` boolean ``[rows or 1, classes or 1]`` (masked classes
  leave the softmax). A row without mass gives 0 and 0; a token on a class
  without mass gives ``-inf``. The computation runs in ``temperature``'s
  dtype (at least float32).
  """
  temperature = temperature.astype(compute_dtype(temperature.dtype))
  return _kernel(axis_name, cap, z, ids, temperature, tuple(masks))


def _log_prob_stats(z, ids, temperature, derivative):
  """``(log p_y, x, x_y, e, 1/s)`` of :func:`_log_probs_only`: ``x = (z - top) / T``,
  ``e = exp(x)``, ``s = sum e``; ``log p_y`` 0 without mass.

  ``derivative``: ``x`` as :func:`_shifted` gives it, whose derivative wrt ``T`` is 0
  rather than NaN at ``-inf`` logits (the rule below is itself differentiated for a
  hessian). The value alone takes ``(z - top) / T``, the same numbers (``-inf``
  stays ``-inf``), whose ``exp`` XLA:CPU fuses into the sum: selects before the
  ``exp`` make it write ``e`` out, a full-size temporary.
  """
  zc = z.astype(temperature.dtype)
  # No mask: the max of z is that of the classes with mass (a max of where(keep, z, -inf)
  # would be written out as a full-size array before XLA:CPU's reduction).
  top = lax.stop_gradient(max_shift(jnp.max(zc, axis=-1, keepdims=True)))
  x = _shifted(zc, zc != -jnp.inf, top, temperature) if derivative else (zc - top) / temperature
  e = jnp.exp(x)
  zy = jnp.take_along_axis(zc, ids, axis=-1, mode="promise_in_bounds")
  x_y = _shifted(zy, zy != -jnp.inf, top, temperature)
  has, inv_s, log_s = normalizer(class_sum(e))
  return jnp.where(has, x_y - log_s, 0.0), x, x_y, e, inv_s


@jax.custom_jvp
def _log_probs_only(z, ids, temperature):
  """``log p_y = x_y - log sum exp(x)`` per row, ``x = (z - top) / T``, 0 for a row
  without mass: :func:`_kernel`'s log-probabilities alone, ``[rows]``.

  Without the entropy there is one sum over the classes, and the kernel is
  the plain expression (Tunix's ``selective_log_softmax``,
  ``tunix/rl/common.py``, with the row max as a ``stop_gradient``): the rule
  below takes ``p = e / s`` from the very ``e = exp(x)`` the forward sums, so
  XLA computes ``exp`` once, writes it in place of the gradient and reads it
  back for ``g (onehot - p)``. :func:`_kernel`'s rule recomputes the softmax
  (twice the ``exp`` work, which dominates on CPU), and its CPU row loop does
  not pay for one sum: this takes about 0.7x its CPU time, level with Tunix's
  code (``benchmarks/bench_rl.py``).
  The derivatives are :func:`_kernel`'s, ``hit - p`` per class (``/ T``).
  """
  return _log_prob_stats(z, ids, temperature, False)[0][:, 0]


@functools.partial(_log_probs_only.defjvp, symbolic_zeros=True)
def _log_probs_only_jvp(primals, tangents):
  z, ids, temperature = primals
  dz, _, dtemp = tangents
  log_p, x, x_y, e, inv_s = _log_prob_stats(z, ids, temperature, True)
  d_lp = jnp.zeros_like(log_p)
  if not is_zero(dz):
    dz = dz.astype(e.dtype)
    dz_y = jnp.take_along_axis(dz, ids, axis=-1, mode="promise_in_bounds")
    d_lp = d_lp + (dz_y - class_sum(e * dz) * inv_s) / temperature
  if not is_zero(dtemp):
    # du/dT = -u/T; hit - p sums to 0, so the shifted x gives the same (exactly).
    x0 = jnp.where(e != 0, x, 0.0)
    x0_y = jnp.where(x_y != -jnp.inf, x_y, 0.0)
    d_lp = d_lp - (x0_y - class_sum(e * x0) * inv_s) * (dtemp / temperature)
  return log_p[:, 0], d_lp[:, 0]


_log_probs_only = compiled(_log_probs_only)


def token_log_prob_rows(z: jax.Array, ids: jax.Array, temperature: jax.Array) -> jax.Array:
  """``log p_y`` per row of ``[rows, classes]`` logits: ``token_rows(z, ids, T)[0]``
  (values and derivatives) without a soft-cap, masks or ``axis_name``, faster.

  For ``z`` in the compute dtype (float32, or float64): the kernel writes
  ``exp(x)`` out for the backward, in place of a gradient of ``z``'s dtype;
  for bf16/f16 logits that would be a float32 ``[rows, classes]`` temporary,
  which :func:`token_rows` does not hold.
  """
  temperature = temperature.astype(compute_dtype(temperature.dtype))

  def accel(z, ids, temperature):
    # Off CPU, :func:`_kernel` (its one-pass statistics; the entropy is dead code there):
    # XLA:GPU and XLA:TPU recompute ``exp`` in the gradient's pass at no cost in bandwidth.
    return _kernel(None, None, z, ids, temperature, ())[0]

  return per_platform(_log_probs_only, accel, z, ids, temperature)


# -- the public functions' token layout (token_log_probs, fused_token_log_probs) -----------------


def token_mask(name, where, token_shape, rows):
  """``where``, a mask of ``token_shape``, as ``[rows, 1]`` (all True for ``None``)."""
  if where is None:
    return jnp.ones((rows, 1), jnp.bool_)
  w = mask_array(name, where)
  if w.shape != token_shape:
    raise ValueError(f"{name}: where must be a token mask of shape {token_shape}; got {w.shape}.")
  return w.reshape(rows, 1)


def token_layout(name, token_ids, token_shape, shape_text, where, ignore_index, num_classes):
  """``(mask, in_range, safe)``, ``[rows, 1]`` each: the tokens that count (``where`` and
  not ``ignore_index``; ``None`` when every one does), the ids in ``[0, num_classes)`` or not
  counted, and the ids with the others replaced by 0 (int32). ``shape_text`` names
  ``token_shape`` in the shape error."""
  ids = index_array(name, "token_ids", token_ids, "token ids")
  if ids.shape != token_shape:
    raise ValueError(f"{name}: token_ids must have {shape_text} {token_shape}; got {ids.shape}.")
  rows = int(np.prod(token_shape, dtype=np.int64))
  mask = None if where is None else token_mask(name, where, token_shape, rows)
  if ignore_index is not None:
    ignore_index = check_int(name, "ignore_index", ignore_index)
  check_ids(
    name, "token_ids", ids, num_classes, mask, ignore_index=ignore_index, has_ignore_index=True
  )
  ids = ids.reshape(rows, 1)
  if ignore_index is not None:
    kept = ids_differ(ids, ignore_index)
    mask = kept if mask is None else mask & kept
  in_range = ids_in_range(ids, num_classes)
  if mask is not None:
    in_range = in_range | ~mask
  return mask, in_range, jnp.where(in_range, ids, 0).astype(jnp.int32)


def token_outputs(log_p, entropy, in_range, mask, token_shape, dtype, temperature, with_entropy):
  """The public outputs from ``[rows]`` kernel results: NaN for an id out of range or an
  invalid temperature, 0 for tokens that do not count, ``token_shape`` and ``dtype``."""
  valid = positive_finite(temperature)

  def out(x):
    x = x if mask is None else jnp.where(mask[:, 0], x, 0.0)
    return nan_unless(x.reshape(token_shape).astype(dtype), valid)

  log_p = out(nan_unless(log_p, in_range[:, 0]))
  return (log_p, out(entropy)) if with_entropy else log_p
