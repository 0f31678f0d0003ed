"""Where and how the row kernels run: per platform, per block of rows, compiled once.

:func:`map_rows` computes per-row statistics over blocks of rows on CPU
(XLA's CPU reductions do not fuse an ``exp`` producer, and materialising
full-size temporaries costs more than the arithmetic) and in one piece
elsewhere; :func:`per_platform` and :func:`gpu_or_other` choose a whole kernel
per platform, at lowering (``lax.platform_dependent``); :func:`compiled`
compiles a module-level kernel once per shapes for eager calls.
"""

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._sums import cpu_sums

# Elements per block of rows for the CPU row statistics (512 KiB of float32).
_BLOCK_ELEMENTS = 1 << 17
# The name scope of the CPU row loop: it marks the path in a lowered module's locations.
ROW_BLOCKS_SCOPE = "kldiv_jax_cpu_row_blocks"

_Fn = TypeVar("_Fn", bound=Callable[..., Any])

# ----------------------------------------------------------------------------- GPU kernels
# The Pallas Triton kernels (kldiv_jax._gpu_rows) are chosen by the losses' public
# ``implementation=`` (kldiv_jax._implementation): ``gpu_kernels_for``. The private context
# below switches them on for a block of code under the default implementation, or gives them
# a layout (the benchmarks' sweeps); read at trace time.


# Below jax 0.7.2 (no ``make_user_context``) the kernels stay off: a plain switch would not be
# part of JAX's cache keys (a function jitted with one setting would keep it).
_make = getattr(jax, "make_user_context", None)
GPU_KERNELS = _make(False) if _make is not None else None


def gpu_kernels_setting():
  """The private context's value: ``False``, ``True`` or a tuple ``(rows per program,
  classes per tile, warps, stages)`` of the kernels' layout (:func:`kldiv_jax._gpu_rows.layout`;
  tile 0: whole rows a program, :func:`kldiv_jax._gpu_rows.whole_rows_layout`; for the
  benchmarks' sweeps), hashable: a static parameter of the kernels' primitives."""
  value = GPU_KERNELS.value if GPU_KERNELS is not None else False
  return tuple(value) if isinstance(value, (tuple, list)) else bool(value)


def gpu_kernels_for(implementation: str):
  """The GPU kernels' setting (``False``, ``True`` or a layout) for a loss's resolved
  ``implementation`` (:mod:`kldiv_jax._implementation`): off with ``"xla"``; on with
  ``"pallas"`` (with the context's layout, if it gives one); with ``"auto"``, the default,
  whatever the private context :func:`gpu_kernels` says (off outside it). Never below jax
  0.7.2, where the switch could not be part of JAX's cache keys."""
  if implementation == "xla" or GPU_KERNELS is None:
    return False
  setting = gpu_kernels_setting()
  if implementation == "pallas":
    return setting if isinstance(setting, tuple) else True
  return setting


def gpu_kernels(enabled: bool | tuple[int, int, int, int] = True):
  """A context manager: inside it the GPU kernels are on (or off); a ``jax.jit`` function
  traced inside is traced and compiled again for it. A tuple ``(rows per program, classes
  per tile, warps, stages)`` switches them on with that layout (the benchmarks' sweeps; tile
  0: whole rows a program where they fit). Below
  jax 0.7.2 it changes nothing (the kernels stay off)."""
  if GPU_KERNELS is None:
    return contextlib.nullcontext()
  return GPU_KERNELS(tuple(enabled) if isinstance(enabled, (tuple, list)) else bool(enabled))


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


def per_device_code() -> bool:
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
  :func:`per_device_code`), ``fn`` runs once. ``num_classes`` sets the rows
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
  if not per_device_code():
    return plain(*arrays)
  off_cpu = plain if accel is None else strong(accel)
  if num_rows <= block and accel is None:
    return plain(*arrays)

  def cpu(*a):
    # The CPU code's class sums are trees (kldiv_jax._sums.cpu_sums).
    with cpu_sums():
      if num_rows <= block:
        return plain(*a)
      with jax.named_scope(ROW_BLOCKS_SCOPE):
        return _row_blocks(plain, a, num_rows, block)

  return lax.platform_dependent(*arrays, cpu=cpu, default=off_cpu)


def per_platform(cpu, accel, *arrays):
  """``cpu(*arrays)`` in a program lowered for CPU, ``accel(*arrays)`` for the others.

  A whole kernel chosen per platform (:func:`map_rows` chooses its row statistics): both
  are staged out with ``lax.platform_dependent`` and lowering keeps the platform's own.
  ``cpu`` everywhere under ``jax.jit`` with several devices (see :func:`per_device_code`).
  """
  if not per_device_code():
    return cpu(*arrays)

  def on_cpu(*a):
    with cpu_sums():
      return cpu(*a)

  out = lax.platform_dependent(*arrays, cpu=on_cpu, default=accel)
  # Strongly typed, as :func:`map_rows`' results.
  return jax.tree.map(lambda r: lax.convert_element_type(r, r.dtype), out)


def gpu_or_other(gpu, other, *arrays):
  """``gpu(*arrays)`` in a program lowered for CUDA or ROCm, ``other(*arrays)`` elsewhere.

  For an accelerator kernel whose best form differs between XLA:GPU and XLA:TPU (staged
  out with ``lax.platform_dependent``, as :func:`per_platform`; strongly typed results).
  """
  out = lax.platform_dependent(*arrays, cuda=gpu, rocm=gpu, default=other)
  return jax.tree.map(lambda r: lax.convert_element_type(r, r.dtype), out)


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


def stacked_rows(x, d, size: int):
  """A batching rule's operand ``x`` (batched along ``d``, or ``None``: broadcast to the
  ``size`` of the batch) with the batch's rows stacked: ``[size * rows, last]``, for a
  row-wise primitive called once on the whole batch (the kernels' ``vmap`` rules)."""
  x = jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
  return x.reshape(-1, x.shape[-1])
