"""Shims for the oldest jax that kldiv_jax supports (pyproject.toml: jax >= 0.7.0).

Each says which jax has the API and when to remove the shim.
"""

import inspect

import jax
import jax.numpy as jnp

# ``jnp.take_along_axis(..., wrap_negative_indices=False)`` is jax >= 0.10.2; before it,
# negative indices always wrap. Sending them past the end instead gives ``mode="fill"``'s
# NaN, as the keyword does. Remove when the floor reaches jax 0.10.2.
_TAKE_HAS_WRAP = "wrap_negative_indices" in inspect.signature(jnp.take_along_axis).parameters


def take_along_last_axis_filled(arr: jax.Array, indices: jax.Array) -> jax.Array:
  """``arr`` gathered at ``indices`` along the last axis; an id outside ``[0, n)`` gives NaN."""
  if _TAKE_HAS_WRAP:
    return jnp.take_along_axis(arr, indices, axis=-1, mode="fill", wrap_negative_indices=False)
  if jnp.issubdtype(indices.dtype, jnp.signedinteger):
    indices = indices.astype(jnp.promote_types(indices.dtype, jnp.int32))
    indices = jnp.where(indices < 0, arr.shape[-1], indices)
  return jnp.take_along_axis(arr, indices, axis=-1, mode="fill")
