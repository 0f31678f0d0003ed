"""One per-token entry point for every divergence: :func:`divergence_from_logits`.

A divergence is named by a string (its default parameters) or given as a
:class:`~kldiv_jax._divergence_spec.Divergence`, a frozen spec whose
parameters are static (Python numbers) or traced (JAX arrays). The body is
validate, lay out as rows
(:func:`kldiv_jax._rows.prepare`), run the engine
(:func:`kldiv_jax._engine.divergence_rows`), shape the result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kldiv_jax._checks import Axis, check_softcap, check_temperature
from kldiv_jax._divergence_spec import Divergence, as_divergence
from kldiv_jax._engine import divergence_rows
from kldiv_jax._implementation import resolve_implementation
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
  implementation: str | None = None,
) -> jax.Array:
  r"""Per-example divergence between two softmax distributions given as logits.

  With the teacher :math:`p = \mathrm{softmax}(\text{target\_logits} / T)`,
  the student :math:`q = \mathrm{softmax}(\text{logits} / T)` and sums over
  the classes (not multiplied by :math:`T^2`):

  * ``"forward_kl"``: :math:`\sum p \log(p/q)`; ``"reverse_kl"``: :math:`\sum q \log(q/p)`.
  * ``"jsd"`` (``beta=0.5``): :math:`\beta\,\mathrm{KL}(p\|m) + (1-\beta)\,
    \mathrm{KL}(q\|m)`, :math:`m = \beta p + (1-\beta) q`.
  * ``"symmetric_kl"`` (``lam=0.5``): :math:`(1-\lambda)\,\mathrm{KL}(p\|q) +
    \lambda\,\mathrm{KL}(q\|p)`.
  * ``"skew_kl"``, ``"skew_reverse_kl"`` (``alpha=0.1``): :math:`\mathrm{KL}(p \,\|\,
    \alpha p + (1-\alpha) q)`, :math:`\mathrm{KL}(q \,\|\, (1-\alpha) p + \alpha q)`.
  * ``"tvd"``: :math:`\tfrac12 \sum |p - q|`.
  * ``"alpha_beta"`` (``alpha``, ``beta``, no defaults):
    :math:`-\frac{1}{\alpha\beta}\sum\big(p^\alpha q^\beta -
    \frac{\alpha}{\alpha+\beta} p^{\alpha+\beta} - \frac{\beta}{\alpha+\beta}
    q^{\alpha+\beta}\big)`.

  Sources, endpoints and which to choose: :doc:`/distillation`; ``-inf``,
  masks, NaN: :doc:`/conventions`; the shared arguments and the derivatives:
  :ref:`shared-arguments`, :ref:`derivatives`.

  Args:
    logits: the student's logits ``[..., num_classes]``.
    target_logits: the teacher's logits, broadcastable to ``logits``.
    divergence: a name above (its default parameters) or a :class:`Divergence`.
    temperature: the softmax temperature ``T`` (Python number or traced).
    axis: the class axis (or axes).
    where: a class mask or a per-example mask.
    axis_name: the mesh axis the classes are split over (vocabulary parallelism).
    softcap, target_softcap: the student's and the teacher's logit soft-caps.
    teacher_vocab_size: the teacher's class count when it differs.
    implementation: ``None`` (the process-wide default: :func:`set_implementation`; unset,
      the TPU whole-row kernel on TPU and XLA elsewhere), ``"xla"`` (XLA's fusions only) or
      ``"pallas"`` (the Pallas kernels where they apply: the TPU whole-row kernel, never run
      on TPU hardware, and the opt-in Triton kernels on NVIDIA GPUs): :ref:`implementation`.

  Returns:
    The divergence per example, ``[...]`` (the inputs without ``axis``), promoted dtype.

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
  """
  name = "divergence_from_logits"
  spec = as_divergence(name, divergence)
  caps = check_softcaps(name, softcap, target_softcap)
  return per_example(
    name, spec, logits, target_logits, temperature, axis, where, axis_name, caps,
    teacher_vocab_size, implementation,
  )  # fmt: skip


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
  implementation: str | None = None,
) -> jax.Array:
  """The body of every per-example loss from logits: validate, lay out, run, reduce.

  Checks the temperature and ``axis_name`` (errors name ``name``), lays the
  logits out as rows (:func:`kldiv_jax._rows.prepare`), runs the engine and
  gives the result the output's shape and dtype. Empty inputs give zeros.
  NaN unless a traced temperature is positive and finite and the spec's
  traced parameters are in range.
  """
  temperature, _ = check_temperature(name, temperature)
  impl = resolve_implementation(name, implementation)
  if axis_name is not None:
    check_axis_name(name, axis_name)
  what = ("logits", "target_logits")
  rows = prepare(name, what, logits, target_logits, axis, where, teacher_vocab_size, axis_name)
  if rows.empty:
    out = jnp.zeros(rows.out_shape, rows.out_dtype)
  else:
    t = jnp.asarray(temperature).astype(rows.cdt)
    out = divergence_rows(rows.z, rows.y, t, rows.masks, spec, axis_name, caps, impl)
    out = rows.finish(out)
  return nan_unless(out, positive_finite(temperature), *spec.valid())
