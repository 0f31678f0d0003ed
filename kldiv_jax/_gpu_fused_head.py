"""Opt-in Pallas Triton kernels for NVIDIA GPUs: the fused LM-head chunk of
:func:`kldiv_jax.fused_token_log_probs`, its logits only on chip.

Apple's Cut Cross-Entropy design (Wijmans et al. 2025, "Cut Your Losses in Large-Vocabulary
Language Models"): the logits ``z = h W + b`` of a ``[token block, vocabulary tile]`` are
computed by ``plgpu.dot`` into registers and reduced there; no ``[tokens, vocab]`` array and no
``[chunk, vocab]`` array is ever written to HBM, forward or backward. Three kernels:

- **forward**, a grid over token blocks, each looping over vocabulary tiles (each tile's
  logits a loop over hidden chunks, ``h[block, k] @ W[k, tile]`` accumulated in float32): an
  online log-sum-exp (Milakov & Gimelshein 2018) of ``x = (soft_cap(z) - m) / T`` with the
  centred sum ``sum e^x x`` of the entropy, and the label's logit; it writes four numbers per
  token ``[N]`` (the raw max ``m``, ``s = sum e^x``, ``sum e^x x``, ``z_y``), from which XLA
  forms ``log p_y`` and ``H`` exactly as :func:`kldiv_jax._tokens.token_stats` does;
- **dh**, a grid over token blocks looping over vocabulary tiles: the tile's logits
  recomputed, ``dz = (g_lp (onehot - p) - g_H p (log p + H)) / T`` (through the soft-cap's
  slope) on chip (:func:`kldiv_jax._tokens.class_derivatives`' formula), and
  ``dh[block] += dz W[:, tile]^T`` a hidden chunk at a time;
- **dW**, a grid over vocabulary tiles looping over token blocks: the same ``dz`` recomputed,
  ``dW[:, tile] += h[block]^T dz`` a hidden chunk at a time and ``db[tile] += sum dz``.

Each program owns the rows of ``dh`` (the columns of ``dW``) it adds to, so the sums are
deterministic (no atomics): the running sums live in the float32 outputs in HBM (an
``[H]``-wide accumulator does not fit a program's registers), read and written once per
vocabulary tile (token block), from L2 in practice, with a barrier between the tiles. This
backward recomputes the logits twice: five ``N H V`` matmuls in all, against the XLA chunk
loop's four. :data:`BACKWARD` ``= "atomic"`` has one backward kernel instead (CCE's, which
adds both gradients with atomics): per token block and vocabulary tile ``dz`` once, ``dh``
owned as above, ``dW`` and ``db`` by ``plgpu.atomic_add`` into zeroed float32 buffers padded
to whole blocks: four matmuls, the order of ``dW``'s sums left to the hardware (not
bit-reproducible run to run). CCE's skipping of tiles whose gradient is below rounding is
an option, off by default (:data:`SKIP_BELOW`): not exact (at ``2**-12`` on a peaked bf16
softmax in the tests' interpreter runs the gradient wrt ``hidden`` moved by 0.5% of its
largest entry, about one bf16 rounding, that wrt ``weight`` by 0.01%).

:func:`kldiv_jax.fused_policy_loss` (``_fused_policy.fused_token_loss``) runs through the same
kernels with ``implementation="pallas"``: the forward kernel's ``[N]`` statistics, the
per-token loss and its derivatives ``g_lp, g_H`` in XLA, then the backward kernels (the XLA
path's token-level losses take one pass of three matmuls a chunk, computing the gradient in
the forward; the kernels take two passes, four or five matmuls, with no logits in HBM).

The numbers are the XLA path's conventions (:mod:`kldiv_jax._fused_tokens`): bf16/f16 inputs
with the default ``logits_dtype`` round each logit to the inputs' dtype after the float32
matmul (then the bias, in that dtype) and feed ``dz`` to the backward matmuls in it; with
``logits_dtype=float32`` the logits stay float32 and ``dz`` enters the bf16 matmuls as two
terms ``hi + lo`` (:func:`kldiv_jax._fused_chunks.grad_operands`); float32 inputs use
float32 dots (Triton's TF32 on Hopper unless XLA's precision says otherwise, as JAX's own
float32 matmuls on GPUs). A masked token (``where``, ``ignore_index``) has no mass: 0 and
0, no gradient; the temperature gets a zero gradient; ``-inf`` logits (a ``-inf`` bias)
have no mass, NaN propagates (Triton's ``max`` skips a NaN that XLA's returns; the sums are
NaN either way).

**Where it runs** (:func:`takes`; XLA's chunk loop otherwise): ``implementation="pallas"``
(per call, or :func:`kldiv_jax.set_implementation`, ``KLDIV_JAX_IMPLEMENTATION``), in a
program lowered for CUDA (``lax.platform_dependent``: CPU, TPU and ROCm keep XLA's), with
``hidden`` and ``weight`` of one dtype among float32, bfloat16 and float16, no
``axis_name``. Any ``N``, ``H`` and ``V``: the blocks are powers of 2 (at least 16,
``plgpu.dot``'s minimum) and the ragged edges are masked loads (no padded copy: a column
past ``V`` is ``-inf``, a row past ``N`` is not stored, a hidden column past ``H`` is 0).
``chunk_size`` is not read (the kernels have blocks, not chunks). **Opt-in, never measured
on a GPU** (``benchmarks/README.md``): the default stays XLA's chunk loop until
``make bench-device`` times it (``bash benchmarks/gpu_check.sh``, its ``head`` steps).
Compiled for an H100 without a device (``bench_accel.py``, XLA's deviceless CUDA client), the
kernels' temp at 16384 x 2048 x 131072 bf16 is the float32 ``dW`` (1.0 GiB) against the
chunk loop's 1.1 GiB; XLA's cost analysis counts none of a Triton call's flops or bytes.
"""

import functools
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._numerics import in_kernel, max_shift, nonnegative, soft_cap
from kldiv_jax._rows import normalizer, times_slope

# Tokens per block, vocabulary columns per tile, hidden columns per matmul step (powers of 2,
# at least 16): a [64, 128] float32 logit tile is 64 registers a thread at 4 warps.
BLOCK_TOKENS = 64
BLOCK_VOCAB = 128
BLOCK_HIDDEN = 64
NUM_WARPS = 4
NUM_STAGES = 3
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Pallas' interpreter instead of Triton (the tests, on CPU); read at trace time.
INTERPRET = False
# The backward: "owned" (a dh kernel and a dW kernel, each program owning the rows or columns
# it adds to: deterministic, five N H V matmuls in all) or "atomic" (one kernel over token
# blocks: dz computed once per tile, dh owned, dW and db by atomic adds: four matmuls, CCE's
# design, the order of the dW sums not fixed). Read at trace time.
BACKWARDS = ("owned", "atomic")
BACKWARD = "owned"
# CCE's gradient filter, off (None) by default: a positive float skips the backward matmuls of
# a [token block, vocabulary tile] whose every |dz| is below it relative to its token's
# cotangents (|dz| / (|g_lp| + |g_H|), the scale of the softmax's own terms p and p log p);
# not exact (the skipped terms are dropped), so never on by default. Read at trace time.
SKIP_BELOW: float | None = None


class HeadKernel(NamedTuple):
  """The static part of the kernels (hashable)."""

  blocks: tuple[int, int, int]  # tokens, vocabulary, hidden
  cap: float | None  # the soft-cap
  low: Any = None  # bf16/f16 inputs' logits dtype (chunk_logits' ``low``), None for float32
  warps: int = NUM_WARPS
  stages: int = NUM_STAGES
  interpret: bool = False
  backward: str = "owned"  # BACKWARDS: two kernels (deterministic) or one with atomic dW
  skip: float | None = None  # SKIP_BELOW: tiles whose relative gradient is below it skipped


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def blocks(n: int, hidden: int, vocab: int, sizes=None) -> tuple[int, int, int]:
  """The blocks for ``[n, hidden] @ [hidden, vocab]``: ``sizes`` (default :data:`BLOCK_TOKENS`
  etc.) cut to the next power of 2 of each dimension, at least 16."""
  bn, bv, bk = sizes or (BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_HIDDEN)

  def fit(b: int, d: int) -> int:
    return max(16, min(b, _pow2(d)))

  return fit(bn, n), fit(bv, vocab), fit(bk, hidden)


def head_kernel(n: int, hidden: int, vocab: int, cap, low) -> HeadKernel:
  """The kernels' setting for ``[n, hidden] @ [hidden, vocab]``: the module's blocks, warps,
  stages and backward, read now (the tests and the benchmarks' sweeps set them)."""
  if BACKWARD not in BACKWARDS:
    raise ValueError(f"_gpu_fused_head.BACKWARD must be one of {BACKWARDS}; got {BACKWARD!r}.")
  return HeadKernel(
    blocks(n, hidden, vocab), cap, low, NUM_WARPS, NUM_STAGES, INTERPRET, BACKWARD, SKIP_BELOW
  )


def takes(h, w, axis_name) -> bool:
  """Whether the kernels take these operands: ``h [N, H]`` and ``w [H, V]`` of one dtype
  among float32, bfloat16 and float16 (float64 keeps XLA's), no ``axis_name``."""
  return axis_name is None and h.dtype == w.dtype and any(h.dtype == d for d in DTYPES)


# ---------------------------------------------------------------------------- in the kernels


class _Head:
  """A program's view of the head: its logit tiles ``soft_cap(h W + b)`` and their ``dz``."""

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


def _dh_kernel(cfg, shape, scalars_ref, h_ref, w_ref, *refs, bias):
  """``dh[block] = sum over tiles of dz W[:, tile]^T``, a hidden chunk at a time."""
  b_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)
  ids_ref, mask_ref, stat_refs, dh_ref = refs[0], refs[1], refs[2:7], refs[7]
  head = _Head(cfg, shape, scalars_ref, h_ref, w_ref, b_ref, ids_ref, mask_ref)
  pl, plgpu = head.pl, head.plgpu
  r0 = pl.program_id(0) * head.bn
  row_in, kept, ids = head.rows(r0)
  stats = _stats(head, r0, stat_refs)

  def out_at(k0):
    k_in = k0 + lax.broadcasted_iota(jnp.int32, (1, head.bk), 1) < head.hidden
    return dh_ref.at[pl.ds(r0, head.bn), pl.ds(k0, head.bk)], row_in & k_in

  def zero(k, _):
    ref, inside = out_at(k * head.bk)
    plgpu.store(ref, jnp.zeros((head.bn, head.bk), jnp.float32), mask=inside)
    return _

  _loop(head.k_steps(), zero, 0)
  head.barrier()

  def tile(j, _):
    c0 = j * head.bv
    dz, col_in = head.logit_grad(r0, c0, row_in, kept, ids, stats)
    parts = head.operands(dz)

    def step(k, _):
      k0 = k * head.bk
      w = head.w_chunk(k0, c0, col_in)
      add = _dots(plgpu, parts, lambda d: (d, w), trans_b=True)
      ref, inside = out_at(k0)
      plgpu.store(ref, plgpu.load(ref, mask=inside, other=0) + add, mask=inside)
      return _

    head.when(head.needed(dz, stats), lambda: _loop(head.k_steps(), step, 0))
    head.barrier()
    return _

  _loop(-(-head.vocab // head.bv), tile, 0)


def _dw_kernel(cfg, shape, scalars_ref, h_ref, w_ref, *refs, bias):
  """``dW[:, tile] = sum over token blocks of h[block]^T dz`` a hidden chunk at a time, and
  ``db[tile] = sum dz``."""
  b_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)
  ids_ref, mask_ref, stat_refs, dw_ref = refs[0], refs[1], refs[2:7], refs[7]
  db_ref = refs[8] if bias else None
  head = _Head(cfg, shape, scalars_ref, h_ref, w_ref, b_ref, ids_ref, mask_ref)
  pl, plgpu = head.pl, head.plgpu
  c0 = pl.program_id(0) * head.bv
  col_in = c0 + lax.broadcasted_iota(jnp.int32, (1, head.bv), 1) < head.vocab

  def out_at(k0):
    k_in = k0 + lax.broadcasted_iota(jnp.int32, (head.bk, 1), 0) < head.hidden
    return dw_ref.at[pl.ds(k0, head.bk), pl.ds(c0, head.bv)], k_in & col_in

  def zero(k, _):
    ref, inside = out_at(k * head.bk)
    plgpu.store(ref, jnp.zeros((head.bk, head.bv), jnp.float32), mask=inside)
    return _

  _loop(head.k_steps(), zero, 0)
  head.barrier()

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


def _atomic_kernel(cfg, shape, scalars_ref, h_ref, w_ref, *refs, bias):
  """One backward kernel over token blocks (``backward="atomic"``): per vocabulary tile,
  ``dz`` once; ``dh[block] += dz W[:, tile]^T`` (owned, as :func:`_dh_kernel`), and
  ``dW[:, tile] += h[block]^T dz``, ``db[tile] += sum dz`` by atomic adds into zeroed float32
  buffers padded to whole blocks (Pallas' interpreter takes no masked atomics: the values
  outside are 0 instead)."""
  b_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)
  ids_ref, mask_ref, stat_refs = refs[0], refs[1], refs[2:7]
  # refs[7 : 8 + bias]: the zero buffers aliased to the outputs dW (and db)
  dh_ref, dw_ref = refs[8 + bias], refs[9 + bias]
  db_ref = refs[10 + bias] if bias else None
  head = _Head(cfg, shape, scalars_ref, h_ref, w_ref, b_ref, ids_ref, mask_ref)
  pl, plgpu = head.pl, head.plgpu
  r0 = pl.program_id(0) * head.bn
  row_in, kept, ids = head.rows(r0)
  stats = _stats(head, r0, stat_refs)

  def dh_at(k0):
    k_in = k0 + lax.broadcasted_iota(jnp.int32, (1, head.bk), 1) < head.hidden
    return dh_ref.at[pl.ds(r0, head.bn), pl.ds(k0, head.bk)], row_in & k_in

  def zero(k, _):
    ref, inside = dh_at(k * head.bk)
    plgpu.store(ref, jnp.zeros((head.bn, head.bk), jnp.float32), mask=inside)
    return _

  _loop(head.k_steps(), zero, 0)
  head.barrier()

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
      a = head.h_chunk(r0, row_in, k0)  # 0 past N and H: so is its product
      add_w = _dots(plgpu, parts, lambda d: (a, d), trans_a=True)
      plgpu.atomic_add(dw_ref, (pl.ds(k0, head.bk), pl.ds(c0, head.bv)), add_w)
      return _

    head.when(head.needed(dz, stats), lambda: _loop(head.k_steps(), step, 0))
    head.barrier()
    if db_ref is not None:
      plgpu.atomic_add(db_ref, (pl.ds(c0, head.bv),), jnp.sum(dz, axis=0))
    return _

  _loop(-(-head.vocab // head.bv), tile, 0)


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


# ---------------------------------------------------------------------------- the calls


def _call(
  cfg: HeadKernel, kernel, grid, out_shapes, h, w, b, ids, temperature, mask, extra=(), zeros=()
):
  """``kernel`` over ``grid`` with every operand whole in HBM (``pl.no_block_spec``);
  ``zeros``: float32 zero buffers aliased to the last outputs (their shapes), after
  ``out_shapes``."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  shape = (h.shape[0], h.shape[1], w.shape[1])
  scalars = jnp.reshape(temperature, (1,)).astype(jnp.float32)
  operands = [scalars, h, w, *([] if b is None else [b])]
  operands += [ids[:, 0].astype(jnp.int32), mask[:, 0].astype(jnp.int32), *extra]
  first = len(operands)
  operands += [jnp.zeros(z, jnp.float32) for z in zeros]
  out_shapes = [*out_shapes, *zeros]
  aliases = {first + i: len(out_shapes) - len(zeros) + i for i in range(len(zeros))}
  body = functools.partial(kernel, cfg, shape, bias=b is not None)
  with warnings.catch_warnings():  # as _gpu_rows._lower: the backend's deprecation
    warnings.filterwarnings(
      "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
    )
    return pl.pallas_call(
      in_kernel(body),
      grid=grid,
      in_specs=[pl.no_block_spec for _ in operands],
      out_specs=[pl.no_block_spec for _ in out_shapes],
      out_shape=[jax.ShapeDtypeStruct(s, jnp.float32) for s in out_shapes],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.warps, num_stages=cfg.stages),
      input_output_aliases=aliases,
      interpret=cfg.interpret,
      name=f"kldiv_jax_gpu_head_{kernel.__name__.strip('_')}",
    )(*operands)


def _forward(cfg: HeadKernel, h, w, b, ids, temperature, mask):
  """``(log p_y, H, top, log s)`` per token ``[N]``: the forward kernel's sums, then
  :func:`kldiv_jax._tokens.token_stats`' closing formulas."""
  n = h.shape[0]
  m, s, centred, picked = _call(
    cfg, _forward_kernel, (-(-n // cfg.blocks[0]),), [(n,)] * 4, h, w, b, ids, temperature, mask
  )
  top = max_shift(m)
  has, inv_s, log_s = normalizer(s)
  keep = picked != -jnp.inf
  x_y = jnp.where(keep, jnp.where(keep, picked - top, 0.0) / temperature, -jnp.inf)
  log_p = jnp.where(has, x_y - log_s, 0.0)
  entropy = jnp.where(has, nonnegative(log_s - centred * inv_s), 0.0)
  return log_p, entropy, top, log_s


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def pallas_tokens(cfg: HeadKernel, h, w, b, ids, temperature, mask):
  """``(log p, H)`` per token ``[n]`` of the logits ``h @ w + b`` from the kernels; the
  arguments as :func:`kldiv_jax._fused_tokens.fused_tokens`' (``ids [n, 1]`` in range,
  ``mask [n, 1]``, ``temperature`` float32)."""
  return _forward(cfg, h, w, b, ids, temperature, mask)[:2]


def _pallas_tokens_fwd(cfg, h, w, b, ids, temperature, mask):
  log_p, entropy, top, log_s = _forward(cfg, h, w, b, ids, temperature, mask)
  return (log_p, entropy), (h, w, b, ids, temperature, mask, top, log_s, entropy)


def _pallas_tokens_bwd(cfg, residuals, g):
  from kldiv_jax._fused_chunks import zero_cotangent

  h, w, b, ids, temperature, mask, top, log_s, entropy = residuals
  g_lp, g_h = (x.astype(jnp.float32) for x in g)
  n, hidden, vocab = h.shape[0], h.shape[1], w.shape[1]
  stats = (top, log_s, entropy, g_lp, g_h)
  run = functools.partial(_call, cfg, h=h, w=w, b=b, ids=ids, temperature=temperature, mask=mask)
  token_blocks = (-(-n // cfg.blocks[0]),)
  if cfg.backward == "atomic":
    _, bv, bk = cfg.blocks
    padded = [(-(-hidden // bk) * bk, -(-vocab // bv) * bv)]
    padded += [] if b is None else [(padded[0][1],)]
    dh, dw, *db = run(_atomic_kernel, token_blocks, [(n, hidden)], extra=stats, zeros=padded)
    dw, db = dw[:hidden, :vocab], [x[:vocab] for x in db]
  else:
    (dh,) = run(_dh_kernel, token_blocks, [(n, hidden)], extra=stats)
    outs = [(hidden, vocab)] + ([] if b is None else [(vocab,)])
    dw, *db = run(_dw_kernel, (-(-vocab // cfg.blocks[1]),), outs, extra=stats)
  return (
    dh.astype(h.dtype),
    dw.astype(w.dtype),
    None if b is None else db[0].astype(b.dtype),
    zero_cotangent(ids),
    jnp.zeros_like(temperature),
    zero_cotangent(mask),
  )


pallas_tokens.defvjp(_pallas_tokens_fwd, _pallas_tokens_bwd)


def cuda_or_xla(cfg: HeadKernel, xla, h, w, b, ids, temperature, mask):
  """:func:`pallas_tokens` in a program lowered for CUDA, ``xla()`` (the chunk loop)
  elsewhere (``lax.platform_dependent``: lowering keeps the platform's own)."""
  out = lax.platform_dependent(
    cuda=lambda: pallas_tokens(cfg, h, w, b, ids, temperature, mask), default=xla
  )
  return jax.tree.map(lambda r: lax.convert_element_type(r, r.dtype), out)
