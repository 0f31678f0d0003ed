"""Per-example KL losses with ``optax.losses``' signatures and values.

Same outputs as optax wherever optax is finite; finite where optax gives NaN
(zero targets, ``-inf`` log-probabilities); and ``where`` may also be a
per-example mask.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from kldiv_jax._checks import Axis, promote_and_broadcast
from kldiv_jax._masked_sum import masked_sum
from kldiv_jax._numerics import nonnegative
from kldiv_jax._pointwise import kl_log_kernel, kl_prob_kernel


def _per_example(
  name, what, terms, zero_mass, log_predictions, targets, axis, where, finish=lambda out: out
):
  """The body the per-example losses share: promote and broadcast, the masked sum of
  ``terms`` (masked entries filled with 0 and ``zero_mass``), ``finish``, the inputs' dtype."""
  (x, t), out_dtype = promote_and_broadcast(name, what, log_predictions, targets)
  out = masked_sum(name, terms, axis, where, inputs=((x, 0.0), (t, zero_mass)))
  return finish(out).astype(out_dtype)


def kl_divergence(
  log_predictions: jax.typing.ArrayLike,
  targets: jax.typing.ArrayLike,
  axis: Axis = -1,
  where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
  r"""Per-example KL divergence ``KL(targets || predictions)``, as optax's.

  .. math::

     \mathrm{KL}(p \,\|\, q) = \sum_i p_i (\log p_i - \log q_i)

  with ``p = targets`` and ``log q = log_predictions``. Terms with
  ``p_i = 0`` are 0 with zero gradients, even where ``log q_i = -inf``
  (optax: NaN). See :doc:`/migration`.

  Args:
    log_predictions: log-probabilities ``[..., num_classes]``.
    targets: probabilities ``[..., num_classes]`` (broadcastable).
    axis: the axis or axes summed over (the class axis).
    where: an element mask (optax's) or a per-example mask (:ref:`shared-arguments`).

  Returns:
    The divergence per example, shape ``[...]`` (inputs without ``axis``).

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import kl_divergence
    >>> logq = jnp.log(jnp.array([[0.5, 0.5], [0.9, 0.1]]))
    >>> kl_divergence(logq, jnp.array([[1.0, 0.0], [0.9, 0.1]]))
    Array([0.6931472, 0.       ], dtype=float32)
  """
  return _per_example(
    "kl_divergence", ("log_predictions", "targets"), kl_prob_kernel, 0.0,
    log_predictions, targets, axis, where,
  )  # fmt: skip


def kl_divergence_with_log_targets(
  log_predictions: jax.typing.ArrayLike,
  log_targets: jax.typing.ArrayLike,
  axis: Axis = -1,
  where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
  r"""Per-example KL divergence with targets in log-space, as optax's.

  .. math::

     \mathrm{KL}(p \,\|\, q) = \sum_i e^{\log p_i} (\log p_i - \log q_i)

  A class with ``log p_i = -inf`` contributes 0 with zero gradients (optax
  returns NaN there). Args, returns and ``where`` as in
  :func:`kl_divergence`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import kl_divergence_with_log_targets
    >>> logq = jnp.log(jnp.array([0.5, 0.5]))
    >>> kl_divergence_with_log_targets(logq, jnp.array([0.0, -jnp.inf]))
    Array(0.6931472, dtype=float32)
  """
  return _per_example(
    "kl_divergence_with_log_targets", ("log_predictions", "log_targets"), kl_log_kernel,
    -jnp.inf, log_predictions, log_targets, axis, where,
  )  # fmt: skip


def generalized_kl_divergence(
  log_predictions: jax.typing.ArrayLike,
  targets: jax.typing.ArrayLike,
  axis: Axis = -1,
  where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
  r"""Generalized KL divergence for unnormalised measures, as optax's.

  The Bregman divergence of :math:`f(x) = x \log x - x`:

  .. math::

     D(p \,\|\, q) = \sum_i p_i (\log p_i - \log q_i) - p_i + q_i

  with ``q = exp(log_predictions)``: :func:`kl_divergence` for normalised
  ``p`` and ``q``, never below 0 (:doc:`/conventions`). Args, ``where`` and
  zero mass as in :func:`kl_divergence`; ``convex_kl_divergence`` is its
  deprecated alias (it warns, as optax's does).

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import generalized_kl_divergence
    >>> generalized_kl_divergence(jnp.log(jnp.array([2.0, 1.0])), jnp.array([1.0, 1.0]))
    Array(0.30685282, dtype=float32)
  """
  terms = lambda x, t: kl_prob_kernel(x, t) + (jnp.exp(x) - t)  # noqa: E731
  return _per_example(
    "generalized_kl_divergence", ("log_predictions", "targets"), terms, 0.0,
    log_predictions, targets, axis, where, nonnegative,
  )  # fmt: skip


def convex_kl_divergence(
  log_predictions: jax.typing.ArrayLike,
  targets: jax.typing.ArrayLike,
  axis: Axis = -1,
  where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
  """Deprecated alias of :func:`generalized_kl_divergence`, as in optax.

  Emits a ``DeprecationWarning`` (optax's message) and returns
  ``generalized_kl_divergence(log_predictions, targets, axis, where)``.

  Examples:
    >>> import warnings, jax.numpy as jnp
    >>> from kldiv_jax import convex_kl_divergence
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   out = convex_kl_divergence(jnp.log(jnp.array([2.0, 1.0])), jnp.array([1.0, 1.0]))
    >>> out, caught[0].category.__name__
    (Array(0.30685282, dtype=float32), 'DeprecationWarning')
  """
  warnings.warn(
    "The function convex_kl_divergence is deprecated. "
    "Please use generalized_kl_divergence instead.",
    DeprecationWarning,
    stacklevel=2,
  )
  return generalized_kl_divergence(log_predictions, targets, axis, where)
