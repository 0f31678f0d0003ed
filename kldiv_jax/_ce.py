"""Cross entropy ``-log softmax(z)[label]`` per row of logits, one kernel for every path.

The hard-label term of :func:`kldiv_jax.distillation_loss`, at temperature 1,
with the class masks of the divergence. One ``jax.custom_jvp`` kernel,
:func:`ce_rows`, with or without the class axis split over a mesh axis
(``axis_name``): one pass gives the row max, the sum of exponentials and the
label's logit (on the device that holds it; ``psum``-ed, with the sums
rescaled to the global max by :func:`kldiv_jax._vocab_parallel.combine`), and
the rule's tangent is ``softmax(z) - onehot(label)`` recomputed elementwise
from those row statistics (no residual of the vocabulary's size).

Its two options (:class:`CEOptions`), each off and out of the program when ``None``:
label smoothing ``eps``, the target ``(1 - eps) onehot(label) + eps / K`` over the ``K``
classes the masks keep (optax's ``smooth_labels``, torch's ``label_smoothing``), and the
z-loss ``z_loss * lse(z)**2`` (PaLM's auxiliary loss, MaxText's and T5X's ``z_loss``,
Levanter's ``logsumexp_weight``), from the same pass: the target's weighted logits are the
one row sum the label's logit was.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._checks import compute_dtype
from kldiv_jax._online_softmax import online_softmax
from kldiv_jax._platform import compiled, map_rows
from kldiv_jax._rows import (
  absent,
  ce_grad,
  ce_targets,
  is_zero,
  normalizer,
  row_stats,
  row_sum,
  scaled,
)
from kldiv_jax._vocab_parallel import class_offset, combine, global_classes


class CEOptions(NamedTuple):
  """The cross entropy's options: each ``None`` (off, and absent from the program) or a 0-d
  array in the compute dtype (its value, traced or not, checked by the caller)."""

  label_smoothing: jax.Array | None = None  # eps in [0, 1]
  z_loss: jax.Array | None = None  # the coefficient of lse**2, >= 0


OFF = CEOptions()  # the plain cross entropy


def smoothing_count(masks, num_classes: int, axis_name=None):
  """``K``, the classes label smoothing spreads over: those every class mask keeps, ``[rows or
  1, 1]`` int32 (global with ``axis_name``), or the global class count without class masks."""
  kept = [m for m in masks if m.shape[1] != 1]
  if not kept:
    return global_classes(num_classes, axis_name)
  count = jnp.sum(functools.reduce(jnp.logical_and, kept), axis=1, keepdims=True, dtype=jnp.int32)
  return count if axis_name is None else lax.psum(count, axis_name)


def target_logits(u, labels, masks, opts: CEOptions, count):
  """The cross entropy's target times the (masked, capped) logits ``u``, per class: its row
  sum is the label's logit, or with label smoothing the smoothed target's mean logit."""
  target = ce_targets(labels, u.shape, masks, opts.label_smoothing, count)
  if opts.label_smoothing is None:
    return jnp.where(target, u, 0.0)
  # The target's mass on a class without any (-inf, masked or not) is -inf, a constant: no
  # 0 * -inf in the value, nor in the derivatives wrt the smoothing (ignored rows included).
  lost = (u == -jnp.inf) & (target != 0)
  return target * jnp.where(u == -jnp.inf, 0.0, u) + jnp.where(lost, -jnp.inf, 0.0)


def ce_stats(axis_name, cap, z, labels, masks, opts=OFF):
  one = jnp.ones((), compute_dtype(z.dtype))
  if axis_name is not None:  # labels of this device's classes; the others hit nothing
    labels = labels - class_offset(axis_name, z.shape[1]).astype(labels.dtype)
  count = None
  extra = ()  # a per-row count goes through the row blocks with the rows
  if opts.label_smoothing is not None:
    count = smoothing_count(masks, z.shape[1], axis_name)
    if not isinstance(count, int):
      extra = (count,)

  def fn(z, labels, *rest):
    masks, k = _split(rest, count)
    u, _ = scaled(z, one, masks, cap)
    m, _, s = row_stats(u)
    picked = jnp.sum(target_logits(u, labels, masks, opts, k), axis=-1, keepdims=True)
    return m, s, picked

  def online(z, labels, *rest):  # off CPU: one pass (online_softmax)
    masks, k = _split(rest, count)
    u, _ = scaled(z, one, masks, cap)
    return online_softmax(u, picked=target_logits(u, labels, masks, opts, k))

  num_classes = global_classes(z.shape[1], axis_name)
  arrays = (z, labels, *masks, *extra)
  m, s, picked = map_rows(fn, arrays, z.shape[0], num_classes, accel=online)
  if axis_name is not None:
    m, s = combine(m, s, axis_name)
    picked = lax.psum(picked, axis_name)
  ce, (m, inv_s) = ce_finish(m, s, picked, opts)
  return ce, (m, inv_s, labels)


def _split(rest, count):
  """``(masks, count)`` from a row function's arguments after the labels."""
  if count is None or isinstance(count, int):
    return rest, count
  return rest[:-1], rest[-1]


def ce_finish(m, s, picked, opts=OFF):
  """``(ce, (m, 1/s))`` per row from the row max, sum of exponentials and label's logit
  (the target's weighted logits: :func:`target_logits`); plus the z-loss."""
  has, inv_s, log_s = normalizer(s)
  ce = log_s + m - picked
  if opts.z_loss is not None:
    lse = log_s + m
    ce = ce + opts.z_loss * (lse * lse)
  return jnp.where(has, ce, 0.0), (m, inv_s)


def ce_tangent(z, labels, masks, m, inv_s, cap, opts: CEOptions, tangents, axis_name=None):
  """The cross entropy's tangent per row (``[rows, 1]``, replicated over ``axis_name``) for
  ``tangents = (dz, d opts)``, not all symbolic zeros (those are skipped); ``labels`` local
  ones, ``m`` and ``inv_s`` the global row statistics (:func:`ce_stats`'). The rule, once:
  ``dz`` times ``softmax (1 + 2 z_loss lse) - target`` (:func:`kldiv_jax._rows.ce_grad`),
  the smoothing's ``u_y - mean(u)`` and the z-loss's ``lse**2``; 0 on rows without mass."""
  dz, (deps, dzl) = tangents
  eps, zl = opts
  count = None if eps is None else smoothing_count(masks, z.shape[1], axis_name)
  terms = []
  if not is_zero(dz):
    terms.append(row_sum(ce_grad(z, labels, masks, m, inv_s, cap, eps, count, zl), dz))
  if eps is not None and not is_zero(deps):
    # d/d eps of -((1 - eps) u_y + eps mean(u)): the label's logit minus the mean.
    u, _ = scaled(z, jnp.ones((), inv_s.dtype), masks, cap)
    one = jnp.ones((), inv_s.dtype)
    mean = jnp.sum(target_logits(u, labels, masks, CEOptions(one), count), -1, keepdims=True)
    label = jnp.sum(target_logits(u, labels, masks, CEOptions(), None), -1, keepdims=True)
    terms.append(jnp.where(inv_s != 0, label - mean, 0.0) * deps)
  out = functools.reduce(jnp.add, terms) if terms else jnp.zeros((z.shape[0], 1), inv_s.dtype)
  if axis_name is not None:
    out = lax.psum(out, axis_name)
  if zl is not None and not is_zero(dzl):
    lse = m - jnp.log(jnp.where(inv_s != 0, inv_s, 1.0))
    out = out + jnp.where(inv_s != 0, lse * lse, 0.0) * dzl
  return out


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel(axis_name, cap, z, labels, masks, opts):
  return ce_stats(axis_name, cap, z, labels, masks, opts)[0][:, 0]


def _kernel_jvp(axis_name, cap, primals, tangents):
  z, labels, masks, opts = primals
  dz, dopts = tangents[0], tangents[3]
  ce, (m, inv_s, local_labels) = ce_stats(axis_name, cap, z, labels, masks, opts)
  if all(absent(x) for x in (dz, *dopts)):
    return ce[:, 0], jnp.zeros_like(ce[:, 0])
  tangent = ce_tangent(z, local_labels, masks, m, inv_s, cap, opts, (dz, dopts), axis_name)
  return ce[:, 0], tangent[:, 0]


_kernel.defjvp(_kernel_jvp, symbolic_zeros=True)
_kernel = compiled(_kernel, static_argnums=(0, 1))


def ce_rows(
  z: jax.Array,
  labels: jax.Array,
  masks: tuple[jax.Array, ...],
  axis_name: str | None = None,
  cap: float | None = None,
  opts: CEOptions = OFF,
) -> jax.Array:
  """Cross entropy per row of ``[rows, classes]`` logits (``[rows]``).

  ``labels`` are ``[rows, 1]`` int32 indices into the whole class axis, in
  ``[0, classes)`` (the caller tests the range). Masked classes leave the
  softmax; a row without mass gives 0; a label on a class without mass gives
  ``+inf``. With ``axis_name``, inside ``jax.shard_map``, ``z`` and the
  masks hold this device's slice of the classes (``labels`` whole) and the
  result is replicated over the axis. ``cap``: the logits' soft-cap (a static
  float, or ``None``). ``opts``: label smoothing and the z-loss (:class:`CEOptions`).
  """
  return _kernel(axis_name, cap, z, labels, tuple(masks), opts)
