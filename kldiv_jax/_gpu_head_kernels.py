"""The kernels' bodies of :mod:`kldiv_jax._gpu_fused_head` (Pallas Triton, traced inside
``pl.pallas_call``): a program's view of the LM head (:class:`_Head`: its logit tiles and
their gradient), the forward kernel, and the backward's dh, dW and one-kernel (atomic)
forms. Their layout, calls, derivative rule and routing are in :mod:`kldiv_jax._gpu_fused_head`.
"""

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from kldiv_jax._numerics import max_shift, soft_cap
from kldiv_jax._rows import times_slope


class HeadKernel(NamedTuple):
  """The static part of the kernels (hashable)."""

  blocks: tuple[int, int, int]  # tokens, vocabulary, hidden
  cap: float | None  # the soft-cap
  low: Any  # bf16/f16 inputs' logits dtype (chunk_logits' ``low``), None for float32
  warps: int
  stages: int
  interpret: bool  # Pallas' interpreter instead of Triton
  backward: str = "owned"  # BACKWARDS: two kernels (deterministic) or one with atomic dW
  skip: float | None = None  # SKIP_BELOW: tiles whose relative gradient is below it skipped


class _Head:
  """A program's view of the head: its logit tiles ``soft_cap(h W + b)`` and their ``dz``.

  The backward kernels open their operands through ``view.open`` (this class by default;
  :mod:`kldiv_jax._gpu_distill_kernels` gives the distillation loss's view, whose ``dz`` has
  other row statistics and a teacher's logits): :data:`NUM_STATS` row statistics after the
  ids and the mask."""

  NUM_STATS = 5  # (top, log s, H, g_lp, g_H)

  @classmethod
  def open(cls, cfg, shape, scalars_ref, h_ref, w_ref, refs, bias):
    """``(head, stat_refs, the refs after them)`` of a kernel's operands ``refs`` after
    ``h`` and ``w``: the bias if ``bias``, the ids, the mask, the row statistics."""
    b_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)
    head = cls(cfg, shape, scalars_ref, h_ref, w_ref, b_ref, refs[0], refs[1])
    return head, refs[2 : 2 + cls.NUM_STATS], refs[2 + cls.NUM_STATS :]

  def __init__(self, cfg: HeadKernel, shape, scalars_ref, h_ref, w_ref, b_ref, ids_ref, mask_ref):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    self.pl, self.plgpu, self.cfg = pl, plgpu, cfg
    self.n, self.hidden, self.vocab = shape
    self.bn, self.bv, self.bk = cfg.blocks
    self.h_ref, self.w_ref, self.b_ref = h_ref, w_ref, b_ref
    self.ids_ref, self.mask_ref = ids_ref, mask_ref
    self.temperature = scalars_ref[0]

  def rows(self, r0):
    """``(in range [bn, 1], kept [bn, 1], ids [bn, 1])`` of the token block at ``r0``."""
    pl, plgpu = self.pl, self.plgpu
    row_in = r0 + lax.broadcasted_iota(jnp.int32, (self.bn, 1), 0) < self.n
    at = pl.ds(r0, self.bn)
    keep = plgpu.load(self.mask_ref.at[at], mask=row_in[:, 0], other=0).reshape(self.bn, 1)
    ids = plgpu.load(self.ids_ref.at[at], mask=row_in[:, 0], other=-1).reshape(self.bn, 1)
    return row_in, row_in & (keep != 0), ids

  def k_steps(self):
    return -(-self.hidden // self.bk)

  def h_chunk(self, r0, row_in, k0):
    k_in = k0 + lax.broadcasted_iota(jnp.int32, (1, self.bk), 1) < self.hidden
    at = (self.pl.ds(r0, self.bn), self.pl.ds(k0, self.bk))
    return self.plgpu.load(self.h_ref.at[at], mask=row_in & k_in, other=0)

  def w_chunk(self, k0, c0, col_in):
    k_in = k0 + lax.broadcasted_iota(jnp.int32, (self.bk, 1), 0) < self.hidden
    at = (self.pl.ds(k0, self.bk), self.pl.ds(c0, self.bv))
    return self.plgpu.load(self.w_ref.at[at], mask=k_in & col_in, other=0)

  def logits(self, r0, c0, row_in, kept):
    """``(col in range [1, bv], soft_cap(z) [bn, bv], z's capped values)`` of the tile at
    ``(r0, c0)`` in float32; ``-inf`` past ``V`` and in masked rows."""
    cfg = self.cfg
    col_in = c0 + lax.broadcasted_iota(jnp.int32, (1, self.bv), 1) < self.vocab

    def step(k, acc):
      k0 = k * self.bk
      a, b = self.h_chunk(r0, row_in, k0), self.w_chunk(k0, c0, col_in)
      return acc + self.plgpu.dot(a, b)

    acc = _loop(self.k_steps(), step, jnp.zeros((self.bn, self.bv), jnp.float32))
    z = acc if cfg.low is None else acc.astype(cfg.low)
    if self.b_ref is not None:
      bias = self.plgpu.load(self.b_ref.at[self.pl.ds(c0, self.bv)], mask=col_in[0], other=0)
      z = z + bias.reshape(1, self.bv).astype(z.dtype)
    z = soft_cap(z.astype(jnp.float32), cfg.cap)
    return col_in, jnp.where(kept & col_in, z, -jnp.inf)

  def logit_grad(self, r0, c0, row_in, kept, ids, stats):
    """``(dz [bn, bv] float32, col in range)``: the tile's gradient wrt the raw logits,
    given the row statistics ``(top, log s, H, g_lp, g_H)`` (``[bn, 1]`` each)."""
    top, log_s, entropy, g_lp, g_h = stats
    col_in, zc = self.logits(r0, c0, row_in, kept)
    keep = zc != -jnp.inf
    x = jnp.where(keep, jnp.where(keep, zc - top, 0.0) / self.temperature, -jnp.inf)
    lp = jnp.where(keep, x - log_s, 0.0)
    p = jnp.where(keep, jnp.exp(lp), 0.0)
    hit = (c0 + lax.broadcasted_iota(jnp.int32, (1, self.bv), 1) == ids).astype(jnp.float32)
    du = g_lp * (hit - p) + g_h * (-p * (lp + entropy))
    dz = times_slope(du, zc, self.cfg.cap) / self.temperature
    return jnp.where(kept & col_in, dz, 0.0), col_in

  def needed(self, dz, stats):
    """Whether the tile's backward matmuls run (a traced bool): always without
    :data:`SKIP_BELOW`; with it, unless every ``|dz|`` is below it relative to its token's
    ``(|g_lp| + |g_H|) / T`` (a count of the others, so that a NaN counts: Triton's ``max``
    skips NaNs)."""
    if self.cfg.skip is None:
      return None
    scale = (jnp.abs(stats[3]) + jnp.abs(stats[4])) / self.temperature
    rel = jnp.abs(dz) / jnp.where(scale > 0, scale, 1.0)
    return jnp.sum(jnp.where(rel < self.cfg.skip, 0, 1)) > 0

  def when(self, needed, body):
    """``body()`` where ``needed`` (``None``: always)."""
    if needed is None:
      body()
      return

    @self.pl.when(needed)
    def _():
      body()

  def operands(self, dz):
    """``dz`` as the backward matmuls' operands (their products summed): as
    :func:`kldiv_jax._fused_chunks.grad_operands`."""
    if self.cfg.low is not None:
      return (dz.astype(self.cfg.low),)
    if self.h_ref.dtype == jnp.bfloat16:
      hi = dz.astype(jnp.bfloat16)
      return hi, (dz - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    return (dz.astype(self.h_ref.dtype),)

  def barrier(self):
    """The writes of a program's running sums seen by its next read (the threads that read an
    element need not be those that wrote it); the interpreter runs in order."""
    if not self.cfg.interpret:
      self.plgpu.debug_barrier()


def _forward_kernel(cfg, shape, scalars_ref, h_ref, w_ref, *refs, bias):
  """Per token of a block: the raw max ``m``, ``s = sum e^x``, ``sum e^x x`` and the label's
  capped logit, ``x = (soft_cap(z) - max_shift(m)) / T``."""
  b_ref, (ids_ref, mask_ref, *out_refs) = (refs[0], refs[1:]) if bias else (None, refs)
  head = _Head(cfg, shape, scalars_ref, h_ref, w_ref, b_ref, ids_ref, mask_ref)
  r0 = head.pl.program_id(0) * head.bn
  row_in, kept, ids = head.rows(r0)
  t = head.temperature

  def tile(j, carry):
    m, s, centred, picked = carry
    c0 = j * head.bv
    _, zc = head.logits(r0, c0, row_in, kept)
    new = jnp.maximum(m, jnp.max(zc, axis=1, keepdims=True))
    shift, new_shift = max_shift(m), max_shift(new)
    d = (shift - new_shift) / t  # <= 0: the old sums rescaled (online softmax)
    alpha = jnp.exp(d)
    keep = zc != -jnp.inf
    x = jnp.where(keep, (zc - new_shift) / t, 0.0)
    e = jnp.where(keep, jnp.exp(x), 0.0)
    hit = c0 + lax.broadcasted_iota(jnp.int32, (1, head.bv), 1) == ids
    s_new = s * alpha + jnp.sum(e, axis=1, keepdims=True)
    centred_new = (centred + d * s) * alpha + jnp.sum(e * x, axis=1, keepdims=True)
    picked = picked + jnp.sum(jnp.where(hit, zc, 0.0), axis=1, keepdims=True)
    return new, s_new, centred_new, picked

  zero = jnp.zeros((head.bn, 1), jnp.float32)
  init = (jnp.full((head.bn, 1), -jnp.inf, jnp.float32), zero, zero, zero)
  out = _loop(-(-head.vocab // head.bv), tile, init)
  for ref, x in zip(out_refs, out):
    head.plgpu.store(ref.at[head.pl.ds(r0, head.bn)], x.reshape(head.bn), mask=row_in[:, 0])


def _stats(head, r0, stat_refs):
  """The row statistics ``(top, log s, H, g_lp, g_H)`` of the token block at ``r0``."""
  row_in = r0 + lax.broadcasted_iota(jnp.int32, (head.bn,), 0) < head.n
  at = head.pl.ds(r0, head.bn)
  return tuple(
    head.plgpu.load(ref.at[at], mask=row_in, other=0).reshape(head.bn, 1) for ref in stat_refs
  )


def _zero_chunks(head, at, shape):
  """The program's float32 output block zeroed a hidden chunk at a time (``at(k0)``: the
  chunk's ``(ref, mask)``), then a barrier before the sums are added to it."""

  def zero(k, _):
    ref, inside = at(k * head.bk)
    head.plgpu.store(ref, jnp.zeros(shape, jnp.float32), mask=inside)
    return _

  _loop(head.k_steps(), zero, 0)
  head.barrier()


def _dh_pass(head, stat_refs, dh_ref, at_chunk=None, at_tile=None):
  """The program's block of rows of ``dh``: zeroed, then ``sum over tiles of dz W[:, tile]^T``
  added a hidden chunk at a time. The atomic backward's adds to dW and db, if given:
  ``at_chunk(parts, c0, k0, r0, row_in)`` at each hidden chunk of a tile, ``at_tile(dz, c0)``
  after the tile."""
  pl, plgpu = head.pl, head.plgpu
  r0 = pl.program_id(0) * head.bn
  row_in, kept, ids = head.rows(r0)
  stats = _stats(head, r0, stat_refs)

  def dh_at(k0):
    k_in = k0 + lax.broadcasted_iota(jnp.int32, (1, head.bk), 1) < head.hidden
    return dh_ref.at[pl.ds(r0, head.bn), pl.ds(k0, head.bk)], row_in & k_in

  _zero_chunks(head, dh_at, (head.bn, head.bk))

  def tile(j, _):
    c0 = j * head.bv
    dz, col_in = head.logit_grad(r0, c0, row_in, kept, ids, stats)
    parts = head.operands(dz)

    def step(k, _):
      k0 = k * head.bk
      w = head.w_chunk(k0, c0, col_in)
      ref, inside = dh_at(k0)
      add = _dots(plgpu, parts, lambda d: (d, w), trans_b=True)
      plgpu.store(ref, plgpu.load(ref, mask=inside, other=0) + add, mask=inside)
      if at_chunk is not None:
        at_chunk(parts, c0, k0, r0, row_in)
      return _

    head.when(head.needed(dz, stats), lambda: _loop(head.k_steps(), step, 0))
    head.barrier()
    if at_tile is not None:
      at_tile(dz, c0)
    return _

  _loop(-(-head.vocab // head.bv), tile, 0)


def _dh_kernel(cfg, shape, scalars_ref, h_ref, w_ref, *refs, bias, view=_Head):
  """``dh[block] = sum over tiles of dz W[:, tile]^T``, a hidden chunk at a time."""
  head, stat_refs, (dh_ref,) = view.open(cfg, shape, scalars_ref, h_ref, w_ref, refs, bias)
  _dh_pass(head, stat_refs, dh_ref)


def _dw_kernel(cfg, shape, scalars_ref, h_ref, w_ref, *refs, bias, view=_Head):
  """``dW[:, tile] = sum over token blocks of h[block]^T dz`` a hidden chunk at a time, and
  ``db[tile] = sum dz``."""
  head, stat_refs, outs = view.open(cfg, shape, scalars_ref, h_ref, w_ref, refs, bias)
  dw_ref, db_ref = outs[0], outs[1] if bias else None
  pl, plgpu = head.pl, head.plgpu
  c0 = pl.program_id(0) * head.bv
  col_in = c0 + lax.broadcasted_iota(jnp.int32, (1, head.bv), 1) < head.vocab

  def out_at(k0):
    k_in = k0 + lax.broadcasted_iota(jnp.int32, (head.bk, 1), 0) < head.hidden
    return dw_ref.at[pl.ds(k0, head.bk), pl.ds(c0, head.bv)], k_in & col_in

  _zero_chunks(head, out_at, (head.bk, head.bv))

  def block(i, db):
    r0 = i * head.bn
    row_in, kept, ids = head.rows(r0)
    stats = _stats(head, r0, stat_refs)
    dz, _ = head.logit_grad(r0, c0, row_in, kept, ids, stats)
    parts = head.operands(dz)

    def step(k, _):
      k0 = k * head.bk
      a = head.h_chunk(r0, row_in, k0)
      add = _dots(plgpu, parts, lambda d, a=a: (a, d), trans_a=True)
      ref, inside = out_at(k0)
      plgpu.store(ref, plgpu.load(ref, mask=inside, other=0) + add, mask=inside)
      return _

    head.when(head.needed(dz, stats), lambda: _loop(head.k_steps(), step, 0))
    head.barrier()
    return db + jnp.sum(dz, axis=0, keepdims=True)

  db = _loop(-(-head.n // head.bn), block, jnp.zeros((1, head.bv), jnp.float32))
  if db_ref is not None:
    plgpu.store(db_ref.at[pl.ds(c0, head.bv)], db.reshape(head.bv), mask=col_in[0])


def _atomic_kernel(cfg, shape, scalars_ref, h_ref, w_ref, *refs, bias, view=_Head):
  """One backward kernel over token blocks (``backward="atomic"``): per vocabulary tile,
  ``dz`` once; ``dh[block] += dz W[:, tile]^T`` (owned, as :func:`_dh_kernel`), and
  ``dW[:, tile] += h[block]^T dz``, ``db[tile] += sum dz`` by atomic adds into zeroed float32
  buffers padded to whole blocks (Pallas' interpreter takes no masked atomics: the values
  outside are 0 instead)."""
  head, stat_refs, outs = view.open(cfg, shape, scalars_ref, h_ref, w_ref, refs, bias)
  # outs[: 1 + bias]: the zero buffers aliased to the outputs dW (and db)
  dh_ref, dw_ref = outs[1 + bias], outs[2 + bias]
  db_ref = outs[3 + bias] if bias else None
  pl, plgpu = head.pl, head.plgpu

  def add_dw(parts, c0, k0, r0, row_in):
    a = head.h_chunk(r0, row_in, k0)  # 0 past N and H: so is its product
    add_w = _dots(plgpu, parts, lambda d: (a, d), trans_a=True)
    plgpu.atomic_add(dw_ref, (pl.ds(k0, head.bk), pl.ds(c0, head.bv)), add_w)

  def add_db(dz, c0):
    plgpu.atomic_add(db_ref, (pl.ds(c0, head.bv),), jnp.sum(dz, axis=0))

  _dh_pass(head, stat_refs, dh_ref, add_dw, add_db if db_ref is not None else None)


def _loop(upper, body, init):
  """``lax.fori_loop`` from 0 with int32 bounds (an int64 counter under ``jax_enable_x64``
  would meet the int32 program ids in an index)."""
  return lax.fori_loop(jnp.int32(0), jnp.int32(upper), body, init)


def _dots(plgpu, parts, operands, **transposes):
  """The sum of ``plgpu.dot(*operands(d))`` over the parts of ``dz``."""
  out = plgpu.dot(*operands(parts[0]), **transposes)
  for d in parts[1:]:
    out = out + plgpu.dot(*operands(d), **transposes)
  return out
