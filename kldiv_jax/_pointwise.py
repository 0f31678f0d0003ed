"""Elementwise KL terms with finite derivatives at zero-mass targets.

Two kernels, one per target space, each a ``jax.custom_jvp`` whose rule pins
the zero-mass convention: where the target has no mass (``t == 0``, or
``log t == -inf``) the term is 0 and so are all its derivatives, whatever the
input (``-inf`` included). Everywhere else values and derivatives are torch's.

Speed: the values are computed without comparisons or selects. On XLA:CPU an
elementwise-plus-reduce computation runs as one fused (YNNPACK) kernel only if
every operation in it is an arithmetic one (``max``, ``min``, ``+``, ``*``,
``exp``, ``log``, ...); a compare or select keeps it out and materialises the
whole elementwise array, which made the usual double-``where`` formula about
4x slower than an unguarded one. The guards below use only ``max`` clamps and
IEEE overflow instead; with ``L = log t`` (the log-target itself with
``log_target``) and ``M = finfo.max``:

* ``Lc = max(-M/2, L)`` is ``L`` for every ``t > 0`` and ``-M/2`` at zero mass.
* ``x' = max(-M, x)`` is ``x`` except that ``-inf`` becomes ``-M``.
* ``D = (Lc - x') * 2`` is twice the difference ``L - x`` (exactly: a power of
  two) where both are finite. Where ``t`` has mass and ``x = -inf``,
  ``L + M`` rounds to ``M`` and doubling it overflows to the true ``+inf``;
  at zero mass ``2 (-M/2 - x')`` is finite for any ``x`` from ``-inf`` up to
  about ``M/4``, and the weight's exact 0 makes the term 0 (``x = +inf``
  gives ``-inf`` and the term NaN, as it should).

The term is then ``(w / 2) * D`` with ``w = t`` or ``exp(Lc)`` (the ``/ 2``
folds into the exponential's kernel): one clamp per input, a subtraction and
a scaling on top of the unguarded formula's operations. Where the target has
mass, inputs below ``-M/2`` (about ``-1.7e38`` in float32) count as ``-inf``.

NaN: XLA:CPU's fused kernels compute ``max(a, b)`` as the x86 instruction
does: when either is NaN the result is ``b``, the *second* operand (HLO
promises NaN). So every clamp takes its bound first and the value second, and
the bounds go through :func:`lax.optimization_barrier` -- XLA moves a
constant operand to the right, which would make ``max(t, -M/2)`` drop a NaN
``t`` (or the NaN of ``log t`` for a negative ``t``) and give a finite number
(:func:`kldiv_jax._numerics.at_least`, the clamp every loss uses).
``tests/test_pointwise.py`` checks NaN propagation at sizes that take the fused
kernel.

That zero may be ``-0.0`` (0 times a negative ``D``). Sums do not show it (a
reduction starts from +0); the unreduced outputs go through
:func:`positive_zero`, one cheap select in a loop that writes the array
anyway.

The derivative rules use the ordinary double ``where`` (they write an array
anyway, and must stay differentiable for second derivatives).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from kldiv_jax._checks import check_bool, promote_and_broadcast
from kldiv_jax._numerics import at_least


def _guards(x: jax.Array, log_t: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(Lc, D)``: the clamped log-target and twice its difference to the clamped input."""
  big = float(jnp.finfo(x.dtype).max)
  lc = at_least(-big / 2, log_t)
  xc = at_least(-big, x)
  return lc, (lc - xc) * 2.0


def positive_zero(a: jax.Array) -> jax.Array:
  """``a`` with ``-0.0`` turned into ``+0.0``, derivatives untouched (unreduced outputs)."""
  # -0 + +0 = +0; the addend is 0 everywhere and carries no derivative.
  return a + lax.stop_gradient(jnp.where(a == 0, -a, 0.0))


def _zero_mass(x: jax.Array, t: jax.Array, zero: float) -> jax.Array:
  # `x < inf` keeps NaN (and the invalid +inf) inputs propagating as NaN.
  return (t == zero) & (x < jnp.inf)


@jax.custom_jvp
def _zero_minus(x: jax.Array) -> jax.Array:
  """Zeros of ``x``'s shape whose derivative wrt ``x`` is -1 (``x = -inf`` too)."""
  return jnp.zeros_like(x)


_zero_minus.defjvp(lambda primals, tangents: (jnp.zeros_like(primals[0]), -tangents[0]))


@jax.custom_jvp
def kl_prob_kernel(x: jax.Array, t: jax.Array) -> jax.Array:
  r"""``t (log t - x)``, with ``0`` where ``t == 0`` (``x = -inf`` included).

  Same-shape, same-dtype arrays of at least float32. A negative or NaN ``t``
  gives NaN, as does a NaN (or ``+inf``) ``x``.
  """
  _, d = _guards(x, jnp.log(t))
  return (t * 0.5) * d


def _kl_prob_kernel_jvp(primals, tangents):
  x, t = primals
  dx, dt = tangents
  out = kl_prob_kernel(x, t)
  tangent = jnp.zeros_like(out)
  if not isinstance(dt, SymbolicZero):
    # d/dt = log t + 1 - x, and 0 at zero mass (double where: the rule is
    # differentiated again for second derivatives). At zero mass the 0 has
    # d/dx = -1, so the Hessian stays symmetric (d/dx of d/dt = d/dt of
    # d/dx = -1, torch's mixed partial).
    mask = _zero_mass(x, t, 0.0)
    safe_t = jnp.where(mask, 1.0, t)
    tangent = jnp.where(mask, _zero_minus(x), jnp.log(safe_t) + 1.0 - x) * dt
  if not isinstance(dx, SymbolicZero):
    tangent = tangent - t * dx  # d/dx = -t, already 0 at zero mass.
  return out, tangent


kl_prob_kernel.defjvp(_kl_prob_kernel_jvp, symbolic_zeros=True)


@jax.custom_jvp
def kl_log_kernel(x: jax.Array, t: jax.Array) -> jax.Array:
  r"""``exp(t) (t - x)``, with ``0`` where ``t == -inf`` (``x = -inf`` included)."""
  tc, d = _guards(x, t)
  return (jnp.exp(tc) * 0.5) * d


def _kl_log_kernel_jvp(primals, tangents):
  x, t = primals
  dx, dt = tangents
  out = kl_log_kernel(x, t)
  p = jnp.exp(t)  # 0 at zero mass, so d/dx = -p needs no guard.
  tangent = jnp.zeros_like(out)
  if not isinstance(dt, SymbolicZero):
    # d/dt = exp(t) (t - x + 1), and 0 at zero mass.
    mask = _zero_mass(x, t, -jnp.inf)
    safe_t = jnp.where(mask, 0.0, t)
    safe_x = jnp.where(mask, 0.0, x)
    tangent = jnp.where(mask, 0.0, jnp.exp(safe_t) * (safe_t - safe_x + 1.0)) * dt
  if not isinstance(dx, SymbolicZero):
    tangent = tangent - p * dx
  return out, tangent


kl_log_kernel.defjvp(_kl_log_kernel_jvp, symbolic_zeros=True)


def kl_div_pointwise(
  input: jax.typing.ArrayLike,  # noqa: A002 - torch's name
  target: jax.typing.ArrayLike,
  *,
  log_target: bool = False,
) -> jax.Array:
  r"""Elementwise Kullback-Leibler term, as torch's ``reduction='none'``.

  .. math::

     \ell(x, t) = t\,(\log t - x) \quad\text{or, with log\_target,}\quad
     \ell(x, t) = e^{t}\,(t - x)

  with ``x = input`` (log-probabilities) and ``t = target``. A target without
  mass gives 0 and zero gradients for any input, ``-inf`` included (torch:
  NaN); a negative target or NaN gives NaN. See :doc:`/conventions`.

  Args:
    input: log-probabilities, any shape broadcastable with ``target``.
    target: probabilities (or log-probabilities if ``log_target``).
    log_target: whether ``target`` is in log-space.

  Returns:
    The elementwise terms, of the broadcast shape and the promoted floating dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import kl_div_pointwise
    >>> x = jnp.log(jnp.array([0.25, 0.75]))
    >>> kl_div_pointwise(x, jnp.array([0.5, 0.0]))
    Array([0.3465736, 0.       ], dtype=float32)
  """
  name = "kl_div_pointwise"
  log_target = check_bool(name, "log_target", log_target)
  (x, t), out_dtype = promote_and_broadcast(name, ("input", "target"), input, target)
  kernel = kl_log_kernel if log_target else kl_prob_kernel
  return positive_zero(kernel(x, t)).astype(out_dtype)
