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
* A clamp keeps a NaN: :func:`at_least` and :func:`at_most`, never
  ``jnp.maximum(x, c)``. XLA:CPU's fused elementwise-plus-reduce kernels
  (YNNPACK, from a few thousand elements on) compute ``max``/``min`` as the
  x86 instructions do: when either operand is NaN the result is the *second*
  one (HLO promises NaN), and XLA moves a constant operand to the right, so
  ``max(x, c)`` turns a NaN ``x`` into ``c``. The helpers put the bound first,
  behind :func:`lax.optimization_barrier` (a constant XLA keeps on the left).
  Inside a Pallas kernel's body (:func:`in_kernel`) the bound is plain: Pallas'
  Triton and Mosaic lowerings have no ``optimization_barrier``, and a kernel's
  ``max`` is not XLA:CPU's fused one.
* A NaN is never masked away by a comparison: a mask built from a value
  (a trust region, an importance-weight bound) is written so that NaN keeps
  the token (``~(x > high)``, not ``x <= high``) and its NaN reaches the loss.
* No NaN is produced and then selected away, so that ``jax.debug_nans``
  raises only for results that are NaN: arguments are made safe before a
  partial operation (double ``where``), not after.

Per-class helpers of the divergence formulas (:mod:`kldiv_jax._divergences`):
a condition or parameter may be a Python number (static: the branch is chosen
at trace time and the other is never built) or an array (traced: both
branches are computed and selected with a double ``where``, the argument made
safe before the partial function). Probabilities ``p`` and log-probabilities
``lp`` come in pairs, with ``p = 0`` and ``lp = -inf`` for a class without
mass. The row-level helpers (``-inf``-safe division by the temperature, safe
normalisers) are in :mod:`kldiv_jax._rows`.

Elementwise helpers of the closed forms and estimators:
:func:`exp_minus_one_minus` (``e^x - 1 - x`` without cancellation: the
Gaussian KL, the k3 estimator) and :func:`clamp` (``torch.clamp``'s gradient
at the bounds).
"""

import contextvars
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def max_shift(m: jax.Array) -> jax.Array:
  """The row max ``m`` to subtract before ``exp``: 0 for a row without mass.

  A ``-inf`` max (every entry ``-inf``: no mass) becomes 0, so ``exp(x - m)``
  is 0, not NaN. A NaN or ``+inf`` max is kept: the row's statistics are then
  NaN, as its softmax is.
  """
  return jnp.where(m == -jnp.inf, 0.0, m)


# True while a Pallas kernel's body is traced (in_kernel): bounds without the barrier.
_IN_KERNEL = contextvars.ContextVar("kldiv_jax_in_kernel", default=False)


def in_kernel(body: Callable) -> Callable:
  """``body``, a Pallas kernel's body, traced with plain bounds (:func:`bound`): Pallas'
  Triton and Mosaic lowerings have no ``optimization_barrier`` ("Unimplemented primitive in
  Pallas Triton lowering", seen on an H200), and inside a kernel ``max`` is the kernel
  language's, not XLA:CPU's fused one. A partial stays a partial of the wrapped function, so
  that Pallas names the kernel after the body (``functools.wraps``: name and source)."""
  if isinstance(body, functools.partial):
    return functools.partial(in_kernel(body.func), *body.args, **body.keywords)

  @functools.wraps(body)
  def traced(*args, **kwargs):
    token = _IN_KERNEL.set(True)
    try:
      return body(*args, **kwargs)
    finally:
      _IN_KERNEL.reset(token)

  return traced


def bound(value: jax.typing.ArrayLike, dtype) -> jax.Array:
  """A bound that XLA keeps as the *first* operand of ``max``/``min`` (module docstring).

  A Python number or a traced array alike (the barrier is free on a scalar, and an array
  that XLA can fold into a constant would be moved right too).
  """
  value = jnp.asarray(value, dtype)
  return value if _IN_KERNEL.get() else lax.optimization_barrier(value)


def at_least(low, x: jax.Array) -> jax.Array:
  """``max(low, x)`` that keeps a NaN ``x`` NaN on every backend (the bound first)."""
  return jnp.maximum(bound(low, x.dtype), x)


def at_most(high, x: jax.Array) -> jax.Array:
  """``min(high, x)`` that keeps a NaN ``x`` NaN on every backend (the bound first)."""
  return jnp.minimum(bound(high, x.dtype), x)


@jax.custom_jvp
def nonnegative(x: jax.Array) -> jax.Array:
  """``max(x, 0)`` for a divergence rounded below 0; NaN propagates.

  Where the clamp acts the exact divergence is within rounding of 0 and so is
  its gradient: the derivative is that of ``x`` itself (the rule below), so
  gradients stay continuous and equal the kernels' exact ones.
  """
  return at_least(0.0, x)


nonnegative.defjvp(lambda primals, tangents: (nonnegative(primals[0]), tangents[0]))


def divide_logits(z: jax.Array, temperature, keep: jax.Array | None = None) -> jax.Array:
  """``z / T`` where ``keep`` (default: ``z != -inf``), ``-inf`` elsewhere.

  The ``-inf`` logits are selected around the division: ``d(-inf / T)/dT`` is
  ``inf``, and ``inf * 0`` would make the gradient wrt a traced temperature
  NaN. NaN logits are kept (and propagate).
  """
  keep = z != -jnp.inf if keep is None else keep
  return jnp.where(keep, jnp.where(keep, z, 0.0) / temperature, -jnp.inf)


def soft_cap(z: jax.Array, cap: float | None) -> jax.Array:
  """Logit soft-capping, ``cap * tanh(z / cap)`` (Gemma 2), or ``z`` for ``cap=None``.

  ``-inf`` stays ``-inf`` (a class without mass has none capped either) and
  ``+inf`` stays ``+inf`` (a logit the conventions make NaN, not ``cap``).
  """
  if cap is None:
    return z
  return jnp.where(jnp.isinf(z), z, cap * jnp.tanh(z / cap))


def soft_cap_slope(capped: jax.Array, cap: float) -> jax.Array:
  """``d soft_cap(z) / dz = 1 - tanh(z / cap)**2`` from the capped value ``cap * tanh(z /
  cap)`` (no second ``tanh``); 0 where it is infinite (no mass)."""
  t = jnp.where(jnp.isfinite(capped), capped, 0.0) / cap
  return jnp.where(jnp.isfinite(capped), 1.0 - t * t, 0.0)


def positive_finite(x):
  """The range test of a temperature or a normalizer: ``0 < x < inf`` (NaN fails)."""
  return (x > 0) & (x < jnp.inf)


def nonnegative_finite(x):
  """The range test of a penalty's coefficient (``z_loss``): ``0 <= x < inf`` (NaN fails)."""
  return (x >= 0) & (x < jnp.inf)


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


Param = float | jax.Array


def is_static(x: object) -> bool:
  """Whether ``x`` is a Python (or NumPy) scalar, decided at trace time."""
  return isinstance(x, (bool, float, int, np.bool_))


def select(cond, then, other):
  """``jnp.where`` for an array ``cond``; the chosen value for a static one."""
  return (then if cond else other) if is_static(cond) else jnp.where(cond, then, other)


def cases(cond, then: Callable, other: Callable):
  """``then()`` where ``cond``, else ``other()``: one branch when ``cond`` is static."""
  if is_static(cond):
    return then() if cond else other()
  return jax.tree.map(lambda x, y: jnp.where(cond, x, y), then(), other())


def nonzero(c: Param) -> Param:
  """``c``, or 1 where it is 0: a divisor for the branch that ``c == 0`` does not select."""
  return (c if c != 0 else 1.0) if is_static(c) else jnp.where(c == 0, 1.0, c)


def weigh(w: Param, x: jax.Array) -> jax.Array:
  """``w * x``, and 0 where the weight ``w`` is 0 even if ``x`` is infinite."""
  if is_static(w):
    return x * w if w != 0 else jnp.zeros_like(x)
  return jnp.where(w == 0, 0.0, w * jnp.where(w == 0, 0.0, x))


def keep(has: jax.Array, x: jax.Array) -> jax.Array:
  """``x`` where ``has``, else 0, with ``x``'s NaN-prone values never selected."""
  return jnp.where(has, x, 0.0)


def times(p: jax.Array, x: jax.Array) -> jax.Array:
  """``p * x`` with ``0 * x = 0`` for any ``x`` (``p log p`` at 0, distrax's ``mul_exp``)."""
  has = p > 0
  return jnp.where(has, p * jnp.where(has, x, 0.0), 0.0)


def log_ratio_mix(p: jax.Array, lp: jax.Array, q: jax.Array, lq: jax.Array, w: Param) -> jax.Array:
  """``log(p / m)`` for the mixture ``m = w p + (1 - w) q``, where ``p > 0`` (else 0).

  One ``log1p``, factored by the larger side so that its argument lies in
  ``[-1, 0]``: ``-log1p((1 - w)(q - p)/p)`` where ``p >= q``, ``log p - log q -
  log1p(w (p - q)/q)`` where ``p < q``. Exactly 0 where ``p == q``; ``-log w``
  where ``q = 0`` (``+inf`` at ``w = 0``). Multiplied by ``p``, it is finite
  wherever the mixture's KL term is.

  Where the mixture is below half the larger side (``m < p/2``: ``w < 1/2`` and ``q``
  well below ``p``, or the mirror case), ``log1p`` of ``x`` near ``-(1 - w)`` would multiply
  ``x``'s rounding by ``p/m``, up to ``1/w`` (10 at the skew KLs' default): a divergence
  saturated at ``-log w`` then read 5 float32 ulps off. There the same log is ``log w +
  log1p((1 - w)/w * q/p)`` (``log1p`` of a non-negative quotient rounded to its own size, the
  constant taken once per call: :func:`_far_mixture`): the same one ``log1p`` and one
  division per class.
  """
  upper = p >= q
  big = jnp.maximum(p, q)
  safe_big = jnp.where(big > 0, big, 1.0)
  gap = select(upper, 1.0 - w, w) * jnp.abs(p - q)  # the larger side minus m
  has = p > 0
  # Where p < q, log q is finite; where p = 0 the result is 0 (log p is not used).
  offset = jnp.where(upper, 0.0, jnp.where(has, lp, 0.0) - jnp.where(upper, 0.0, lq))
  ok, ratio, log_own = _far_mixture(w)
  if ok is False:  # w static, 0, 1/2 or 1: m is never below half the larger side
    return jnp.where(has, offset - jnp.log1p(-gap / safe_big), 0.0)
  far = (gap > 0.5 * big) if ok is True else ok & (gap > 0.5 * big)
  # The smaller side: q where w < 1/2 (there p is the larger side), p where w > 1/2.
  small = select(w < 0.5, q, p) if is_static(w) else jnp.minimum(p, q)
  x = jnp.where(far, ratio * small, -gap) / safe_big
  offset = offset - jnp.where(far, log_own, 0.0)
  return jnp.where(has, offset - jnp.log1p(x), 0.0)


def _far_mixture(w: Param):
  """``(ok, c, log_own)`` of :func:`log_ratio_mix` where ``m`` is below half the larger side.

  That side is ``p`` for ``w < 1/2`` (``gap = (1 - w)|p - q| > p/2`` needs ``1 - w > 1/2``),
  ``q`` for ``w > 1/2``; its own weight ``own`` is ``w`` or ``1 - w``, ``m / big = own (1 +
  c small / big)`` with ``c = (1 - own) / own`` and ``log_own = log(own)``. ``ok``: whether
  such classes exist (``own > 0``); ``False`` for a static ``w`` where none can.
  """
  if is_static(w):
    if 0 < w < 0.5:
      return True, (1.0 - w) / w, math.log(w)
    if 0.5 < w < 1:
      return True, w / (1.0 - w), math.log1p(-w)
    return False, 1.0, 0.0
  own = jnp.where(w < 0.5, w, 1.0 - w)
  ok = own > 0
  safe = jnp.where(ok, own, 1.0)
  return ok, (1.0 - safe) / safe, jnp.log(safe)


def mix_quotient(p: jax.Array, q: jax.Array, w: Param) -> jax.Array:
  """``p q / m`` for ``m = w p + (1 - w) q``, 0 where ``p q = 0``."""
  m = w * p + (1.0 - w) * q
  return p * q / jnp.where(m > 0, m, 1.0)


def exp_expm1(l0: jax.Array, delta: jax.Array, top: jax.Array | None = None) -> jax.Array:
  """``exp(l0) * expm1(delta)`` without overflow: ``exp(l0 + delta)`` is what must be finite.

  Factored by the larger of ``exp(l0)``, ``exp(l0 + delta)``; exactly 0 at ``delta = 0``.
  ``top``: ``l0 + delta`` as the caller can write it directly (``s log p`` for ``alpha log p
  + beta log q + beta (log p - log q)``): a sum of large terms that cancel loses digits of
  the exponent, and ``exp`` turns them into relative error.
  """
  up = delta > 0
  big = l0 + at_least(0.0, delta) if top is None else jnp.where(up, top, l0)
  return jnp.where(up, -1.0, 1.0) * jnp.exp(big) * jnp.expm1(-jnp.abs(delta))


def series(x: jax.Array, coeffs: tuple[float, ...]) -> jax.Array:
  """``sum(coeffs[k] * x**k)`` by Horner's rule."""
  out = jnp.full_like(x, coeffs[-1])
  for c in coeffs[-2::-1]:
    out = out * x + c
  return out


def split_small(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(|x| < 1/2, x there else 0, x elsewhere else 1)``: the series and closed-form arguments."""
  small = jnp.abs(x) < 0.5
  return small, jnp.where(small, x, 0.0), jnp.where(small, 1.0, x)


# Taylor coefficients 1/n! of e^x - 1 - x, highest first, to the degree whose
# remainder for |x| < 1 is below the dtype's rounding (2/(n+1)! < eps / 4).
_SERIES = {
  degree: tuple(1.0 / float(np.prod(np.arange(1, n + 1))) for n in range(degree, 1, -1))
  for degree in (11, 19)
}


def exp_minus_one_minus(x: jax.Array) -> jax.Array:
  r"""``e^x - 1 - x`` without cancellation, finite gradients, ``+inf`` at ``+-inf``.

  ``expm1(x) - x`` loses relative precision where ``|x| < 1`` (about
  ``2 eps / |x|``: the result is near ``x**2 / 2``); there a Taylor
  polynomial (to ``x**11`` in float32, ``x**19`` in float64) is used
  instead, accurate to a few ulps.
  """
  small = jnp.abs(x) < 1.0
  xs = jnp.where(small, x, 0.0)
  series = jnp.zeros_like(xs)
  for c in _SERIES[11 if jnp.finfo(x.dtype).bits <= 32 else 19]:
    series = series * xs + c
  series = series * xs * xs
  big = jnp.where(small | (x == jnp.inf), 1.0, x)
  direct = jnp.where(x == jnp.inf, jnp.inf, jnp.expm1(big) - big)
  return jnp.where(small, series, direct)


def clamp(x: jax.Array, low: jax.typing.ArrayLike, high: jax.typing.ArrayLike) -> jax.Array:
  """``torch.clamp``: the gradient passes where ``low <= x <= high``, bounds included.

  (``jnp.clip`` gives half the gradient at a bound, as ``jnp.minimum`` does at a tie.)
  """
  return jnp.where(x < low, low, jnp.where(x > high, high, x))
