"""Trace-time validation shared by every loss: dtypes, shapes, axes, masks.

Only static facts are checked (the kinds of arguments, dtypes, shapes, option
strings, axes); values cannot be inspected under ``jit``, so invalid values
propagate as NaN instead. Every argument is checked here by name before it
reaches JAX: :func:`as_array` for arrays, :func:`real_scalar` for numeric
options, :func:`check_bool`, :func:`check_int`, :func:`check_choice` and
:func:`normalize_axis` for static ones (ids and vocabulary sizes:
:mod:`kldiv_jax._id_checks`).

Dtypes are promoted with JAX's standard rules (:func:`result_dtype`) whatever
``jax_numpy_dtype_promotion`` the caller set: strict mode governs the caller's
code; inside, arithmetic runs in the compute dtype with explicit casts.
"""

from collections.abc import Sequence
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

Axis = int | tuple[int, ...] | None


def result_dtype(*arrays_or_dtypes: object) -> jnp.dtype:
  """``jnp.result_type`` under the standard promotion rules, even in strict mode.

  Python scalars stay weakly typed (``bf16`` with ``2.0`` is ``bf16``), and
  mixed inputs promote as ``jnp.promote_types`` does (``bf16`` with ``f32`` is
  ``f32``) instead of raising ``TypePromotionError`` under the caller's
  ``jax.numpy_dtype_promotion("strict")``.
  """
  with jax.numpy_dtype_promotion("standard"):
    return jnp.result_type(*arrays_or_dtypes)


def compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
  """The dtype arithmetic runs in: at least float32 (bf16/f16 are upcast)."""
  return result_dtype(dtype, jnp.float32)


def _describe(value: object) -> str:
  text = repr(value)
  if len(text) > 60:
    text = text[:57] + "..."
  return text if value is None else f"{type(value).__name__} {text}"


def _numeric(dtype: np.dtype) -> bool:
  return dtype == np.bool_ or jnp.issubdtype(dtype, jnp.number)


def _numeric_leaves(value: object) -> bool:
  if isinstance(value, (list, tuple)):
    return all(_numeric_leaves(v) for v in value)
  if isinstance(value, (bool, int, float, complex)):
    return True
  return isinstance(value, (np.ndarray, np.generic, jax.Array)) and _numeric(value.dtype)


def _has_jax_array(value: object) -> bool:
  if isinstance(value, (list, tuple)):
    return any(_has_jax_array(v) for v in value)
  return isinstance(value, jax.Array)


class SupportsJaxArray(Protocol):
  """An object JAX converts to an array through its ``__jax_array__`` method."""

  def __jax_array__(self) -> jax.Array: ...


# What :func:`as_array` returns: whatever JAX converts to an array. That is
# ``jax.typing.ArrayLike`` and two kinds it does not list: NumPy scalars of the
# ml_dtypes types (``ml_dtypes.bfloat16(1.0)`` is a ``np.generic`` but not a
# ``np.number``) and objects defining ``__jax_array__``.
ArrayInput = jax.typing.ArrayLike | np.generic | SupportsJaxArray

_AN_ARRAY = "an array of numbers (a JAX or NumPy array, a number or a nested list of numbers)"


def as_array(name: str, arg: str, value: object, expected: str = _AN_ARRAY) -> ArrayInput:
  """``value`` checked to be array-like, or a ``TypeError`` naming ``arg``.

  Accepted: JAX arrays (tracers included) and NumPy arrays of numbers or
  bools, Python and NumPy scalars, and nested lists or tuples of those, which
  come back as an array (NumPy unless they hold JAX arrays). Python scalars
  come back unchanged, so they stay weakly typed. ``None``, strings, bytes,
  dicts, object arrays and lists of mixed kinds are rejected; ``expected``
  words the message.
  """
  if isinstance(value, (bool, int, float, complex)):
    return value
  if isinstance(value, (list, tuple)) and _numeric_leaves(value):
    try:  # then checked as an array: ints beyond int64 make an object array
      value = jnp.asarray(value) if _has_jax_array(value) else np.asarray(value)
    except (TypeError, ValueError):
      raise ValueError(
        f"{name}: {arg} is a nested list whose rows have different lengths; "
        "expected a rectangular array."
      ) from None
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    if _numeric(value.dtype):
      return value
    got = f"an array of dtype {value.dtype}"
  elif hasattr(value, "__jax_array__"):
    return cast(SupportsJaxArray, value)  # the checker does not narrow on hasattr
  else:
    got = _describe(value)
  raise TypeError(f"{name}: {arg} must be {expected}; got {got}.")


MASK = "a boolean mask (an array of bools)"


def _join(names: Sequence[str]) -> str:
  """``"a"``, ``"a and b"``, ``"a, b and c"``."""
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _float_arrays(
  name: str, names: Sequence[str], arrays: Sequence[object]
) -> tuple[list[ArrayInput], jnp.dtype]:
  arrays = [as_array(name, n, a) for n, a in zip(names, arrays, strict=True)]
  return arrays, _check_float_dtypes(name, _join(names), arrays)


def check_float(name: str, names: Sequence[str], *arrays: object) -> jnp.dtype:
  """Returns the promoted floating dtype of ``arrays``, or raises ``TypeError``.

  ``names`` are the arguments' names, one per array, for the messages. The
  words follow torch's ("Integral inputs not supported.").
  """
  return _float_arrays(name, names, arrays)[1]


def _check_float_dtypes(name: str, what: str, arrays: Sequence[object]) -> jnp.dtype:
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
  return result_dtype(*arrays)


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


def array_shape(value: object) -> tuple[int, ...]:
  """The shape of an array argument that :func:`as_array` accepted, as given.

  ``np.shape``, not ``jnp.shape``: JAX warns (``DeprecationWarning``) on a nested
  list. ``np.shape`` does not call ``__jax_array__``: it takes such an object as
  0-d, which the cast keeps as it was (NumPy's ArrayLike does not list them).
  """
  return np.shape(cast(npt.ArrayLike, value))


def promote_and_broadcast(
  name: str, names: Sequence[str], *arrays: object
) -> tuple[list[jax.Array], jnp.dtype]:
  """Casts ``arrays`` (named ``names``) to their common compute dtype and broadcast shape.

  Returns the arrays (explicitly broadcast, so ``jax_numpy_rank_promotion``
  never fires inside the library) and the dtype results come back in.
  """
  checked, out_dtype = _float_arrays(name, names, arrays)
  shape = broadcast_shapes(name, *[array_shape(a) for a in checked])
  cdt = compute_dtype(out_dtype)
  out = [jnp.broadcast_to(jnp.asarray(a).astype(cdt), shape) for a in checked]
  return out, out_dtype


def normalize_axis(name: str, axis: Axis, ndim: int) -> tuple[int, ...]:
  """Axis (or axes, or ``None`` for all) as sorted non-negative ints."""
  if axis is None:
    return tuple(range(ndim))
  axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
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


def mask_array(name: str, where: object) -> jax.Array:
  """``where`` as a boolean JAX array, or a ``TypeError`` naming ``name``.

  The first step of every ``where`` argument; each path then reads the
  shape its way (:func:`split_where` for the logit and optax losses, a token
  mask for the fused head, an example or slot mask for top-k).
  """
  w = jnp.asarray(as_array(name, "where", where, MASK))
  if w.dtype != jnp.bool_:
    raise TypeError(f"{name}: where must be a boolean mask; got dtype {w.dtype}.")
  return w


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
  w = mask_array(name, where)
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


def check_bool(name: str, option: str, value: object) -> bool:
  """``value`` as a bool, or a ``TypeError`` unless it is a Python or NumPy bool.

  As torch does for ``log_target``: a string such as ``"False"`` is not taken
  as true, nor a number as a flag.
  """
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
      f"{name}: {option} must be a bool (True or False), not {type(value).__name__}; got {value!r}."
    )
  return bool(value)


def check_int(name: str, option: str, value: object) -> int:
  """``value`` as an int, or a ``TypeError`` unless it is a Python or NumPy integer."""
  if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}: {option} must be an int; got {_describe(value)}.")
  return int(value)


def _is_static(value: object) -> bool:
  return isinstance(value, (int, float, np.ndarray, np.generic)) and not isinstance(value, bool)


def real_scalar(name: str, option: str, value: object) -> tuple[float | jax.Array, bool]:
  """Returns ``(value, is_static)`` for a real scalar option, or raises naming ``option``.

  A static value is a Python or NumPy real number, returned as a float; any
  other (a JAX array, possibly traced) must be a real scalar too and comes
  back as an array whose value is not checked.
  """
  value = as_array(name, option, value, "a real number (a Python or NumPy number, or a 0-d array)")
  traced = None if _is_static(value) else jnp.asarray(value)
  arr = np.asarray(value) if traced is None else traced
  if arr.ndim != 0:
    raise ValueError(f"{name}: {option} must be a scalar; got shape {arr.shape}.")
  if not (jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)):
    got = repr(value) if traced is None else f"dtype {arr.dtype}"
    raise TypeError(f"{name}: {option} must be a real number; got {got}.")
  return (float(arr), True) if traced is None else (traced, False)


def check_temperature(name: str, temperature: object) -> tuple[float | jax.Array, bool]:
  """Returns ``(temperature, is_static)``; a static one must be positive and finite.

  A static temperature is a Python or NumPy real scalar; anything else is
  traced and must be a real scalar (its value is not checked).
  """
  value, static = real_scalar(name, "temperature", temperature)
  if static and not (np.isfinite(value) and value > 0):
    raise ValueError(f"{name}: temperature must be positive and finite; got {temperature!r}.")
  return value, static


def check_unit_interval(name: str, option: str, value: object) -> tuple[float | jax.Array, bool]:
  """Returns ``(value, is_static)``; a static one must lie in ``[0, 1]``."""
  out, static = real_scalar(name, option, value)
  if static and not 0.0 <= out <= 1.0:
    raise ValueError(f"{name}: {option} must be a number in [0, 1]; got {value!r}.")
  return out, static


def check_nonnegative(name: str, option: str, value: object) -> tuple[float | jax.Array, bool]:
  """Returns ``(value, is_static)``; a static one must be non-negative and finite (a
  penalty's coefficient: ``z_loss``)."""
  out, static = real_scalar(name, option, value)
  if static and not (np.isfinite(out) and out >= 0):
    raise ValueError(f"{name}: {option} must be a non-negative, finite number; got {value!r}.")
  return out, static


def check_normalizer(name: str, value: object) -> float | jax.Array:
  """A loss's ``normalizer``: a real scalar; a static one must be positive and finite.

  (0 is invalid, not "no tokens": a zero count with a non-zero total is a bug
  to surface.) A traced one is the caller's to test (``positive_finite``).
  """
  out, static = real_scalar(name, "normalizer", value)
  if static and not (np.isfinite(out) and out > 0):
    raise ValueError(f"{name}: normalizer must be a positive, finite scalar; got {value!r}.")
  return out


def check_softcap(name: str, option: str, value: object) -> float | None:
  """A logit soft-cap: ``None``, or a positive, finite Python or NumPy number (a model
  constant, fixed at trace time: Gemma 2's ``final_logit_softcapping``)."""
  if value is None:
    return None
  if not _is_static(value) or np.ndim(cast(Any, value)) != 0:
    raise TypeError(
      f"{name}: {option} must be None or a positive Python number (a static model constant); "
      f"got {_describe(value)}."
    )
  cap = float(np.asarray(cast(Any, value)))
  if not (np.isfinite(cap) and cap > 0):
    raise ValueError(f"{name}: {option} must be positive and finite; got {value!r}.")
  return cap


def clip_bounds(name: str, clip: object, option: str = "clip"):
  """``clip`` as ``(low, high)`` bounds of a log-ratio (``None`` stays ``None``; ``c`` is ``(-c, c)``)."""
  if clip is None:
    return None
  if isinstance(clip, (tuple, list)):
    if len(clip) != 2:
      raise ValueError(f"{name}: {option} must be a number or a (low, high) pair; got {clip!r}.")
    (low, low_static), (high, high_static) = (real_scalar(name, option, b) for b in clip)
  else:
    c, static = real_scalar(name, option, clip)
    (low, low_static), (high, high_static) = (-c, static), (c, static)
  if low_static and high_static and not low <= high:
    raise ValueError(
      f"{name}: {option} must bound the log-ratio by low <= high (a number c means "
      f"[-c, c]); got {clip!r}."
    )
  return low, high
