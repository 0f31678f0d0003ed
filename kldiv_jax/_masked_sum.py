"""The sum over axes under a ``where`` mask, shared by the elementwise per-example losses.

:func:`masked_sum` takes ``where`` as an element mask or a per-example mask
(:func:`kldiv_jax._checks.split_where`) and selects masked entries away
instead of multiplying them, so that NaN or ``inf`` there reaches neither the
value nor the gradients. Used by :mod:`kldiv_jax._optax` and
:mod:`kldiv_jax._gaussian`.
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from kldiv_jax._checks import Axis, normalize_axis, split_where


def masked_sum(
  name: str,
  terms: jax.Array | Callable[..., jax.Array],
  axis: Axis,
  where: jax.typing.ArrayLike | None,
  inputs: Sequence[tuple[jax.Array, float]] = (),
) -> jax.Array:
  """Sums ``terms`` over ``axis`` under an element or per-example ``where``.

  Masked elements are selected away (never multiplied), so a NaN or ``inf``
  there cannot leak into the result; a masked-out example gives 0. With
  ``inputs`` (pairs of an array and a harmless fill value), ``terms`` is a
  function of those arrays, called after the masked entries are replaced by
  the fills: a NaN under the mask then cannot reach the gradients either.
  """
  shape = inputs[0][0].shape if callable(terms) else terms.shape
  axes = normalize_axis(name, axis, len(shape))
  element, example = split_where(name, where, shape, axes)
  if callable(terms):
    keep = element
    if example is not None:
      keep = jnp.broadcast_to(jnp.expand_dims(example, axes), shape)
    arrays = [a if keep is None else jnp.where(keep, a, fill) for a, fill in inputs]
    terms = terms(*arrays)
  if element is not None:
    terms = jnp.where(element, terms, 0.0)
  out = jnp.sum(terms, axis=axes)
  if example is not None:
    out = jnp.where(example, out, 0.0)
  return out
