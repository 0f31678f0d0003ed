"""The value contract shared by every loss: NaN propagates, divergences are never below 0.

* NaN in any input propagates to the value as NaN. The row statistics tell
  NaN apart from "no mass": :func:`max_shift` keeps a NaN (or ``+inf``) row
  max instead of mapping it to 0, and ``_rows.normalizer`` counts a NaN sum
  as mass, so a NaN row never looks like the zero measure.
* A traced option outside its range (a temperature that is not positive and
  finite, an ``alpha`` or ``beta`` outside ``[0, 1]``, ...) makes the result
  NaN, value and gradients: :func:`nan_unless` with the option's range test
  (:func:`positive_finite`, :func:`in_unit_interval`). A static option
  outside its range raises ``ValueError`` at trace time instead (``_checks``).
* A divergence is never below 0: :func:`nonnegative` clamps the value after
  rounding; its derivative is that of the unclamped formula.
* No NaN is produced and then selected away, so that ``jax.debug_nans``
  raises only for results that are NaN: arguments are made safe before a
  partial operation (double ``where``), not after.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def max_shift(m: jax.Array) -> jax.Array:
  """The row max ``m`` to subtract before ``exp``: 0 for a row without mass.

  A ``-inf`` max (every entry ``-inf``: no mass) becomes 0, so ``exp(x - m)``
  is 0, not NaN. A NaN or ``+inf`` max is kept: the row's statistics are then
  NaN, as its softmax is.
  """
  return jnp.where(m == -jnp.inf, 0.0, m)


@jax.custom_jvp
def nonnegative(x: jax.Array) -> jax.Array:
  """``max(x, 0)`` for a divergence rounded below 0; NaN propagates.

  Where the clamp acts the exact divergence is within rounding of 0 and so is
  its gradient: the derivative is that of ``x`` itself (the rule below), so
  gradients stay continuous and equal the kernels' exact ones.
  """
  return jnp.maximum(x, 0.0)


nonnegative.defjvp(lambda primals, tangents: (nonnegative(primals[0]), tangents[0]))


def positive_finite(x):
  """The range test of a temperature or a normalizer: ``0 < x < inf`` (NaN fails)."""
  return (x > 0) & (x < jnp.inf)


def in_unit_interval(x):
  """The range test of ``alpha`` and ``beta``: ``0 <= x <= 1`` (NaN fails)."""
  return (x >= 0) & (x <= 1)


def nan_unless(out: jax.Array, *valid) -> jax.Array:
  """``out``, or NaN (value and gradients) unless every test in ``valid`` holds.

  ``valid`` are the range tests of the options, as booleans that broadcast
  against ``out`` (scalars, or one per example for an invalid input). A static
  option was checked at trace time (``ValueError``) and its test is the
  Python ``True``, skipped; with traced ones the result is multiplied by 1,
  or by NaN, so that an invalid option reaches every element of the value
  (masked examples included) and every gradient.
  """
  flags = [v for v in valid if not (isinstance(v, (bool, np.bool_)) and v)]
  if not flags:
    return out
  ok = functools.reduce(jnp.logical_and, flags)
  # sqrt(-1) is the NaN: a NaN constant selected away would still be a NaN
  # value that jax.debug_nans reports (inside jax.shard_map, say).
  return out * jnp.sqrt(jnp.where(ok, 1.0, -1.0)).astype(out.dtype)
