"""Elementwise KL terms with finite derivatives at zero-mass targets.

Two kernels, one per target space, each a ``jax.custom_jvp`` whose rule pins
the zero-mass convention: where the target has no mass (``t == 0``, or
``log t == -inf``) the term is 0 and so are all its derivatives, whatever the
input (``-inf`` included). Everywhere else values and derivatives are torch's.
"""

import jax
import jax.numpy as jnp

from kldiv_jax._checks import promote_and_broadcast


def _zero_mass(x: jax.Array, t: jax.Array, zero: float) -> jax.Array:
  # `x < inf` keeps NaN (and the invalid +inf) inputs propagating as NaN.
  return (t == zero) & (x < jnp.inf)


@jax.custom_jvp
def kl_prob_kernel(x: jax.Array, t: jax.Array) -> jax.Array:
  r"""``t log t - t x``, with ``0`` where ``t == 0`` (``x = -inf`` included).

  Same-shape, same-dtype arrays of at least float32. A negative or NaN ``t``
  gives NaN, as does a NaN ``x``.
  """
  return jnp.where(_zero_mass(x, t, 0.0), 0.0, t * jnp.log(t) - t * x)


@kl_prob_kernel.defjvp
def _kl_prob_kernel_jvp(primals, tangents):
  x, t = primals
  dx, dt = tangents
  mask = _zero_mass(x, t, 0.0)
  safe_t = jnp.where(mask, 1.0, t)
  log_t = jnp.log(safe_t)
  out = jnp.where(mask, 0.0, safe_t * log_t - t * x)
  # d/dt = log t + 1 - x (0 at zero mass); d/dx = -t (0 at zero mass).
  d_t = jnp.where(mask, 0.0, log_t + 1.0 - x)
  return out, d_t * dt - t * dx


@jax.custom_jvp
def kl_log_kernel(x: jax.Array, t: jax.Array) -> jax.Array:
  r"""``exp(t) (t - x)``, with ``0`` where ``t == -inf`` (``x = -inf`` included)."""
  return jnp.where(_zero_mass(x, t, -jnp.inf), 0.0, jnp.exp(t) * (t - x))


@kl_log_kernel.defjvp
def _kl_log_kernel_jvp(primals, tangents):
  x, t = primals
  dx, dt = tangents
  mask = _zero_mass(x, t, -jnp.inf)
  safe_t = jnp.where(mask, 0.0, t)
  safe_x = jnp.where(mask, 0.0, x)
  p = jnp.where(mask, 0.0, jnp.exp(safe_t))
  diff = safe_t - safe_x
  out = p * diff
  # d/dt = exp(t)(t - x + 1); d/dx = -exp(t); both 0 at zero mass.
  return out, p * (diff + 1.0) * dt - p * dx


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

  where ``x`` is the input in log-space (log-probabilities) and ``t`` the
  target, a probability (or a log-probability with ``log_target=True``).

  Conventions: a target with no mass (``t = 0``, or ``t = -inf`` with
  ``log_target``) gives 0 and zero gradients, for any input including
  ``-inf`` (``0 log(0/q) = 0``, the definition of KL). torch gives NaN values
  or NaN gradients there. A negative target or a NaN anywhere gives NaN: an
  invalid probability is never turned into a finite number. ``x = -inf`` with
  ``t > 0`` gives ``+inf``, the true divergence.

  Args:
    input: log-probabilities, any shape broadcastable with ``target``.
    target: probabilities (or log-probabilities if ``log_target``).
    log_target: whether ``target`` is in log-space.

  Returns:
    The elementwise terms, of the broadcast shape and the promoted floating
    dtype (computed in at least float32).

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import kl_div_pointwise
    >>> x = jnp.log(jnp.array([0.25, 0.75]))
    >>> kl_div_pointwise(x, jnp.array([0.5, 0.0]))
    Array([0.3465736, 0.       ], dtype=float32)
  """
  (x, t), out_dtype = promote_and_broadcast(
      "kl_div_pointwise", "input and target", input, target
  )
  kernel = kl_log_kernel if log_target else kl_prob_kernel
  return kernel(x, t).astype(out_dtype)
