"""Rows of logits: layout as ``[rows, classes]`` and blocked per-row statistics.

The machinery shared by the logits kernels (``_logits``, ``_distill`` and the
vocabulary-parallel ones): validation and layout of a pair of logits with
their masks (:func:`prepare`), temperature scaling with ``-inf`` and masked
classes (:func:`scaled`), ``stop_gradient``-max row statistics
(:func:`row_stats`, :func:`normalizer`), and :func:`map_rows`, which on CPU
computes per-row statistics over blocks of rows: XLA's CPU reductions do not
fuse an ``exp`` producer, and materialising full-size temporaries costs more
than the arithmetic.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

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
  teacher_classes,
)
from kldiv_jax._numerics import divide_logits, max_shift, soft_cap, soft_cap_slope
from kldiv_jax._vocab_parallel import VOCAB_PARALLEL_PADDING

# Elements per block of rows for the CPU row statistics (512 KiB of float32).
_BLOCK_ELEMENTS = 1 << 17
# The name scope of the CPU row loop: it marks the path in a lowered module's locations.
ROW_BLOCKS_SCOPE = "kldiv_jax_cpu_row_blocks"

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def is_zero(tangent: object) -> bool:
  """Whether a ``symbolic_zeros`` tangent is a symbolic zero."""
  return isinstance(tangent, SymbolicZero)


def compiled(fn: _Fn, static_argnums: int | Sequence[int] = (), *, inline: bool = True) -> _Fn:
  """``fn``, a module-level kernel, compiled once per input shapes and static arguments.

  Why: outside ``jit`` (notebooks, evaluation loops) JAX runs a loss op by op,
  and compiles a control-flow primitive (the ``lax.fori_loop`` of
  :func:`map_rows`, a ``lax.switch``) on its own, cached by the identity of
  its traced body. That body is a closure made afresh on every call, so every
  eager call compiled it again (0.3-0.5 s for ``[512, 1000]`` logits) and
  kept the executable (memory grew by megabytes per call). A ``jax.jit`` of
  the module-level kernel is cached by the kernel, its static arguments and
  the input shapes. ``inline=True``: traced inside the caller's ``jit`` (or
  ``grad``, ``vmap``, ``shard_map``), the kernel is inlined into the caller's
  program exactly as before, so jitted code is unchanged. The public
  functions are not jitted themselves: their checks and layout are cheap op
  by op, and the caller's ``jit`` compiles them anyway.

  ``inline=False`` keeps a kernel whose *derivative* holds control flow a
  call of its own: an eager ``jax.grad`` stages the tangent into a fresh
  linear program, and an inlined ``lax.switch`` there would be compiled again
  on every call (XLA still inlines the call under the caller's ``jit``).

  Typed as returning ``fn``'s own type: the kernels are rebound to their
  compiled selves (``kl_kernel = compiled(kl_kernel)``) and called exactly as
  before, but ``jax.jit`` is typed as returning a ``JitWrapped``, which the
  checker cannot match to the declared ``custom_jvp``/``custom_vjp`` names.
  """
  # The cast restates that the jitted callable takes the same arguments and
  # returns the same values as ``fn`` (not that it keeps ``fn``'s attributes:
  # ``defjvp``/``defvjp`` come before ``compiled``).
  return cast(_Fn, jax.jit(fn, static_argnums=static_argnums, inline=inline))


def _per_device_code() -> bool:
  """Whether the arrays being traced live on one device.

  True with a single device, or inside ``jax.shard_map`` (manual axes: the
  arrays are per-device blocks). Under ``jax.jit`` with several devices the
  inputs may be sharded along the rows, and XLA cannot partition the row
  loop: it would all-gather every row onto every device. There the plain
  computation is left to XLA's partitioner instead.
  """
  return jax.device_count() == 1 or bool(jax.sharding.get_abstract_mesh().manual_axes)


def map_rows(fn, arrays, num_rows, num_classes=None, accel=None):
  """``fn(*arrays)`` for per-row statistics, over blocks of rows on CPU.

  ``arrays`` have rows on axis 0 (``num_rows`` of them, or 1 to broadcast);
  ``fn`` returns a tuple of ``[rows, 1]`` arrays. On CPU the rows go through
  ``fn`` a block at a time (:func:`_row_blocks`); on other platforms, when one
  block holds every row, or under ``jax.jit`` with several devices (see
  :func:`_per_device_code`), ``fn`` runs once. ``num_classes`` sets the rows
  per block (default: the arrays' class axis; the vocabulary-parallel kernels
  pass the global one, so that a device's blocks shrink with its slice of the
  classes).

  The platform is the one the program is lowered for, not the machine that
  traces it: both versions are staged out with ``lax.platform_dependent``, and
  lowering keeps the platform's own (a program exported with ``jax.export``
  for several platforms holds both, and the runtime picks). Eagerly, outside
  ``jit``, the platform of the default device decides at once. The CPU loop
  runs in the name scope :data:`ROW_BLOCKS_SCOPE`, which marks it in a lowered
  module. ``accel``: the same statistics computed another way off CPU (GPU, TPU),
  run once over every row there instead of ``fn`` (on one device, or per device
  inside ``jax.shard_map``; under ``jax.jit`` with several devices ``fn`` is left
  to XLA's partitioner everywhere).

  The outputs are strongly typed on every path. The loop and
  ``lax.platform_dependent`` return a weakly typed result (one made from
  Python numbers) strongly typed, and a plain call would not: a program's
  types would then depend on the row count. Under ``jax_enable_x64`` a weakly
  typed float64 ``[rows, 1]`` added to float32 stays float32 on one path and
  becomes float64 on the other (a ``custom_jvp`` rule's tangent no longer
  matches its primal).
  """
  if num_classes is None:
    num_classes = max(a.shape[-1] for a in arrays if a.ndim == 2)
  block = max(1, _BLOCK_ELEMENTS // max(num_classes, 1))

  def strong(f):
    return lambda *a: tuple(lax.convert_element_type(r, r.dtype) for r in f(*a))

  plain = strong(fn)
  if not _per_device_code():
    return plain(*arrays)
  off_cpu = plain if accel is None else strong(accel)
  if num_rows <= block:
    if accel is None:
      return plain(*arrays)
    cpu = plain
  else:

    def cpu(*a):
      with jax.named_scope(ROW_BLOCKS_SCOPE):
        return _row_blocks(plain, a, num_rows, block)

  return lax.platform_dependent(*arrays, cpu=cpu, default=off_cpu)


def per_platform(cpu, accel, *arrays):
  """``cpu(*arrays)`` in a program lowered for CPU, ``accel(*arrays)`` for the others.

  A whole kernel chosen per platform (:func:`map_rows` chooses its row statistics): both
  are staged out with ``lax.platform_dependent`` and lowering keeps the platform's own.
  ``cpu`` everywhere under ``jax.jit`` with several devices (see :func:`_per_device_code`).
  """
  if not _per_device_code():
    return cpu(*arrays)
  out = lax.platform_dependent(*arrays, cpu=cpu, default=accel)
  # Strongly typed, as :func:`map_rows`' results.
  return jax.tree.map(lambda r: lax.convert_element_type(r, r.dtype), out)


def gpu_or_other(gpu, other, *arrays):
  """``gpu(*arrays)`` in a program lowered for CUDA or ROCm, ``other(*arrays)`` elsewhere.

  For an accelerator kernel whose best form differs between XLA:GPU and XLA:TPU (staged
  out with ``lax.platform_dependent``, as :func:`per_platform`; strongly typed results).
  """
  out = lax.platform_dependent(*arrays, cuda=gpu, rocm=gpu, default=other)
  return jax.tree.map(lambda r: lax.convert_element_type(r, r.dtype), out)


def _rescale(m, total):
  """``(exp(m - total), m - total)`` for a partial max ``m`` of a row whose max is
  ``total``: ``(1, 0)`` where they are equal (``-inf`` ones too); NaN propagates."""
  same = m == total
  return jnp.where(same, 1.0, jnp.exp(m - total)), jnp.where(same, 0.0, m - total)


def online_softmax(u, raw=None, picked=None, centred=False):
  """Row statistics of ``u`` (``-inf`` without mass) in one pass: ``(m, s, ...)``, ``[rows, 1]``.

  ``m`` the row max (:func:`~kldiv_jax._numerics.max_shift`-ed, ``stop_gradient``) and
  ``s = sum exp(u - m)``, as :func:`row_stats` gives them; then with ``centred`` ``sum
  exp(u - m) (u - m)``, with ``raw`` (an array of ``u``'s shape) its row max
  (``stop_gradient``, not shifted), with ``picked`` its row sum (plain: a label's logit).
  One variadic reduction whose combiner carries the running max and rescales the sums
  when it grows (online softmax, Milakov & Gimelshein 2018): XLA reads ``u`` once, where
  the max and the sums are two passes. For GPU and TPU: XLA:CPU runs the combiner's
  ``exp`` per element. A NaN or ``+inf`` in ``u`` makes ``s`` NaN, as in :func:`row_stats`.
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
  ops = [u, jnp.where(has, jnp.exp(u - u), 0.0)]  # 1, or NaN at a NaN or +inf logit
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
      f, d = _rescale(part[0], m)
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

  res = [x[:, None] for x in lax.reduce(ops, init, combine, (1,))]
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
    out.append(jnp.sum(e * jnp.where(u != -jnp.inf, u - m, 0.0), axis=-1, keepdims=True))
  if raw is not None:
    out.append(lax.stop_gradient(jnp.max(raw.astype(u.dtype), axis=-1, keepdims=True)))
  if picked is not None:
    out.append(jnp.sum(picked.astype(u.dtype), axis=-1, keepdims=True))
  return tuple(out)


@_online_softmax.defjvp
def _online_softmax_jvp(centred, primals, tangents):
  # Derivatives of the statistics (a rule differentiated again: hessians) from the same
  # sums written with differentiable reductions; the maxes are constants.
  _, out_tangents = jax.jvp(functools.partial(two_pass_softmax, centred), primals, tangents)
  return _online_softmax(centred, *primals), out_tangents


def _row_blocks(fn, arrays, num_rows, block):
  """``fn(*arrays)`` computed ``block`` rows at a time in a ``fori_loop``.

  The last block is shifted back to end at the last row (it recomputes a few
  rows rather than padding a copy).
  """

  def rows(a, start):
    if a.shape[0] == 1:
      return a
    return lax.dynamic_slice_in_dim(a, start, block, axis=0)

  # The first block seeds the outputs: inside jax.shard_map a loop carry must
  # vary over the same mesh axes as the values written into it, and
  # ``full_like`` keeps those of the block's results.
  first = fn(*[rows(a, 0) for a in arrays])
  init = tuple(
    lax.dynamic_update_slice_in_dim(
      lax.full_like(r, 0, shape=(num_rows, *r.shape[1:])), r, 0, axis=0
    )
    for r in first
  )

  def body(i, outs):
    start = jnp.minimum(i * block, num_rows - block)
    res = fn(*[rows(a, start) for a in arrays])
    return tuple(lax.dynamic_update_slice_in_dim(o, r, start, axis=0) for o, r in zip(outs, res))

  return lax.fori_loop(1, -(-num_rows // block), body, init)


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
  return m, e, jnp.sum(e, axis=-1, keepdims=True)


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
  :func:`kldiv_jax._checks.teacher_classes`, not with ``axis_name``): the
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
  return jnp.sum(g * dx.astype(g.dtype), axis=-1, keepdims=True)


def label_hit(labels: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Whether each class of ``[rows, classes]`` is its row's label (``labels`` ``[rows, 1]``)."""
  return lax.broadcasted_iota(labels.dtype, shape, 1) == labels


def ce_grad(z, labels, masks, m, inv_s, cap=None):
  """``d CE / dz``: ``softmax(z) - onehot(label)`` per class, 0 on rows without mass.

  ``m`` and ``inv_s`` are the row max and inverse sum of exponentials of the
  (masked, soft-capped by ``cap``) logits, ``labels`` index the classes of
  ``z`` (local ones for the vocabulary-parallel kernel, where a label on
  another device hits nothing). With ``cap``, times the cap's slope.
  """
  u, _ = scaled(z, jnp.ones((), inv_s.dtype), masks, cap)
  hit = label_hit(labels, u.shape).astype(inv_s.dtype)
  g = jnp.where(inv_s != 0, jnp.exp(u - m) * inv_s - hit, 0.0)
  return times_slope(g, u, cap)


def times_slope(g: jax.Array, capped: jax.Array, cap: float | None) -> jax.Array:
  """``g * d soft_cap(z)/dz``: a derivative wrt capped logits taken back to the raw ones,
  from the capped logits (``-inf`` without mass, where the product is 0)."""
  return g if cap is None else g * soft_cap_slope(capped, cap)


def logit_tangents(temperature, tangents, g_u, g_v, u, keep_u, v, keep_v, caps=None):
  """Per-row tangent of a divergence of ``softmax(u)``, ``softmax(v)`` (``[rows, 1]``).

  ``tangents`` are ``(dz, dy, dtemp)`` for the raw logits ``z``, ``y`` and
  the temperature, where ``u = soft_cap(z) / T`` and ``v = soft_cap(y) / T``
  (``caps`` their soft-caps, ``None`` for none: the slope comes from ``u T``);
  ``g_u``, ``g_v`` are the derivatives wrt ``u`` and ``v`` (``g_v`` may be
  ``None`` when ``dy`` and ``dtemp`` are symbolic zeros, which are skipped).
  Sums over the classes held here: the vocabulary-parallel kernels ``psum``
  the result.
  """
  dz, dy, dtemp = tangents
  cap_z, cap_y = (None, None) if caps is None else caps
  out = jnp.zeros((u.shape[0], 1), g_u.dtype)
  if not is_zero(dz):
    g = times_slope(g_u / temperature, u * temperature, cap_z)
    out = out + row_sum(g, dz)
  if not is_zero(dy):
    g = times_slope(g_v / temperature, v * temperature, cap_y)
    out = out + row_sum(g, dy)
  if not is_zero(dtemp):
    # du/dT = -u/T on kept classes, 0 on the others.
    u0 = jnp.where(keep_u, u, 0.0)
    v0 = jnp.where(keep_v, v, 0.0)
    out = out - jnp.sum(g_u * u0 + g_v * v0, axis=-1, keepdims=True) / temperature * dtemp
  return out
