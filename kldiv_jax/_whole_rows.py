"""Off CPU, a divergence's row statistics and class sums; on TPU from one read of the logits.

A formula without a one-pass form (JSD at ``0 < beta < 1``, skew KL, skew reverse KL, TVD:
their terms, ``log(beta p + (1 - beta) q)`` or ``|p - q|``, cannot be rescaled as a
running max grows) needs both sides' normalisers before its class sums. As XLA fusions that
is two passes over the logits before the derivative rule's own: both sides' maxes and sums
of exponentials (online softmax), then the class sums (:func:`xla_row_sums`). On TPU,
:func:`row_sums` instead runs one Pallas kernel per block of whole rows, held in VMEM: the
two passes read VMEM, and HBM is read once (:func:`pallas_row_sums`).

:func:`row_sums` is a primitive of its own (:data:`ROW_SUMS`) lowered per platform: the
Pallas kernel for TPU, the XLA passes for every other platform, and for a TPU case the kernel
does not take (masks of single elements, float64, float16, rows too long for VMEM). Inside
``lax.platform_dependent`` a ``pallas_call`` would be lowered for every platform of a
multi-platform export and fail on CPU; a primitive's per-platform rules are lowered only
for their own. Its derivatives (a rule differentiated again: hessians) are those of the XLA
passes, and under ``vmap`` whole rows are stacked (or, with batched options or masks, the
XLA passes are mapped).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from kldiv_jax._class_sums import (
  Needs,
  class_sums,
  class_sums_apart,
  identical_gap,
  normalized,
  norms,
  plain_sums,
  summands,
)
from kldiv_jax._divergences import FORMULAS
from kldiv_jax._numerics import in_kernel, is_static, max_shift
from kldiv_jax._online_softmax import joint_reduce, online_softmax_parts, rescale
from kldiv_jax._platform import gpu_kernels_for, gpu_or_other, stacked_rows
from kldiv_jax._rows import scaled

# Lanes of a TPU vector register: the kernel's output block is [rows, LANES].
LANES = 128
# Elements of one [rows, tile] slice the kernel computes on at a time (16 vector registers
# of float32), and the bytes of one input block (the rows per grid step).
_TILE_ELEMENTS = 1 << 14
_BLOCK_BYTES = 1 << 20
# The most VMEM the kernel's double-buffered inputs may take (of 16 MiB on a v4 TensorCore,
# the least of the TPUs; 128 MiB on v5e and v6e); longer rows take the XLA path.
_VMEM_INPUTS = 12 << 20

# Under x64, the oldest jax whose Pallas TPU lowering takes the kernel: jax 0.7 passes the
# Python floats of jnp.where to an inner jit as float64, a cast Mosaic does not lower.
X64_KERNEL_JAX = (0, 10)

# (formula name, static params (None where traced), Needs, caps, number of masks)
Spec = tuple[str, tuple[float | None, ...], Needs, tuple[float | None, float | None], int]


def row_sums(
  formula, params, needs: Needs, caps, z, y, temperature, masks, implementation="auto"
) -> tuple:
  """``(mu, su, mv, sv, gap, *sums)``, ``[rows, 1]`` each, of scaled logits ``z``, ``y``.

  Each side's row max (:func:`~kldiv_jax._numerics.max_shift`-ed) and sum of
  exponentials, the sum of :func:`~kldiv_jax._class_sums.identical_gap` (0 on identical
  rows), and the class sums :func:`~kldiv_jax._class_sums.class_sums` gives for
  ``needs``, of ``soft_cap(z) / temperature`` and ``soft_cap(y) / temperature`` with
  ``masks``. ``params`` as :func:`~kldiv_jax._class_sums.formula_params` gives them. On one
  device (the engine's off-CPU path); inside ``jax.shard_map`` always the XLA passes, and
  with ``implementation="xla"`` (:mod:`kldiv_jax._implementation`) on TPU too.
  """
  static = tuple(float(p) if is_static(p) else None for p in params)
  traced = tuple(p for p in params if not is_static(p))
  spec: Spec = (formula.name, static, needs, tuple(caps), len(masks))
  if implementation == "xla" or jax.sharding.get_abstract_mesh().manual_axes:
    # "xla": the XLA passes themselves, not even the primitive. Inside jax.shard_map: the
    # XLA passes, whose results carry the mesh axes their operands vary over (a primitive's
    # abstract values would have to say so themselves).
    return xla_row_sums(spec, z, y, temperature, *traced, *masks)
  # The opt-in GPU kernels (kldiv_jax._gpu_rows), decided at trace time from
  # ``implementation``: a parameter of the primitive (False, True or a layout) that only its
  # CUDA lowering reads.
  gpu = gpu_kernels_for(implementation)
  return _row_sums(spec, gpu, z, y, temperature, *traced, *masks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _row_sums(spec: Spec, gpu, *args):
  return tuple(ROW_SUMS.bind(*args, spec=spec, gpu=gpu))


@_row_sums.defjvp
def _row_sums_jvp(spec, gpu, primals, tangents):
  # The derivatives of the XLA passes (the maxes are constants there).
  _, out_tangents = jax.jvp(functools.partial(xla_row_sums, spec), primals, tangents)
  return _row_sums(spec, gpu, *primals), out_tangents


def _split(spec: Spec, args):
  """``(z, y, temperature, params, masks)`` of the primitive's operands."""
  _, static, _, _, num_masks = spec
  z, y, temperature, *rest = args
  masks = tuple(rest[len(rest) - num_masks :])
  traced = iter(rest[: len(rest) - num_masks])
  params = tuple(next(traced) if s is None else s for s in static)
  return z, y, temperature, params, masks


def xla_row_sums(spec: Spec, *args) -> tuple:
  """:func:`row_sums` as XLA fusions: both sides' online softmax and the identical-rows
  gap in one variadic reduction, then the class sums in a second pass (no temporary)."""
  name, _, needs, caps, _ = spec
  z, y, temperature, params, masks = _split(spec, args)
  formula = FORMULAS[name]
  u, _ = scaled(z, temperature, masks, caps[0])
  v, _ = scaled(y, temperature, masks, caps[1])
  (mu, su), (mv, sv), (gap,) = joint_reduce(
    online_softmax_parts(False, u, None, None),
    online_softmax_parts(False, v, None, None),
    plain_sums(identical_gap(u, v)),
  )
  n = norms(su, sv)
  stats = (mu, n.inv_su, n.log_su, mv, n.inv_sv, n.log_sv)

  def joint(u, v, *stats):
    return class_sums(formula, params, needs, normalized(u, v, *stats), barrier=False)

  apart = functools.partial(class_sums_apart, formula, params, needs)
  return (mu, su, mv, sv, gap, *gpu_or_other(apart, joint, u, v, *stats))


def _layout(rows: int, classes: int, itemsizes: tuple[int, int]) -> tuple[int, int, int]:
  """``(rows per block, tile, padded classes)`` of the Pallas kernel: blocks of about
  :data:`_BLOCK_BYTES` per input, in whole vector tiles of rows (8 of float32, 16 of
  bfloat16, packed two to a sublane, where 16 rows fit :data:`_VMEM_INPUTS`; else 8),
  slices of :data:`_TILE_ELEMENTS`."""
  lanes = -(-classes // LANES) * LANES
  sublanes = 8 * (4 // min(itemsizes))
  if 2 * sublanes * lanes * sum(itemsizes) > _VMEM_INPUTS:
    sublanes = 8
  block = sublanes * max(
    1, min(512 // sublanes, _BLOCK_BYTES // (sublanes * lanes * max(itemsizes)))
  )
  block = min(block, -(-rows // sublanes) * sublanes)
  tile = max(LANES, min(lanes, (_TILE_ELEMENTS // block) // LANES * LANES))
  return block, tile, -(-classes // tile) * tile


def kernel_operands(z, y, temperature, masks, dtypes) -> bool:
  """Whether the library's Pallas kernels (this one, :mod:`kldiv_jax._gpu_rows`') take these
  operands (avals): float32 computation, logits ``[rows, classes]`` (at least one of each) of
  ``dtypes``, masks of rows ``[rows or 1, 1]`` or of classes ``[1, classes]`` (masks of
  single elements keep the XLA passes)."""
  if jnp.dtype(temperature.dtype) != jnp.float32 or z.ndim != 2 or z.shape != y.shape:
    return False
  if any(m.shape[0] != 1 and m.shape[1] != 1 for m in masks):
    return False
  if {jnp.dtype(z.dtype), jnp.dtype(y.dtype)} - {jnp.dtype(d) for d in dtypes}:
    return False
  return z.shape[0] > 0 and z.shape[1] > 0


def takes_whole_rows(spec: Spec, z, y, temperature, masks=()) -> bool:
  """Whether the Pallas kernel takes these operands (avals): float32 computation, float32 or
  bfloat16 logits, masks of rows ``[rows or 1, 1]`` or of classes ``[1, classes]`` (not of
  single elements), both double-buffered blocks of rows within VMEM, and under x64 a jax
  from :data:`X64_KERNEL_JAX` on."""
  if not kernel_operands(z, y, temperature, masks, (jnp.float32, jnp.bfloat16)):
    return False
  x64 = jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64
  if x64 and jax.__version_info__ < X64_KERNEL_JAX:
    return False
  rows, classes = z.shape
  itemsizes = (jnp.dtype(z.dtype).itemsize, jnp.dtype(y.dtype).itemsize)
  block, _, width = _layout(rows, classes, itemsizes)
  return 2 * block * width * sum(itemsizes) <= _VMEM_INPUTS


def _merge(a, b):
  """Two partial ``(max, sum of exp(x - max))`` of a row as one (online softmax)."""
  m = jnp.maximum(a[0], b[0])
  fa, _ = rescale(a[0], m)
  fb, _ = rescale(b[0], m)
  return m, a[1] * fa + b[1] * fb


def _partial_softmax(u):
  m = jnp.max(u, axis=-1, keepdims=True)
  e = jnp.where(u != -jnp.inf, jnp.exp(u - max_shift(m)), 0.0)
  return m, jnp.sum(e, axis=-1, keepdims=True)


def _kernel(spec: Spec, classes: int, tile: int, scalars, z_ref, y_ref, *refs):
  """One block of whole rows: two passes over VMEM, the statistics then the class sums.
  ``refs``: the masks' blocks (int32: ``[rows, 1]``, ``[1, classes]`` or ``[1, 1]``), then
  the output's."""
  from jax.experimental import pallas as pl

  name, static, needs, caps, _ = spec
  formula = FORMULAS[name]
  traced = iter(scalars[i] for i in range(1, 1 + sum(s is None for s in static)))
  params = tuple(next(traced) if s is None else s for s in static)
  temperature = scalars[0]
  *mask_refs, out_ref = refs
  rows = z_ref.shape[0]

  def load(j):
    start = pl.multiple_of(j * tile, tile)
    keep = [start + lax.broadcasted_iota(jnp.int32, (rows, tile), 1) < classes]
    for m in mask_refs:
      keep.append((m[:, pl.ds(start, tile)] if m.shape[1] > 1 else m[...]) != 0)
    z = z_ref[:, pl.ds(start, tile)]
    y = y_ref[:, pl.ds(start, tile)]
    u, _ = scaled(z, temperature, tuple(keep), caps[0])
    v, _ = scaled(y, temperature, tuple(keep), caps[1])
    return u, v

  def first(j, carry):
    su, sv, gap = carry
    u, v = load(j)
    gap = gap + jnp.sum(identical_gap(u, v), axis=-1, keepdims=True)
    return _merge(su, _partial_softmax(u)), _merge(sv, _partial_softmax(v)), gap

  tiles = z_ref.shape[1] // tile
  none = jnp.full((rows, 1), -jnp.inf, jnp.float32)
  zero = jnp.zeros((rows, 1), jnp.float32)
  # int32 loop indices and block indices: under x64 a Python int is int64, which Mosaic does
  # not take (and a weakly typed int stays int32 beside an int32 index).
  (mu, su), (mv, sv), gap = lax.fori_loop(
    jnp.int32(0), jnp.int32(tiles), first, ((none, zero), (none, zero), zero)
  )
  mu, mv = max_shift(mu), max_shift(mv)
  n = norms(su, sv)
  stats = (mu, n.inv_su, n.log_su, mv, n.inv_sv, n.log_sv)

  def second(j, sums):
    u, v = load(j)
    c = normalized(u, v, *stats)
    terms = summands(formula, params, needs, c, False)
    return tuple(s + jnp.sum(t, axis=-1, keepdims=True) for s, t in zip(sums, terms))

  sums = lax.fori_loop(jnp.int32(0), jnp.int32(tiles), second, (zero,) * needs.num_sums())
  lane = lax.broadcasted_iota(jnp.int32, (rows, LANES), 1)
  out = jnp.zeros((rows, LANES), jnp.float32)
  for i, column in enumerate((mu, su, mv, sv, gap, *sums)):
    out = jnp.where(lane == i, column, out)
  out_ref[...] = out


def _rows_block(i):
  """The block index map of an input tiled over rows (int32: under x64 a Python 0 would be
  an int64, which Mosaic does not take)."""
  return i, jnp.int32(0)


def _first_block(i):
  """The block index map of an input with one block for every grid step."""
  return jnp.int32(0), jnp.int32(0)


def _first_item(i):
  return (jnp.int32(0),)


def pallas_row_sums(spec: Spec, *args, interpret: bool = False) -> tuple:
  """:func:`row_sums` as one Pallas TPU kernel over blocks of whole rows (masks of rows or
  of classes, as :func:`takes_whole_rows` says).

  Each grid step holds a block of rows of both logits in VMEM (padded to a whole number of
  slices; the padding is masked), finds both sides' running maxes and sums of exponentials
  and the identical-rows gap over the slices, then the class sums: HBM is read once.
  ``interpret``: Pallas' interpreter (tests, on CPU).
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  z, y, temperature, params, masks = _split(spec, args)
  rows, classes = z.shape
  block, tile, width = _layout(rows, classes, (z.dtype.itemsize, y.dtype.itemsize))
  traced = [p for p in params if not is_static(p)]
  scalars = jnp.stack([temperature, *traced]).astype(jnp.float32)
  blocks = pl.BlockSpec((block, width), _rows_block)
  elements = rows * classes

  def mask_block(m):  # a row mask moves with the rows; a class mask is one block for all
    if m.shape[0] > 1:
      return pl.BlockSpec((block, 1), _rows_block)
    return pl.BlockSpec((1, width if m.shape[1] > 1 else 1), _first_block)

  out = pl.pallas_call(
    in_kernel(functools.partial(_kernel, spec, classes, tile)),
    grid=(-(-rows // block),),
    in_specs=[
      pl.BlockSpec(scalars.shape, _first_item, memory_space=pltpu.SMEM),
      blocks,
      blocks,
      *map(mask_block, masks),
    ],
    out_specs=pl.BlockSpec((block, LANES), _rows_block),
    out_shape=jax.ShapeDtypeStruct((rows, LANES), jnp.float32),
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel",), vmem_limit_bytes=_VMEM_INPUTS + (4 << 20)
    ),
    cost_estimate=pl.CostEstimate(
      flops=60 * elements,
      transcendentals=6 * elements,
      bytes_accessed=z.size * z.dtype.itemsize
      + y.size * y.dtype.itemsize
      + sum(4 * m.size for m in masks)
      + rows * LANES * 4,
    ),
    interpret=interpret,
  )(scalars, z, y, *(m.astype(jnp.int32) for m in masks))
  return tuple(out[:, i : i + 1] for i in range(5 + spec[2].num_sums()))


def _abstract(*avals, spec: Spec, gpu=False):
  rows, dtype = avals[0].shape[0], avals[2].dtype
  return [ShapedArray((rows, 1), dtype) for _ in range(5 + spec[2].num_sums())]


def tpu_lowering(ctx, *args, spec: Spec, gpu=False, interpret: bool = False):
  """The TPU lowering of :data:`ROW_SUMS`: the Pallas kernel where it takes the operands,
  else the XLA passes. ``interpret``: the kernel in Pallas' interpreter (tests)."""
  z, y, temperature = ctx.avals_in[:3]
  masks = ctx.avals_in[len(ctx.avals_in) - spec[4] :] if spec[4] else ()
  if takes_whole_rows(spec, z, y, temperature, masks):
    fn = functools.partial(pallas_row_sums, interpret=interpret)
  else:
    fn = xla_row_sums
  return mlir.lower_fun(lambda *a: fn(spec, *a), multiple_results=True)(ctx, *args)


def _batched(args, dims, *, spec: Spec, gpu=False):
  """Under ``vmap``: whole rows stacked into one call when only the logits are batched;
  otherwise the XLA passes mapped."""
  z, y, *rest = args
  if spec[4] or any(d is not None for d in dims[2:]):
    return jax.vmap(functools.partial(xla_row_sums, spec), in_axes=dims)(*args), (0,) * (
      5 + spec[2].num_sums()
    )
  size = next(x.shape[d] for x, d in zip((z, y), dims[:2]) if d is not None)
  zs, ys = stacked_rows(z, dims[0], size), stacked_rows(y, dims[1], size)
  out = ROW_SUMS.bind(zs, ys, *rest, spec=spec, gpu=gpu)
  return [o.reshape(size, -1, 1) for o in out], [0] * len(out)


ROW_SUMS = Primitive("kldiv_jax_row_sums")
ROW_SUMS.multiple_results = True
ROW_SUMS.def_impl(lambda *args, spec, gpu=False: xla_row_sums(spec, *args))
ROW_SUMS.def_abstract_eval(_abstract)
# Every platform but TPU: the XLA passes (CUDA: kldiv_jax._gpu_rows registers the opt-in
# Triton kernels, ``gpu=True``).
XLA_LOWERING = mlir.lower_fun(
  lambda *a, spec, gpu=False: xla_row_sums(spec, *a), multiple_results=True
)
mlir.register_lowering(ROW_SUMS, XLA_LOWERING)
mlir.register_lowering(ROW_SUMS, tpu_lowering, platform="tpu")
batching.primitive_batchers[ROW_SUMS] = _batched
