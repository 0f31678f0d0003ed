"""A divergence and the cross entropy of the same student rows from one kernel.

:func:`divergence_ce_rows` is :func:`kldiv_jax._engine.divergence_rows` and
:func:`kldiv_jax._ce.ce_rows` (the hard-label term) in one ``jax.custom_jvp``,
without ``axis_name``: off CPU, for the KL family, the statistics of both come
from one pass over the logits (:func:`kldiv_jax._online_kl.online_kl_ce_sums`);
elsewhere each is computed as its own kernel computes it. The derivative rule
is the engine's (:func:`kldiv_jax._engine.tangent_rows`) plus the cross
entropy's gradient.
"""

import functools

import jax
import jax.numpy as jnp

from kldiv_jax._ce import (
  OFF,
  CEOptions,
  ce_finish,
  ce_stats,
  ce_tangent,
  smoothing_count,
  target_logits,
)
from kldiv_jax._checks import compute_dtype
from kldiv_jax._class_sums import Needs, formula_params
from kldiv_jax._divergence_spec import Divergence
from kldiv_jax._divergences import FORMULAS
from kldiv_jax._engine import (
  one_pass_outcomes,
  statistics,
  tangent_needs,
  tangent_rows,
)
from kldiv_jax._online_kl import online_kl_ce_sums
from kldiv_jax._platform import compiled, per_platform
from kldiv_jax._rows import absent, scaled


def _statistics_ce(formula, params, needs, z, y, temperature, masks, caps, labels, impl, opts):
  """``(Outcomes, (ce, m, inv_s))``: :func:`kldiv_jax._engine.statistics` and the cross entropy's
  (:func:`kldiv_jax._ce.ce_stats`, at temperature 1) of the same rows, one device. Off
  CPU, for a formula whose sums are KL sums, from one pass over both logits
  (:func:`online_kl_ce_sums`); elsewhere as the two kernels compute them."""
  cap_z, cap_y = caps

  def apart(z, y, labels, *masks):
    rows = statistics(formula, params, needs, z, y, temperature, masks, None, caps, impl)
    ce, (m, inv_s, _) = ce_stats(None, cap_z, z, labels, masks, opts)
    return rows, (ce, m, inv_s)

  one_pass = None if formula.one_pass is None else formula.one_pass(params)
  if one_pass is None or not one_pass.kl_sums:
    return apart(z, y, labels, *masks)

  def together(z, y, labels, *masks):
    u, _ = scaled(z, temperature, masks, cap_z)
    v, _ = scaled(y, temperature, masks, cap_y)
    w, _ = scaled(z, jnp.ones((), compute_dtype(z.dtype)), masks, cap_z)
    count = None if opts.label_smoothing is None else smoothing_count(masks, z.shape[1])
    picked = target_logits(w, labels, masks, opts, count)
    kl, (m, s, picked) = online_kl_ce_sums(u, v, w, picked)
    mu, su, mv, sv, gv, gu = kl
    sums = tuple({"v": gv, "u": gu}[k] for k in one_pass.kl_sums)
    rows = one_pass_outcomes(one_pass, needs, mu, su, mv, sv, sums)
    ce, (m, inv_s) = ce_finish(m, s, picked, opts)
    return rows, (ce, m, inv_s)

  return per_platform(apart, together, z, y, labels, *masks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _kernel_ce(key, caps, impl, z, y, temperature, traced, masks, labels, opts):
  formula = FORMULAS[key[0]]
  params = formula_params(key, traced, temperature.dtype)
  rows, (ce, _, _) = _statistics_ce(
    formula, params, Needs(), z, y, temperature, masks, caps, labels, impl, opts
  )
  return rows.value[:, 0], ce[:, 0]


def _kernel_ce_jvp(key, caps, impl, primals, tangents):
  z, y, temperature, traced, masks, labels, opts = primals
  dz, dy, dtemp, dtraced, _, _, dopts = tangents
  formula = FORMULAS[key[0]]
  params = formula_params(key, traced, temperature.dtype)
  dparams, needs = tangent_needs(key, dz, dy, dtemp, dtraced)
  rows, (ce, m, inv_s) = _statistics_ce(
    formula, params, needs, z, y, temperature, masks, caps, labels, impl, opts
  )
  tangent = tangent_rows(
    formula, params, z, y, temperature, masks, (dz, dy, dtemp, dparams), rows, None, caps
  )
  d_ce = jnp.zeros_like(ce)
  if not all(absent(x) for x in (dz, *dopts)):
    d_ce = ce_tangent(z, labels, masks, m, inv_s, caps[0], opts, (dz, dopts))
  return (rows.value[:, 0], ce[:, 0]), (tangent[:, 0], d_ce[:, 0])


_kernel_ce.defjvp(_kernel_ce_jvp, symbolic_zeros=True)
_kernel_ce = compiled(_kernel_ce, static_argnums=(0, 1, 2))


def divergence_ce_rows(
  z: jax.Array,
  y: jax.Array,
  temperature: jax.Array,
  masks: tuple[jax.Array, ...],
  divergence: Divergence,
  labels: jax.Array,
  caps: tuple[float | None, float | None] = (None, None),
  implementation: str = "auto",
  opts: CEOptions = OFF,
) -> tuple[jax.Array, jax.Array]:
  """``(divergence_rows(z, y, temperature, masks, divergence, caps=caps), ce_rows(z, labels,
  masks, cap=caps[0]))`` (values and derivatives) from one kernel, without ``axis_name``:
  off CPU the KL family's statistics and the cross entropy's come from one pass over the
  logits (:func:`_statistics_ce`). ``labels`` ``[rows, 1]`` int32 in range. ``implementation``
  as in :func:`kldiv_jax._engine.divergence_rows`; ``opts`` the cross entropy's
  (:class:`kldiv_jax._ce.CEOptions`)."""
  key, traced, impl = divergence.key, divergence.traced, implementation
  masks = tuple(masks)
  return _kernel_ce(key, tuple(caps), impl, z, y, temperature, traced, masks, labels, opts)
