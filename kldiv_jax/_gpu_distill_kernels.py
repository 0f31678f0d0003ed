"""The kernels' bodies of :mod:`kldiv_jax._gpu_fused_distill` (Pallas Triton, traced inside
``pl.pallas_call``): a program's view of both LM heads (:class:`DistillView`,
:class:`_DistillHead`: the student's and the teacher's logit tiles, the loss's ``dz``), the
statistics kernel and the class-sums kernel. The backward runs through
:mod:`kldiv_jax._gpu_head_kernels`' dh, dW and atomic kernels with this view.

No divergence formula is written here: the per-class terms are the engine's
(:func:`kldiv_jax._class_sums.normalized`, :func:`~kldiv_jax._class_sums.summands`,
``FORMULAS[name].terms``), as in :mod:`kldiv_jax._gpu_rows`' kernels, and the derivative is
the engine's rule (:func:`kldiv_jax._class_sums.rule_grads`' ``b - q sum b``, through
:func:`kldiv_jax._rows.logit_tangents`' ``1 / T``) and the cross entropy's
(:func:`kldiv_jax._rows.ce_grad`'s ``softmax - onehot``), with the per-row coefficients
computed in XLA from the kernels' statistics.
"""

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from kldiv_jax._class_sums import Needs, identical_gap, normalized, rule_grads, summands
from kldiv_jax._divergences import FORMULAS
from kldiv_jax._gpu_head_kernels import _Head, _loop, _stats
from kldiv_jax._gpu_rows import _num_sums, _one_pass_form, _params, _row_sum, _tile_softmax
from kldiv_jax._rows import scaled
from kldiv_jax._whole_rows import _merge

# The class sums the kernels take: the value's and the student's derivative's (the teacher
# gets no gradient, as in the XLA path, where its logits are under stop_gradient).
NEEDS = Needs(b=True)
# Row statistics of the class-sums kernel: (mu, 1/su, log su, mv, 1/sv, log sv).
NUM_NORMS = 6
# Row statistics of the backward: the norms, (identical or no b, sum b, NaN, coefficient) of
# the divergence, and with labels (max, 1/s, coefficient) of the cross entropy at T = 1.
NUM_SOFT = NUM_NORMS + 4
NUM_HARD = 3


class DistillView(NamedTuple):
  """The static part of the distillation kernels besides the head's (hashable): how they
  open their operands (after the student's: the teacher's hidden states, head and bias) and
  what they compute."""

  key: tuple  # the divergence's Divergence.key
  vocab: int  # the classes both heads share (a longer head's others are never read)
  teacher_hidden: int
  teacher_block: int  # the teacher's hidden columns per matmul step
  teacher_bias: bool
  labels: bool  # the hard-label cross entropy is on
  kind: tuple | None = None  # the divergence's one-pass form (_gpu_rows.Kind), or None

  def open(self, cfg, shape, scalars_ref, h_ref, w_ref, refs, bias, num_stats=None):
    """``(head, stat_refs, the refs after them)``, as :meth:`_Head.open`: the student's bias
    if ``bias``, the labels, the mask, the teacher's ``h_T, W_T`` (and ``b_T``), then
    ``num_stats`` row statistics (default: the backward's)."""
    if num_stats is None:
      num_stats = NUM_SOFT + NUM_HARD * self.labels
    b_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)
    head = _DistillHead(cfg, shape, scalars_ref, h_ref, w_ref, b_ref, refs[0], refs[1])
    teacher, refs = refs[2:4], refs[4:]
    if self.teacher_bias:
      teacher, refs = (*teacher, refs[0]), refs[1:]
    head.attach(self, scalars_ref, *teacher)
    return head, refs[:num_stats], refs[num_stats:]


class _DistillHead(_Head):
  """The student's view (:class:`_Head`) with the teacher's logit tiles beside it, and the
  distillation loss's ``dz``."""

  def attach(self, view: DistillView, scalars_ref, th_ref, tw_ref, tb_ref=None):
    cfg = self.cfg._replace(blocks=(self.bn, self.bv, view.teacher_block))
    shape = (self.n, view.teacher_hidden, self.vocab)
    self.teacher = _Head(cfg, shape, scalars_ref, th_ref, tw_ref, tb_ref, None, None)
    self.view = view
    self.formula = FORMULAS[view.key[0]]
    self.params = _params(scalars_ref, tuple(v for _, v in view.key[1]))

  def both(self, r0, c0, row_in, kept):
    """``(col in range, z, u, v)`` of the tile at ``(r0, c0)``: the student's logits ``z``
    (float32, ``-inf`` past ``V`` and in masked rows), ``u = z / T`` and the teacher's
    ``v = y / T`` (:func:`kldiv_jax._rows.scaled`)."""
    col_in, z = self.logits(r0, c0, row_in, kept)
    _, y = self.teacher.logits(r0, c0, row_in, kept)
    u, _ = scaled(z, self.temperature, ())
    v, _ = scaled(y, self.temperature, ())
    return col_in, z, u, v

  def logit_grad(self, r0, c0, row_in, kept, ids, stats):
    """``(dz [bn, bv] float32, col in range)``: ``g_D (b - q sum b) / T`` (the engine's rule,
    0 on identical rows, NaN on invalid ones) plus ``g_CE (softmax(z) - onehot)``."""
    col_in, z, u, v = self.both(r0, c0, row_in, kept)
    norms, (zero, total, nan, g_soft) = stats[:NUM_NORMS], stats[NUM_NORMS:NUM_SOFT]
    g_u, _ = rule_grads(self.formula, self.params, u, v, norms, (), (zero != 0, total), nan)
    dz = g_soft * g_u / self.temperature
    if self.view.labels:
      dz = dz + hard_grad(self, c0, ids, z, stats[NUM_SOFT:])
    return jnp.where(kept & col_in, dz, 0.0), col_in

  def needed(self, dz, stats):
    return None  # no gradient filter (SKIP_BELOW is the token kernels')


# ------------------------------------------------ the cross entropy beside a loss (T = 1)


def _hit(head, c0, ids):
  return c0 + lax.broadcasted_iota(jnp.int32, (1, head.bv), 1) == ids


def hard_init(head):
  """The cross entropy's running ``(max, sum of exp(z - max_shift(max)), label's logit)``
  before the first tile."""
  zero = jnp.zeros((head.bn, 1), jnp.float32)
  return (jnp.full((head.bn, 1), -jnp.inf, jnp.float32), zero, zero)


def hard_tile(head, c0, ids, z, hard):
  """``hard`` (:func:`hard_init`'s) with the tile of raw logits ``z`` at column ``c0`` folded
  in (online softmax at ``T = 1``)."""
  m, s, _, _ = _tile_softmax(z)
  picked = hard[2] + _row_sum(jnp.where(_hit(head, c0, ids), z, 0.0))
  return (*_merge(hard[0:2], (m, s)), picked)


def hard_grad(head, c0, ids, z, stats):
  """``g_CE (softmax(z) - onehot)`` of a tile (:func:`kldiv_jax._rows.ce_grad`'s rule), given
  the row statistics ``(max, 1/s, g_CE)`` (:func:`kldiv_jax._gpu_fused_distill.hard_rows`)."""
  m, inv_s, g_ce = stats
  p = jnp.exp(z - m) * inv_s
  return g_ce * jnp.where(inv_s != 0, p - _hit(head, c0, ids).astype(jnp.float32), 0.0)


def _store(head, r0, row_in, out_refs, values):
  at = head.pl.ds(r0, head.bn)
  for ref, x in zip(out_refs, values):
    head.plgpu.store(ref.at[at], x.reshape(head.bn), mask=row_in[:, 0])


def _stats_kernel(cfg, shape, scalars_ref, h_ref, w_ref, *refs, bias, view: DistillView):
  """Per token of a block: both sides' raw maxes and sums of exponentials of ``u``, ``v``
  (online softmax), then the identical-rows gap, or with a one-pass form (``view.kind``) its
  sums (:func:`kldiv_jax._gpu_rows._one_pass_form`); with labels the max and sum of ``z``
  (``T = 1``) and the label's logit."""
  head, _, out_refs = view.open(cfg, shape, scalars_ref, h_ref, w_ref, refs, bias, 0)
  r0 = head.pl.program_id(0) * head.bn
  row_in, kept, ids = head.rows(r0)

  def tile(j, carry):
    soft, hard = carry
    c0 = j * head.bv
    _, z, u, v = head.both(r0, c0, row_in, kept)
    mu, su, u0, eu = _tile_softmax(u)
    mv, sv, v0, ev = _tile_softmax(v)
    if view.kind is not None:
      terms, combine, _, _ = _one_pass_form(view.kind)
      soft = combine(soft, (mu, su, mv, sv, *map(_row_sum, terms(u0, v0, eu, ev))))
    else:
      gap = soft[4] + _row_sum(identical_gap(u, v))
      soft = (*_merge(soft[0:2], (mu, su)), *_merge(soft[2:4], (mv, sv)), gap)
    if view.labels:
      hard = hard_tile(head, c0, ids, z, hard)
    return soft, hard

  none = jnp.full((head.bn, 1), -jnp.inf, jnp.float32)
  zero = jnp.zeros((head.bn, 1), jnp.float32)
  sums = 1 if view.kind is None else _num_sums(view.kind)
  init = ((none, zero, none, zero) + (zero,) * sums, hard_init(head) if view.labels else ())
  soft, hard = _loop(-(-head.vocab // head.bv), tile, init)
  _store(head, r0, row_in, out_refs, (*soft, *hard))


def _sums_kernel(cfg, shape, scalars_ref, h_ref, w_ref, *refs, bias, view: DistillView):
  """Per token of a block, given the row statistics ``(mu, 1/su, log su, mv, 1/sv, log
  sv)``: the row sums of the formula's ``f`` and ``b`` (:func:`summands`), the logits
  recomputed."""
  head, stat_refs, out_refs = view.open(
    cfg, shape, scalars_ref, h_ref, w_ref, refs, bias, NUM_NORMS
  )
  r0 = head.pl.program_id(0) * head.bn
  row_in, kept, _ = head.rows(r0)
  stats = _stats(head, r0, stat_refs)

  def tile(j, sums):
    _, _, u, v = head.both(r0, j * head.bv, row_in, kept)
    terms = summands(head.formula, head.params, NEEDS, normalized(u, v, *stats), False)
    return tuple(s + _row_sum(x) for s, x in zip(sums, terms))

  zero = jnp.zeros((head.bn, 1), jnp.float32)
  init = (zero,) * NEEDS.num_sums()
  _store(head, r0, row_in, out_refs, _loop(-(-head.vocab // head.bv), tile, init))
