"""Row reductions over the class axis as a tree: float32 sums of long rows stay accurate.

Every sum over a vocabulary (sums of exponentials, a divergence's class sums, the tangents'
contractions, the one-pass variadic reductions off CPU) goes through :func:`class_sum` or
:func:`class_reduce`. Both split a row of ``V`` classes into groups of at most
:data:`GROUP` and reduce level by level (``[rows, V] -> [rows, V / GROUP] -> ...``), each
level behind ``lax.optimization_barrier``: XLA merges a reduction of a reduction into one
otherwise, and XLA:CPU adds a long row in one sequential run where it is given one. It does
so for a row reduced alone (a block of one row: the CPU row loop at ``V >= 2**17``), about
``sqrt(V)`` times the rounding error of a pairwise sum, and for every row of a variadic
reduction (the online softmax's combiner), up to ``V`` times. A tree of groups bounds each
sequential run by the group's length; the partial results (``[rows, V / GROUP]``) are the
only temporary. Rows of at most one group are reduced as they were.
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

# Classes per group of the tree: XLA:CPU vectorises a group's reduction (and adds a
# variadic one in sequence), and a level of partial results is ``1 / GROUP`` of the data.
GROUP = 256


def _levels(x: jax.Array, init, group: int) -> jax.Array:
  """``x`` ``[..., n]`` padded with ``init`` to a whole number of groups, as ``[..., n / group,
  group]``."""
  n = x.shape[-1]
  pad = -n % group
  if pad:
    x = lax.pad(x, jnp.asarray(init, x.dtype), [(0, 0, 0)] * (x.ndim - 1) + [(0, pad, 0)])
  return x.reshape(*x.shape[:-1], (n + pad) // group, group)


def class_sum(x: jax.Array, group: int | None = None) -> jax.Array:
  """``sum(x, axis=-1, keepdims=True)`` as a tree of groups of ``group`` classes.

  Differentiable (the sum's derivatives: the barrier is the identity). ``group``: default
  :data:`GROUP`, read at trace time.
  """
  group = GROUP if group is None else group
  while x.shape[-1] > group:
    x = lax.optimization_barrier(jnp.sum(_levels(x, 0, group), axis=-1))
  return jnp.sum(x, axis=-1, keepdims=True)


def class_reduce(
  operands: Sequence[jax.Array],
  inits: Sequence[jax.Array],
  combine: Callable[[tuple, tuple], tuple],
  group: int | None = None,
) -> tuple[jax.Array, ...]:
  """``lax.reduce(operands, inits, combine, (last axis,))`` as a tree of groups of ``group``.

  ``combine`` must be associative up to rounding (a monoid with ``inits`` its identity:
  padding takes the ``inits``). The results drop the class axis. ``group``: as
  :func:`class_sum`'s.
  """
  group = GROUP if group is None else group
  ops = tuple(operands)
  axis = ops[0].ndim - 1
  while ops[0].shape[-1] > group:
    grouped = tuple(_levels(x, i, group) for x, i in zip(ops, inits))
    ops = lax.optimization_barrier(tuple(lax.reduce(grouped, tuple(inits), combine, (axis + 1,))))
  return tuple(lax.reduce(ops, tuple(inits), combine, (axis,)))
