"""Trace-time validation shared by every loss: dtypes, shapes, axes, masks.

Only static facts are checked (dtypes, shapes, option strings, axes); values
cannot be inspected under ``jit``, so invalid values propagate as NaN instead.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

Axis = int | tuple[int, ...] | None


def compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
  """The dtype arithmetic runs in: at least float32 (bf16/f16 are upcast)."""
  return jnp.promote_types(dtype, jnp.float32)


def check_float(name: str, what: str, *arrays: jax.typing.ArrayLike) -> jnp.dtype:
  """Returns the promoted floating dtype of ``arrays``, or raises ``TypeError``.

  ``what`` names the arguments in the message, e.g. ``"input and target"``.
  The words follow torch's ("Integral inputs not supported.").
  """
  dtypes = [jnp.result_type(a) for a in arrays]
  for dt in dtypes:
    if jnp.issubdtype(dt, jnp.complexfloating):
      raise TypeError(
        f"{name}: Complex inputs not supported. Expected floating {what}; "
        f"got dtypes {', '.join(str(d) for d in dtypes)}."
      )
    if not jnp.issubdtype(dt, jnp.floating):
      raise TypeError(
        f"{name}: Integral inputs not supported. Expected floating {what}; "
        f"got dtypes {', '.join(str(d) for d in dtypes)}. "
        "Cast with .astype(jnp.float32) first."
      )
  return jnp.result_type(*arrays)


def broadcast_shapes(name: str, *shapes: Sequence[int]) -> tuple[int, ...]:
  """``jnp.broadcast_shapes`` with a ``ValueError`` naming every shape."""
  try:
    return tuple(jnp.broadcast_shapes(*[tuple(s) for s in shapes]))
  except ValueError:
    pretty = " and ".join(str(tuple(s)) for s in shapes)
    raise ValueError(
      f"{name}: shapes {pretty} cannot be broadcast together; the arrays "
      "must have equal sizes or size 1 in each trailing dimension."
    ) from None


def promote_and_broadcast(
  name: str, what: str, *arrays: jax.typing.ArrayLike
) -> tuple[list[jax.Array], jnp.dtype]:
  """Casts ``arrays`` to their common compute dtype and broadcast shape.

  Returns the arrays (explicitly broadcast, so ``jax_numpy_rank_promotion``
  never fires inside the library) and the dtype results come back in.
  """
  out_dtype = check_float(name, what, *arrays)
  shape = broadcast_shapes(name, *[np.shape(a) for a in arrays])
  cdt = compute_dtype(out_dtype)
  cast = [jnp.broadcast_to(jnp.asarray(a).astype(cdt), shape) for a in arrays]
  return cast, out_dtype


def normalize_axis(name: str, axis: Axis, ndim: int) -> tuple[int, ...]:
  """Axis (or axes, or ``None`` for all) as sorted non-negative ints."""
  if axis is None:
    return tuple(range(ndim))
  axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
  out = []
  for a in axes:
    if not isinstance(a, (int, np.integer)) or isinstance(a, bool):
      raise TypeError(f"{name}: axis must be an int, a tuple of ints or None; got {axis!r}.")
    if not -ndim <= a < ndim:
      raise ValueError(
        f"{name}: axis {a} is out of range for inputs of rank {ndim}; "
        f"expected an axis in [{-ndim}, {ndim - 1}]."
      )
    out.append(int(a) % ndim)
  if len(set(out)) != len(out):
    raise ValueError(f"{name}: axis {axis!r} repeats an axis.")
  return tuple(sorted(out))


def split_where(
  name: str, where: jax.typing.ArrayLike | None, shape: tuple[int, ...], axes: tuple[int, ...]
) -> tuple[jax.Array | None, jax.Array | None]:
  """Interprets a ``where`` mask as an element mask or a per-example mask.

  A mask whose shape equals the reduced (per-example) output shape is a
  per-example mask: a masked-out example gives 0. Otherwise the mask must
  broadcast against the inputs, and masked elements are left out of the sum
  (optax's semantics). Returns ``(element_mask, example_mask)``, one of them
  ``None`` (both for ``where=None``), each explicitly broadcast.
  """
  if where is None:
    return None, None
  w = jnp.asarray(where)
  if w.dtype != jnp.bool_:
    raise TypeError(f"{name}: where must be a boolean mask; got dtype {w.dtype}.")
  out_shape = tuple(d for i, d in enumerate(shape) if i not in axes)
  if len(axes) > 0 and w.shape == out_shape and w.ndim > 0:
    return None, w
  try:
    full = jnp.broadcast_shapes(w.shape, shape)
  except ValueError:
    full = None
  if full != tuple(shape):
    raise ValueError(
      f"{name}: where has shape {w.shape}, which neither broadcasts to the "
      f"inputs' shape {tuple(shape)} (an element mask) nor equals the "
      f"per-example output shape {out_shape}."
    )
  return jnp.broadcast_to(w, shape), None


def check_choice(name: str, option: str, value: object, choices: Sequence[str]) -> None:
  """``ValueError`` unless ``value`` is one of ``choices``."""
  if not isinstance(value, str) or value not in choices:
    allowed = ", ".join(repr(c) for c in choices)
    raise ValueError(f"{name}: {option} must be one of {allowed}; got {value!r}.")


def _is_static(value: object) -> bool:
  return isinstance(value, (int, float, np.ndarray, np.generic)) and not isinstance(value, bool)


def check_temperature(name: str, temperature: object) -> tuple[float | jax.Array, bool]:
  """Returns ``(temperature, is_static)``; a static one must be positive and finite.

  A static temperature is a Python or NumPy real scalar; anything else is
  traced and must be a real scalar (its value is not checked).
  """
  if _is_static(temperature):
    value = np.asarray(temperature)
    if value.ndim != 0:
      raise ValueError(f"{name}: temperature must be a scalar; got shape {value.shape}.")
    if not np.issubdtype(value.dtype, np.number) or np.iscomplexobj(value):
      raise TypeError(f"{name}: temperature must be a real number; got {temperature!r}.")
    if not (np.isfinite(value) and value > 0):
      raise ValueError(f"{name}: temperature must be positive and finite; got {temperature!r}.")
    return float(value), True
  value = jnp.asarray(temperature)
  if value.ndim != 0:
    raise ValueError(f"{name}: temperature must be a scalar; got shape {value.shape}.")
  if not (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)):
    raise TypeError(f"{name}: temperature must be a real number; got dtype {value.dtype}.")
  return value, False


def check_unit_interval(name: str, option: str, value: object) -> tuple[float | jax.Array, bool]:
  """Returns ``(value, is_static)``; a static one must lie in ``[0, 1]``."""
  if _is_static(value):
    arr = np.asarray(value)
    if arr.ndim != 0 or not 0.0 <= float(arr) <= 1.0:
      raise ValueError(f"{name}: {option} must be a number in [0, 1]; got {value!r}.")
    return float(arr), True
  arr = jnp.asarray(value)
  if arr.ndim != 0:
    raise ValueError(f"{name}: {option} must be a scalar; got shape {arr.shape}.")
  return arr, False
