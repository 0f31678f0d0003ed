"""A streaming divergence metric for evaluation loops: :class:`DivergenceMetric`.

The state is a pytree of two arrays, a sum and a count, so that it accumulates
over batches (``merge``), devices (``lax.psum``, or ``lax.all_gather`` and
``reduce``) and processes (``process_allgather`` and ``reduce``) by addition.
The options are static and live on the class (``configure``), as
``clu.metrics.Metric``'s protocol needs: ``empty`` and ``from_model_output``
are class methods. The values come from the engine
(:func:`kldiv_jax._divergence_api.per_example`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kldiv_jax._checks import (
  MASK,
  as_array,
  check_choice,
  check_float,
  check_temperature,
  compute_dtype,
  mask_array,
)
from kldiv_jax._divergence_api import per_example
from kldiv_jax._divergence_spec import Divergence, as_divergence
from kldiv_jax._rl import sequence_mean

INPUTS = ("logits", "log_probs", "probs")
REDUCTIONS = ("mean", "sum")
PER = ("token", "sequence")


class _Options(NamedTuple):
  divergence: Divergence
  inputs: str
  temperature: float
  reduction: str
  per: str


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DivergenceMetric:
  r"""A streaming divergence for evaluation loops (a sum and a count), in ``clu``'s metric protocol.

  Per distribution (a row of ``[..., num_classes]``), :math:`d = D(p \,\|\,
  q)` with the target :math:`p = \mathrm{softmax}(\text{target\_logits} / T)`,
  the prediction :math:`q = \mathrm{softmax}(\text{logits} / T)` and any
  divergence of :func:`~kldiv_jax.divergence_from_logits` (default forward KL):

  .. math::

     \text{total} = \sum_{u \text{ valid}} d_u, \qquad
     \text{count} = \#\{u \text{ valid}\}, \qquad
     \text{compute}() = \text{total} / \text{count} \ (\text{'mean'})
     \text{ or total} \ (\text{'sum'}),

  a unit :math:`u` being a token (``per="token"``) or a sequence
  (``per="sequence"``, :math:`d_u` the mean over its valid tokens). The
  options live on the class (:meth:`configure`); an instance is a pytree of
  ``total`` and ``count`` that adds up over batches (:meth:`merge`), devices
  (``lax.psum``) and processes (``process_allgather`` and :meth:`reduce`).
  Protocol, torchmetrics' ``KLDivergence``, dtypes and conventions:
  :doc:`/evaluation`.

  Attributes:
    total: the sum of the units' values, a scalar (or with a leading axis
      after ``all_gather``).
    count: the number of units.
    options: a class attribute, the class's options (a named tuple).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kldiv_jax import DivergenceMetric
    >>> step = jax.jit(lambda m, z, y: m.merge(DivergenceMetric.from_model_output(z, y)))
    >>> m = DivergenceMetric.empty()
    >>> for z, y in [(jnp.zeros((2, 3)), jnp.ones((2, 3))), (jnp.eye(3), jnp.zeros((3, 3)))]:
    ...   m = step(m, z, y)
    >>> m.count, m.compute()  # 3 * (log(e + 2) - log(3) - 1/3) / 5
    (Array(5, dtype=int32), Array(0.0716..., dtype=float32))
  """

  total: jax.Array
  count: jax.Array

  options: ClassVar[_Options] = _Options(Divergence("forward_kl"), "logits", 1.0, "mean", "token")
  # The class ``configure`` derives from: the first one that was not made by ``configure``.
  _root: ClassVar[type[DivergenceMetric] | None] = None

  @classmethod
  def configure(
    cls,
    *,
    divergence: str | Divergence | None = None,
    inputs: str | None = None,
    temperature: float | None = None,
    reduction: str | None = None,
    per: str | None = None,
  ) -> type[DivergenceMetric]:
    """A subclass with these options; one left ``None`` keeps ``cls``'s.

    The same options give the same class (a jitted step compiles once);
    ``DivergenceMetric`` itself has the defaults.

    Args:
      divergence: a name or a static :class:`~kldiv_jax.Divergence` (default ``"forward_kl"``).
      inputs: ``"logits"`` (default), ``"log_probs"`` or ``"probs"`` (normalised per row).
      temperature: a static positive softmax temperature (default 1).
      reduction: ``"mean"`` (default: total over count) or ``"sum"`` (total).
      per: ``"token"`` (default: each row) or ``"sequence"`` (the axis before the classes).

    Returns:
      A subclass of ``cls``'s root class (``DivergenceMetric``, or the user's
      subclass that ``configure`` was first called on), registered as a pytree.
    """
    name = "DivergenceMetric.configure"
    old = cls.options
    if divergence is None:
      spec = old.divergence
    else:
      spec = as_divergence(name, divergence)
      if spec.traced:
        raise TypeError(
          f"{name}: the divergence's parameters are part of the class, so they must be "
          f"Python numbers; got {spec!r} with traced parameters."
        )
    for option, value, choices in (
      ("inputs", inputs, INPUTS),
      ("reduction", reduction, REDUCTIONS),
      ("per", per, PER),
    ):
      if value is not None:
        if option == "reduction" and value in ("none", "batchmean"):
          raise ValueError(
            f"{name}: reduction must be one of 'mean', 'sum'; got {value!r}. A metric keeps "
            "a fixed-size state; for per-example values call divergence_from_logits per batch."
          )
        check_choice(name, option, value, choices)
    if temperature is None:
      t = old.temperature
    else:
      t, static = check_temperature(name, temperature)
      if not static:
        raise TypeError(
          f"{name}: temperature is part of the class, so it must be a Python number; "
          f"got {temperature!r}."
        )
    options = _Options(
      spec, inputs or old.inputs, float(t), reduction or old.reduction, per or old.per
    )
    root = cls._root or cls
    if options == root.options:
      return root
    key = (root, options)
    if key not in _CLASSES:
      _CLASSES[key] = _subclass(root, options)
    return _CLASSES[key]

  @classmethod
  def empty(cls) -> DivergenceMetric:
    """The metric of no data: ``m.merge(cls.empty())`` equals ``m``."""
    return cls(
      total=jnp.zeros((), _default_dtype(np.float64)),
      count=jnp.zeros((), _default_dtype(np.int64)),
    )

  @classmethod
  def from_model_output(
    cls,
    logits: jax.typing.ArrayLike,
    target_logits: jax.typing.ArrayLike,
    *,
    where: jax.typing.ArrayLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
    teacher_vocab_size: int | None = None,
    implementation: str | None = None,
    **_: Any,
  ) -> DivergenceMetric:
    """The metric of one batch.

    Args:
      logits: the prediction ``q`` ``[..., num_classes]`` (``[..., seq,
        num_classes]`` for ``per="sequence"``), in the class's ``inputs`` space.
      target_logits: the target ``p``, in the same space, broadcastable.
      where: a class mask broadcastable to the inputs.
      mask: which rows count (clu's): the rows' shape or a prefix of it, bool or numeric.
      teacher_vocab_size: ``target_logits``' class count when it differs.
      implementation: ``None``, ``"xla"`` or ``"pallas"``, as in
        :func:`~kldiv_jax.divergence_from_logits`.
      **_: ignored (a ``clu`` ``Collection`` passes every model output).

    Returns:
      An instance of ``cls`` holding the batch's total and count.
    """
    name = "DivergenceMetric.from_model_output"
    opts = cls.options
    total_dtype = _default_dtype(np.float64)
    dtype = check_float(name, ("logits", "target_logits"), logits, target_logits)
    ndim = max(np.ndim(logits), np.ndim(target_logits))
    min_ndim, layout = (
      (2, "[..., seq, num_classes]") if opts.per == "sequence" else (1, "[..., num_classes]")
    )
    if ndim < min_ndim:
      raise ValueError(
        f"{name}: per={opts.per!r} needs inputs {layout} (a class axis last); got shapes "
        f"{np.shape(logits)} and {np.shape(target_logits)}."
      )
    if where is not None:
      # Given every axis, the engine reads ``where`` as a class mask, never a per-example one.
      w = mask_array(name, where)
      where = w.reshape((1,) * (ndim - w.ndim) + w.shape) if w.ndim < ndim else w
    # In the compute dtype (float32 for bf16/f16): the engine then returns each row's value
    # unrounded, and the sums keep it (the convert fuses into the kernel under jit).
    cdt = compute_dtype(dtype)
    z, y = jnp.asarray(logits).astype(cdt), jnp.asarray(target_logits).astype(cdt)
    has_mass = None
    if opts.inputs == "probs":
      # A row of zeros cannot be normalised: NaN, as torchmetrics' p / p.sum().
      has_mass = (jnp.any(z > 0, axis=-1), jnp.any(y > 0, axis=-1))
      z, y = jnp.log(z), jnp.log(y)
    values = per_example(
      name,
      opts.divergence,
      z,
      y,
      opts.temperature,
      -1,
      where,
      None,
      (None, None),
      teacher_vocab_size,
      implementation,
    )
    values = values.astype(total_dtype)
    if has_mass is not None:
      ok = jnp.broadcast_to(has_mass[0], values.shape) & jnp.broadcast_to(has_mass[1], values.shape)
      values = jnp.where(ok, values, jnp.nan)
    keep = None if mask is None else _row_mask(name, mask, values.shape)
    if opts.per == "sequence":
      seq_len = values.shape[-1]
      values = sequence_mean(values, where=keep)
      if keep is not None:
        keep = jnp.any(keep, axis=-1)
      elif seq_len == 0:
        keep = jnp.zeros(values.shape, jnp.bool_)  # a sequence without tokens is not counted
    if keep is None:
      total, count = jnp.sum(values), values.size
    else:
      total, count = jnp.sum(jnp.where(keep, values, 0.0)), jnp.sum(keep)
    return cls(total=total, count=jnp.asarray(count, _default_dtype(np.int64)))

  def merge(self, other: DivergenceMetric) -> DivergenceMetric:
    """The metric of both: totals and counts added (``other`` of the same class)."""
    _check_same(self, other, "merge")
    return type(self)(total=self.total + other.total, count=self.count + other.count)

  def reduce(self) -> DivergenceMetric:
    """Sums a metric whose fields gained a leading axis (``all_gather``, ``process_allgather``)."""
    if jnp.ndim(self.total) < 1 or jnp.ndim(self.count) < 1:
      raise ValueError(
        "DivergenceMetric.reduce: the fields must have a leading axis to sum over (after "
        f"jax.lax.all_gather or process_allgather); got shapes {jnp.shape(self.total)} "
        f"and {jnp.shape(self.count)}."
      )
    return type(self)(total=jnp.sum(self.total, axis=0), count=jnp.sum(self.count, axis=0))

  def compute(self) -> jax.Array:
    """``total / count`` for ``'mean'`` (NaN when ``count`` is 0), ``total`` for ``'sum'``."""
    total = jnp.asarray(self.total)
    if type(self).options.reduction == "sum":
      return total
    return total / jnp.asarray(self.count).astype(total.dtype)

  def __reduce__(self):
    # Picklable although ``configure``'s classes are made at run time: rebuilt from the options.
    cls = type(self)
    return _rebuild, (cls._root or cls, *cls.options, self.total, self.count)


_CLASSES: dict[tuple[type, _Options], type[DivergenceMetric]] = {}


def _subclass(root: type[DivergenceMetric], options: _Options) -> type[DivergenceMetric]:
  spec = options.divergence
  label = ", ".join(
    [repr(spec) if spec.params else repr(spec.name)]
    + [f"{k}={v!r}" for k, v in options._asdict().items() if k != "divergence"]
  )
  attrs = {"options": options, "_root": root, "__module__": root.__module__}
  sub = type(f"{root.__name__}[{label}]", (root,), attrs)
  return jax.tree_util.register_dataclass(sub, data_fields=["total", "count"], meta_fields=[])


def _rebuild(root, divergence, inputs, temperature, reduction, per, total, count):
  cls = root.configure(
    divergence=divergence,
    inputs=inputs,
    temperature=temperature,
    reduction=reduction,
    per=per,
  )
  return cls(total=total, count=count)


def _default_dtype(dtype) -> np.dtype:
  """float64 -> float32 and int64 -> int32 unless x64 is on."""
  return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _row_mask(name: str, mask: object, shape: tuple[int, ...]) -> jax.Array:
  """``mask`` (clu's: the rows' shape or a prefix of it, bool or numeric) broadcast to ``shape``."""
  m = jnp.asarray(as_array(name, "mask", mask, MASK))
  if m.dtype != jnp.bool_:
    m = m.astype(jnp.bool_)  # clu.metrics casts numeric masks the same way
  if m.shape != shape[: m.ndim]:
    raise ValueError(
      f"{name}: mask has shape {m.shape}; expected the inputs' shape without the class axis, "
      f"{shape}, or a prefix of it (clu's convention: a [batch] mask masks whole sequences)."
    )
  return jnp.broadcast_to(m.reshape(m.shape + (1,) * (len(shape) - m.ndim)), shape)


def _check_same(a: DivergenceMetric, b: object, method: str) -> None:
  name = f"DivergenceMetric.{method}"
  if not isinstance(b, DivergenceMetric) or type(b).options != type(a).options:
    raise TypeError(
      f"{name}: can only combine metrics of one configuration; got {type(a).__name__} and "
      f"{type(b).__name__}."
    )
  if jnp.shape(a.total) != jnp.shape(b.total) or jnp.shape(a.count) != jnp.shape(b.count):
    raise ValueError(
      f"{name}: the fields' shapes differ, {jnp.shape(a.total)} and {jnp.shape(b.total)}; "
      "reduce() a metric gathered over devices or processes before merging it."
    )
