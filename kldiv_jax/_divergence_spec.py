"""The divergence spec: :class:`Divergence`, a divergence's name and its parameters.

Beside :data:`kldiv_jax._divergences.FORMULAS` (whose entries it names) and
below the engine (:func:`kldiv_jax._engine.divergence_rows` takes a spec),
so that every path, the engine's included, imports it from here. A spec's
parameters are static (Python numbers: checked at once, hashed) or traced
(JAX arrays: pytree leaves); the engine receives :attr:`Divergence.key` and
:attr:`Divergence.traced` separately.
"""

from __future__ import annotations

import dataclasses
import math
from typing import cast

import jax

from kldiv_jax._checks import real_scalar
from kldiv_jax._divergences import FORMULAS, Formula
from kldiv_jax._numerics import Param


@jax.tree_util.register_pytree_node_class
class Divergence:
  """A divergence and its parameters, e.g. ``Divergence("skew_kl", alpha=0.2)``.

  ``name`` is one of :data:`FORMULAS` (the formulas:
  :func:`~kldiv_jax.divergence_from_logits`); parameters are keywords,
  defaulting to the string shorthand's (``"jsd"`` is ``Divergence("jsd",
  beta=0.5)``). A Python number is static: checked here, hashed, fixed at
  trace time; a JAX array is traced, a pytree leaf (NaN when out of range).
  Frozen; hashable when all parameters are static. Why one spec, and more:
  :doc:`/distillation`.

  Examples:
    >>> from kldiv_jax import Divergence
    >>> Divergence("jsd") == Divergence("jsd", beta=0.5)
    True
  """

  __slots__ = ("name", "params")
  name: str
  params: tuple[tuple[str, Param], ...]

  def __init__(self, name: str = "forward_kl", **params: float | jax.typing.ArrayLike):
    if not isinstance(name, str):
      raise TypeError(f"Divergence: name must be a string; got {name!r}.")
    formula = FORMULAS.get(name)
    if formula is None:
      allowed = ", ".join(repr(n) for n in FORMULAS)
      raise ValueError(f"Divergence: name must be one of {allowed}; got {name!r}.")
    unknown = sorted(set(params) - set(formula.param_names))
    if unknown:
      expected = ", ".join(formula.param_names) or "none"
      raise TypeError(
        f"Divergence: {name!r} takes the parameters ({expected}); got unexpected {unknown}."
      )
    values = []
    for i, key in enumerate(formula.param_names):
      if key in params:
        values.append((key, _check_param(name, key, params[key], formula.ranges[i])))
      elif formula.defaults is None:
        raise TypeError(
          f"Divergence: {name!r} has no default parameters; pass "
          + ", ".join(f"{k}=..." for k in formula.param_names)
          + "."
        )
      else:
        values.append((key, float(formula.defaults[i])))
    object.__setattr__(self, "name", name)
    object.__setattr__(self, "params", tuple(values))

  def __setattr__(self, key, value):
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {key!r}")

  def __reduce__(self):
    # pickle and copy: rebuilt through __init__ (the default would assign the slots).
    return _rebuild_divergence, (self.name, self.params)

  @property
  def formula(self) -> Formula:
    return FORMULAS[self.name]

  @property
  def key(self) -> tuple:
    """The static part, hashable: ``(name, ((param, float or None if traced), ...))``."""
    return self.name, tuple((k, v if isinstance(v, float) else None) for k, v in self.params)

  def valid(self) -> tuple:
    """The parameters' range tests, for :func:`~kldiv_jax._numerics.nan_unless`."""
    return self.formula.valid(tuple(v for _, v in self.params))

  @property
  def traced(self) -> tuple[jax.Array, ...]:
    """The traced parameters' values, in order."""
    # Arrays, or any leaves jax.tree_util puts in their place (vmap's in_axes, ...).
    return cast(tuple[jax.Array, ...], tuple(v for _, v in self.params if not isinstance(v, float)))

  def __repr__(self) -> str:
    args = "".join(f", {k}={v!r}" for k, v in self.params)
    return f"Divergence({self.name!r}{args})"

  def __eq__(self, other) -> bool:
    if not isinstance(other, Divergence) or self.key != other.key:
      return False
    return all(a is b for a, b in zip(self.traced, other.traced))

  def __hash__(self) -> int:
    if self.traced:
      raise TypeError(f"{self!r} has traced parameters and is not hashable.")
    return hash(self.key)

  def tree_flatten(self):
    return self.traced, self.key

  @classmethod
  def tree_unflatten(cls, key, leaves):
    out = object.__new__(cls)
    leaves = iter(leaves)
    name, static = key
    params = tuple((k, v if v is not None else next(leaves)) for k, v in static)
    object.__setattr__(out, "name", name)
    object.__setattr__(out, "params", params)
    return out


def _rebuild_divergence(name: str, params: tuple[tuple[str, Param], ...]) -> Divergence:
  return Divergence(name, **dict(params))


def _check_param(name, key, value, bounds):
  lo, hi = bounds
  x, static = real_scalar(f"Divergence({name!r})", key, value)
  if static and not (math.isfinite(x) and lo <= x <= hi):
    where = f"in [{lo:g}, {hi:g}]" if math.isfinite(lo) else "finite"
    raise ValueError(f"Divergence: {name!r} parameter {key} must be {where}; got {value!r}.")
  return x


def as_divergence(name: str, divergence: object) -> Divergence:
  """``divergence`` (a name or a :class:`Divergence`) as a :class:`Divergence`.

  Errors name the calling function ``name``.
  """
  if isinstance(divergence, Divergence):
    return divergence
  if isinstance(divergence, str) and divergence in FORMULAS:
    try:
      return Divergence(divergence)
    except TypeError as err:
      raise ValueError(f"{name}: {err}") from None
  allowed = ", ".join(repr(n) for n in FORMULAS)
  error = ValueError if isinstance(divergence, str) else TypeError
  raise error(
    f"{name}: divergence must be one of {allowed} or a kldiv_jax.Divergence; got {divergence!r}."
  )
