"""Rows of logits: layout as ``[rows, classes]``, scaling, row statistics and tangents.

The machinery shared by the logits kernels (``_logits``, ``_distill`` and the
vocabulary-parallel ones): validation and layout of a pair of logits with
their masks (:func:`prepare`), temperature scaling with ``-inf`` and masked
classes (:func:`scaled`), ``stop_gradient``-max row statistics
(:func:`row_stats`, :func:`normalizer`), and the per-row tangents the kernels'
rules share (:func:`logit_tangents`, :func:`ce_grad`). Where and how the
statistics run (blocks of rows on CPU, the platform switch) is
:mod:`kldiv_jax._platform`'s; their one-pass form off CPU,
:mod:`kldiv_jax._online_softmax`'s.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from kldiv_jax._checks import (
  Axis,
  broadcast_shapes,
  check_float,
  compute_dtype,
  mask_array,
  normalize_axis,
  split_where,
)
from kldiv_jax._id_checks import teacher_classes
from kldiv_jax._numerics import divide_logits, max_shift, soft_cap, soft_cap_slope
from kldiv_jax._sums import class_sum
from kldiv_jax._vocab_parallel import VOCAB_PARALLEL_PADDING


def is_zero(tangent: object) -> bool:
  """Whether a ``symbolic_zeros`` tangent is a symbolic zero."""
  return isinstance(tangent, SymbolicZero)


def absent(tangent: object) -> bool:
  """Whether a tangent is ``None`` (not taken) or a symbolic zero."""
  return tangent is None or is_zero(tangent)


def scaled(
  z: jax.Array, temperature: jax.Array, masks: tuple[jax.Array, ...], cap: float | None = None
):
  """``(soft_cap(z) / T, keep)`` in the compute dtype, ``-inf`` where ``z`` is or a mask is off.

  ``-inf`` logits are selected around the division: ``-inf / T`` has a NaN
  derivative wrt ``T``. NaN logits are kept (and propagate). ``cap``: the
  soft-cap applied before the temperature (:func:`kldiv_jax._numerics.soft_cap`);
  a class's mass is decided from the raw logit (``-inf`` has none, capped or not).
  """
  z = z.astype(temperature.dtype)
  keep = z != -jnp.inf
  for m in masks:
    keep = keep & m
  return divide_logits(soft_cap(z, cap), temperature, keep), keep


def row_stats(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(m, exp(x - m), sum)`` over the last axis, ``m`` a ``stop_gradient`` max.

  ``m`` is 0 for an all ``-inf`` row, which gives ``exp = 0`` and sum 0,
  never NaN; a row with a NaN (or ``+inf``) gets a NaN sum (see
  :func:`~kldiv_jax._numerics.max_shift`). ``m`` and the sum keep their axis.
  """
  m = lax.stop_gradient(max_shift(jnp.max(x, axis=-1, keepdims=True)))
  e = jnp.exp(x - m)
  return m, e, class_sum(e)


def normalizer(s: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(s != 0, 1/s or 0, log s or 0)`` for row sums ``s >= 0``, safe for autodiff.

  A NaN sum counts as mass (and gives NaN): a NaN row is not the zero measure.
  """
  has = s != 0
  safe = jnp.where(has, s, 1.0)
  return has, jnp.where(has, 1.0 / safe, 0.0), jnp.log(safe)


class Rows:
  """Logits laid out as ``[rows, classes]`` with their masks and output shape."""

  def __init__(self, z, y, masks, out_shape, out_dtype):
    self.z, self.y, self.masks = z, y, masks
    self.out_shape, self.out_dtype = out_shape, out_dtype
    self.cdt = compute_dtype(out_dtype)

  @property
  def empty(self) -> bool:
    return self.z.shape[0] == 0 or self.z.shape[1] == 0

  def finish(self, per_row: jax.Array) -> jax.Array:
    return per_row.reshape(self.out_shape).astype(self.out_dtype)


def prepare(
  name: str,
  what: tuple[str, str],
  logits: jax.typing.ArrayLike,
  target_logits: jax.typing.ArrayLike,
  axis: Axis,
  where: jax.typing.ArrayLike | None,
  teacher_vocab_size: int | None = None,
  axis_name: str | None = None,
) -> Rows:
  """Validates a pair of logits (named ``what``) and lays them out as ``[rows, classes]``.

  Class axes go last and are flattened into one; the logits keep their
  dtype (the kernels upcast). ``where`` becomes a mask of shape
  ``[rows or 1, classes or 1]``, not broadcast further (broadcasting a
  vocabulary mask to every row would cost a full-size temporary).

  Vocabularies of different sizes (one class axis, at least 2 classes each)
  only when the caller says so (``teacher_vocab_size``, checked by
  :func:`kldiv_jax._id_checks.teacher_classes`, not with ``axis_name``): the
  shared classes are the first ones and the others are padding, without mass
  on either side (:func:`shared_classes`); both logits, and a class ``where``
  longer than the shared classes, are cut to them.
  """
  out_dtype = check_float(name, what, logits, target_logits)
  ls, ts = tuple(np.shape(logits)), tuple(np.shape(target_logits))
  ndim = max(len(ls), len(ts))
  if ndim == 0:
    raise ValueError(f"{name}: logits need a class axis; got scalars.")
  axes = normalize_axis(name, axis, ndim)
  if not axes:
    raise ValueError(f"{name}: axis must name at least one class axis; got {axis!r}.")
  padded = [(1,) * (ndim - len(s)) + s for s in (ls, ts)]
  for a in axes:
    sizes = (padded[0][a], padded[1][a])
    if sizes[0] != sizes[1] and (len(axes) > 1 or min(sizes) < 2):
      raise ValueError(
        f"{name}: {' and '.join(what)} must have the same number of classes along axis {a}; "
        f"got shapes {ls} and {ts}."
      )
  if len(axes) == 1:
    a = axes[0]
    shards = 1 if axis_name is None else lax.axis_size(axis_name)
    sharded = None if axis_name is None else VOCAB_PARALLEL_PADDING
    sizes = (padded[0][a] * shards, padded[1][a] * shards)
    teacher_classes(name, teacher_vocab_size, *sizes, what, sharded)
  elif teacher_vocab_size is not None:
    raise ValueError(f"{name}: teacher_vocab_size needs one class axis; got axis={axis!r}.")
  if len(axes) == 1 and padded[0][axes[0]] != padded[1][axes[0]]:
    a = axes[0]
    shared = min(padded[0][a], padded[1][a])
    logits = shared_classes(logits, shared, a - (ndim - len(ls)))
    target_logits = shared_classes(target_logits, shared, a - (ndim - len(ts)))
    example = np.broadcast_shapes(*(s[:a] + s[a + 1 :] for s in padded))
    w_shape = tuple(np.shape(where)) if where is not None else ()
    is_class_mask = len(w_shape) >= ndim - a and w_shape != example
    if where is not None and is_class_mask and w_shape[a - ndim] > shared:
      where = shared_classes(mask_array(name, where), shared, np.ndim(where) + a - ndim)
    ls, ts = tuple(np.shape(logits)), tuple(np.shape(target_logits))
  shape = broadcast_shapes(name, ls, ts)
  element, example = split_where(name, where, shape, axes)
  batch_axes = tuple(i for i in range(ndim) if i not in axes)
  out_shape = tuple(shape[i] for i in batch_axes)
  num_rows = int(np.prod(out_shape, dtype=np.int64))
  num_classes = int(np.prod([shape[a] for a in axes], dtype=np.int64))

  def layout(a, full):
    a = jnp.asarray(a)
    a = a.reshape((1,) * (ndim - a.ndim) + a.shape)
    rows_full = any(a.shape[i] != 1 for i in batch_axes) if full is None else full
    cols_full = any(a.shape[i] != 1 for i in axes) if full is None else full
    target = tuple(
      d if (i in axes and cols_full) or (i not in axes and rows_full) else 1
      for i, d in enumerate(shape)
    )
    a = jnp.broadcast_to(a, target)
    if axes != tuple(range(ndim - len(axes), ndim)):
      a = jnp.transpose(a, batch_axes + axes)
    return a.reshape((num_rows if rows_full else 1, num_classes if cols_full else 1))

  masks = ()
  if element is not None:
    masks = (layout(where, None),)
  elif example is not None:
    masks = (example.reshape(num_rows, 1),)
  z, y = layout(logits, True), layout(target_logits, True)
  return Rows(z, y, masks, out_shape, out_dtype)


def shared_classes(x: jax.typing.ArrayLike, size: int, axis: int = -1) -> jax.Array:
  """The first ``size`` classes of ``x`` along ``axis``: the classes two vocabularies share.

  The convention for a teacher and a student whose vocabularies differ in
  size (a padded vocabulary, or a bigger model of the same family, Qwen2.5-3B's
  151,936 logits against 72B's 152,064): the shared token ids are the first
  ones, and the classes only one side has carry no mass on either side. They
  are padding ids no tokenizer produces, so the teacher's mass there is
  rounding, and a student must not be taught (nor charged) to put mass on ids
  its teacher cannot express. Cutting both sides to the shared classes is that
  convention, and its gradient wrt the cut classes is 0.
  """
  x = jnp.asarray(x)
  return x if x.shape[axis] == size else lax.slice_in_dim(x, 0, size, axis=axis)


def row_sum(g: jax.Array, dx: jax.Array) -> jax.Array:
  """``sum(g * dx)`` over the class axis, kept: a tangent contracted per row."""
  return class_sum(g * dx.astype(g.dtype))


def label_hit(labels: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Whether each class of ``[rows, classes]`` is its row's label (``labels`` ``[rows, 1]``)."""
  return lax.broadcasted_iota(labels.dtype, shape, 1) == labels


def ce_targets(labels, shape, masks, smoothing=None, count=None):
  """The cross entropy's target per class of ``[rows, classes]``: ``onehot(label)`` (bool),
  or with label smoothing ``eps`` (``smoothing``) ``(1 - eps) onehot(label) + eps / K`` on
  the classes every mask keeps (``count``: their number ``K``, global, ``[rows or 1, 1]`` or an
  int) and 0 on the others, optax's ``smooth_labels`` with ``where``; ``-inf`` logits are
  classes, whose logit then makes the cross entropy ``+inf`` (optax's, torch's)."""
  hit = label_hit(labels, shape)
  if smoothing is None:
    return hit
  assert count is not None  # the smoothing's class count
  k = count if isinstance(count, int) else jnp.maximum(count, 1).astype(smoothing.dtype)
  spread = jnp.broadcast_to(smoothing / k, shape)
  for m in masks:
    spread = jnp.where(m, spread, 0.0)
  return spread + jnp.where(hit, 1.0 - smoothing, 0.0)


def ce_grad(z, labels, masks, m, inv_s, cap=None, smoothing=None, count=None, z_loss=None):
  """``d CE / dz``: ``softmax(z) - onehot(label)`` per class, 0 on rows without mass.

  ``m`` and ``inv_s`` are the row max and inverse sum of exponentials of the
  (masked, soft-capped by ``cap``) logits, ``labels`` index the classes of
  ``z`` (local ones for the vocabulary-parallel kernel, where a label on
  another device hits nothing). With ``cap``, times the cap's slope. With label
  smoothing (``smoothing``, ``count``) the target is :func:`ce_targets`'; with ``z_loss``
  ``c`` (the penalty ``c lse**2``, ``lse`` the row's log-sum-exp) the softmax is scaled by
  ``1 + 2 c lse`` (MaxText's and T5X's rule).
  """
  u, _ = scaled(z, jnp.ones((), inv_s.dtype), masks, cap)
  target = ce_targets(labels, u.shape, masks, smoothing, count).astype(inv_s.dtype)
  has = inv_s != 0
  p = jnp.exp(u - m) * inv_s
  if z_loss is not None:
    lse = m - jnp.log(jnp.where(has, inv_s, 1.0))
    p = p * (1.0 + 2.0 * z_loss * lse)
  g = jnp.where(has, p - target, 0.0)
  return times_slope(g, u, cap)


def times_slope(g: jax.Array, capped: jax.Array, cap: float | None) -> jax.Array:
  """``g * d soft_cap(z)/dz``: a derivative wrt capped logits taken back to the raw ones,
  from the capped logits (``-inf`` without mass, where the product is 0)."""
  return g if cap is None else g * soft_cap_slope(capped, cap)


def logit_grad(g: jax.Array, x: jax.Array, temperature, cap: float | None) -> jax.Array:
  """The derivative wrt the raw logits ``z`` of a function of ``x = soft_cap(z) / T``, from
  its derivative ``g`` wrt ``x`` (per class): ``g / T`` times the soft-cap's slope."""
  return times_slope(g / temperature, x * temperature, cap)


def logit_tangents(temperature, tangents, g_u, g_v, u, keep_u, v, keep_v, caps=None):
  """Per-row tangent of a divergence of ``softmax(u)``, ``softmax(v)`` (``[rows, 1]``).

  ``tangents`` are ``(dz, dy, dtemp)`` for the raw logits ``z``, ``y`` and
  the temperature, where ``u = soft_cap(z) / T`` and ``v = soft_cap(y) / T``
  (``caps`` their soft-caps, ``None`` for none: the slope comes from ``u T``);
  ``g_u``, ``g_v`` are the derivatives wrt ``u`` and ``v`` (``g_v`` may be
  ``None`` when ``dy`` and ``dtemp`` are symbolic zeros, which are skipped, as are
  tangents given as ``None``). Sums over the classes held here: the vocabulary-parallel kernels ``psum``
  the result.
  """
  dz, dy, dtemp = tangents
  cap_z, cap_y = (None, None) if caps is None else caps
  out = jnp.zeros((u.shape[0], 1), g_u.dtype)
  if not absent(dz):
    out = out + row_sum(logit_grad(g_u, u, temperature, cap_z), dz)
  if not absent(dy):
    out = out + row_sum(logit_grad(g_v, v, temperature, cap_y), dy)
  if not absent(dtemp):
    # du/dT = -u/T on kept classes, 0 on the others.
    u0 = jnp.where(keep_u, u, 0.0)
    v0 = jnp.where(keep_v, v, 0.0)
    out = out - class_sum(g_u * u0 + g_v * v0) / temperature * dtemp
  return out
