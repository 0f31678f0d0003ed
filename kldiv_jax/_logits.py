"""The KL divergence and the generalized JSD between softmax distributions given as logits.

The two per-example losses kldiv_jax had before the divergence engine, kept
with their names and arguments: each is :func:`kldiv_jax.divergence_from_logits`
with one divergence (``"forward_kl"``/``"reverse_kl"``, ``"jsd"``), and the
same body (:func:`kldiv_jax._divergence_api.per_example`). The kernel, its
derivative rules and the vocabulary-parallel passes are the engine's
(:mod:`kldiv_jax._engine`).
"""

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
) -> jax.Array:
  r"""Per-example KL divergence between two softmax distributions given as logits.

  With :math:`p = \mathrm{softmax}(\text{target\_logits} / T)` (the teacher)
  and :math:`q = \mathrm{softmax}(\text{logits} / T)` (the student):

  .. math::

     \text{forward:}\ \mathrm{KL}(p \,\|\, q) = \sum_i p_i (\log p_i - \log q_i),
     \qquad
     \text{reverse:}\ \mathrm{KL}(q \,\|\, p).

  Forward is Hinton et al.'s distillation loss (mass-covering); reverse is
  the mode-seeking KL of on-policy distillation. Multiply by :math:`T^2` to
  keep gradient magnitudes independent of ``T`` (Hinton et al.), or use
  :func:`distillation_loss`, which does.

  Computed from log-probabilities in at least float32 with a
  ``stop_gradient`` max, never materialising probabilities twice. Gradients:
  wrt ``logits``, :math:`(q - p)/T` (forward) or
  :math:`q(\log q - \log p - \mathrm{KL})/T` (reverse), per example; wrt
  ``target_logits`` correct too (self-distillation, mutual learning), unless
  the caller applies ``jax.lax.stop_gradient``. ``jvp``, ``jax.hessian`` and
  higher derivatives work.

  Conventions: a ``-inf`` logit is a class without mass (a masked
  vocabulary). A class without mass under the weighting distribution (``p``
  for forward) contributes 0 with zero gradients, whatever the other side;
  mass where the other side has none gives ``+inf`` (the true KL), with
  finite gradients wrt the other side's logits (and zero wrt its own). A
  side whose every class is ``-inf`` or masked is the zero measure:
  ``KL(0 || q) = 0``, ``KL(p || 0) = +inf``; an example masked on both sides
  (an all-masked row, or a per-example ``where``) gives 0 and zero
  gradients.

  NaN and invalid values: a NaN (or ``+inf``) logit that is not masked makes
  its example NaN, value and gradients, on either side (a NaN teacher is
  never read as "no mass"). The value is never below 0: a divergence that
  rounds below 0 (nearly equal distributions) is clamped at 0, and its
  gradient is that of the exact formula (about 0 there too).

  Args:
    logits: the student's logits ``[..., num_classes]``.
    target_logits: the teacher's logits, broadcastable to ``logits``, with
      the same number of classes (unless ``teacher_vocab_size``).
    temperature: positive softmax temperature ``T``; a Python number is
      checked at trace time (``ValueError`` unless positive and finite); a
      traced scalar (a schedule) may be differentiated, and makes every
      output NaN, value and gradients, unless positive and finite (NaN
      fails).
    direction: ``"forward"`` for ``KL(p || q)``, ``"reverse"`` for
      ``KL(q || p)``.
    axis: the class axis (or axes, flattened into one distribution).
    where: a boolean mask. Broadcastable to the inputs: an element mask over
      classes; masked classes leave both distributions (as
      ``jax.nn.log_softmax(where=...)``: a masked vocabulary). Or the
      output's shape: a per-example mask (tokens); a masked example gives 0
      and zero gradients. A mask whose shape equals the output's is taken per
      example.
    axis_name: for vocabulary parallelism: the name of a mesh axis over which
      the class axis is split, when called inside ``jax.shard_map``. Each
      device then passes its slice of the classes of ``logits``,
      ``target_logits`` and an element ``where`` (a per-example ``where``
      whole); the row max is combined with ``lax.pmax`` and the sums over
      classes with ``lax.psum``, so only per-example scalars cross devices.
      Values and gradients equal the unsharded computation and the result is
      replicated over ``axis_name``. For example, on a mesh with axes
      ``("data", "vocab")``, ``jax.shard_map(lambda s, t:
      kl_div_from_logits(s, t, axis_name="vocab"), mesh=mesh,
      in_specs=P("data", "vocab"), out_specs=P("data"))`` takes logits
      ``[batch, vocab]`` split over both axes and gives the ``[batch]``
      divergences split over ``"data"``. ``None`` (default): no collectives.
    softcap: soft-cap the student's logits before the temperature,
      ``softcap * tanh(logits / softcap)``, as in
      :func:`divergence_from_logits` (``None``: none, at no cost).
    target_softcap: likewise for the teacher's logits.
    teacher_vocab_size: the size of ``target_logits``' class axis when it
      differs from ``logits``' (``None``: they must be equal, else
      ``ValueError``): both are then cut to the shared first classes, as in
      :func:`divergence_from_logits`.

  Returns:
    The divergence per example, shape ``[...]`` (the inputs without
    ``axis``), in the promoted input dtype.

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
    name, spec, logits, target_logits, temperature, axis, where, axis_name, caps, teacher_vocab_size
  )


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
) -> jax.Array:
  r"""Per-example generalized Jensen-Shannon divergence from logits (TRL's GKD loss).

  With teacher :math:`p = \mathrm{softmax}(\text{target\_logits}/T)`, student
  :math:`q = \mathrm{softmax}(\text{logits}/T)` and mixture
  :math:`m = \beta p + (1 - \beta) q`:

  .. math::

     \mathrm{JSD}_\beta(p, q) = \beta\,\mathrm{KL}(p \,\|\, m)
       + (1 - \beta)\,\mathrm{KL}(q \,\|\, m), \qquad 0 < \beta < 1,

  and, as TRL's ``generalized_jsd_loss`` and Liger's JSD define the
  endpoints, :math:`\mathrm{KL}(p \,\|\, q)` at :math:`\beta = 0` and
  :math:`\mathrm{KL}(q \,\|\, p)` at :math:`\beta = 1`. The formula itself
  tends to 0 as :math:`\beta \to 0` or 1, so the loss is discontinuous at the
  endpoints: they are a different loss, not a limit. :math:`\beta = 0.5` is
  the symmetric JSD, bounded by :math:`\log 2`. Not multiplied by
  :math:`T^2` (as in TRL).

  Finite for every interior :math:`\beta`, ``-inf`` logits included (the
  mixture has mass wherever either side has). Gradients wrt ``logits``:
  :math:`(1-\beta)\,q\,(\log q - \log m - \mathrm{KL}(q\|m))/T`; wrt
  ``target_logits`` and a traced ``beta`` too. Masks, temperature, dtypes
  and conventions as in :func:`kl_div_from_logits`.

  Args:
    logits: the student's logits ``[..., num_classes]``.
    target_logits: the teacher's logits, broadcastable, same number of classes.
    beta: the mixture weight of the teacher, in ``[0, 1]``; checked when a
      Python number; a traced value outside ``[0, 1]`` (or NaN) makes every
      output NaN.
    temperature: positive softmax temperature, as in
      :func:`kl_div_from_logits` (a traced one is allowed; NaN unless
      positive and finite).
    axis: the class axis (or axes).
    where: an element (class) mask or a per-example mask, as in
      :func:`kl_div_from_logits`.
    axis_name: the mesh axis over which the class axis is split inside
      ``jax.shard_map`` (vocabulary parallelism), as in
      :func:`kl_div_from_logits`: e.g. ``jax.shard_map(lambda s, t:
      generalized_jsd(s, t, beta=0.5, axis_name="vocab"), mesh=mesh,
      in_specs=P(None, "vocab"), out_specs=P())``. Values and gradients equal
      the unsharded ones; the result is replicated over ``axis_name``.
    softcap: soft-cap the student's logits before the temperature, as in
      :func:`divergence_from_logits`.
    target_softcap: likewise for the teacher's logits.
    teacher_vocab_size: the size of ``target_logits``' class axis when it
      differs, as in :func:`kl_div_from_logits`.

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
    name, spec, logits, target_logits, temperature, axis, where, axis_name, caps, teacher_vocab_size
  )
