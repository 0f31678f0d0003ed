"""One per-token entry point for every divergence: :func:`divergence_from_logits`.

A divergence is named by a string (its default parameters) or given as a
:class:`~kldiv_jax._divergence_spec.Divergence`, a frozen spec whose
parameters are static (Python numbers) or traced (JAX arrays). The body is
validate, lay out as rows
(:func:`kldiv_jax._rows.prepare`), run the engine
(:func:`kldiv_jax._engine.divergence_rows`), shape the result.
"""

import jax
import jax.numpy as jnp

from kldiv_jax._checks import Axis, check_softcap, check_temperature
from kldiv_jax._divergence_spec import Divergence, as_divergence
from kldiv_jax._engine import divergence_rows
from kldiv_jax._numerics import nan_unless, positive_finite
from kldiv_jax._rows import prepare
from kldiv_jax._vocab_parallel import check_axis_name


def check_softcaps(name: str, softcap: object, target_softcap: object):
  """``(softcap, target_softcap)``, each ``None`` or a positive float (errors name ``name``)."""
  return check_softcap(name, "softcap", softcap), check_softcap(
    name, "target_softcap", target_softcap
  )


def divergence_from_logits(
  logits: jax.typing.ArrayLike,
  target_logits: jax.typing.ArrayLike,
  *,
  divergence: str | Divergence = "forward_kl",
  temperature: float | jax.typing.ArrayLike = 1.0,
  axis: Axis = -1,
  where: jax.typing.ArrayLike | None = None,
  axis_name: str | None = None,
  softcap: float | None = None,
  target_softcap: float | None = None,
  teacher_vocab_size: int | None = None,
) -> jax.Array:
  r"""Per-example divergence between two softmax distributions given as logits.

  With the teacher :math:`p = \mathrm{softmax}(\text{target\_logits} / T)`
  and the student :math:`q = \mathrm{softmax}(\text{logits} / T)`, per
  example, summed over the classes:

  * ``"forward_kl"``: :math:`\sum p \log(p/q)`.
  * ``"reverse_kl"``: :math:`\sum q \log(q/p)`.
  * ``"jsd"`` (``beta=0.5``): :math:`\beta\,\mathrm{KL}(p\|m) + (1-\beta)\,
    \mathrm{KL}(q\|m)` with :math:`m = \beta p + (1-\beta) q`; ``beta=0`` is
    forward KL, ``beta=1`` reverse KL (TRL's endpoints).
  * ``"symmetric_kl"`` (``lam=0.5``): :math:`(1-\lambda)\,\mathrm{KL}(p\|q) +
    \lambda\,\mathrm{KL}(q\|p)`.
  * ``"skew_kl"`` (``alpha=0.1``): :math:`\mathrm{KL}(p \,\|\, \alpha p +
    (1-\alpha) q)`.
  * ``"skew_reverse_kl"`` (``alpha=0.1``): :math:`\mathrm{KL}(q \,\|\,
    (1-\alpha) p + \alpha q)`.
  * ``"tvd"``: :math:`\tfrac12 \sum |p - q|`.
  * ``"alpha_beta"`` (``alpha``, ``beta``, no defaults):
    :math:`-\frac{1}{\alpha\beta}\sum\big(p^\alpha q^\beta -
    \frac{\alpha}{\alpha+\beta} p^{\alpha+\beta} - \frac{\beta}{\alpha+\beta}
    q^{\alpha+\beta}\big)`.

  Sources: forward/reverse, symmetric and skew KL as DistiLLM's
  ``distillm/losses.py`` (``skewed_forward_kl``, ``skewed_reverse_kl``);
  ``jsd`` as TRL's ``GKDTrainer.generalized_jsd_loss``; ``tvd`` as Liger's
  ``LigerTVDLoss``; ``alpha_beta`` as ABKD's ``ab_div`` with Cichocki et
  al.'s closed forms where ``alpha``, ``beta`` or ``alpha + beta`` is 0
  (``(1, 0)`` is forward KL, ``(0, 1)`` reverse KL). Not multiplied by
  :math:`T^2`.

  Parameters: ``divergence="skew_kl"`` takes the defaults;
  ``divergence=Divergence("skew_kl", alpha=0.2)`` sets them. A Python number
  is checked at once and fixes the formula at trace time; a JAX array is
  traced (a schedule): no recompilation for a new value, differentiable, NaN
  when out of range. A :class:`Divergence` is a pytree, so it can be passed
  to a jitted function as an argument.

  Gradients wrt ``logits``, ``target_logits``, a traced ``temperature`` and
  traced parameters, all from per-example statistics (two passes over the
  classes, no probabilities saved for the backward pass); ``jvp`` and
  ``jax.hessian`` work where the divergence is smooth (all but ``"tvd"``,
  whose subgradient is 0 where ``p = q``). At a limit point of
  ``alpha_beta``, derivatives wrt its parameters are exact to first order.

  Conventions: a ``-inf`` logit (or a class masked by ``where``) has no
  mass. A class without mass on either side contributes 0; one with mass on
  one side only contributes the limit of the formula: 0 where the weighting
  side has none (forward KL where ``p = 0``), ``+inf`` where the divergence is
  unbounded (forward KL where only ``q = 0``), a finite value where it is not
  (``jsd``, ``skew_kl``, ``tvd``). On an example whose value is ``+inf``, the
  derivatives that would be infinite are 0 (forward KL: finite wrt
  ``logits``, 0 wrt ``target_logits``). An example masked on both sides is 0
  with zero gradients. Identical logits give exactly 0, and no value is
  negative. NaN where a logit is NaN (or ``+inf``), the temperature is not
  positive or a traced parameter is out of range. bf16/f16 inputs are
  computed in float32 and returned in their dtype.

  Args:
    logits: the student's logits ``[..., num_classes]``.
    target_logits: the teacher's logits, broadcastable to ``logits``, with
      the same number of classes unless ``teacher_vocab_size`` says otherwise.
    divergence: a name from the table or a :class:`Divergence`.
    temperature: positive softmax temperature ``T``; a Python number is
      checked, a traced scalar is not and may be differentiated.
    axis: the class axis (or axes, flattened into one distribution).
    where: a boolean mask: broadcastable to the inputs, a class mask (masked
      classes leave both distributions); or of the output's shape, a
      per-example mask (a masked example gives 0 and zero gradients).
    axis_name: the name of a mesh axis over which the class axis is split,
      inside ``jax.shard_map`` (vocabulary parallelism): each device passes
      its slice of the classes; only per-example scalars cross devices
      (``pmax``/``psum``), and values and gradients equal the unsharded ones.
    softcap: soft-cap the student's logits, ``softcap * tanh(logits /
      softcap)`` (Gemma 2's final-logit soft-capping), before the
      temperature; ``None`` (the default) costs nothing. A static positive
      number. Differentiable: the gradient goes through the ``tanh``.
    target_softcap: likewise for the teacher's logits.
    teacher_vocab_size: ``None`` (the default): the class axes must have
      equal sizes, else ``ValueError`` (an off-by-one vocabulary is a bug
      more often than a padded teacher). An int, the size of
      ``target_logits``' class axis: the vocabularies may differ, as below.

  Vocabularies of different sizes, explicitly (``teacher_vocab_size``): with
  one class axis, ``logits`` and ``target_logits`` may have different numbers
  of classes (a padded vocabulary, a teacher from the same family with more
  logits). The shared classes are the first ones; the classes only one side
  has are padding and carry no mass on either side (a class ``where`` may
  have either length). Why: such ids are padding no tokenizer produces, so a
  student must neither be taught nor charged to put mass where its teacher
  cannot. Equal to the call on both logits cut to the shared classes, with
  zero gradient wrt the cut ones. Not with ``axis_name`` (each device's
  slices of the two vocabularies would not hold the same classes): cut the
  logits, or the LM heads, to the shared classes before sharding.

  Returns:
    The divergence per example, shape ``[...]`` (the inputs without
    ``axis``), in the promoted input dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import Divergence, divergence_from_logits
    >>> student = jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, -jnp.inf]])
    >>> teacher = jnp.array([[3.0, 2.0, 1.0], [1.0, 0.0, -jnp.inf]])
    >>> divergence_from_logits(student, teacher)
    Array([1.1504..., 0.1109...], dtype=float32)
    >>> divergence_from_logits(student, teacher, divergence="tvd", temperature=2.0)
    Array([0.3201..., 0.1224...], dtype=float32)
    >>> divergence_from_logits(student, teacher, divergence=Divergence("skew_kl", alpha=0.3))
    Array([0.4653..., 0.0561...], dtype=float32)

  References:
    Ko et al., *DistiLLM: Towards Streamlined Distillation for Large Language
    Models* (ICML 2024), arXiv:2402.03898. Agarwal et al., *On-Policy
    Distillation of Language Models* (GKD, ICLR 2024), arXiv:2306.13649.
    Wang et al., *ABKD: Pursuing a Proper Allocation of the Probability Mass
    in Knowledge Distillation via alpha-beta-Divergence* (ICML 2025),
    arXiv:2505.04560. Cichocki, Cruces and Amari, *Generalized Alpha-Beta
    Divergences and Their Application to Robust Nonnegative Matrix
    Factorization*, Entropy 13 (2011).
  """
  name = "divergence_from_logits"
  spec = as_divergence(name, divergence)
  caps = check_softcaps(name, softcap, target_softcap)
  return per_example(
    name, spec, logits, target_logits, temperature, axis, where, axis_name, caps, teacher_vocab_size
  )


def per_example(
  name: str,
  spec: Divergence,
  logits: jax.typing.ArrayLike,
  target_logits: jax.typing.ArrayLike,
  temperature: float | jax.typing.ArrayLike,
  axis: Axis,
  where: jax.typing.ArrayLike | None,
  axis_name: str | None,
  caps: tuple[float | None, float | None] = (None, None),
  teacher_vocab_size: int | None = None,
) -> jax.Array:
  """The body of every per-example loss from logits: validate, lay out, run, reduce.

  Checks the temperature and ``axis_name`` (errors name ``name``), lays the
  logits out as rows (:func:`kldiv_jax._rows.prepare`), runs the engine and
  gives the result the output's shape and dtype. Empty inputs give zeros.
  NaN unless a traced temperature is positive and finite and the spec's
  traced parameters are in range.
  """
  temperature, _ = check_temperature(name, temperature)
  if axis_name is not None:
    check_axis_name(name, axis_name)
  what = ("logits", "target_logits")
  rows = prepare(name, what, logits, target_logits, axis, where, teacher_vocab_size, axis_name)
  if rows.empty:
    out = jnp.zeros(rows.out_shape, rows.out_dtype)
  else:
    t = jnp.asarray(temperature).astype(rows.cdt)
    out = divergence_rows(rows.z, rows.y, t, rows.masks, spec, axis_name, caps)
    out = rows.finish(out)
  return nan_unless(out, positive_finite(temperature), *spec.valid())
