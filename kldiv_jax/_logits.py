"""KL divergence and generalized JSD between softmax distributions given as logits.

Each divergence is one ``jax.custom_jvp`` kernel over rows ``[rows, classes]``
of raw logits, with the temperature and the class masks applied inside. The
forward pass computes a few statistics per row (max, sum of exponentials, the
divergence); the rule's tangent recomputes the per-class gradient from them
elementwise, so reverse mode saves no probabilities and XLA fuses the gradient
into a single pass that writes it. For ``KL(p || q)`` the gradient wrt the
logits of ``q`` is ``(q - p) / T``. Symbolic-zero tangents skip the work for an
argument that is not differentiated (a teacher under ``stop_gradient``, a
constant temperature). The rules are plain differentiable JAX, so ``jvp``,
``jax.hessian`` and higher-order derivatives work.

On CPU the row statistics are computed over blocks of rows (``_rows``).

Conventions: a class whose logit is ``-inf`` (or masked) has no mass. A class
without mass under the weighting distribution contributes 0, with zero
gradients; mass where the other side has none gives ``+inf`` (the true value).
A row without any mass is the zero measure. A NaN (or ``+inf``) logit makes its
row NaN, never the zero measure; the kernels' values are clamped at 0 after
rounding (``_numerics``).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._checks import Axis, check_choice, check_temperature, check_unit_interval
from kldiv_jax._numerics import in_unit_interval, nan_unless, nonnegative, positive_finite
from kldiv_jax._rows import (
  Rows,
  compiled,
  is_zero,
  logit_tangents,
  map_rows,
  normalizer,
  prepare,
  row_stats,
  scaled,
)

# Re-exported for the modules built on these kernels (_distill, _fused, _vocab_parallel).
__all__ = [
  "DIRECTIONS",
  "Rows",
  "beta_tangent",
  "check_temperature",
  "check_unit_interval",
  "generalized_jsd",
  "gjsd",
  "gjsd_kernel",
  "is_zero",
  "jsd_kernel",
  "jsd_tangent",
  "kl_div_from_logits",
  "kl_from_sums",
  "kl_kernel",
  "kl_tangent",
  "kl_terms",
  "map_rows",
  "normalizer",
  "prepare",
  "row_stats",
  "scaled",
]

DIRECTIONS = ("forward", "reverse")


# KL(softmax(y / T) || softmax(z / T)) per row: z is the "input" side.


def kl_terms(u, mu, v, mv, ev):
  """``exp(v - mv) * ((v - mv) - (u - mu))`` per class, 0 where ``ev = exp(v - mv)`` is 0.

  ``(v - mv) - (u - mu)`` is ``log p - log q`` up to the row constant, and
  ``+inf`` where ``p > 0 = q``. Where ``p = 0`` the ``-inf`` logits are
  selected away before the subtraction (``-inf - -inf`` would be a NaN that
  ``jax.debug_nans`` reports); a NaN ``ev`` still propagates.
  """
  pos = ev > 0
  return ev * jnp.where(pos, (v - mv) - jnp.where(pos, u - mu, 0.0), 0.0)


def _kl_stats(temperature, masks):
  def fn(z, y, *masks):
    u, _ = scaled(z, temperature, masks)
    v, _ = scaled(y, temperature, masks)
    mu, _, su = row_stats(u)
    mv, ev, sv = row_stats(v)
    return mu, su, mv, sv, jnp.sum(kl_terms(u, mu, v, mv, ev), axis=-1, keepdims=True)

  return fn


def kl_from_sums(mu, su, mv, sv, a):
  """``(KL, stats for kl_tangent)`` per row from the row maxes and sums (``[rows, 1]``).

  ``su``, ``sv`` are the sums of ``exp(u - mu)``, ``exp(v - mv)`` and ``a``
  that of ``exp(v - mv) * ((v - mv) - (u - mu))`` over the classes with mass.
  """
  _, inv_su, log_su = normalizer(su)
  has_v, inv_sv, log_sv = normalizer(sv)
  log_ratio = log_su - log_sv
  kl = jnp.where(has_v, inv_sv * a + log_ratio, 0.0)
  return kl, (mu, inv_su, mv, inv_sv, log_ratio)


def _kl_rows(z, y, temperature, masks):
  return kl_from_sums(*map_rows(_kl_stats(temperature, masks), (z, y, *masks), z.shape[0]))


def kl_tangent(z, y, temperature, masks, tangents, kl, stats):
  """The tangent of :func:`kl_kernel` per row (``[rows, 1]``), over the classes held here.

  ``kl`` and ``stats`` come from :func:`kl_from_sums`; ``tangents`` are
  ``(dz, dy, dtemp)``. The vocabulary-parallel kernel ``psum``s the result.
  """
  mu, inv_su, mv, inv_sv, log_ratio = stats
  _, dy, dtemp = tangents
  u, keep_u = scaled(z, temperature, masks)
  v, keep_v = scaled(y, temperature, masks)
  q = jnp.exp(u - mu) * inv_su
  p = jnp.exp(v - mv) * inv_sv
  # d/du = q - p; d/dv = p (log p - log q - KL), 0 on rows where KL = +inf.
  g_u = q - p
  g_v = None
  if not (is_zero(dy) and is_zero(dtemp)):
    finite = kl != jnp.inf
    pos = (p != 0) & finite  # NaN rows too: their gradients are NaN
    diff = jnp.where(pos, (v - mv) - jnp.where(pos, u - mu, 0.0), 0.0)
    g_v = jnp.where(pos, p * (diff + log_ratio - jnp.where(finite, kl, 0.0)), 0.0)
  return logit_tangents(temperature, tangents, g_u, g_v, u, keep_u, v, keep_v)


@jax.custom_jvp
def kl_kernel(z, y, temperature, masks):
  """``KL(softmax(y/T) || softmax(z/T))`` per row of ``[rows, classes]`` logits.

  ``temperature`` is a scalar of the compute dtype, ``masks`` a tuple of
  boolean ``[rows or 1, classes or 1]`` arrays. Returns ``[rows]``, never
  below 0 (:func:`~kldiv_jax._numerics.nonnegative`).
  """
  return nonnegative(_kl_rows(z, y, temperature, masks)[0][:, 0])


def _kl_kernel_jvp(primals, tangents):
  z, y, temperature, masks = primals
  kl, stats = _kl_rows(z, y, temperature, masks)
  tangent = kl_tangent(z, y, temperature, masks, tangents[:3], kl, stats)
  return nonnegative(kl[:, 0]), tangent[:, 0]


kl_kernel.defjvp(_kl_kernel_jvp, symbolic_zeros=True)
kl_kernel = compiled(kl_kernel)


# Generalized JSD per row, mixture m = beta p + (1 - beta) q with p = softmax(y/T)
# and q = softmax(z/T): beta KL(p || m) + (1 - beta) KL(q || m), 0 < beta < 1.


def _log_terms(u, mu, log_su, v, mv, log_sv, q, p, beta):
  """``(log q - log m, log p - log m)`` where ``q``, resp. ``p``, is positive, else 0."""
  m = beta * p + (1.0 - beta) * q
  log_m = jnp.log(jnp.where(m != 0, m, 1.0))  # a NaN m (a NaN row) propagates
  a_q = jnp.where(q > 0, jnp.where(q > 0, u - mu, 0.0) - log_su - log_m, 0.0)
  a_p = jnp.where(p > 0, jnp.where(p > 0, v - mv, 0.0) - log_sv - log_m, 0.0)
  return a_q, a_p


def _jsd_stats(temperature, beta, masks):
  def fn(z, y, *masks):
    u, _ = scaled(z, temperature, masks)
    v, _ = scaled(y, temperature, masks)
    mu, eu, su = row_stats(u)
    mv, ev, sv = row_stats(v)
    _, inv_su, log_su = normalizer(su)
    _, inv_sv, log_sv = normalizer(sv)
    q = eu * inv_su
    p = ev * inv_sv
    a_q, a_p = _log_terms(u, mu, log_su, v, mv, log_sv, q, p, beta)
    kl_qm = jnp.sum(q * a_q, axis=-1, keepdims=True)
    kl_pm = jnp.sum(p * a_p, axis=-1, keepdims=True)
    return mu, su, mv, sv, kl_qm, kl_pm

  return fn


@jax.custom_jvp
def jsd_kernel(z, y, temperature, beta, masks):
  """Generalized JSD per row for ``0 < beta < 1``; arguments as :func:`kl_kernel`."""
  stats = map_rows(_jsd_stats(temperature, beta, masks), (z, y, *masks), z.shape[0])
  kl_qm, kl_pm = stats[-2:]
  return nonnegative(beta * kl_pm + (1.0 - beta) * kl_qm)[:, 0]


def jsd_tangent(z, y, temperature, beta, masks, tangents, stats, kl_qm, kl_pm):
  """The tangent of :func:`jsd_kernel` per row (``[rows, 1]``), over the classes held here.

  ``stats`` are ``(mu, mv, inv_su, log_su, inv_sv, log_sv)`` and ``kl_qm``,
  ``kl_pm`` the row divergences to the mixture; ``tangents`` are ``(dz, dy,
  dtemp)``. Without the ``beta`` term (:func:`beta_tangent`), which is per row
  already: the vocabulary-parallel kernel ``psum``s this part only.
  """
  mu, mv, inv_su, log_su, inv_sv, log_sv = stats
  dz, dy, dtemp = tangents
  if is_zero(dz) and is_zero(dy) and is_zero(dtemp):
    return jnp.zeros_like(kl_qm)
  u, keep_u = scaled(z, temperature, masks)
  v, keep_v = scaled(y, temperature, masks)
  q = jnp.exp(u - mu) * inv_su
  p = jnp.exp(v - mv) * inv_sv
  a_q, a_p = _log_terms(u, mu, log_su, v, mv, log_sv, q, p, beta)
  # d/du = (1 - beta) q (log q - log m - KL(q || m)); d/dv likewise with p.
  g_u = (1.0 - beta) * q * (a_q - kl_qm)
  g_v = beta * p * (a_p - kl_pm)
  return logit_tangents(temperature, tangents, g_u, g_v, u, keep_u, v, keep_v)


def beta_tangent(dbeta, kl_qm, kl_pm):
  """The ``beta`` part of the JSD tangent per row: ``d/dbeta = KL(p || m) - KL(q || m)``."""
  return jnp.zeros_like(kl_qm) if is_zero(dbeta) else (kl_pm - kl_qm) * dbeta


def _jsd_kernel_jvp(primals, tangents):
  z, y, temperature, beta, masks = primals
  mu, su, mv, sv, kl_qm, kl_pm = map_rows(
    _jsd_stats(temperature, beta, masks), (z, y, *masks), z.shape[0]
  )
  jsd = beta * kl_pm + (1.0 - beta) * kl_qm
  _, inv_su, log_su = normalizer(su)
  _, inv_sv, log_sv = normalizer(sv)
  stats = (mu, mv, inv_su, log_su, inv_sv, log_sv)
  tangent = jsd_tangent(z, y, temperature, beta, masks, tangents[:3], stats, kl_qm, kl_pm)
  return nonnegative(jsd)[:, 0], (tangent + beta_tangent(tangents[3], kl_qm, kl_pm))[:, 0]


jsd_kernel.defjvp(_jsd_kernel_jvp, symbolic_zeros=True)
jsd_kernel = compiled(jsd_kernel)


def gjsd(kl, jsd, z, y, temperature, masks, beta, beta_static):
  """TRL's generalized JSD per row, endpoints included, from the kernels given.

  ``kl(z, y, t, masks)`` and ``jsd(z, y, t, beta, masks)`` are the KL and
  interior-JSD kernels (unsharded or vocabulary-parallel). ``beta == 0`` is
  ``KL(p || q)`` and ``beta == 1`` is ``KL(q || p)`` (TRL's special cases); a
  traced ``beta`` selects the branch at run time (outside ``[0, 1]`` the
  public functions make the result NaN with ``nan_unless``).
  """
  if beta_static:
    if beta == 0:
      return kl(z, y, temperature, masks)
    if beta == 1:
      return kl(y, z, temperature, masks)
    return jsd(z, y, temperature, jnp.asarray(beta, temperature.dtype), masks)
  b = jnp.asarray(beta).astype(temperature.dtype)
  index = jnp.where(b == 0, 0, jnp.where(b == 1, 1, 2))
  return lax.switch(
    index,
    [
      lambda z, y, t, b, m: kl(z, y, t, m),
      lambda z, y, t, b, m: kl(y, z, t, m),
      jsd,
    ],
    z,
    y,
    temperature,
    b,
    masks,
  )


def gjsd_kernel(z, y, temperature, masks, beta, beta_static):
  """TRL's generalized JSD per row, endpoints included (see :func:`gjsd`)."""
  if not beta_static:
    return _gjsd_traced(z, y, temperature, masks, beta)
  return gjsd(kl_kernel, jsd_kernel, z, y, temperature, masks, beta, beta_static)


@functools.partial(compiled, inline=False)
def _gjsd_traced(z, y, temperature, masks, beta):
  """:func:`gjsd` for a traced ``beta``: its ``lax.switch`` compiled once (:func:`compiled`)."""
  return gjsd(kl_kernel, jsd_kernel, z, y, temperature, masks, beta, False)


def _vocab_parallel():
  """The vocabulary-parallel kernels (imported late: that module imports this one)."""
  from kldiv_jax import _vocab_parallel

  return _vocab_parallel


def _per_example(name, logits, target_logits, temperature, axis, where, axis_name, run, valid=()):
  """The shared body of the per-example logit losses.

  Checks the temperature and ``axis_name``, lays the logits out as rows
  (:func:`prepare`) and returns ``run(rows, t)``, per row, in the output's
  shape and dtype; ``t`` is the temperature as a compute-dtype scalar. Empty
  inputs give zeros. The result is NaN unless a traced temperature is
  positive and finite and the other options' range tests ``valid`` hold.
  """
  temperature, _ = check_temperature(name, temperature)
  if axis_name is not None:
    _vocab_parallel().check_axis_name(name, axis_name)
  rows = prepare(name, ("logits", "target_logits"), logits, target_logits, axis, where)
  if rows.empty:
    out = jnp.zeros(rows.out_shape, rows.out_dtype)
  else:
    out = rows.finish(run(rows, jnp.asarray(temperature).astype(rows.cdt)))
  return nan_unless(out, positive_finite(temperature), *valid)


def kl_div_from_logits(
  logits: jax.typing.ArrayLike,
  target_logits: jax.typing.ArrayLike,
  *,
  temperature: float | jax.typing.ArrayLike = 1.0,
  direction: str = "forward",
  axis: Axis = -1,
  where: jax.typing.ArrayLike | None = None,
  axis_name: str | None = None,
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
      the same number of classes.
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

  def run(rows, t):
    z, y = (rows.z, rows.y) if direction == "forward" else (rows.y, rows.z)
    if axis_name is None:
      return kl_kernel(z, y, t, rows.masks)
    return _vocab_parallel().kl_kernel(axis_name, z, y, t, rows.masks)

  return _per_example(name, logits, target_logits, temperature, axis, where, axis_name, run)


def generalized_jsd(
  logits: jax.typing.ArrayLike,
  target_logits: jax.typing.ArrayLike,
  *,
  beta: float | jax.typing.ArrayLike = 0.5,
  temperature: float | jax.typing.ArrayLike = 1.0,
  axis: Axis = -1,
  where: jax.typing.ArrayLike | None = None,
  axis_name: str | None = None,
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
  beta, beta_static = check_unit_interval(name, "beta", beta)

  def run(rows, t):
    if axis_name is None:
      return gjsd_kernel(rows.z, rows.y, t, rows.masks, beta, beta_static)
    return _vocab_parallel().gjsd_kernel(
      axis_name, rows.z, rows.y, t, rows.masks, beta, beta_static
    )

  valid = (in_unit_interval(beta),)
  return _per_example(name, logits, target_logits, temperature, axis, where, axis_name, run, valid)
