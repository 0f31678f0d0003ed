"""The opt-in Pallas Triton kernel of the engine's gradient pass, for NVIDIA GPUs.

The engine's derivative rule (:func:`kldiv_jax._engine.tangent_rows`) ends in an elementwise
pass over the logits: from the per-row outcomes (:class:`kldiv_jax._engine.Outcomes`) it
computes the derivatives of a row's value wrt every class,

.. math::

   \\frac{\\partial D}{\\partial z_j} = \\frac{b_j - q_j \\sum_i b_i}{T} \\, s_z(z_j), \\qquad
   \\frac{\\partial D}{\\partial y_j} = \\frac{a_j - p_j \\sum_i a_i}{T} \\, s_y(y_j)

(``s``: a soft-cap's slope), and under ``grad`` writes them times the row's cotangent: the
gradient wrt the logits, ``[rows, classes]``. With the switch on
(:func:`~kldiv_jax._platform.gpu_kernels_for`, ``implementation="pallas"``, as the row kernels
of :mod:`kldiv_jax._gpu_rows`), in a program lowered for CUDA that pass is one Triton kernel
over a grid ``(row blocks, column tiles)`` (any number of classes; ragged edges masked): a
program reads its tile of both raw logits (the soft-cap, temperature and masks of rows or
classes applied in the kernel) and its rows' outcomes and cotangents, and writes the tile of
the student's gradient and, where the rule gives one, the teacher's, in the logits' dtype.
The per-class formulas are the engine's own (:func:`~kldiv_jax._class_sums.rule_grads`,
:func:`~kldiv_jax._rows.logit_grad`, :func:`~kldiv_jax._rows.scaled`), called per tile.
Elsewhere (CPU, TPU, ROCm, operands the kernel does not take, inside ``jax.shard_map``) and
by default, the same XLA pass as always.

How it enters the rule: the tangent's contraction with the logits' tangents, ``sum_j
(dD/dz_j dz_j + dD/dy_j dy_j)`` per row, is a primitive linear in ``dz``, ``dy``
(:data:`GRAD_TANGENT`, XLA's fusion under ``jvp``) whose transpose (``grad``) is the kernel's
primitive :data:`GRAD_PASS`. Derivatives of that (hessians) are those of the XLA pass:
:data:`GRAD_PASS` is a ``jax.custom_jvp`` whose rule differentiates :func:`xla_grad_pass`,
and :data:`GRAD_TANGENT`'s ``jvp`` is :func:`xla_grad_tangent`'s. Under ``vmap`` a batch of
logits is stacked into one call (batched masks, temperatures or parameters: XLA's pass
mapped).

**Opt-in, never run on a GPU yet** (``benchmarks/gpu_check.sh`` times it with the row
kernels, ``bench_device.py --gpu-kernels both``).
"""

import functools

import jax
import jax.numpy as jnp
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from kldiv_jax._class_sums import rule_grads
from kldiv_jax._divergences import FORMULAS
from kldiv_jax._gpu_rows import BLOCK_ROWS, NUM_WARPS, TILE, _lower, _masks_in, _pow2, _Tiles, takes
from kldiv_jax._numerics import in_kernel, is_static
from kldiv_jax._platform import stacked_rows
from kldiv_jax._rows import logit_grad, scaled

# (formula name, static params (None where traced), caps, number of masks, (student side,
# teacher side)): the static parameters of both primitives.
Spec = tuple[str, tuple[float | None, ...], tuple[float | None, float | None], int, tuple]

# Per-row operands: (mu, inv_su, log_su, mv, inv_sv, log_sv, nan), then the student side's
# (zero, sum b) and the teacher side's (zero, sum a), where present.
NUM_STATS = 7


def _num_rows(spec: Spec) -> int:
  return NUM_STATS + 2 * sum(spec[4])


def _split(spec: Spec, args):
  """``(z, y, temperature, params, per-row operands, masks, rest)`` of the operands ``z, y,
  temperature, *traced, *per_row, *masks, *rest``."""
  _, static, _, num_masks, _ = spec
  z, y, temperature, *rest = args
  num_traced = sum(s is None for s in static)
  traced, rest = rest[:num_traced], rest[num_traced:]
  per_row, rest = rest[: _num_rows(spec)], rest[_num_rows(spec) :]
  masks, rest = tuple(rest[:num_masks]), rest[num_masks:]
  traced = iter(traced)
  params = tuple(next(traced) if s is None else s for s in static)
  return z, y, temperature, params, per_row, masks, rest


def _grads(spec: Spec, u, v, temperature, params, per_row):
  """The rule's derivatives wrt the raw logits per class, ``[dz]`` and/or ``[dy]`` (the
  sides the spec names), from scaled logits ``u``, ``v`` and the per-row operands."""
  name, _, caps, _, (student, teacher) = spec
  stats, nan, rest = per_row[:6], per_row[6], list(per_row[NUM_STATS:])
  b = (rest.pop(0) != 0, rest.pop(0)) if student else ()
  a = (rest.pop(0) != 0, rest.pop(0)) if teacher else ()
  g_u, g_v = rule_grads(FORMULAS[name], params, u, v, stats, a, b, nan)
  out = []
  for g, x, cap in ((g_u, u, caps[0]), (g_v, v, caps[1])):
    if g is not None:  # the sides the spec names
      out.append(logit_grad(g, x, temperature, cap))
  return out


def _scaled(spec: Spec, z, y, temperature, masks):
  caps = spec[2]
  return scaled(z, temperature, masks, caps[0])[0], scaled(y, temperature, masks, caps[1])[0]


def xla_grad_pass(spec: Spec, *args) -> list:
  """:data:`GRAD_PASS` as XLA's fusion: ``ct * dD/dz`` (and ``ct * dD/dy``) per class, in
  the logits' dtypes; operands ``z, y, temperature, *traced, *per_row, *masks, ct``."""
  z, y, temperature, params, per_row, masks, (ct,) = _split(spec, args)
  u, v = _scaled(spec, z, y, temperature, masks)
  grads = _grads(spec, u, v, temperature, params, per_row)
  dtypes = [x.dtype for x, side in zip((z, y), spec[4]) if side]
  return [(ct * g).astype(d) for g, d in zip(grads, dtypes)]


def xla_grad_tangent(spec: Spec, *args) -> jax.Array:
  """:data:`GRAD_TANGENT` as XLA's fusion: ``sum_j dD/dz_j dz_j (+ dD/dy_j dy_j)`` per row
  (``[rows, 1]``); operands ``z, y, temperature, *traced, *per_row, *masks, *tangents``."""
  z, y, temperature, params, per_row, masks, tangents = _split(spec, args)
  u, v = _scaled(spec, z, y, temperature, masks)
  grads = _grads(spec, u, v, temperature, params, per_row)
  out = jnp.zeros((z.shape[0], 1), temperature.dtype)
  for g, d in zip(grads, tangents):
    out = out + jnp.sum(g * d.astype(g.dtype), axis=-1, keepdims=True)
  return out


# ---------------------------------------------------------------------------- the kernel


def _grad_kernel(shape, grid, kinds, spec, scalars_ref, z_ref, y_ref, *refs):
  """One program: a tile ``[rows per program, tile]`` of the gradient (each side's)."""
  from jax.experimental.pallas import triton as plgpu

  num_masks, num_rows = len(kinds), _num_rows(spec)
  mask_refs, row_refs = refs[:num_masks], refs[num_masks : num_masks + num_rows]
  ct_ref, out_refs = refs[num_masks + num_rows], refs[num_masks + num_rows + 1 :]
  tiles = _Tiles(shape, grid, kinds, scalars_ref, z_ref, y_ref, mask_refs, spec[2])
  static = spec[1]
  traced = iter(scalars_ref[i] for i in range(1, 1 + sum(s is None for s in static)))
  params = tuple(next(traced) if s is None else s for s in static)
  per_row = [r[...].reshape(grid[0], 1) for r in row_refs]
  ct = ct_ref[...].reshape(grid[0], 1)
  u, v = tiles.load(0)
  grads = _grads(spec, u, v, tiles.temperature, params, per_row)
  block, inside = tiles.where(0)
  for ref, g in zip(out_refs, grads):
    plgpu.store(ref.at[block], (ct * g).astype(ref.dtype), mask=inside)


def grad_layout(rows: int, classes: int, setting=True) -> tuple[int, int, int]:
  """``(rows per program, classes per tile, warps)`` of the kernel: :mod:`kldiv_jax._gpu_rows`'
  defaults, or the switch's layout ``(rows per program, tile, warps, stages)`` (tile 0, whole
  rows for the row kernels: the default tile here)."""
  block_rows, tile, warps, _ = setting if isinstance(setting, tuple) else (None,) * 4
  block_rows = block_rows or min(BLOCK_ROWS, _pow2(rows))
  tile = tile or max(32, min(TILE, _pow2(classes)))
  return block_rows, tile, warps or NUM_WARPS


def triton_grad_pass(spec: Spec, *args, setting=True, interpret=False) -> list:
  """:func:`xla_grad_pass` as one Triton kernel over ``(row blocks, column tiles)``.
  ``setting``: the switch's value (``True`` or a layout); ``interpret``: Pallas'
  interpreter (tests, on CPU)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  z, y, temperature, params, per_row, masks, (ct,) = _split(spec, args)
  rows, classes = z.shape
  block_rows, tile, warps = grad_layout(rows, classes, setting)
  row_blocks = -(-rows // block_rows)
  padded = row_blocks * block_rows
  grid = (block_rows, tile, 1, -(-classes // tile))
  kinds, mask_arrays = _masks_in(masks, rows)
  traced = [p for p in params if not is_static(p)]
  scalars = jnp.stack([temperature, *traced]).astype(jnp.float32)
  scalars = jnp.pad(scalars, (0, _pow2(scalars.shape[0]) - scalars.shape[0]))
  columns = [jnp.pad(x[:, 0].astype(jnp.float32), (0, padded - rows)) for x in (*per_row, ct)]
  whole = pl.no_block_spec
  by_rows = pl.BlockSpec((block_rows,), lambda i, j: (i,))
  dtypes = [x.dtype for x, side in zip((z, y), spec[4]) if side]
  return pl.pallas_call(
    in_kernel(functools.partial(_grad_kernel, (rows, classes), grid, kinds, spec)),
    grid=(row_blocks, grid[3]),
    in_specs=[whole, whole, whole, *(whole for _ in masks), *(by_rows for _ in columns)],
    out_specs=[whole for _ in dtypes],
    out_shape=[jax.ShapeDtypeStruct((rows, classes), d) for d in dtypes],
    compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
    interpret=interpret,
    name="kldiv_jax_gpu_grad",
  )(scalars, z, y, *mask_arrays, *columns)


# ---------------------------------------------------------------------------- GRAD_PASS


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def grad_pass(spec: Spec, setting, *args) -> list:
  """``ct * dD/dz`` (and ``ct * dD/dy``) per class: the kernel in a program lowered for
  CUDA (where ``setting`` is on and it takes the operands), else XLA's pass."""
  return list(GRAD_PASS.bind(*args, spec=spec, setting=setting))


@grad_pass.defjvp
def _grad_pass_jvp(spec, setting, primals, tangents):
  # Second and higher derivatives: XLA's pass's.
  _, out = jax.jvp(functools.partial(xla_grad_pass, spec), primals, tangents)
  return grad_pass(spec, setting, *primals), out


def _pass_abstract(*avals, spec: Spec, setting):
  return [ShapedArray(x.shape, x.dtype) for x, side in zip(avals[:2], spec[4]) if side]


def grad_pass_cuda_lowering(ctx, *args, spec: Spec, setting, interpret: bool = False):
  """The CUDA lowering of :data:`GRAD_PASS`: the Triton kernel where switched on and it takes
  the operands (:func:`kldiv_jax._gpu_rows.takes`), else XLA's pass."""
  z, y, temperature = ctx.avals_in[:3]
  masks = ctx.avals_in[len(ctx.avals_in) - 1 - spec[3] : len(ctx.avals_in) - 1]
  fn = xla_grad_pass
  if setting and takes(z, y, temperature, masks):
    fn = functools.partial(triton_grad_pass, setting=setting, interpret=interpret)
  return _lower(lambda *a: fn(spec, *a), ctx, args)


def _row_operands(spec: Spec) -> set[int]:
  """The operands of :data:`GRAD_PASS` with a row axis first (the logits, the per-row
  operands, the cotangent): those a batch can be stacked along."""
  num_traced = sum(s is None for s in spec[1])
  first = 3 + num_traced
  return {0, 1, *range(first, first + _num_rows(spec)), first + _num_rows(spec) + spec[3]}


def _pass_batched(args, dims, *, spec: Spec, setting):
  """Under ``vmap``: the batch's rows stacked into one call when only row operands are
  batched, else XLA's pass mapped."""
  rowwise = _row_operands(spec)
  out_dims = [0] * sum(spec[4])
  if any(d is not None for i, d in enumerate(dims) if i not in rowwise):
    return jax.vmap(functools.partial(xla_grad_pass, spec), in_axes=dims)(*args), out_dims
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  operands = [
    stacked_rows(x, d, size) if i in rowwise else x for i, (x, d) in enumerate(zip(args, dims))
  ]
  out = GRAD_PASS.bind(*operands, spec=spec, setting=setting)
  return [o.reshape(size, -1, o.shape[-1]) for o in out], out_dims


GRAD_PASS = Primitive("kldiv_jax_gpu_grad_pass")
GRAD_PASS.multiple_results = True
GRAD_PASS.def_impl(lambda *args, spec, setting: xla_grad_pass(spec, *args))
GRAD_PASS.def_abstract_eval(_pass_abstract)
GRAD_PASS_XLA_LOWERING = mlir.lower_fun(
  lambda *args, spec, setting: xla_grad_pass(spec, *args), multiple_results=True
)
mlir.register_lowering(GRAD_PASS, GRAD_PASS_XLA_LOWERING)
mlir.register_lowering(GRAD_PASS, grad_pass_cuda_lowering, platform="cuda")
batching.primitive_batchers[GRAD_PASS] = _pass_batched


# ---------------------------------------------------------------------------- GRAD_TANGENT


def _tangent_impl(*args, spec: Spec, setting):
  return xla_grad_tangent(spec, *args)


def _tangent_abstract(*avals, spec: Spec, setting):
  return ShapedArray((avals[0].shape[0], 1), avals[2].dtype)


def _tangent_jvp(primals, tangents, *, spec: Spec, setting):
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  return jax.jvp(functools.partial(xla_grad_tangent, spec), primals, tangents)


def _tangent_transpose(ct, *args, spec: Spec, setting):
  """``grad``: the cotangents of the logits' tangents, the gradient pass (:data:`GRAD_PASS`)."""
  num_linear = sum(spec[4])
  residuals, linear = args[: len(args) - num_linear], args[len(args) - num_linear :]
  assert all(ad.is_undefined_primal(x) for x in linear)
  assert not any(ad.is_undefined_primal(x) for x in residuals)
  if type(ct) is ad.Zero:
    return [None] * len(args)
  return [None] * len(residuals) + list(grad_pass(spec, setting, *residuals, ct))


def _tangent_batched(args, dims, *, spec: Spec, setting):
  return jax.vmap(functools.partial(xla_grad_tangent, spec), in_axes=dims)(*args), 0


GRAD_TANGENT = Primitive("kldiv_jax_gpu_grad_tangent")
GRAD_TANGENT.def_impl(_tangent_impl)
GRAD_TANGENT.def_abstract_eval(_tangent_abstract)
mlir.register_lowering(GRAD_TANGENT, mlir.lower_fun(_tangent_impl, multiple_results=False))
ad.primitive_jvps[GRAD_TANGENT] = _tangent_jvp
ad.primitive_transposes[GRAD_TANGENT] = _tangent_transpose
batching.primitive_batchers[GRAD_TANGENT] = _tangent_batched


def grad_tangent(
  setting, formula, params, caps, z, y, temperature, masks, stats, a, b, nan, dz, dy
) -> jax.Array:
  """The engine's tangent of the logits, ``sum_j (dD/dz_j dz_j + dD/dy_j dy_j)`` per row
  (``[rows, 1]``; ``dz`` or ``dy`` ``None`` where zero), whose transpose under ``grad`` is
  the gradient pass: the Triton kernel in a program lowered for CUDA (``setting``: the
  switch's value, from :func:`~kldiv_jax._platform.gpu_kernels_for`). ``stats``, ``a``,
  ``b``, ``nan``: the rows' outcomes, as :func:`~kldiv_jax._class_sums.rule_grads` takes
  them."""
  sides = (dz is not None, dy is not None)
  static = tuple(float(p) if is_static(p) else None for p in params)
  traced = [p for p in params if not is_static(p)]
  spec: Spec = (formula.name, static, tuple(caps), len(masks), sides)
  per_row = [*stats, nan, *(b if sides[0] else ()), *(a if sides[1] else ())]
  tangents = [d for d in (dz, dy) if d is not None]
  args = (z, y, temperature, *traced, *per_row, *masks, *tangents)
  if jax.sharding.get_abstract_mesh().manual_axes:  # inside jax.shard_map: XLA's pass
    return xla_grad_tangent(spec, *args)
  return GRAD_TANGENT.bind(*args, spec=spec, setting=setting)
