"""Cross entropy ``-log softmax(z)[label]`` per row of logits, one kernel for every path.

The hard-label term of :func:`kldiv_jax.distillation_loss`, at temperature 1,
with the class masks of the divergence. One ``jax.custom_jvp`` kernel,
:func:`ce_rows`, with or without the class axis split over a mesh axis
(``axis_name``): one pass gives the row max, the sum of exponentials and the
label's logit (on the device that holds it; ``psum``-ed, with the sums
rescaled to the global max by :func:`kldiv_jax._vocab_parallel.combine`), and
the rule's tangent is ``softmax(z) - onehot(label)`` recomputed elementwise
from those row statistics (no residual of the vocabulary's size).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._checks import compute_dtype
from kldiv_jax._online_softmax import online_softmax
from kldiv_jax._platform import compiled, map_rows
from kldiv_jax._rows import ce_grad, is_zero, label_hit, normalizer, row_stats, row_sum, scaled
from kldiv_jax._vocab_parallel import class_offset, combine, global_classes


def ce_stats(axis_name, cap, z, labels, masks):
  one = jnp.ones((), compute_dtype(z.dtype))
  if axis_name is not None:  # labels of this device's classes; the others hit nothing
    labels = labels - class_offset(axis_name, z.shape[1]).astype(labels.dtype)

  def fn(z, labels, *masks):
    u, _ = scaled(z, one, masks, cap)
    m, _, s = row_stats(u)
    picked = jnp.sum(jnp.where(label_hit(labels, u.shape), u, 0.0), axis=-1, keepdims=True)
    return m, s, picked

  def online(z, labels, *masks):  # off CPU: one pass (online_softmax)
    u, _ = scaled(z, one, masks, cap)
    return online_softmax(u, picked=jnp.where(label_hit(labels, u.shape), u, 0.0))

  num_classes = global_classes(z.shape[1], axis_name)
  m, s, picked = map_rows(fn, (z, labels, *masks), z.shape[0], num_classes, accel=online)
  if axis_name is not None:
    m, s = combine(m, s, axis_name)
    picked = lax.psum(picked, axis_name)
  ce, (m, inv_s) = ce_finish(m, s, picked)
  return ce, (m, inv_s, labels)


def ce_finish(m, s, picked):
  """``(ce, (m, 1/s))`` per row from the row max, sum of exponentials and label's logit."""
  has, inv_s, log_s = normalizer(s)
  return jnp.where(has, log_s + m - picked, 0.0), (m, inv_s)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel(axis_name, cap, z, labels, masks):
  return ce_stats(axis_name, cap, z, labels, masks)[0][:, 0]


def _kernel_jvp(axis_name, cap, primals, tangents):
  z, labels, masks = primals
  dz = tangents[0]
  ce, (m, inv_s, local_labels) = ce_stats(axis_name, cap, z, labels, masks)
  if is_zero(dz):
    return ce[:, 0], jnp.zeros_like(ce[:, 0])
  tangent = row_sum(ce_grad(z, local_labels, masks, m, inv_s, cap), dz)
  if axis_name is not None:
    tangent = lax.psum(tangent, axis_name)
  return ce[:, 0], tangent[:, 0]


_kernel.defjvp(_kernel_jvp, symbolic_zeros=True)
_kernel = compiled(_kernel, static_argnums=(0, 1))


def ce_rows(
  z: jax.Array,
  labels: jax.Array,
  masks: tuple[jax.Array, ...],
  axis_name: str | None = None,
  cap: float | None = None,
) -> jax.Array:
  """Cross entropy per row of ``[rows, classes]`` logits (``[rows]``).

  ``labels`` are ``[rows, 1]`` int32 indices into the whole class axis, in
  ``[0, classes)`` (the caller tests the range). Masked classes leave the
  softmax; a row without mass gives 0; a label on a class without mass gives
  ``+inf``. With ``axis_name``, inside ``jax.shard_map``, ``z`` and the
  masks hold this device's slice of the classes (``labels`` whole) and the
  result is replicated over the axis. ``cap``: the logits' soft-cap (a static
  float, or ``None``).
  """
  return _kernel(axis_name, cap, z, labels, tuple(masks))
