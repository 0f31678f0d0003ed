"""torch-parity ``kl_div`` and ``KLDivLoss``.

Semantics of ``torch.nn.functional.kl_div`` (torch 2.13): the four reductions,
``'batchmean'`` dividing by ``input.shape[0]`` after the reduction, the
deprecated ``size_average``/``reduce`` overriding ``reduction``, broadcasting
and type promotion, and torch's warnings. Differs from torch only where torch
is not finite at zero-mass targets (see :func:`kl_div_pointwise`).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp

from kldiv_jax._checks import array_shape, check_bool, check_choice, promote_and_broadcast
from kldiv_jax._pointwise import kl_log_kernel, kl_prob_kernel, positive_zero

REDUCTIONS = ("none", "mean", "sum", "batchmean")

_MEAN_WARNING = (
  "reduction: 'mean' divides the total loss by both the batch size and the "
  "support size.'batchmean' divides only by the batch size, and aligns with "
  "the KL div math definition.'mean' will be changed to behave the same as "
  "'batchmean' in the next major release."
)


def legacy_reduction(size_average: bool | None, reduce: bool | None) -> str:
  """torch's ``_Reduction.legacy_get_string``: ``None`` counts as ``True``."""
  size_average = True if size_average is None else size_average
  reduce = True if reduce is None else reduce
  if not reduce:
    reduction = "none"
  elif size_average:
    reduction = "mean"
  else:
    reduction = "sum"
  warnings.warn(
    f"size_average and reduce args will be deprecated, please use reduction='{reduction}' instead.",
    UserWarning,
    stacklevel=3,
  )
  return reduction


def kl_div(
  input: jax.typing.ArrayLike,  # noqa: A002 - torch's name
  target: jax.typing.ArrayLike,
  size_average: bool | None = None,
  reduce: bool | None = None,
  reduction: str = "mean",
  log_target: bool = False,
) -> jax.Array:
  r"""Kullback-Leibler divergence loss with ``torch.nn.functional.kl_div``'s semantics.

  .. math::

     L = \operatorname{reduce}\big(t\,(\log t - x)\big)
     \quad\text{or, with log\_target,}\quad
     L = \operatorname{reduce}\big(e^{t}\,(t - x)\big)

  with ``x = input`` (log-probabilities) and ``t = target``. ``'mean'``
  averages over *all* elements, batch and classes (torch's warning);
  ``'batchmean'`` divides the sum by ``input.shape[0]``: the KL divergence
  averaged over the batch. Differs from torch only where torch is not
  finite (zero-mass targets: 0 and zero gradients here). Reductions, legacy
  arguments, errors and differences: :doc:`/migration`, :doc:`/conventions`.

  Args:
    input: log-probabilities, e.g. ``[batch, num_classes]``.
    target: probabilities (log-probabilities with ``log_target``), broadcastable.
    size_average, reduce: deprecated: they override ``reduction``, as in torch.
    reduction: ``'none' | 'mean' | 'sum' | 'batchmean'``.
    log_target: whether ``target`` is in log-space.

  Returns:
    A scalar, or the broadcast shape for ``'none'``; the promoted dtype.

  Raises:
    TypeError: integer, bool, complex or non-array inputs, a non-bool ``log_target``.
    ValueError: an unknown ``reduction`` or non-broadcastable shapes.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kldiv_jax import kl_div
    >>> logq = jax.nn.log_softmax(jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]))
    >>> p = jnp.array([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    >>> kl_div(logq, p, reduction="batchmean")
    Array(0.5882..., dtype=float32)
  """
  check_choice("kl_div", "reduction", reduction, REDUCTIONS)
  log_target = check_bool("kl_div", "log_target", log_target)
  (x, t), out_dtype = promote_and_broadcast("kl_div", ("input", "target"), input, target)
  input_shape = array_shape(input)  # before broadcasting: 'batchmean' divides by its shape[0]
  # torch's warnings, once every argument is known to be valid.
  if size_average is not None or reduce is not None:
    mode = legacy_reduction(size_average, reduce)
  else:
    if reduction == "mean":
      warnings.warn(_MEAN_WARNING, UserWarning, stacklevel=2)
    mode = "sum" if reduction == "batchmean" else reduction
  kernel = kl_log_kernel if log_target else kl_prob_kernel
  loss = kernel(x, t)
  if mode == "none":
    loss = positive_zero(loss)
  elif mode == "sum":
    loss = jnp.sum(loss)
  elif mode == "mean":
    loss = jnp.mean(loss) if loss.size else jnp.array(jnp.nan, loss.dtype)
  if reduction == "batchmean" and input_shape:
    loss = loss / input_shape[0]
  return loss.astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class KLDivLoss:
  r"""``torch.nn.KLDivLoss`` as a frozen, hashable dataclass: :func:`kl_div` with its options.

  As torch's module, the deprecated ``size_average``/``reduce`` become a
  ``reduction`` string at construction. Instances compare and hash by their
  options: static arguments of ``jax.jit``. See :doc:`/migration`.

  Args:
    size_average, reduce: deprecated (see ``reduction``).
    reduction: ``'none' | 'mean' | 'sum' | 'batchmean'`` (the KL divergence).
    log_target: whether targets are in log-space.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import KLDivLoss
    >>> loss = KLDivLoss(reduction="batchmean", log_target=True)
    >>> x = jnp.log(jnp.array([[0.5, 0.5]]))
    >>> loss(x, jnp.log(jnp.array([[0.25, 0.75]])))
    Array(0.1308..., dtype=float32)
  """

  size_average: bool | None = None
  reduce: bool | None = None
  reduction: str = "mean"
  log_target: bool = False

  def __post_init__(self) -> None:
    check_choice("KLDivLoss", "reduction", self.reduction, REDUCTIONS)
    if self.size_average is not None or self.reduce is not None:
      reduction = legacy_reduction(self.size_average, self.reduce)
      object.__setattr__(self, "reduction", reduction)
      object.__setattr__(self, "size_average", None)
      object.__setattr__(self, "reduce", None)
    object.__setattr__(self, "log_target", check_bool("KLDivLoss", "log_target", self.log_target))

  def __call__(
    self,
    input: jax.typing.ArrayLike,  # noqa: A002 - torch's name
    target: jax.typing.ArrayLike,
  ) -> jax.Array:
    """The loss of ``input`` (log-probabilities) against ``target``."""
    return kl_div(input, target, reduction=self.reduction, log_target=self.log_target)

  forward = __call__
