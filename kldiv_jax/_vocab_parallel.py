"""Vocabulary parallelism: the class axis split over a mesh axis (``axis_name``).

Inside ``jax.shard_map`` each device holds a slice of the classes (the
vocabulary) of every row. A softmax over the whole row only needs per-row
scalars from the other devices: the row max (``lax.pmax``) and sums over
classes (``lax.psum``). The kernels (:mod:`kldiv_jax._engine` for the
divergences, :mod:`kldiv_jax._ce` for the cross entropy) make one pass per
reduction and call the helpers here after it, so no vocabulary-sized buffer
crosses devices. This module holds no kernel: only the argument check and the
collectives every kernel shares.
"""

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._numerics import max_shift

# Why vocabularies of different sizes need one size with ``axis_name`` (in the errors).
VOCAB_PARALLEL_PADDING = (
  "with axis_name each device's slices of two vocabularies of different sizes would not "
  "hold the same classes: cut both to the shared classes before sharding"
)


def check_axis_name(name: str, axis_name: object) -> int:
  """Returns the size of mesh axis ``axis_name``; raises if it is not bound."""
  if not isinstance(axis_name, str):
    raise TypeError(
      f"{name}: axis_name must be a str (a mesh axis name) or None; got {axis_name!r}."
    )
  try:
    return int(lax.axis_size(axis_name))
  except NameError as err:
    raise ValueError(
      f"{name}: axis_name={axis_name!r} is not a mesh axis of an enclosing jax.shard_map; "
      "call the loss inside shard_map with the class axis split over that axis, "
      "or pass axis_name=None."
    ) from err


def global_classes(local_classes: int, axis_name: str | None) -> int:
  """The number of classes of the whole (unsharded) class axis."""
  return local_classes if axis_name is None else local_classes * lax.axis_size(axis_name)


def class_offset(axis_name: str, local_classes: int) -> jax.Array:
  """The global index of this device's first class."""
  return lax.axis_index(axis_name) * local_classes


def any_class(mask: jax.Array, axis_name: str | None) -> jax.Array:
  """Whether any class of each row of a ``[rows or 1, classes]`` mask is on, over all devices."""
  local = jnp.any(mask, axis=1, keepdims=True)
  if axis_name is None:
    return local
  return lax.pmax(local.astype(jnp.int32), axis_name) > 0


def combine(m: jax.Array, s: jax.Array, axis_name: str) -> tuple[jax.Array, jax.Array]:
  """Global row max and sum of exponentials from each device's max ``m`` and sum ``s``.

  ``s`` is the sum of ``exp(x - m)`` over this device's classes. Each sum is
  rescaled to the global max, so one pass over the data gives both. The max
  carries no gradient (``stop_gradient`` before the ``pmax``, which has no
  derivative rule).
  """
  m = lax.stop_gradient(m)
  # A device without mass (or with a NaN sum) does not take part: the max is finite or -inf.
  top = max_shift(lax.pmax(jnp.where(s > 0, m, -jnp.inf), axis_name))
  # A device without mass has s = 0 (and m = 0): rescale it by 1, not exp(0 - top).
  return top, lax.psum(s * jnp.exp(jnp.where(s == 0, top, m) - top), axis_name)
