"""Vocabulary-parallel logit kernels: the class axis split over a mesh axis.

Inside ``jax.shard_map`` each device holds a slice of the classes (the
vocabulary) of every row. A softmax over the whole row only needs per-row
scalars from the other devices: the row max (``lax.pmax``) and sums over
classes (``lax.psum``: the sum of exponentials, the divergence terms, a picked
label logit). Each kernel here makes the passes of its unsharded counterpart
in :mod:`kldiv_jax._logits` with a collective after each reduction:

1. the local row max of each side, ``pmax``-ed into a global ``stop_gradient``
   max (``0`` for a row without mass, as in ``row_stats``);
2. the sums of exponentials relative to that max, ``psum``-ed;
3. (JSD only) the divergence sums given the global normalisers, ``psum``-ed.

For KL the divergence sum is accumulated in pass 2 already. Every value is
then the unsharded one, on every device (replicated over the axis), and no
vocabulary-sized buffer crosses devices.

The ``custom_jvp`` rules are those of the unsharded kernels with the
per-row tangent sum ``psum``-ed; reverse mode transposes that ``psum`` into a
broadcast of the per-row cotangent, so the gradient wrt a local slice of the
logits is computed locally, elementwise, from the global statistics.
Conventions for ``-inf`` logits, masks and NaN are those of the unsharded
kernels.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._checks import compute_dtype
from kldiv_jax._logits import (
  _log_terms,
  beta_tangent,
  gjsd,
  is_zero,
  jsd_tangent,
  kl_from_sums,
  kl_tangent,
  kl_terms,
  map_rows,
  normalizer,
  scaled,
)
from kldiv_jax._numerics import max_shift, nonnegative
from kldiv_jax._rows import ce_grad, compiled, label_hit, row_sum


def check_axis_name(name: str, axis_name: object) -> int:
  """Returns the size of mesh axis ``axis_name``; raises if it is not bound."""
  if not isinstance(axis_name, str):
    raise TypeError(
      f"{name}: axis_name must be a str (a mesh axis name) or None; got {axis_name!r}."
    )
  try:
    return int(lax.axis_size(axis_name))
  except NameError as err:
    raise ValueError(
      f"{name}: axis_name={axis_name!r} is not a mesh axis of an enclosing jax.shard_map; "
      "call the loss inside shard_map with the class axis split over that axis, "
      "or pass axis_name=None."
    ) from err


def class_offset(axis_name: str, local_classes: int) -> jax.Array:
  """The global index of this device's first class."""
  return lax.axis_index(axis_name) * local_classes


def any_class(mask: jax.Array, axis_name: str) -> jax.Array:
  """Whether any class of each row of a ``[rows or 1, classes]`` mask is on, over all devices."""
  local = jnp.any(mask, axis=1, keepdims=True)
  return lax.pmax(local.astype(jnp.int32), axis_name) > 0


def _map_blocks(fn, arrays, axis_name):
  """``map_rows`` over the row blocks of the unsharded kernel (set by the global class count).

  A device's blocks thus hold its slice of the classes of the same rows, and
  its temporaries shrink with the slice. ``arrays[0]`` is a full
  ``[rows, local_classes]`` array.
  """
  rows, local_classes = arrays[0].shape
  return map_rows(fn, arrays, rows, local_classes * lax.axis_size(axis_name))


def _global_max(local: jax.Array, axis_name: str) -> jax.Array:
  """``pmax`` of local row maxes, through :func:`max_shift`; no gradient.

  The gradient is stopped before the ``pmax``, which has no derivative rule
  (second derivatives differentiate the kernels' rules, which call this).
  """
  return max_shift(lax.pmax(lax.stop_gradient(local), axis_name))


def _maxes(temperature, masks, axis_name, z, y=None):
  """Global ``stop_gradient`` row maxes of ``z / T`` (and ``y / T``), ``[rows, 1]`` each."""

  def fn(*arrays):
    k = len(arrays) - len(masks)
    ms = arrays[k:]
    return tuple(jnp.max(scaled(a, temperature, ms)[0], axis=-1, keepdims=True) for a in arrays[:k])

  sides = (z,) if y is None else (z, y)
  local = _map_blocks(fn, (*sides, *masks), axis_name)
  return tuple(_global_max(m, axis_name) for m in local)


# KL(softmax(y / T) || softmax(z / T)) per row, as kl_kernel.


def _kl_rows(axis_name, z, y, temperature, masks):
  mu, mv = _maxes(temperature, masks, axis_name, z, y)

  def fn(z, y, mu, mv, *masks):
    u, _ = scaled(z, temperature, masks)
    v, _ = scaled(y, temperature, masks)
    ev = jnp.exp(v - mv)
    su = jnp.sum(jnp.exp(u - mu), axis=-1, keepdims=True)
    sv = jnp.sum(ev, axis=-1, keepdims=True)
    return su, sv, jnp.sum(kl_terms(u, mu, v, mv, ev), axis=-1, keepdims=True)

  su, sv, a = lax.psum(_map_blocks(fn, (z, y, mu, mv, *masks), axis_name), axis_name)
  return kl_from_sums(mu, su, mv, sv, a)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def kl_kernel(axis_name, z, y, temperature, masks):
  """``KL(softmax(y/T) || softmax(z/T))`` per row, classes split over ``axis_name``.

  Arguments as :func:`kldiv_jax._logits.kl_kernel`, with local ``[rows,
  local_classes]`` logits and masks. Returns ``[rows]``, replicated.
  """
  return nonnegative(_kl_rows(axis_name, z, y, temperature, masks)[0][:, 0])


def _kl_kernel_jvp(axis_name, primals, tangents):
  z, y, temperature, masks = primals
  kl, stats = _kl_rows(axis_name, z, y, temperature, masks)
  if all(is_zero(t) for t in tangents[:3]):
    return nonnegative(kl[:, 0]), jnp.zeros_like(kl[:, 0])
  local = kl_tangent(z, y, temperature, masks, tangents[:3], kl, stats)
  return nonnegative(kl[:, 0]), lax.psum(local, axis_name)[:, 0]


kl_kernel.defjvp(_kl_kernel_jvp, symbolic_zeros=True)
kl_kernel = compiled(kl_kernel, static_argnums=0)


# Generalized JSD per row for 0 < beta < 1, as jsd_kernel.


def _jsd_rows(axis_name, z, y, temperature, beta, masks):
  mu, mv = _maxes(temperature, masks, axis_name, z, y)

  def sums(z, y, mu, mv, *masks):
    u, _ = scaled(z, temperature, masks)
    v, _ = scaled(y, temperature, masks)
    su = jnp.sum(jnp.exp(u - mu), axis=-1, keepdims=True)
    return su, jnp.sum(jnp.exp(v - mv), axis=-1, keepdims=True)

  su, sv = lax.psum(_map_blocks(sums, (z, y, mu, mv, *masks), axis_name), axis_name)
  _, inv_su, log_su = normalizer(su)
  _, inv_sv, log_sv = normalizer(sv)

  def divergences(z, y, mu, mv, inv_su, log_su, inv_sv, log_sv, *masks):
    u, _ = scaled(z, temperature, masks)
    v, _ = scaled(y, temperature, masks)
    q = jnp.exp(u - mu) * inv_su
    p = jnp.exp(v - mv) * inv_sv
    a_q, a_p = _log_terms(u, mu, log_su, v, mv, log_sv, q, p, beta)
    return jnp.sum(q * a_q, axis=-1, keepdims=True), jnp.sum(p * a_p, axis=-1, keepdims=True)

  stats = (mu, mv, inv_su, log_su, inv_sv, log_sv)
  kl_qm, kl_pm = lax.psum(_map_blocks(divergences, (z, y, *stats, *masks), axis_name), axis_name)
  return kl_qm, kl_pm, stats


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def jsd_kernel(axis_name, z, y, temperature, beta, masks):
  """Generalized JSD per row for ``0 < beta < 1``, classes split over ``axis_name``."""
  kl_qm, kl_pm, _ = _jsd_rows(axis_name, z, y, temperature, beta, masks)
  return nonnegative(beta * kl_pm + (1.0 - beta) * kl_qm)[:, 0]


def _jsd_kernel_jvp(axis_name, primals, tangents):
  z, y, temperature, beta, masks = primals
  kl_qm, kl_pm, stats = _jsd_rows(axis_name, z, y, temperature, beta, masks)
  jsd = beta * kl_pm + (1.0 - beta) * kl_qm
  # The beta term is per row already (global): only the class sums are psum-ed.
  tangent = beta_tangent(tangents[3], kl_qm, kl_pm)
  if not all(is_zero(t) for t in tangents[:3]):
    local = jsd_tangent(z, y, temperature, beta, masks, tangents[:3], stats, kl_qm, kl_pm)
    tangent = tangent + lax.psum(local, axis_name)
  return nonnegative(jsd)[:, 0], tangent[:, 0]


jsd_kernel.defjvp(_jsd_kernel_jvp, symbolic_zeros=True)
jsd_kernel = compiled(jsd_kernel, static_argnums=0)


def gjsd_kernel(axis_name, z, y, temperature, masks, beta, beta_static):
  """TRL's generalized JSD per row, endpoints included, as :func:`kldiv_jax._logits.gjsd_kernel`."""
  if not beta_static:
    return _gjsd_traced(axis_name, z, y, temperature, masks, beta)
  kl = functools.partial(kl_kernel, axis_name)
  jsd = functools.partial(jsd_kernel, axis_name)
  return gjsd(kl, jsd, z, y, temperature, masks, beta, beta_static)


@functools.partial(compiled, static_argnums=0, inline=False)
def _gjsd_traced(axis_name, z, y, temperature, masks, beta):
  """:func:`gjsd` for a traced ``beta``, its ``lax.switch`` compiled once (``compiled``)."""
  kl = functools.partial(kl_kernel, axis_name)
  jsd = functools.partial(jsd_kernel, axis_name)
  return gjsd(kl, jsd, z, y, temperature, masks, beta, False)


# Cross entropy -log softmax(z)[label] per row, at temperature 1, as ce_kernel.


def _ce_rows(axis_name, z, labels, masks):
  one = jnp.ones((), compute_dtype(z.dtype))
  (m,) = _maxes(one, masks, axis_name, z)
  local_labels = labels - class_offset(axis_name, z.shape[1]).astype(labels.dtype)

  def fn(z, local_labels, m, *masks):
    u, _ = scaled(z, one, masks)
    s = jnp.sum(jnp.exp(u - m), axis=-1, keepdims=True)
    # The label's logit, on the device that holds it; 0 elsewhere.
    picked = jnp.sum(jnp.where(label_hit(local_labels, u.shape), u, 0.0), axis=-1, keepdims=True)
    return s, picked

  s, picked = lax.psum(_map_blocks(fn, (z, local_labels, m, *masks), axis_name), axis_name)
  has, inv_s, log_s = normalizer(s)
  return jnp.where(has, log_s + m - picked, 0.0), (m, inv_s, local_labels)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def ce_kernel(axis_name, z, labels, masks):
  """Cross entropy per row, classes split over ``axis_name``; ``labels`` global ``[rows, 1]``.

  As :func:`kldiv_jax._distill.ce_kernel`: labels must lie in ``[0,
  classes)`` of the whole (global) class axis.
  """
  return _ce_rows(axis_name, z, labels, masks)[0][:, 0]


def _ce_kernel_jvp(axis_name, primals, tangents):
  z, labels, masks = primals
  dz = tangents[0]
  ce, (m, inv_s, local_labels) = _ce_rows(axis_name, z, labels, masks)
  if is_zero(dz):
    return ce[:, 0], jnp.zeros_like(ce[:, 0])
  g = ce_grad(z, local_labels, masks, m, inv_s)
  return ce[:, 0], lax.psum(row_sum(g, dz), axis_name)[:, 0]


ce_kernel.defjvp(_ce_kernel_jvp, symbolic_zeros=True)
ce_kernel = compiled(ce_kernel, static_argnums=0)
