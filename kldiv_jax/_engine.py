"""The divergence engine: any :mod:`kldiv_jax._divergences` formula over rows of logits.

One ``jax.custom_jvp`` kernel, :func:`divergence_rows`, for every divergence,
with or without a class axis split over a mesh axis (``axis_name``). For rows
``[rows, classes]`` of student logits ``z`` and teacher logits ``y``, with
``u = z / T``, ``v = y / T``, ``q = softmax(u)``, ``p = softmax(v)``:

1. per row and side, a ``stop_gradient`` max and the sum of exponentials
   (``lax.pmax``/``lax.psum`` when sharded: each device's sum is rescaled to
   the global max, so one pass over the data gives both);
2. per row, the sums over classes of the formula's ``f`` (the value) and,
   for the derivative rule, of ``a``, ``b`` and ``df/dtheta`` (``psum``-ed).
   A formula with a one-pass form (:class:`kldiv_jax._divergences.OnePass`:
   the KL family) gets these sums in the first pass, from unnormalised terms;
   off CPU that pass finds the maxes too (running maxes:
   :func:`kldiv_jax._online_kl.online_kl_sums`). Off CPU the others take both
   steps from :func:`kldiv_jax._whole_rows.row_sums`: two XLA passes, or on
   TPU one Pallas kernel over whole rows (the logits read once).

The rule then computes the derivatives per class, elementwise, from those
per-row statistics (no residual of the vocabulary's size):

.. math::

   \\frac{\\partial D}{\\partial u_j} = b_j - q_j \\sum_i b_i, \\qquad
   \\frac{\\partial D}{\\partial v_j} = a_j - p_j \\sum_i a_i, \\qquad
   \\frac{\\partial D}{\\partial \\theta} = \\sum_i \\frac{\\partial f_i}{\\partial \\theta},

contracts them with the tangents per row (``psum``-ed when sharded) and adds
the temperature's (``du/dT = -u/T``, :func:`kldiv_jax._rows.logit_tangents`).
Symbolic-zero tangents skip their sums: a teacher under ``stop_gradient`` and
a constant temperature cost nothing. The rule is plain JAX, so ``jvp``,
``jax.hessian`` and higher derivatives work. On CPU the passes run over blocks
of rows (:func:`kldiv_jax._platform.map_rows`); on one device both passes share a
block, and the per-row coefficients of the rule (:class:`Outcomes`) are computed
there too, so that the rule's elementwise pass only reads them.

Row conventions: the value is ``sum f`` clamped below at 0 by
:func:`kldiv_jax._numerics.nonnegative` (rounding never makes a divergence
negative), and exactly 0 with zero derivatives where the two rows are
identical after temperature and masks (a per-row flag: under ``jit`` XLA may
round the two sides' identical arithmetic differently; :func:`identical_rows`,
or for a one-pass formula its sums: equal maxes, sums of exponentials equal
to 8 ulps and every weighted log-ratio sum exactly 0). NaN, in the value and
every derivative, where a logit is NaN or ``+inf``; a traced temperature or
parameter out of range is the caller's to test (``nan_unless``, as
:func:`kldiv_jax._divergence_api.divergence_from_logits` does). On a row
whose value is ``+inf``, a derivative that is not finite there is 0 (forward
KL with student mass missing: finite gradient wrt the student, 0 wrt the
teacher). A row without mass on either side is 0 with zero gradients; where
one side is the zero measure, the value is the formula's at 0 (``KL(0 || q) =
0``) and its derivatives are those of that function (0 wrt ``q`` there).

Reusing the per-class math elsewhere: the chunked fused LM-head loss calls
:func:`divergence_rows` per chunk of logits; the distillation loss, with the
cross entropy of the same rows, :func:`kldiv_jax._divergence_ce.divergence_ce_rows`
(these statistics and this rule, one kernel); a path that has log-probabilities
already (top-k) calls the formula itself, ``FORMULAS[name].terms(
classes(log_p, log_q), params)``, and reduces as it needs.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._class_sums import (
  Needs,
  class_sums,
  class_terms,
  formula_params,
  identical_rows,
  norms,
  rule_grads,
)
from kldiv_jax._divergence_spec import Divergence
from kldiv_jax._divergences import FORMULAS, Norms
from kldiv_jax._gpu_grad import grad_tangent
from kldiv_jax._gpu_one_pass import one_pass_sums
from kldiv_jax._numerics import nonnegative
from kldiv_jax._online_ab import online_ab_sums
from kldiv_jax._online_kl import online_kl_sums
from kldiv_jax._platform import compiled, gpu_kernels_for, map_rows
from kldiv_jax._rows import absent, is_zero, logit_tangents, row_stats, scaled
from kldiv_jax._sums import class_sum
from kldiv_jax._vocab_parallel import combine, global_classes
from kldiv_jax._whole_rows import row_sums


class Outcomes(NamedTuple):
  """Per-row outcomes ``[rows, 1]``: the value and everything the derivative rule needs.

  Computed per block of rows with the statistics (:func:`statistics`), so
  that the elementwise pass of the rule reads them and XLA does not fuse
  their per-row arithmetic into it (once per class instead of once per row).
  """

  value: jax.Array  # sum f, never below 0; 0 on identical rows; NaN on invalid rows
  nan: jax.Array  # NaN on invalid rows, else 0: added to every derivative's coefficient
  mu: jax.Array
  inv_su: jax.Array
  log_su: jax.Array
  mv: jax.Array
  inv_sv: jax.Array
  log_sv: jax.Array
  a: tuple[jax.Array, ...]  # (zero, sum a) when the rule needs them, else ()
  b: tuple[jax.Array, ...]  # (zero, sum b) likewise
  params: tuple[jax.Array, ...]  # d value / d theta per needed parameter


def _row_sum_or_zero(total, same, infinite):
  """``(zero, total)``: a class sum, 0 on identical rows and where it is not finite on
  ``+inf`` rows."""
  zero = same | (infinite & ~jnp.isfinite(total))
  return zero, jnp.where(zero, 0.0, total)


def _outcomes(needs: Needs, mu, su, mv, sv, row_norms: Norms, same, sums) -> Outcomes:
  """The :class:`Outcomes` from a block's statistics: ``sum f`` and the sums ``needs`` names.

  The value is ``sum f`` clamped below at 0, 0 on identical rows, NaN on rows with a NaN
  or ``+inf`` logit (the options' range tests are the caller's: ``nan_unless``).
  """
  ok = jnp.isfinite(su) & jnp.isfinite(sv)
  # log(-1): a NaN only where one is meant to be (jax.debug_nans stays quiet elsewhere), in
  # the rows' dtype (two Python floats would make a weakly typed float64 under x64).
  nan = jnp.log(jnp.where(ok, 1.0, -1.0).astype(su.dtype))
  value = nonnegative(jnp.where(same, 0.0, sums[0])) + nan
  infinite = value == jnp.inf
  rest = iter(sums[1:])
  a = _row_sum_or_zero(next(rest), same, infinite) if needs.a else ()
  b = _row_sum_or_zero(next(rest), same, infinite) if needs.b else ()
  params = tuple(
    _row_sum_or_zero(next(rest), same, infinite)[1] + nan for need in needs.params if need
  )
  n = row_norms
  return Outcomes(value, nan, mu, n.inv_su, n.log_su, mv, n.inv_sv, n.log_sv, a, b, params)


def _per_block(fn, arrays, num_rows, num_classes=None, accel=None):
  """:func:`map_rows` of ``fn`` (and off CPU ``accel``) returning :class:`Outcomes`
  (flattened through the row loop and ``lax.platform_dependent``)."""
  tree = []

  def flat(fn):
    def run(*arrays):
      leaves, treedef = jax.tree.flatten(fn(*arrays))
      tree[:] = [treedef]
      return tuple(leaves)

    return run

  leaves = map_rows(flat(fn), arrays, num_rows, num_classes, None if accel is None else flat(accel))
  return jax.tree.unflatten(tree[0], leaves)


def _same_one_pass(mu, su, mv, sv, sums):
  """Equal rows, as the one-pass sums see them (no extra pass over the classes): equal
  maxes, sums of exponentials equal to rounding, and no weighted log-ratio left."""
  same = (mu == mv) & (jnp.abs(su - sv) <= 8 * jnp.finfo(su.dtype).eps * su)
  for g in sums:
    same = same & (g == 0)
  return same


def one_pass_outcomes(one_pass, needs, mu, su, mv, sv, sums) -> Outcomes:
  """The :class:`Outcomes` of a one-pass formula from its row statistics and sums."""
  same = _same_one_pass(mu, su, mv, sv, sums[: one_pass.checked])
  n = norms(su, sv)
  f, a, b, partials = one_pass.finish(sums, n)
  totals = [f, *([a] if needs.a else []), *([b] if needs.b else [])]
  totals += [d for d, need in zip(partials, needs.params) if need]
  return _outcomes(needs, mu, su, mv, sv, n, same, totals)


def _two_passes(formula, params, needs, temperature, caps, local, implementation):
  """``(cpu, accel)``: the row functions of the two-pass statistics on one device. Per block
  on CPU, the row statistics, then the class sums; off CPU, :func:`row_sums`: both sides'
  maxes and sums of exponentials in one pass (online softmax), then the class sums in a
  second one, the terms fused into them (no temporary), or on TPU one kernel over whole rows
  (unless ``implementation="xla"``; on GPUs the opt-in Triton kernels with ``"pallas"``)."""

  def cpu(z, y, *masks):
    u, v, (mu, su, mv, sv), eu, ev = local(z, y, *masks)
    same = identical_rows(u, v)
    c = class_terms(u, mu, su, v, mv, sv, eu, ev)
    sums = class_sums(formula, params, needs, c)
    return _outcomes(needs, mu, su, mv, sv, norms(su, sv), same, sums)

  def accel(z, y, *masks):
    mu, su, mv, sv, gap, *sums = row_sums(
      formula, params, needs, caps, z, y, temperature, masks, implementation
    )
    return _outcomes(needs, mu, su, mv, sv, norms(su, sv), gap == 0, sums)

  return cpu, accel


def _one_pass(one_pass, needs, temperature, caps, local, implementation):
  """``(cpu, accel)``: the row functions of a one-pass formula on one device. Per block on
  CPU, the sums of exponentials and the formula's unnormalised sums; off CPU the maxes in the
  same pass too (:func:`online_kl_sums`, :func:`online_ab_sums`), or ``None`` (the CPU's)."""
  cap_z, cap_y = caps
  outcomes = functools.partial(one_pass_outcomes, one_pass, needs)

  def cpu(z, y, *masks):
    u, v, (mu, su, mv, sv), eu, ev = local(z, y, *masks)
    terms = one_pass.terms(u - mu, v - mv, eu, ev)
    return outcomes(mu, su, mv, sv, tuple(class_sum(t) for t in terms))

  def accel(z, y, *masks):
    gpu = gpu_kernels_for(implementation)
    if gpu:
      # Opt-in (kldiv_jax._gpu_rows): on CUDA a Triton kernel, elsewhere the same XLA pass.
      kind = ("kl",) if one_pass.powers is None else ("ab", *one_pass.powers)
      mu, su, mv, sv, *sums = one_pass_sums(kind, caps, z, y, temperature, masks, gpu)
      if one_pass.powers is None:
        sums = [{"v": sums[0], "u": sums[1]}[k] for k in one_pass.kl_sums]
      return outcomes(mu, su, mv, sv, tuple(sums))
    u, _ = scaled(z, temperature, masks, cap_z)
    v, _ = scaled(y, temperature, masks, cap_y)
    if one_pass.powers is not None:
      mu, su, mv, sv, *sums = online_ab_sums(*one_pass.powers, u, v)
      return outcomes(mu, su, mv, sv, tuple(sums))
    mu, su, mv, sv, gv, gu = online_kl_sums(u, v)
    return outcomes(mu, su, mv, sv, tuple({"v": gv, "u": gu}[k] for k in one_pass.kl_sums))

  return cpu, accel if one_pass.kl_sums or one_pass.powers is not None else None


def statistics(
  formula, params, needs, z, y, temperature, masks, axis_name, caps, implementation="auto"
) -> Outcomes:
  cap_z, cap_y = caps

  def local(z, y, *masks):
    u, _ = scaled(z, temperature, masks, cap_z)
    v, _ = scaled(y, temperature, masks, cap_y)
    mu, eu, su = row_stats(u)
    mv, ev, sv = row_stats(v)
    return u, v, (mu, su, mv, sv), eu, ev

  if axis_name is None:
    one_pass = None if formula.one_pass is None else formula.one_pass(params)
    cpu, accel = _two_passes(formula, params, needs, temperature, caps, local, implementation)
    if one_pass is not None:
      one_cpu, accel = _one_pass(one_pass, needs, temperature, caps, local, implementation)
      cpu = one_cpu if one_pass.cpu else cpu
    return _per_block(cpu, (z, y, *masks), z.shape[0], accel=accel)

  rows, classes = z.shape
  num_classes = global_classes(classes, axis_name)

  def first(z, y, *masks):
    u, v, stats, _, _ = local(z, y, *masks)
    return (*stats, identical_rows(u, v))

  mu, su, mv, sv, same = map_rows(first, (z, y, *masks), rows, num_classes)
  mu, su = combine(mu, su, axis_name)
  mv, sv = combine(mv, sv, axis_name)
  same = lax.psum((~same).astype(jnp.int32), axis_name) == 0

  def sums(z, y, mu, su, mv, sv, *masks):
    u, _ = scaled(z, temperature, masks, cap_z)
    v, _ = scaled(y, temperature, masks, cap_y)
    return class_sums(formula, params, needs, class_terms(u, mu, su, v, mv, sv))

  out = lax.psum(map_rows(sums, (z, y, mu, su, mv, sv, *masks), rows, num_classes), axis_name)
  return _outcomes(needs, mu, su, mv, sv, norms(su, sv), same, out)


def row_norms(rows: Outcomes) -> tuple[jax.Array, ...]:
  """The rows' ``(mu, inv_su, log_su, mv, inv_sv, log_sv)``, as :func:`normalized` takes them."""
  return rows.mu, rows.inv_su, rows.log_su, rows.mv, rows.inv_sv, rows.log_sv


def tangent_rows(
  formula,
  params,
  z,
  y,
  temperature,
  masks,
  tangents,
  rows: Outcomes,
  axis_name,
  caps,
  implementation="auto",
):
  """The rule's tangent per row (``[rows, 1]``). Its elementwise pass over the logits (under
  ``grad``, the gradient wrt them) is XLA's, or with the opt-in GPU kernels on
  (``implementation``, :func:`gpu_kernels_for`) on one device, a Triton kernel in a program
  lowered for CUDA (:func:`kldiv_jax._gpu_grad.grad_tangent`; the temperature's tangent stays
  XLA's)."""
  dz, dy, dtemp, dparams = tangents
  out = jnp.zeros_like(rows.value)
  if rows.a or rows.b:
    local = jnp.zeros_like(out)
    gpu = gpu_kernels_for(implementation) if axis_name is None else False
    if gpu and not (is_zero(dz) and is_zero(dy)):
      dz, dy = (None if is_zero(d) else d for d in (dz, dy))
      local = grad_tangent(
        gpu, formula, params, caps, z, y, temperature, masks, row_norms(rows), rows.a,
        rows.b, rows.nan, dz, dy,
      )  # fmt: skip
      dz = dy = None
    if not all(absent(d) for d in (dz, dy, dtemp)):
      u, keep_u = scaled(z, temperature, masks, caps[0])
      v, keep_v = scaled(y, temperature, masks, caps[1])
      g_u, g_v = rule_grads(formula, params, u, v, row_norms(rows), rows.a, rows.b, rows.nan)
      g_u = jnp.zeros((), out.dtype) if g_u is None else g_u
      tangents = (dz, dy, dtemp)
      local = local + logit_tangents(temperature, tangents, g_u, g_v, u, keep_u, v, keep_v, caps)
    out = out + (local if axis_name is None else lax.psum(local, axis_name))
  partials = iter(rows.params)
  for d in dparams:
    if d is not None and not is_zero(d):
      out = out + next(partials) * d.astype(out.dtype)
  return out


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _kernel(key, axis_name, caps, impl, z, y, temperature, traced, masks):
  formula = FORMULAS[key[0]]
  params = formula_params(key, traced, temperature.dtype)
  rows = statistics(formula, params, Needs(), z, y, temperature, masks, axis_name, caps, impl)
  return rows.value[:, 0]


def tangent_needs(key, dz, dy, dtemp, dtraced):
  """The tangents per parameter (static ones, never differentiated, as ``None``) and which
  statistics the tangent needs, from the kernels' tangents."""
  dtraced = iter(dtraced)
  dparams = tuple(next(dtraced) if v is None else None for _, v in key[1])
  needs = Needs(
    a=not (is_zero(dy) and is_zero(dtemp)),
    b=not (is_zero(dz) and is_zero(dtemp)),
    params=tuple(d is not None and not is_zero(d) for d in dparams),
  )
  return dparams, needs


def _kernel_jvp(key, axis_name, caps, impl, primals, tangents):
  z, y, temperature, traced, masks = primals
  dz, dy, dtemp, dtraced, _ = tangents
  formula = FORMULAS[key[0]]
  params = formula_params(key, traced, temperature.dtype)
  dparams, needs = tangent_needs(key, dz, dy, dtemp, dtraced)
  rows = statistics(formula, params, needs, z, y, temperature, masks, axis_name, caps, impl)
  tangents = (dz, dy, dtemp, dparams)
  tangent = tangent_rows(
    formula, params, z, y, temperature, masks, tangents, rows, axis_name, caps, impl
  )
  return rows.value[:, 0], tangent[:, 0]


_kernel.defjvp(_kernel_jvp, symbolic_zeros=True)
_kernel = compiled(_kernel, static_argnums=(0, 1, 2, 3))


def divergence_rows(
  z: jax.Array,
  y: jax.Array,
  temperature: jax.Array,
  masks: tuple[jax.Array, ...],
  divergence: Divergence,
  axis_name: str | None = None,
  caps: tuple[float | None, float | None] = (None, None),
  implementation: str = "auto",
) -> jax.Array:
  """``D(softmax(y/T), softmax(z/T))`` per row of ``[rows, classes]`` logits (``[rows]``).

  ``z`` are the student's logits, ``y`` the teacher's (any float dtype: the
  computation runs in ``temperature``'s dtype, at least float32);
  ``temperature`` is a scalar; ``masks`` a tuple of boolean ``[rows or 1,
  classes or 1]`` arrays (masked classes leave both distributions);
  ``divergence`` a :class:`kldiv_jax._divergence_spec.Divergence`. With
  ``axis_name``, inside ``jax.shard_map``, the arrays hold this device's
  slice of the classes and the result is replicated over the axis. Compiled
  once per shapes and static arguments when called eagerly (``_platform.compiled``).
  ``caps``: the student's and the teacher's logit soft-caps (static floats, or
  ``None``), applied before the temperature. Not tested here: the temperature's
  and traced parameters' ranges (the caller applies ``nan_unless`` with
  ``positive_finite`` and ``divergence.valid()``). ``implementation``: ``"xla"``,
  ``"pallas"`` or ``"auto"`` (:mod:`kldiv_jax._implementation`, resolved by the caller).
  """
  key, traced = divergence.key, divergence.traced
  return _kernel(
    key, axis_name, tuple(caps), implementation, z, y, temperature, traced, tuple(masks)
  )
