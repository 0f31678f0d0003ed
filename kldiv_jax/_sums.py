"""Sums over the class axis: on CPU a tree, so that float32 sums of long rows stay accurate.

Every sum over a vocabulary (sums of exponentials, a divergence's class sums, the tangents'
contractions, the one-pass variadic reductions of the accelerator code) goes through
:func:`class_sum` or :func:`class_reduce`. In a program lowered for CPU both split a row of
``V`` classes into groups of at most :data:`GROUP` and reduce level by level (``[rows, V] ->
[rows, V / GROUP] -> ...``), each level behind ``lax.optimization_barrier`` (XLA merges a
reduction of a reduction into one otherwise). XLA:CPU adds a long row in one sequential run
where it is given one: a row reduced alone (a block of one row: the CPU row loop at ``V >=
2**17``), about ``sqrt(V)`` times the rounding error of a pairwise sum, and every row of a
variadic reduction (the online softmax's combiner), up to ``V`` times. The tree bounds each
sequential run by a group; the groups' results (``[rows, V / GROUP]``) are the only
temporary, and a row reduced alone is faster (XLA:CPU splits the groups over its threads).
Rows of at most :data:`SHORT` classes are XLA's own reduction. A variadic reduction's groups
are smaller (:data:`VARIADIC_GROUP`): XLA:CPU vectorises a plain sum over its lanes (a group
of 256 classes is 8 runs of 32 with AVX2) but runs a variadic one through the whole group in
sequence, and at 256 the online softmax's sums of exponentials were off by up to 4.7 float32
ulps at ``V = 2**17`` (under 1.5 at 32: ``benchmarks/README.md``, *Precision*).

Elsewhere the sums are XLA's own reductions, which GPUs and TPUs compute as trees already:
on TPU the reshape into groups would change the logits' tiled layout, and XLA then writes
the reductions' operands out (XLA's estimate for v5e: 7 GiB of temporaries and ten times
the time at ``[2048, 131072]``). The CPU code is traced inside :func:`cpu_sums`: the CPU
branch of :func:`kldiv_jax._platform.map_rows` and :func:`kldiv_jax._platform.per_platform`
(a ``lax.platform_dependent`` of its own per sum would put every sum of a program exported
for several platforms in a conditional, apart from the producer XLA fuses into it). Tests
that run the accelerator code on CPU enter it too: XLA:CPU then sums that code's rows.
"""

import contextlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

# Classes per group of the tree: XLA:CPU vectorises a group's reduction (and adds a
# variadic one in sequence), and a level of partial results is ``1 / GROUP`` of the data.
GROUP = 256
# Classes per group of a variadic reduction's tree (class_reduce): XLA:CPU runs such a
# reduction through a group in sequence, so a group is as long as a plain sum's run per lane.
VARIADIC_GROUP = 32
# Rows of at most this many classes are reduced as XLA reduces them (a run of at most 4096
# adds; programs of short rows are the same as without the tree).
SHORT = 16 * GROUP
# Whether the code being traced is for CPU (:func:`cpu_sums`), innermost last.
_FOR_CPU: list[bool] = [False]


@contextlib.contextmanager
def cpu_sums(on: bool = True):
  """Inside the block, :func:`class_sum` and :func:`class_reduce` trace the tree (``on``) or
  XLA's plain reduction: the CPU branch of a platform choice is traced inside it."""
  _FOR_CPU.append(on)
  try:
    yield
  finally:
    _FOR_CPU.pop()


def _on_cpu(tree, plain, *args):
  """``tree(*args)`` when tracing for CPU (:func:`cpu_sums`), else ``plain(*args)``."""
  return tree(*args) if _FOR_CPU[-1] else plain(*args)


def _levels(x: jax.Array, init, group: int) -> jax.Array:
  """``x`` ``[..., n]`` padded with ``init`` to a whole number of groups, as ``[..., n / group,
  group]``."""
  n = x.shape[-1]
  pad = -n % group
  if pad:
    x = lax.pad(x, jnp.asarray(init, x.dtype), [(0, 0, 0)] * (x.ndim - 1) + [(0, pad, 0)])
  return x.reshape(*x.shape[:-1], (n + pad) // group, group)


def class_sum(x: jax.Array, group: int | None = None) -> jax.Array:
  """``sum(x, axis=-1, keepdims=True)``; on CPU a tree of groups of ``group`` classes.

  Differentiable (the sum's derivatives: the barrier is the identity). ``group``: default
  :data:`GROUP`, read at trace time.
  """
  group = GROUP if group is None else group
  if x.shape[-1] <= max(group, SHORT):
    return jnp.sum(x, axis=-1, keepdims=True)

  def tree(x):
    while x.shape[-1] > group:
      x = lax.optimization_barrier(jnp.sum(_levels(x, 0, group), axis=-1))
    return jnp.sum(x, axis=-1, keepdims=True)

  return _on_cpu(tree, lambda x: jnp.sum(x, axis=-1, keepdims=True), x)


def class_reduce(
  operands: Sequence[jax.Array],
  inits: Sequence[jax.Array],
  combine: Callable[[tuple, tuple], tuple],
  group: int | None = None,
) -> tuple[jax.Array, ...]:
  """``lax.reduce(operands, inits, combine, (last axis,))``; on CPU a tree of groups of ``group``.

  ``combine`` must be associative up to rounding (a monoid with ``inits`` its identity:
  padding takes the ``inits``). The results drop the class axis. ``group``: default
  :data:`VARIADIC_GROUP`, read at trace time; rows of at most :data:`SHORT` classes are one
  reduction.
  """
  group = VARIADIC_GROUP if group is None else group
  ops, inits = tuple(operands), tuple(inits)
  axis = ops[0].ndim - 1

  def plain(*ops):
    return tuple(lax.reduce(ops, inits, combine, (axis,)))

  def tree(*ops):
    while ops[0].shape[-1] > group:
      grouped = tuple(_levels(x, i, group) for x, i in zip(ops, inits))
      ops = lax.optimization_barrier(tuple(lax.reduce(grouped, inits, combine, (axis + 1,))))
    return plain(*ops)

  if ops[0].shape[-1] <= max(group, SHORT):
    return plain(*ops)
  return _on_cpu(tree, plain, *ops)
