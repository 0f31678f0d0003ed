"""Opt-in Pallas Triton kernels for NVIDIA GPUs: the engine's row statistics and class sums.

XLA:GPU's row reductions moved the divergences' HBM floor at 7-23% of an H200's bandwidth
(``benchmarks/README.md``). These kernels compute the same per-row statistics with Pallas'
Triton backend. Tiled over columns, a row of 131072 classes need not fit one SM: a grid
``(row blocks, column splits)`` whose programs each reduce a block of rows over a
contiguous run of column tiles and write per-split partials ``[splits, rows]``, combined
in XLA (online softmax: the partial maxes and rescaled sums, Milakov & Gimelshein 2018).
Rows that fit a program are held whole where that saves a read (:func:`triton_row_sums`).

- :func:`_stats_kernel`: the one-pass statistics of the KL family
  (:func:`kldiv_jax._online_kl.online_kl_sums`: both sides' maxes and sums of exponentials
  and the weighted log-ratio sums) and of alpha-beta at static ``alpha, beta > 0``
  (:func:`kldiv_jax._online_ab.online_ab_sums`) from one read of the logits, the kernel of
  :mod:`kldiv_jax._gpu_one_pass`' primitive.
- :func:`triton_row_sums`: the CUDA lowering of :data:`kldiv_jax._whole_rows.ROW_SUMS`
  (JSD, skew KL, skew reverse KL, TVD: terms that need both normalisers first). Where a
  row pair fits a program (:func:`whole_rows_layout`: up to :data:`WHOLE_ROW_ELEMENTS`
  classes padded to a power of 2, 8192 at one row a program, 16 warps), one kernel per
  block of whole rows held in registers: the statistics, then the class sums from the same
  values, the logits read once (as the TPU kernel, :mod:`kldiv_jax._whole_rows`; with the
  derivative rule's pass 5/3 of the HBM floor, not 7/3). Compiled for an H100 (sm_90a) at
  (4096, 8192) float32, ptxas gives it 128 registers a thread at 512 threads and no spill
  (``benchmarks/bench_accel.py``). Longer rows: a statistics kernel, then a class-sums
  kernel given the combined row statistics (two reads).

Both compute from the raw logits (the soft-cap, temperature and masks of rows or classes
applied in the kernel, so no scaled copy is written), with the per-class formulas of
:mod:`kldiv_jax._class_sums` (:func:`~kldiv_jax._rows.scaled`,
:func:`~kldiv_jax._class_sums.normalized`, :func:`~kldiv_jax._class_sums.summands`,
:func:`~kldiv_jax._class_sums.identical_gap`). Their derivatives (hessians) are those of
the XLA passes. The engine's derivative rule's elementwise pass (the gradient wrt the
logits) has its own kernel on the same switch, :mod:`kldiv_jax._gpu_grad`, which reuses
:class:`_Tiles`.

**Opt-in** (off by default: on an H200 the split kernels measured 0.76-1.26x the time of
XLA's fusions, ``benchmarks/README.md``; the whole-row kernel has not run on a GPU yet,
``benchmarks/gpu_check.sh`` times it): the losses' ``implementation="pallas"``, per call or
process-wide (:func:`kldiv_jax.set_implementation`, ``KLDIV_JAX_IMPLEMENTATION=pallas``:
:mod:`kldiv_jax._implementation`), resolved at trace time and turned into the kernels'
setting by :func:`~kldiv_jax._platform.gpu_kernels_for`: by the engine for the KL family,
by :func:`kldiv_jax._whole_rows.row_sums` for the others (the primitive's ``gpu``
parameter, which only its CUDA lowering reads). The private context
:func:`~kldiv_jax._platform.gpu_kernels` (``jax.make_user_context``, part of JAX's tracing
and compilation cache keys) switches them on for a block of code with the default
implementation, or gives them a layout (the benchmarks' sweeps).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import mlir

from kldiv_jax._alpha_beta import ab_pass_terms
from kldiv_jax._class_sums import identical_gap, normalized, norms, summands
from kldiv_jax._divergences import FORMULAS, FORWARD_PASS, REVERSE_PASS
from kldiv_jax._numerics import in_kernel, is_static, max_shift
from kldiv_jax._online_ab import _combiner, _two_pass_ab_sums, online_ab_sums
from kldiv_jax._online_kl import _combine_online, _two_pass_kl_sums, online_kl_sums
from kldiv_jax._rows import scaled
from kldiv_jax._whole_rows import ROW_SUMS, XLA_LOWERING, Spec, _merge, _split, kernel_operands

# ---------------------------------------------------------------------------- the layout

# Rows per program and classes per tile (powers of 2, as Triton's blocks must be): a tile of
# [4, 1024] is 32 elements of each input per thread at 4 warps.
BLOCK_ROWS = 4
TILE = 1024
# Programs the grid aims at (an H100 has 132 SMs): the columns are split while the row blocks
# alone are fewer, down to splits of at least MIN_TILES tiles.
PROGRAMS = 1024
MIN_TILES = 4
NUM_WARPS = 4
NUM_STAGES = 3
# The whole-row kernel of ROW_SUMS (one read): a program holds its rows of both inputs in
# registers, as float32, their classes padded to a power of 2, up to WHOLE_ROW_ELEMENTS
# elements of each (rows x padded classes): 8192, a row pair of 64 KiB at (4096, 8192) f32.
# With their exponentials (kept for the class sums) that is four arrays of 32 KiB, half of an
# H100 SM's 256 KiB register file, at WHOLE_ROW_THREAD elements of each per thread: 16 warps
# (512 threads, 128 registers each at most) hold them in 64 registers a thread, the rest for
# the class sums' terms (Triton's fused-softmax tutorial likewise holds a row in one block).
# ptxas (sm_90a) at (4096, 8192) f32: 128 registers (TVD 64), no spill; two rows a program
# spill. Longer rows (131072 classes, 512 KiB in bfloat16, over the 228 KiB of shared
# memory too) take the split-column kernels. Rows per program: at most WHOLE_ROWS (short
# rows), so that 4096 rows of 512 classes still give 256 programs for the 132 SMs.
WHOLE_ROW_ELEMENTS = 8192
WHOLE_ROW_THREAD = 16
WHOLE_ROWS = 16

# (rows per program, classes per tile, tiles per split, splits)
Layout = tuple[int, int, int, int]


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def layout(rows: int, classes: int, block_rows=None, tile=None, splits=None) -> Layout:
  """The grid of the kernels: ``(rows per program, tile, tiles per split, splits)``."""
  block_rows = block_rows or min(BLOCK_ROWS, _pow2(rows))
  tile = tile or max(32, min(TILE, _pow2(classes)))
  tiles = -(-classes // tile)
  row_blocks = -(-rows // block_rows)
  if splits is None:
    splits = max(1, min(-(-PROGRAMS // row_blocks), tiles // MIN_TILES))
  per_split = -(-tiles // splits)
  return block_rows, tile, per_split, -(-tiles // per_split)


def whole_rows_layout(rows: int, classes: int, block_rows=None) -> Layout | None:
  """The grid of the whole-row kernel, ``(rows per program, padded classes, 1, 1)``, or
  ``None`` where a row pair does not fit a program (:data:`WHOLE_ROW_ELEMENTS`)."""
  width = max(32, _pow2(classes))
  if width > WHOLE_ROW_ELEMENTS:
    return None
  block_rows = block_rows or min(_pow2(rows), WHOLE_ROWS, WHOLE_ROW_ELEMENTS // width)
  return block_rows, width, 1, 1


def _whole_rows_warps(grid: Layout) -> int:
  """Warps of a whole-row program: :data:`WHOLE_ROW_THREAD` elements of each input a thread
  (4 to 16 warps, a power of 2)."""
  return max(4, min(16, grid[0] * grid[1] // (32 * WHOLE_ROW_THREAD)))


def _launch(shape, setting, grid=None, whole=False) -> tuple[Layout, int, int, bool]:
  """``(layout, warps, stages, whole rows)`` of a kernel call: ``grid`` where given (tests),
  else from the switch's value (``True``: the defaults; a tuple ``(rows per program, tile,
  warps, stages)``: a layout of the benchmarks' sweeps, ``tile`` 0 for whole rows). With
  ``whole`` (:data:`ROW_SUMS`' kernels) a layout of one tile per row takes the whole-row
  kernel, by default where the rows fit (:func:`whole_rows_layout`)."""
  rows, classes = shape
  block_rows, tile, warps, stages = (
    setting if isinstance(setting, tuple) else (None, None, None, NUM_STAGES)
  )
  if grid is None and whole and not tile:
    grid = whole_rows_layout(rows, classes, block_rows)
    if grid is not None:
      return grid, warps or _whole_rows_warps(grid), 1, True
  grid = grid or layout(rows, classes, block_rows, tile or None)
  return grid, warps or NUM_WARPS, stages, whole and grid[2] == grid[3] == 1


def takes(z, y, temperature, masks=()) -> bool:
  """Whether the kernels take these operands (avals): float32 computation, float32, bfloat16
  or float16 logits ``[rows, classes]``, masks of rows ``[rows or 1, 1]`` or of classes
  ``[1, classes]`` (masks of single elements keep the XLA passes)."""
  return kernel_operands(z, y, temperature, masks, (jnp.float32, jnp.bfloat16, jnp.float16))


# ---------------------------------------------------------------------------- the kernels


def _masks_in(masks, rows: int):
  """The masks as kernel operands: int32 ``[rows]`` (a mask of rows, or a ``[1, 1]`` one
  broadcast) or ``[classes]`` (a mask of classes), with their kinds (static)."""
  kinds, arrays = [], []
  for m in masks:
    if m.shape[1] > 1:
      kinds.append("classes")
      arrays.append(m[0].astype(jnp.int32))
    else:
      kinds.append("rows")
      arrays.append(jnp.broadcast_to(m[:, 0], (rows,)).astype(jnp.int32))
  return tuple(kinds), arrays


class _Tiles:
  """A program's view of the logits: its block of rows, its run of column tiles."""

  def __init__(self, shape, grid: Layout, kinds, scalars_ref, z_ref, y_ref, mask_refs, caps):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    self.pl, self.plgpu = pl, plgpu
    self.rows, self.classes = shape
    self.block_rows, self.tile, self.per_split, _ = grid
    self.z_ref, self.y_ref, self.caps = z_ref, y_ref, caps
    self.temperature = scalars_ref[0]
    self.r0 = pl.program_id(0) * self.block_rows
    self.first_tile = pl.program_id(1) * self.per_split
    row_ids = self.r0 + lax.broadcasted_iota(jnp.int32, (self.block_rows, 1), 0)
    self.row_in = row_ids < self.rows
    self.row_keep = []
    self.class_refs = []
    for kind, ref in zip(kinds, mask_refs):
      if kind == "rows":
        m = plgpu.load(ref.at[pl.ds(self.r0, self.block_rows)], mask=self.row_in[:, 0], other=0)
        self.row_keep.append(m.reshape(self.block_rows, 1) != 0)
      else:
        self.class_refs.append(ref)

  def load(self, t):
    """``(u, v)``: the scaled logits of tile ``t`` of this program's split, ``-inf`` outside
    the logits and where a mask is off."""
    pl, plgpu = self.pl, self.plgpu
    c0 = (self.first_tile + t) * self.tile
    col_in = c0 + lax.broadcasted_iota(jnp.int32, (1, self.tile), 1) < self.classes
    block, inside = self.where(t)
    z = plgpu.load(self.z_ref.at[block], mask=inside, other=-jnp.inf)
    y = plgpu.load(self.y_ref.at[block], mask=inside, other=-jnp.inf)
    keep = [*self.row_keep]
    for ref in self.class_refs:
      m = plgpu.load(ref.at[pl.ds(c0, self.tile)], mask=col_in[0], other=0)
      keep.append(m.reshape(1, self.tile) != 0)
    u, _ = scaled(z, self.temperature, tuple(keep), self.caps[0])
    v, _ = scaled(y, self.temperature, tuple(keep), self.caps[1])
    return u, v

  def where(self, t):
    """``(block, inside)``: the indices of tile ``t`` of this program's split in the logits,
    and which of its elements lie inside them."""
    pl = self.pl
    c0 = (self.first_tile + t) * self.tile
    col_in = c0 + lax.broadcasted_iota(jnp.int32, (1, self.tile), 1) < self.classes
    return (pl.ds(self.r0, self.block_rows), pl.ds(c0, self.tile)), self.row_in & col_in

  def loop(self, body, init):
    return lax.fori_loop(jnp.int32(0), jnp.int32(self.per_split), body, init)


def _row_sum(x):
  return jnp.sum(x, axis=-1, keepdims=True)


def _tile_softmax(u):
  """A tile's raw row max (``-inf`` without mass) and sum of ``exp(u - max_shift(max))``,
  with the shifted logits and exponentials."""
  m = jnp.max(u, axis=-1, keepdims=True)
  u0 = u - max_shift(m)
  e = jnp.where(u != -jnp.inf, jnp.exp(u0), 0.0)
  return m, _row_sum(e), u0, e


# A one-pass form (static): ("kl",) for the KL family's sums (online_kl_sums'), or
# ("ab", alpha, beta) for alpha-beta's at static alpha, beta > 0 (online_ab_sums').
Kind = tuple


def _one_pass_form(kind: Kind):
  """``(per-class terms of (u0, v0, eu, ev), combiner of two partial states, the XLA pass
  of (u, v), its two-pass form of (u, v))`` of a one-pass form: the states are ``(mu, su,
  mv, sv, *sums)`` with raw maxes and sums relative to ``max_shift`` of them."""
  if kind[0] == "kl":

    def kl_terms(u0, v0, eu, ev):
      return (*FORWARD_PASS.terms(u0, v0, eu, ev), *REVERSE_PASS.terms(u0, v0, eu, ev))

    return kl_terms, _combine_online, online_kl_sums, _two_pass_kl_sums
  _, alpha, beta = kind

  def ab_terms(u0, v0, eu, ev):
    return ab_pass_terms(alpha, beta, u0, v0)

  return (
    ab_terms,
    _combiner(alpha, beta),
    functools.partial(online_ab_sums, alpha, beta),
    functools.partial(_two_pass_ab_sums, alpha, beta),
  )


def _num_sums(kind: Kind) -> int:
  return 2 if kind[0] == "kl" else 3


def _stats_kernel(shape, grid, kinds, scalars_ref, z_ref, y_ref, *refs, caps, kind):
  """Partial row statistics of one program: ``(mu, su, mv, sv, gap)`` (maxes raw), or with
  a one-pass ``kind`` ``(mu, su, mv, sv, *sums)`` (:func:`_one_pass_form`'s)."""
  mask_refs, out_refs = refs[: len(kinds)], refs[len(kinds) :]
  tiles = _Tiles(shape, grid, kinds, scalars_ref, z_ref, y_ref, mask_refs, caps)

  def body(t, carry):
    u, v = tiles.load(t)
    mu, su, u0, eu = _tile_softmax(u)
    mv, sv, v0, ev = _tile_softmax(v)
    if kind is not None:
      terms, combine, _, _ = _one_pass_form(kind)
      sums = tuple(_row_sum(t) for t in terms(u0, v0, eu, ev))
      return combine(carry, (mu, su, mv, sv, *sums))
    (mu, su), (mv, sv) = _merge(carry[:2], (mu, su)), _merge(carry[2:4], (mv, sv))
    return mu, su, mv, sv, carry[4] + _row_sum(identical_gap(u, v))

  none = jnp.full((grid[0], 1), -jnp.inf, jnp.float32)
  zero = jnp.zeros((grid[0], 1), jnp.float32)
  extra = _num_sums(kind) if kind is not None else 1
  out = tiles.loop(body, (none, zero, none, zero) + (zero,) * extra)
  for ref, x in zip(out_refs, out):
    ref[...] = x.reshape(grid[0])


def _params(scalars_ref, static):
  """The formula's parameters: static floats as they are, traced ones from the scalars
  (after the temperature)."""
  traced = iter(scalars_ref[i] for i in range(1, 1 + sum(s is None for s in static)))
  return tuple(next(traced) if s is None else s for s in static)


def _sums_kernel(shape, grid, kinds, scalars_ref, z_ref, y_ref, *refs, caps, formula_spec):
  """Partial class sums of one program, given the combined row statistics ``(mu, inv_su,
  log_su, mv, inv_sv, log_sv)`` (blocks ``[rows per program]``)."""
  name, static, needs = formula_spec
  num = len(kinds)
  mask_refs, stat_refs, out_refs = refs[:num], refs[num : num + 6], refs[num + 6 :]
  tiles = _Tiles(shape, grid, kinds, scalars_ref, z_ref, y_ref, mask_refs, caps)
  params = _params(scalars_ref, static)
  stats = tuple(r[...].reshape(grid[0], 1) for r in stat_refs)

  def body(t, sums):
    u, v = tiles.load(t)
    terms = summands(FORMULAS[name], params, needs, normalized(u, v, *stats), False)
    return tuple(s + _row_sum(x) for s, x in zip(sums, terms))

  zero = jnp.zeros((grid[0], 1), jnp.float32)
  out = tiles.loop(body, (zero,) * needs.num_sums())
  for ref, x in zip(out_refs, out):
    ref[...] = x.reshape(grid[0])


def _whole_rows_kernel(shape, grid, kinds, scalars_ref, z_ref, y_ref, *refs, caps, formula_spec):
  """One program's block of whole rows, held on chip (one tile: the padded row): both sides'
  statistics and the identical-rows gap, then the class sums from the same registers, the
  logits read once: ``(mu, su, mv, sv, gap, *sums)`` (maxes :func:`max_shift`-ed)."""
  name, static, needs = formula_spec
  mask_refs, out_refs = refs[: len(kinds)], refs[len(kinds) :]
  tiles = _Tiles(shape, grid, kinds, scalars_ref, z_ref, y_ref, mask_refs, caps)
  u, v = tiles.load(0)
  mu, su, _, eu = _tile_softmax(u)
  mv, sv, _, ev = _tile_softmax(v)
  mu, mv = max_shift(mu), max_shift(mv)
  n = norms(su, sv)
  # The exponentials kept: normalized's exp(u - mu), exp(v - mv) are these (0 at -inf).
  c = normalized(u, v, mu, n.inv_su, n.log_su, mv, n.inv_sv, n.log_sv, eu, ev)
  terms = summands(FORMULAS[name], _params(scalars_ref, static), needs, c, False)
  out = (mu, su, mv, sv, _row_sum(identical_gap(u, v)), *map(_row_sum, terms))
  for ref, x in zip(out_refs, out):
    ref[...] = x.reshape(grid[0])


def _call(kernel, num_out, z, y, scalars, masks, launch, extra=(), interpret=False):
  """``kernel`` over the grid ``(row blocks, splits)`` of ``launch`` (:func:`_launch`'s):
  partials ``[splits, rows]`` each."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  rows, classes = z.shape
  grid, warps, stages, _ = launch
  block_rows, _, _, splits = grid
  row_blocks = -(-rows // block_rows)
  padded = row_blocks * block_rows
  kinds, mask_arrays = _masks_in(masks, rows)
  # The scalars (temperature, traced parameters) padded to a power of 2 (a Triton block).
  scalars = jnp.pad(scalars, (0, _pow2(scalars.shape[0]) - scalars.shape[0]))
  whole = pl.no_block_spec
  per_row = pl.BlockSpec((block_rows,), lambda i, s: (i,))
  extra = [jnp.pad(x[:, 0], (0, padded - rows)) for x in extra]
  out = pl.pallas_call(
    in_kernel(functools.partial(kernel, (rows, classes), grid, kinds)),
    grid=(row_blocks, splits),
    in_specs=[whole, whole, whole, *(whole for _ in masks), *(per_row for _ in extra)],
    out_specs=[pl.BlockSpec((None, block_rows), lambda i, s: (s, i)) for _ in range(num_out)],
    out_shape=[jax.ShapeDtypeStruct((splits, padded), jnp.float32) for _ in range(num_out)],
    compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
    interpret=interpret,
    name="kldiv_jax_gpu_rows",
  )(scalars, z, y, *mask_arrays, *extra)
  return [x[:, :rows] for x in out]


def _reduce_splits(parts, init, combine):
  """Per-split partials ``[splits, rows]`` reduced over the splits to ``[rows, 1]``."""
  out = lax.reduce(tuple(parts), tuple(jnp.asarray(x, jnp.float32) for x in init), combine, (0,))
  return [x[:, None] for x in out]


def triton_row_sums(spec: Spec, *args, grid=None, setting=True, interpret=False) -> tuple:
  """:func:`kldiv_jax._whole_rows.xla_row_sums` from Triton kernels: where a program holds
  whole rows (:func:`whole_rows_layout`, or a ``grid`` of one tile per row) one kernel, the
  logits read once (:func:`_whole_rows_kernel`); else the statistics and identical-rows gap
  (a read of the logits), then the class sums (a second). ``grid``, ``setting``,
  ``interpret``: as :func:`kldiv_jax._gpu_one_pass.triton_one_pass_sums`'."""
  name, static, needs, caps, _ = spec
  z, y, temperature, params, masks = _split(spec, args)
  traced = [p for p in params if not is_static(p)]
  scalars = jnp.stack([temperature, *traced]).astype(jnp.float32)
  launch = _launch(z.shape, setting, grid, whole=True)
  run = functools.partial(_call, z=z, y=y, scalars=scalars, masks=masks, launch=launch)
  formula_spec = (name, static, needs)
  if launch[3]:
    kernel = functools.partial(_whole_rows_kernel, caps=caps, formula_spec=formula_spec)
    return tuple(x[0][:, None] for x in run(kernel, 5 + needs.num_sums(), interpret=interpret))
  parts = run(functools.partial(_stats_kernel, caps=caps, kind=None), 5, interpret=interpret)

  def combine(a, b):
    return (*_merge(a[:2], b[:2]), *_merge(a[2:4], b[2:4]), a[4] + b[4])

  inf = -jnp.inf
  mu, su, mv, sv, gap = _reduce_splits(parts, (inf, 0, inf, 0, 0), combine)
  mu, mv = max_shift(mu), max_shift(mv)
  n = norms(su, sv)
  stats = (mu, n.inv_su, n.log_su, mv, n.inv_sv, n.log_sv)
  sums = run(
    functools.partial(_sums_kernel, caps=caps, formula_spec=formula_spec),
    needs.num_sums(),
    extra=stats,
    interpret=interpret,
  )
  return (mu, su, mv, sv, gap, *(jnp.sum(s, axis=0)[:, None] for s in sums))


# ---------------------------------------------------------------------------- ROW_SUMS on CUDA


def _lower(fn, ctx, args):
  """``fn`` lowered in a primitive's lowering rule, without jax's deprecation warning of the
  Pallas Triton backend (``jax-pallas-triton``, from jax 0.11: Mosaic GPU is its successor):
  the kernels are opt-in, and the warning would reach every caller that opted in, as an
  error under ``-W error``. TODO(issue 37): port the kernels to Mosaic GPU."""
  with warnings.catch_warnings():
    warnings.filterwarnings(
      "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
    )
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def cuda_lowering(ctx, *args, spec: Spec, gpu=False, interpret: bool = False):
  """The CUDA lowering of :data:`~kldiv_jax._whole_rows.ROW_SUMS`: the Triton kernels where
  switched on when traced (``gpu``, from :func:`~kldiv_jax._platform.gpu_kernels_for`) and they take the operands,
  else the XLA passes."""
  z, y, temperature = ctx.avals_in[:3]
  masks = ctx.avals_in[len(ctx.avals_in) - spec[4] :] if spec[4] else ()
  if not (gpu and takes(z, y, temperature, masks)):
    return XLA_LOWERING(ctx, *args, spec=spec)
  fn = functools.partial(triton_row_sums, setting=gpu, interpret=interpret)
  return _lower(lambda *a: fn(spec, *a), ctx, args)


mlir.register_lowering(ROW_SUMS, cuda_lowering, platform="cuda")
