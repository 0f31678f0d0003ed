"""The KL divergence and the generalized JSD between softmax distributions given as logits.

The two per-example losses kldiv_jax had before the divergence engine, kept
with their names and arguments: each is :func:`kldiv_jax.divergence_from_logits`
with one divergence (``"forward_kl"``/``"reverse_kl"``, ``"jsd"``), and the
same body (:func:`kldiv_jax._divergence_api.per_example`). The kernel, its
derivative rules and the vocabulary-parallel passes are the engine's
(:mod:`kldiv_jax._engine`).
"""

from __future__ import annotations

import jax

from kldiv_jax._checks import Axis, check_choice, check_unit_interval
from kldiv_jax._divergence_api import check_softcaps, per_example
from kldiv_jax._divergence_spec import Divergence

DIRECTIONS = ("forward", "reverse")


def kl_div_from_logits(
  logits: jax.typing.ArrayLike,
  target_logits: jax.typing.ArrayLike,
  *,
  temperature: float | jax.typing.ArrayLike = 1.0,
  direction: str = "forward",
  axis: Axis = -1,
  where: jax.typing.ArrayLike | None = None,
  axis_name: str | None = None,
  softcap: float | None = None,
  target_softcap: float | None = None,
  teacher_vocab_size: int | None = None,
  implementation: str | None = None,
) -> jax.Array:
  r"""Per-example KL divergence between two softmax distributions given as logits.

  With :math:`p = \mathrm{softmax}(\text{target\_logits} / T)` (the teacher)
  and :math:`q = \mathrm{softmax}(\text{logits} / T)` (the student):

  .. math::

     \text{forward:}\ \mathrm{KL}(p \,\|\, q) = \sum_i p_i (\log p_i - \log q_i),
     \qquad
     \text{reverse:}\ \mathrm{KL}(q \,\|\, p).

  Forward is Hinton et al.'s distillation loss (mass-covering), reverse the
  mode-seeking KL of on-policy distillation; not multiplied by :math:`T^2`.
  Zero mass, ``-inf``, masks, NaN: :doc:`/conventions`; the shared
  arguments, gradients: :ref:`shared-arguments`, :ref:`derivatives`.

  Args:
    logits: the student's logits ``[..., num_classes]``.
    target_logits: the teacher's logits, broadcastable to ``logits``.
    temperature: the softmax temperature ``T`` (Python number or traced).
    direction: ``"forward"`` for ``KL(p || q)``, ``"reverse"`` for ``KL(q || p)``.
    axis, where, axis_name, softcap, target_softcap, teacher_vocab_size, implementation: as
      in :func:`divergence_from_logits`.

  Returns:
    The divergence per example, ``[...]`` (the inputs without ``axis``), promoted dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import kl_div_from_logits
    >>> student = jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, -jnp.inf]])
    >>> teacher = jnp.array([[3.0, 2.0, 1.0], [1.0, 0.0, -jnp.inf]])
    >>> kl_div_from_logits(student, teacher)
    Array([1.1504..., 0.1109...], dtype=float32)
    >>> kl_div_from_logits(student, teacher, temperature=2.0, direction="reverse")
    Array([0.3201..., 0.0309...], dtype=float32)

  References:
    Hinton, Vinyals and Dean, *Distilling the Knowledge in a Neural Network*
    (2015), arXiv:1503.02531.
  """
  name = "kl_div_from_logits"
  check_choice(name, "direction", direction, DIRECTIONS)
  spec = Divergence("forward_kl" if direction == "forward" else "reverse_kl")
  caps = check_softcaps(name, softcap, target_softcap)
  return per_example(
    name, spec, logits, target_logits, temperature, axis, where, axis_name, caps,
    teacher_vocab_size, implementation,
  )  # fmt: skip


def generalized_jsd(
  logits: jax.typing.ArrayLike,
  target_logits: jax.typing.ArrayLike,
  *,
  beta: float | jax.typing.ArrayLike = 0.5,
  temperature: float | jax.typing.ArrayLike = 1.0,
  axis: Axis = -1,
  where: jax.typing.ArrayLike | None = None,
  axis_name: str | None = None,
  softcap: float | None = None,
  target_softcap: float | None = None,
  teacher_vocab_size: int | None = None,
  implementation: str | None = None,
) -> jax.Array:
  r"""Per-example generalized Jensen-Shannon divergence from logits (TRL's GKD loss).

  With teacher :math:`p = \mathrm{softmax}(\text{target\_logits}/T)`, student
  :math:`q = \mathrm{softmax}(\text{logits}/T)` and mixture
  :math:`m = \beta p + (1 - \beta) q`:

  .. math::

     \mathrm{JSD}_\beta(p, q) = \beta\,\mathrm{KL}(p \,\|\, m)
       + (1 - \beta)\,\mathrm{KL}(q \,\|\, m), \qquad 0 < \beta < 1,

  and, as TRL and Liger define the endpoints (not a limit: the formula tends
  to 0 there), :math:`\mathrm{KL}(p \,\|\, q)` at :math:`\beta = 0` and
  :math:`\mathrm{KL}(q \,\|\, p)` at :math:`\beta = 1`. Not multiplied by
  :math:`T^2`, as in TRL. More in :doc:`/distillation`; conventions and
  gradients as in :func:`kl_div_from_logits`.

  Args:
    logits: the student's logits ``[..., num_classes]``.
    target_logits: the teacher's logits, broadcastable to ``logits``.
    beta: the teacher's mixture weight, in ``[0, 1]`` (Python number or traced).
    temperature: the softmax temperature ``T`` (Python number or traced).
    axis, where, axis_name, softcap, target_softcap, teacher_vocab_size, implementation: as
      in :func:`divergence_from_logits`.

  Returns:
    The divergence per example, shape ``[...]``, in the promoted input dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import generalized_jsd
    >>> student = jnp.array([1.0, 2.0, 3.0])
    >>> teacher = jnp.array([3.0, 2.0, 1.0])
    >>> generalized_jsd(student, teacher)
    Array(0.2475..., dtype=float32)
    >>> generalized_jsd(student, teacher, beta=0.9, temperature=2.0)
    Array(0.0283..., dtype=float32)

  References:
    Agarwal et al., *On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes* (GKD, 2024), arXiv:2306.13649, Eq. (1);
    TRL's ``GKDTrainer.generalized_jsd_loss``.
  """
  name = "generalized_jsd"
  beta, _ = check_unit_interval(name, "beta", beta)
  spec = Divergence("jsd", beta=beta)
  caps = check_softcaps(name, softcap, target_softcap)
  return per_example(
    name, spec, logits, target_logits, temperature, axis, where, axis_name, caps,
    teacher_vocab_size, implementation,
  )  # fmt: skip
