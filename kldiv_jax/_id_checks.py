"""Trace-time checks of class ids and vocabulary sizes: labels, sampled tokens, top-k ids.

:func:`index_array` takes an integer array of ids without letting 64-bit
values wrap onto valid ids; :func:`ids_in_range` and :func:`ids_differ`
compare ids in their own dtype; :func:`check_ids` is the one contract for ids
out of range (known ones raise, traced ones make their example NaN);
:func:`teacher_classes` is the one rule for a teacher's vocabulary size.
"""

import math
from typing import Any, cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from kldiv_jax._checks import as_array, check_int


def index_array(name: str, arg: str, value: object, what: str) -> jax.Array:
  """An integer array of ``what`` (class ids), as a JAX array whose values did not wrap.

  JAX stores NumPy ``int64``/``uint64`` arrays (and Python ints) in 32 bits
  unless x64 is enabled, which wraps large values onto valid ids
  (``2**32 + 1`` becomes 1). Such values are saturated to the 32-bit range
  instead, where they stay out of range; they are then compared with
  :func:`ids_in_range` and :func:`ids_differ` in their own dtype.
  """
  value = as_array(name, arg, value)
  if isinstance(value, int):
    value = np.asarray(min(max(value, np.iinfo(np.int64).min), np.iinfo(np.int64).max))
  # JAX and NumPy arrays and scalars have a dtype (so may a ``__jax_array__`` object).
  dtype = getattr(value, "dtype", None)
  if dtype is None:
    dtype = np.asarray(value).dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name}: {arg} must be an integer array of {what}; got dtype {dtype}.")
  if isinstance(value, (np.ndarray, np.generic)):
    stored = jax.dtypes.canonicalize_dtype(dtype)
    if stored != dtype:
      info = np.iinfo(stored)
      value = np.clip(value, info.min, info.max).astype(stored)
  return jnp.asarray(value)


def ids_in_range(ids: jax.Array, num_classes: int) -> jax.Array:
  """``0 <= ids < num_classes``, compared in the ids' own dtype (nothing wraps)."""
  below = (
    ids < jnp.asarray(num_classes, ids.dtype)
    if num_classes <= jnp.iinfo(ids.dtype).max
    else jnp.ones(ids.shape, jnp.bool_)
  )
  return (ids >= jnp.asarray(0, ids.dtype)) & below


def ids_differ(ids: jax.Array, value: int) -> jax.Array:
  """``ids != value`` exactly: all true when ``value`` does not fit the ids' dtype.

  (Casting ``-100`` to ``uint32`` would make it 4294967196 and match that id.)
  """
  info = jnp.iinfo(ids.dtype)
  if not info.min <= value <= info.max:
    return jnp.ones(ids.shape, jnp.bool_)
  return ids != jnp.asarray(value, ids.dtype)


def concrete(*arrays: object) -> list[np.ndarray | None] | None:
  """The arrays as NumPy arrays when none is traced (``None`` stays ``None``), else ``None``.

  Values are known outside ``jit``: eager calls with JAX or NumPy arrays, lists or
  numbers. Under ``jit`` (a ``jax.core.Tracer``) nothing is read and no work is added.
  """
  if any(isinstance(a, jax.core.Tracer) for a in arrays):
    return None
  try:
    return [None if a is None else np.asarray(cast(Any, a)) for a in arrays]
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None


def check_ids(
  name: str,
  arg: str,
  ids: object,
  num_classes: int,
  *masks: object,
  what: str = "",
  ignore_index: int | None = None,
  has_ignore_index: bool = False,
  log_probs: object = None,
  fix: str = "",
) -> None:
  """``ValueError`` for a counted id outside ``[0, num_classes)`` when the values are known.

  The one contract for ids (labels, sampled tokens, top-k teachers): concrete ids
  (an eager call) are checked here, and the error names ``name``, ``arg``, the
  first bad position and the valid range; traced ids (under ``jit``) are not
  read, and an id out of range makes its example NaN instead. An id counts
  unless a mask in ``masks`` (booleans of a prefix of the ids' shape, or as
  many as the ids in another layout) is off at it, it equals ``ignore_index``, or its ``log_probs`` is ``-inf`` (a top-k
  teacher's padding). A function with an unset ``ignore_index``
  (``has_ignore_index``) suggests ``ignore_index=-100`` for a ``-100``. An empty vocabulary
  (``num_classes == 0``) with any id raises at trace time, naming the vocabulary.
  """
  shape = getattr(ids, "shape", None)
  if num_classes == 0 and math.prod(np.shape(cast(Any, ids)) if shape is None else shape) > 0:
    # A shape error, known at trace time whatever the ids' values: no id can be in range.
    raise ValueError(
      f"{name}: the vocabulary is empty (0 classes: the class axis of the logits or of the "
      f"LM head has size 0), so {arg} cannot index it; expected at least 1 class."
    )
  arrays = concrete(ids, log_probs, *masks)
  if arrays is None:
    return
  values = cast(np.ndarray, arrays[0])
  counted = np.ones(values.shape, np.bool_)
  if arrays[1] is not None:
    counted &= arrays[1] != -np.inf
  for m in arrays[2:]:
    if m is not None:  # a token mask of any layout, or of a prefix of the ids' shape
      shape = values.shape if m.size == values.size else m.shape + (1,) * (values.ndim - m.ndim)
      counted &= m.reshape(shape).astype(np.bool_)
  if ignore_index is not None:
    counted &= values != ignore_index
  bad = counted & ((values < 0) | (values >= num_classes))
  if not bad.any():
    return
  pos = tuple(int(i) for i in np.argwhere(bad)[0])
  got = values[pos]
  allowed = f"[0, {num_classes})"
  if ignore_index is not None:
    allowed += f" or ignore_index={ignore_index}"
  if has_ignore_index and ignore_index is None and got == -100:
    fix = " (pass ignore_index=-100 to leave such tokens out)"
  what = f"{what} in" if what else "in"
  raise ValueError(f"{name}: {arg} must be {what} {allowed}; got {got} at position {pos}{fix}.")


def teacher_classes(
  name: str,
  teacher_vocab_size: object,
  student: int,
  teacher: int | None = None,
  what: tuple[str, str] = ("logits", "target_logits"),
  sharded: str | None = None,
) -> int:
  """The teacher's vocabulary size, checked: the one rule of every logit and top-k path.

  ``student`` is the student's number of classes (its global vocabulary);
  ``teacher`` the teacher's when the teacher is dense (logits or an LM head
  named by ``what``), ``None`` for a top-k teacher given as ids. Sizes that
  differ must be explicit: ``teacher_vocab_size=None`` means the student's
  size (a dense teacher of another size raises, naming both and the fix); an
  int is the teacher's size (for a dense teacher it must be its actual size).
  The shared classes are then the first ``min`` of both
  (:func:`kldiv_jax._rows.shared_classes`). ``sharded``: with ``axis_name``,
  the reason the sizes must be equal (each device's slices would not hold the
  same classes).
  """
  if teacher_vocab_size is not None:
    size = check_int(name, "teacher_vocab_size", teacher_vocab_size)
    if size < 1:
      raise ValueError(f"{name}: teacher_vocab_size must be positive; got {size}.")
  else:
    size = student if teacher is None else teacher
  if sharded is not None and (size != student or (teacher is not None and teacher != student)):
    raise ValueError(
      f"{name}: the student has {student} classes and the teacher "
      f"{size if teacher is None else teacher}: {sharded}."
    )
  if teacher is not None and teacher_vocab_size is not None and size != teacher:
    raise ValueError(
      f"{name}: teacher_vocab_size={size} but {what[1]} has {teacher} classes; pass the "
      f"teacher's actual vocabulary size, teacher_vocab_size={teacher}."
    )
  if teacher is not None and teacher_vocab_size is None and teacher != student:
    raise ValueError(
      f"{name}: {what[0]} and {what[1]} have different numbers of classes, {student} and "
      f"{teacher}; pass teacher_vocab_size={teacher} to compare them on their shared first "
      f"{min(student, teacher)} classes (a vocabulary padded to a longer size), or fix the "
      "vocabulary that is off."
    )
  return size
