"""Knowledge-distillation loss from student and teacher logits (Hinton et al.)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._ce import OFF, CEOptions, ce_rows
from kldiv_jax._checks import (
  check_bool,
  check_int,
  check_nonnegative,
  check_normalizer,
  check_temperature,
  check_unit_interval,
  compute_dtype,
)
from kldiv_jax._divergence_api import check_softcaps
from kldiv_jax._divergence_ce import divergence_ce_rows
from kldiv_jax._divergence_spec import Divergence, as_divergence
from kldiv_jax._engine import divergence_rows
from kldiv_jax._id_checks import check_ids, ids_differ, ids_in_range, index_array
from kldiv_jax._implementation import resolve_implementation
from kldiv_jax._numerics import (
  in_unit_interval,
  is_static,
  nan_unless,
  nonnegative_finite,
  positive_finite,
)
from kldiv_jax._rows import prepare
from kldiv_jax._vocab_parallel import any_class, check_axis_name, global_classes


def loss_divergence(name: str, divergence: object, beta: float | jax.Array) -> Divergence:
  """The :class:`Divergence` of a loss's ``divergence=`` and legacy ``beta=`` arguments.

  The string ``"jsd"`` takes its ``beta`` from the loss's ``beta`` argument
  (checked, errors naming ``name``); every other name its defaults; a
  :class:`Divergence` is used as it is.
  """
  if isinstance(divergence, str) and divergence == "jsd":
    return Divergence("jsd", beta=beta)
  return as_divergence(name, divergence)


class DistillationParts(NamedTuple):
  """The parts of a distillation loss, for logging: sums over the valid tokens.

  ``soft``: the sum of the distillation term, :math:`T^2 D` per token (without
  ``alpha``); ``hard``: the sum of the label cross entropy (0 without labels; with
  ``label_smoothing`` the smoothed one, and with ``z_loss`` its penalty included);
  ``num_tokens``: the number of valid tokens (int32). Sums, not means, so that
  they add up over micro-batches, devices (``lax.psum``) and hosts; divide by
  the summed ``num_tokens`` to log means. They carry no gradient
  (``stop_gradient``): differentiate the loss.
  """

  soft: jax.Array
  hard: jax.Array
  num_tokens: jax.Array

  @classmethod
  def of(cls, soft, hard, num_tokens, checks=()) -> DistillationParts:
    """The parts, without gradient; NaN (the sums) unless the option ``checks`` hold."""
    soft, hard = (lax.stop_gradient(nan_unless(x, *checks)) for x in (soft, hard))
    return cls(soft, hard, lax.stop_gradient(num_tokens.astype(jnp.int32)))


class LossWeights(NamedTuple):
  """Which terms a distillation loss computes (static) and how it mixes them."""

  soft: bool  # the divergence (skipped for a static alpha = 0, unless parts are wanted)
  hard: bool  # the cross entropy (with labels; skipped for a static alpha = 1 likewise)
  labelled: bool

  def mix(self, soft, hard, alpha, dtype):
    """``alpha soft + (1 - alpha) hard`` with labels, ``soft`` without."""
    if not self.labelled:
      return soft
    if is_static(alpha) and alpha == 1.0:
      return soft
    if is_static(alpha) and alpha == 0.0:
      return hard
    a = alpha if is_static(alpha) else jnp.asarray(alpha).astype(dtype)
    return a * soft + (1.0 - a) * hard


def loss_weights(alpha, alpha_static: bool, labelled: bool, parts: bool) -> LossWeights:
  """:class:`LossWeights` of a loss with (``labelled``) or without labels."""
  soft = not labelled or parts or not (alpha_static and alpha == 0.0)
  hard = labelled and (parts or not (alpha_static and alpha == 1.0))
  return LossWeights(soft, hard, labelled)


def hard_rows(z, labels, labelled, masks, axis_name=None, cap=None, opts=OFF) -> jax.Array:
  """The cross entropy per row (``[rows]``) of the student's raw logits at temperature 1.

  ``labels`` ``[rows, 1]`` in their own dtype; ``labelled`` which count (not
  ``ignore_index``, not masked). A labelled row whose label is outside the (global) class
  axis is NaN (the callers raise first when the labels are known,
  :func:`check_labels`); the others are those of :func:`kldiv_jax._ce.ce_rows`, with its
  ``opts`` (label smoothing, the z-loss: :meth:`DistillOptions.ce_options`).
  """
  safe, ok = safe_labels(labels, labelled, global_classes(z.shape[1], axis_name))
  return nan_unless(ce_rows(z, safe, masks, axis_name, cap, opts), ok)


def soft_hard_rows(
  z, y, temperature, masks, spec, labels, labelled, weights, axis_name, caps, impl, ce_opts
):
  """``(divergence rows, cross entropy rows)`` (``[rows]`` each, 0 for a term ``weights``
  leaves out) of the student's logits ``z`` against the teacher's ``y``: where both terms
  count on one device, from one kernel (:func:`kldiv_jax._divergence_ce.divergence_ce_rows`:
  off CPU the KL family's statistics and the cross entropy's from one pass over the logits,
  not two sibling reductions, which XLA:TPU does not merge); else each from its own
  (:func:`kldiv_jax._engine.divergence_rows`, :func:`hard_rows`). ``labels`` and
  ``labelled`` as in :func:`hard_rows`; the divergence unscaled by ``T**2``. Shared by
  :func:`distillation_loss` and the fused loss's chunks of a dense teacher."""
  soft = hard = jnp.zeros((z.shape[0],), compute_dtype(z.dtype))
  if weights.soft and weights.hard and axis_name is None:
    safe, ok = safe_labels(labels, labelled, z.shape[1])
    soft, hard = divergence_ce_rows(z, y, temperature, masks, spec, safe, caps, impl, ce_opts)
    return soft, nan_unless(hard, ok)
  if weights.soft:
    soft = divergence_rows(z, y, temperature, masks, spec, axis_name, caps, impl)
  if weights.hard:
    hard = hard_rows(z, labels, labelled, masks, axis_name, caps[0], ce_opts)
  return soft, hard


def safe_labels(labels, labelled, num_classes):
  """``(labels in range or 0 (int32), [rows, 1]; which rows are not NaN, [rows])``."""
  in_range = ids_in_range(labels, num_classes)
  safe = jnp.where(in_range, labels, 0).astype(jnp.int32)
  return safe, in_range[:, 0] | ~labelled[:, 0]


def check_labels(name, labels, token_shape, shape_text, ignore_index, num_classes, counted):
  """``labels`` as an integer array of ``token_shape`` (``shape_text`` names it), and which
  are not ``ignore_index`` (both ``[rows, 1]``). Known labels that count (``counted``, a
  token mask ``[rows, 1]`` or ``None``) must be in ``[0, num_classes)``
  (:func:`kldiv_jax._id_checks.check_ids`)."""
  labels = index_array(name, "labels", labels, "class indices")
  if labels.shape != token_shape:
    raise ValueError(f"{name}: labels must have {shape_text} {token_shape}; got {labels.shape}.")
  check_ids(
    name,
    "labels",
    labels,
    num_classes,
    counted,
    what="class indices",
    ignore_index=ignore_index,
  )
  labels = labels.reshape(-1, 1)
  return labels, ids_differ(labels, ignore_index)


class DistillOptions(NamedTuple):
  """The options of a distillation loss, checked (:func:`distill_options`): what
  :func:`distillation_loss` and the fused losses (``_fused_distill``) read alike."""

  alpha: float | jax.Array
  alpha_static: bool
  beta: float | jax.Array
  spec: Divergence
  temperature: float | jax.Array
  t_static: bool
  scale_t2: bool  # scale_by_temperature_squared
  ignore_index: int
  caps: tuple[float | None, float | None]  # (softcap, target_softcap)
  return_parts: bool
  normalizer: float | jax.Array | None
  label_smoothing: float | jax.Array  # of the cross entropy; static 0: off
  z_loss: float | jax.Array  # the cross entropy's z-loss coefficient; static 0: off

  def labels(self, name, labels, token_shape, shape_text, num_classes, counted):
    """:func:`check_labels` with the loss's ``ignore_index``: ``(labels, labelled)``."""
    return check_labels(
      name, labels, token_shape, shape_text, self.ignore_index, num_classes, counted
    )

  def weights(self, labelled: bool) -> LossWeights:
    """The terms to compute (:func:`loss_weights`), with labels or without."""
    return loss_weights(self.alpha, self.alpha_static, labelled, self.return_parts)

  def ce_options(self, name: str, labelled: bool, dtype) -> CEOptions:
    """The cross entropy's options in ``dtype``; ``None`` for a static 0 (off: the program
    without it). Without labels there is no cross entropy: a static non-zero option raises."""
    given = {"label_smoothing": self.label_smoothing, "z_loss": self.z_loss}
    on = {k: v for k, v in given.items() if not (is_static(v) and v == 0.0)}
    if not labelled:
      static = [k for k, v in on.items() if is_static(v)]
      if static:
        raise ValueError(
          f"{name}: {' and '.join(static)} apply to the label cross entropy; pass labels "
          f"(without labels there is no cross entropy), or leave them at 0."
        )
      return CEOptions()
    opts = {k: jnp.asarray(v).astype(dtype) for k, v in on.items()}
    return CEOptions(**opts)

  def t2(self, t):
    """The divergence's factor: :math:`T^2` (``t`` the temperature in the compute dtype,
    squared when traced), or 1 with ``scale_by_temperature_squared=False``."""
    if not self.scale_t2:
      return 1.0
    return self.temperature**2 if self.t_static else t * t

  def checks(self) -> tuple:
    """The traced options' range tests, for ``nan_unless``: an invalid one makes the loss
    and the parts NaN (``True`` for a static one, checked already)."""
    checks = (
      positive_finite(self.temperature),
      in_unit_interval(self.alpha),
      in_unit_interval(self.beta),
      *self.spec.valid(),
      in_unit_interval(self.label_smoothing),
      nonnegative_finite(self.z_loss),
    )
    if self.normalizer is not None:
      checks = (*checks, positive_finite(self.normalizer))
    return checks

  def denominator(self, valid, dtype):
    """The mean's denominator: ``normalizer``, else the number of ``valid`` tokens, at
    least 1."""
    if self.normalizer is None:
      return jnp.maximum(jnp.sum(valid), 1).astype(dtype)
    n = self.normalizer
    return n.astype(dtype) if isinstance(n, jax.Array) else n

  def finish(self, loss, soft, hard, num_tokens, checks, out_dtype):
    """The loss in ``out_dtype``, NaN unless ``checks`` hold; with ``return_parts``,
    ``(loss, DistillationParts(soft, hard, num_tokens))``."""
    loss = nan_unless(loss.astype(out_dtype), *checks)
    if not self.return_parts:
      return loss
    return loss, DistillationParts.of(soft, hard, num_tokens, checks)


def distill_options(
  name, alpha, beta, divergence, temperature, scale_by_temperature_squared, ignore_index,
  softcap, target_softcap, return_parts, normalizer, label_smoothing, z_loss, /,
) -> DistillOptions:  # fmt: skip
  """The options of a distillation loss checked, errors naming ``name`` (the public
  function called); the arguments in this order, named as the losses name them."""
  alpha, alpha_static = check_unit_interval(name, "alpha", alpha)
  beta, _ = check_unit_interval(name, "beta", beta)
  spec = loss_divergence(name, divergence, beta)
  temperature, t_static = check_temperature(name, temperature)
  scale_t2 = check_bool(name, "scale_by_temperature_squared", scale_by_temperature_squared)
  ignore_index = check_int(name, "ignore_index", ignore_index)
  caps = check_softcaps(name, softcap, target_softcap)
  return_parts = check_bool(name, "return_parts", return_parts)
  if normalizer is not None:
    normalizer = check_normalizer(name, normalizer)
  label_smoothing, _ = check_unit_interval(name, "label_smoothing", label_smoothing)
  z_loss, _ = check_nonnegative(name, "z_loss", z_loss)
  return DistillOptions(
    alpha, alpha_static, beta, spec, temperature, t_static, scale_t2, ignore_index, caps,
    return_parts, normalizer, label_smoothing, z_loss,
  )  # fmt: skip


def distillation_loss(
  student_logits: jax.typing.ArrayLike,
  teacher_logits: jax.typing.ArrayLike,
  labels: jax.typing.ArrayLike | None = None,
  *,
  temperature: float | jax.typing.ArrayLike = 1.0,
  alpha: float | jax.typing.ArrayLike = 0.5,
  divergence: str | Divergence = "forward_kl",
  beta: float | jax.typing.ArrayLike = 0.5,
  scale_by_temperature_squared: bool = True,
  ignore_index: int = -100,
  label_smoothing: float | jax.typing.ArrayLike = 0.0,
  z_loss: float | jax.typing.ArrayLike = 0.0,
  where: jax.typing.ArrayLike | None = None,
  normalizer: float | jax.typing.ArrayLike | None = None,
  axis_name: str | None = None,
  softcap: float | None = None,
  target_softcap: float | None = None,
  teacher_vocab_size: int | None = None,
  return_parts: bool = False,
  implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, DistillationParts]:
  r"""Knowledge-distillation loss: softened teacher divergence plus label cross entropy.

  .. math::

     L = \frac{1}{N} \sum_{\text{valid tokens}} \Big[\alpha\, T^2\,
         D\big(\mathrm{softmax}(t/T), \mathrm{softmax}(s/T)\big)
         + (1 - \alpha)\, \big(-\log \mathrm{softmax}(s)_{y}\big)\Big]

  with student logits :math:`s`, teacher logits :math:`t`, labels :math:`y`,
  :math:`D` any divergence of :func:`divergence_from_logits` and :math:`N` the
  number of valid tokens (``labels != ignore_index`` and ``where``; at least 1,
  so an all-ignored batch gives 0) or ``normalizer``. Without ``labels``:
  :math:`T^2 D` alone. The cross entropy is at temperature 1, of the soft-capped
  logits; with ``label_smoothing`` :math:`\varepsilon` and ``z_loss`` :math:`\lambda` its
  term (weighted by :math:`1 - \alpha` as a whole) is

  .. math::

     -(1 - \varepsilon) \log \mathrm{softmax}(s)_{y}
     - \frac{\varepsilon}{K} \sum_{k} \log \mathrm{softmax}(s)_k
     + \lambda \Big(\log \sum_k e^{s_k}\Big)^2

  with :math:`K` the classes ``where`` keeps (optax's ``smooth_labels``, torch's
  ``label_smoothing``; PaLM's z-loss, MaxText's ``z_loss``). Which divergence, the
  hard term's options: :doc:`/distillation`; ``-inf``, masks,
  labels, NaN: :doc:`/conventions`; the shared arguments, the derivatives and
  ``axis_name``: :ref:`shared-arguments`, :ref:`derivatives`, :ref:`vocab-parallel`.

  .. note::

     ``alpha`` weights the **distillation (soft) term**, and ``1 - alpha`` the cross
     entropy: :math:`\alpha\,T^2 D + (1 - \alpha)\,\mathrm{CE}`.
     The Hugging Face blog's ``DistillationTrainer`` and the
     Keras knowledge-distillation example weight the *cross entropy* with their ``alpha``
     (:math:`\alpha_{\text{HF}}\,\mathrm{CE} + (1 - \alpha_{\text{HF}})\,T^2 D`): port
     them with ``alpha = 1 - alpha_hf`` (their ``alpha=0.7`` is ``alpha=0.3`` here).
     Copied unchanged, the loss is different and nothing raises.

  Args:
    student_logits, teacher_logits: ``[..., num_classes]``; the teacher's broadcastable.
    labels: optional integer class indices ``[...]`` (the logits' shape without the class
      axis), aligned with the logits: for a causal LM, already shifted (``labels[t]`` is the
      token after position ``t``; Hugging Face models shift inside their loss):
      :func:`shift_labels`.
    temperature: the softmax temperature ``T`` of the divergence (Python number or traced).
    alpha: the weight of the distillation (soft) term, in ``[0, 1]``; the cross entropy gets
      ``1 - alpha`` (the HF blog's and Keras' ``alpha`` is the other way round: see the note).
    divergence: a name (its default parameters) or a :class:`Divergence`.
    beta: the mixture weight of ``divergence="jsd"`` given as a string (others ignore it).
    scale_by_temperature_squared: multiply the divergence by :math:`T^2`.
    ignore_index: the label of tokens to leave out.
    label_smoothing: :math:`\varepsilon` in ``[0, 1]``, the cross entropy's label smoothing.
    z_loss: :math:`\lambda \ge 0`, the cross entropy's z-loss coefficient (0: none).
    where: a per-token mask ``[...]``, or a class mask broadcastable to the logits.
    normalizer: the denominator instead of the number of valid tokens (a global count).
    axis_name: the mesh axis the classes are split over (vocabulary parallelism).
    softcap, target_softcap, teacher_vocab_size: both logit soft-caps; the teacher's class count.
    return_parts: also return the :class:`DistillationParts` (sums, for logging).
    implementation: ``None``, ``"xla"`` or ``"pallas"``, as in :func:`divergence_from_logits`.

  Returns:
    A scalar in the promoted logits dtype; with ``return_parts``, ``(loss, parts)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import distillation_loss
    >>> student = jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    >>> teacher = jnp.array([[3.0, 2.0, 1.0], [1.0, 0.0, 0.0]])
    >>> labels = jnp.array([2, -100])
    >>> distillation_loss(student, teacher, labels, temperature=2.0)
    Array(0.8441..., dtype=float32)
    >>> loss, parts = distillation_loss(student, teacher, labels, temperature=2.0, return_parts=True)
    >>> int(parts.num_tokens), bool(jnp.allclose(loss, 0.5 * parts.soft + 0.5 * parts.hard))
    (1, True)

  References:
    Hinton, Vinyals and Dean, *Distilling the Knowledge in a Neural Network*
    (2015), arXiv:1503.02531.
  """
  name = "distillation_loss"
  o = distill_options(
    name, alpha, beta, divergence, temperature, scale_by_temperature_squared, ignore_index,
    softcap, target_softcap, return_parts, normalizer, label_smoothing, z_loss,
  )  # fmt: skip
  impl = resolve_implementation(name, implementation)
  if axis_name is not None:
    check_axis_name(name, axis_name)
  what = ("student_logits", "teacher_logits")
  rows = prepare(
    name, what, student_logits, teacher_logits, -1, where, teacher_vocab_size, axis_name
  )
  masks = rows.masks
  valid = jnp.ones((rows.z.shape[0], 1), jnp.bool_)
  for m in masks:
    valid = valid & (m if m.shape[1] == 1 else any_class(m, axis_name))
  labelled = None  # with labels: which tokens' labels are not ignore_index
  if labels is not None:
    # Compared in the labels' own dtype: a cast could wrap an id onto another.
    num_classes = global_classes(rows.z.shape[1], axis_name)
    shape_text = "the logits' shape without the class axis,"
    labels, labelled = o.labels(name, labels, rows.out_shape, shape_text, num_classes, valid)
    valid = valid & labelled
    masks = (*masks, labelled)
  cdt, spec, caps = rows.cdt, o.spec, o.caps
  weights = o.weights(labels is not None)
  ce_opts = o.ce_options(name, labels is not None, cdt)
  t = jnp.asarray(o.temperature).astype(cdt)
  t2 = o.t2(t)
  if rows.empty:
    soft = hard = jnp.zeros((), cdt)
    if labelled is not None and weights.hard:
      # Without classes every label is out of range: NaN, as documented.
      hard = jnp.where(jnp.any(labelled), jnp.nan, hard)
  else:
    # ``valid``: a masked token's label is not read (no NaN from it), as ignore_index's.
    soft, hard = soft_hard_rows(
      rows.z, rows.y, t, masks, spec, labels, valid, weights, axis_name, caps, impl, ce_opts
    )
    soft, hard = jnp.sum(soft * t2), jnp.sum(hard)
  total = weights.mix(soft, hard, o.alpha, cdt)
  loss = total / o.denominator(valid, cdt)
  return o.finish(loss, soft, hard, jnp.sum(valid), o.checks(), rows.out_dtype)
