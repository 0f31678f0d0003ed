"""Opt-in Pallas Triton kernels for NVIDIA GPUs: the fused LM-head chunk of
:func:`kldiv_jax.fused_topk_distillation_loss`, the student's logits only on chip.

The top-k loss reads the student's logits in two places (:func:`kldiv_jax._sparse.topk_student`):
at the teacher's ``k`` ids, ``z_{i_j}``, and through the log-sum-exp of the classes outside
them, the tail (:func:`kldiv_jax._sparse.tail_lse`); the rest, the divergence on ``k + 1``
classes with its tail bucket, floors and renormalisation, is ``[N, k]``-sized
(:func:`kldiv_jax._sparse.topk_divergence`). Here:

- the logits at the ids are the small product ``h . W[:, ids] (+ b[ids])`` in XLA (``N H k``
  flops, :func:`topk_logits`; its derivative XLA's, a scatter into ``dW``);
- the tail's log-sum-exp is a kernel (:func:`pallas_topk_head`, a ``jax.custom_vjp``): a grid
  over token blocks, each looping over vocabulary tiles (the logits ``h W + b`` of a
  ``[token block, vocabulary tile]`` by ``plgpu.dot`` into registers, as
  :mod:`kldiv_jax._gpu_fused_head`'s kernels), the tile's classes compared with the token's
  ``k`` ids (a loop over the slots) and the online max and sum of ``z / T`` over the others;
  with labels, the same pass keeps the cross entropy's sums at ``T = 1`` and the label's
  logit (:func:`kldiv_jax._gpu_distill_kernels.hard_tile`, the distillation kernels');
- its derivative, ``d tail / d z_v = w_v / T`` with ``w`` the tail's softmax (0 at the top-k's
  ids), through :mod:`kldiv_jax._gpu_head_kernels`' dh and dW kernels (or the atomic one,
  ``_gpu_fused_head.BACKWARD``) with this loss's view of the operands (:class:`TopkView`):
  per tile ``dz = g w / T``, ``g`` the tail's cotangent per token from XLA's autodiff of the
  ``k``-sized rule, plus the cross entropy's ``g_CE (softmax(z) - onehot)``
  (:func:`~kldiv_jax._gpu_distill_kernels.hard_grad`).

No divergence or derivative formula is written here: the per-row algebra is the top-k path's,
the tail's derivative :func:`kldiv_jax._sparse.tail_lse`'s rule. Matmuls of ``N H V`` size,
labels or not: one forward, three (atomic) or four (owned) backward; the XLA chunk loop takes
three. Compiled for an H100 without a
device (``benchmarks/bench_accel.py --targets h100 --cases fused_topk``: 16384 x 2048 x
131072 bf16, ``k = 64``, forward KL, no labels): temp 1.0 GiB with the owned backward, 1.1
GiB with the atomic one (the float32 ``dW``; the chunk loop's 1.4 GiB, the materialised
loss's 10.0 GiB); ptxas (sm_90a) at the token kernels' 64 x 128 x 64 blocks, 4 warps:
197-208 registers a thread, no spill (with labels, JSD and the bucket: 255, the limit, no
spill; 174-244 at 8 warps); the compute-bound model (the matmuls at the bf16 peak)
1.66x XLA's estimate of the materialised loss with the owned backward, 1.33x with the atomic
one: the kernels save memory, not time, until measured.

The numbers are the XLA path's conventions (:mod:`kldiv_jax._fused_distill`): bf16/f16 inputs
with the default ``logits_dtype`` round each logit to their dtype after the float32 matmul,
then add the bias in it; a masked token (``where``, ``ignore_index`` with labels) has no mass:
0, no gradient; ``-inf`` logits have no mass; NaN propagates. The teacher, the temperature and
the divergence's parameters get no gradient, nor do the parts of ``return_parts``.

**Where it runs** (:func:`takes`; XLA's chunk loop otherwise): ``implementation="pallas"``
(per call, :func:`kldiv_jax.set_implementation`, ``KLDIV_JAX_IMPLEMENTATION``) in a program
lowered for CUDA (CPU, TPU and ROCm keep XLA's), every divergence of the top-k path (static or
traced parameters), both tails, any temperature, ``where``, labels with ``alpha`` and
``ignore_index``, ``teacher_vocab_size``, with: ``hidden`` and ``weight`` of one dtype among
float32, bfloat16 and float16; at most :data:`MAX_SLOTS` top-k slots; the divergence term on;
no ``axis_name``, ``softcap``, ``label_smoothing`` or ``z_loss``. ``chunk_size`` is not read. **Opt-in, never run on
a GPU** (``benchmarks/README.md``): the default stays XLA's chunk loop until
``make bench-device`` times it (``bash benchmarks/gpu_check.sh``, its ``topk`` steps).
"""

import functools
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._divergence_spec import Divergence
from kldiv_jax._fused_chunks import zero_cotangent
from kldiv_jax._gpu_distill_kernels import NUM_HARD, _store, hard_grad, hard_init, hard_tile
from kldiv_jax._gpu_fused_distill import hard_rows, kernel_labels
from kldiv_jax._gpu_fused_head import _call, head_grads, head_kernel
from kldiv_jax._gpu_fused_head import takes as head_takes
from kldiv_jax._gpu_head_kernels import _Head, _loop
from kldiv_jax._gpu_rows import _tile_softmax
from kldiv_jax._numerics import max_shift
from kldiv_jax._rows import normalizer
from kldiv_jax._sparse import topk_divergence, topk_student
from kldiv_jax._whole_rows import _merge

# The most top-k slots the kernels take: each vocabulary tile compares its classes with the
# token's slots one at a time (k comparisons per logit, beside the matmul's 2 H flops).
MAX_SLOTS = 256
# Row statistics of the backward: the tail's max and log-sum (of z / T) and its coefficient.
NUM_STATS = 3


def takes(h, w, axis_name, cap, ce_opts, soft: bool, k: int) -> bool:
  """Whether the kernels take these operands and options (the module's list): ``h`` and ``w``
  of one dtype among float32, bfloat16 and float16, at most :data:`MAX_SLOTS` slots, the
  divergence term on, no ``axis_name``, soft-cap, label smoothing or z-loss."""
  return (
    soft
    and head_takes(h, w, axis_name)
    and cap is None
    and all(x is None for x in ce_opts)
    and k <= MAX_SLOTS
  )


class TopkView(NamedTuple):
  """The static part of the tail kernels besides the head's (hashable): how they open their
  operands (after the student's: the top-k ids ``[N, k]``, -1 in a slot without mass) and
  whether they add the cross entropy."""

  vocab: int  # the classes the student shares with the teacher (a longer head's never read)
  slots: int  # k
  labels: bool = False  # the hard-label cross entropy is on

  def open(self, cfg, shape, scalars_ref, h_ref, w_ref, refs, bias, num_stats=None):
    """``(head, stat_refs, the refs after them)``, as :meth:`_Head.open`: the bias if
    ``bias``, the labels, the mask, the top-k ids, then ``num_stats`` row statistics
    (default: the backward's)."""
    if num_stats is None:
      num_stats = NUM_STATS + NUM_HARD * self.labels
    b_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)
    head = _TailHead(cfg, shape, scalars_ref, h_ref, w_ref, b_ref, refs[0], refs[1])
    head.slots_ref, head.view = refs[2], self
    return head, refs[3 : 3 + num_stats], refs[3 + num_stats :]


class _TailHead(_Head):
  """The student's view (:class:`_Head`) restricted to the tail, and the loss's ``dz``. Its
  scalar (``self.temperature``, the first) is ``1 / T``, as :func:`tail_lse`'s ``scale``."""

  slots_ref: Any = None
  view: Any = None

  def tail(self, r0, c0, row_in):
    """``[bn, bv]`` bool: the tile's classes that none of the token's top-k ids hold."""
    cols = c0 + lax.broadcasted_iota(jnp.int32, (1, self.bv), 1)
    at = self.pl.ds(r0, self.bn)

    def slot(j, out):
      ids = self.plgpu.load(self.slots_ref.at[at, j], mask=row_in[:, 0], other=-1)
      return out & (cols != ids.reshape(self.bn, 1))

    return _loop(self.view.slots, slot, jnp.ones((self.bn, self.bv), jnp.bool_))

  def scaled_tail(self, r0, c0, row_in, kept):
    """``(col in range, z, x)``: the raw logits ``z`` and ``x = z * scale`` on the tail's
    classes, ``-inf`` elsewhere (:func:`kldiv_jax._sparse._scaled_tail`)."""
    col_in, z = self.logits(r0, c0, row_in, kept)
    return col_in, z, jnp.where(self.tail(r0, c0, row_in), z * self.temperature, -jnp.inf)

  def logit_grad(self, r0, c0, row_in, kept, ids, stats):
    """``(dz [bn, bv] float32, col in range)``: ``coef w`` with ``w = exp(x - m - log s)``
    the tail's softmax (0 outside it) and ``coef = g / T`` per token (tail_lse's rule), plus
    ``g_CE (softmax(z) - onehot)`` with labels."""
    m, log_s, coef = stats[:NUM_STATS]
    col_in, z, x = self.scaled_tail(r0, c0, row_in, kept)
    has = x != -jnp.inf
    dz = coef * jnp.where(has, jnp.exp(jnp.where(has, x - m, 0.0) - log_s), 0.0)
    if self.view.labels:
      dz = dz + hard_grad(self, c0, ids, z, stats[NUM_STATS:])
    return jnp.where(kept & col_in, dz, 0.0), col_in

  def needed(self, dz, stats):
    return None  # no gradient filter (SKIP_BELOW is the token kernels')


def _tail_kernel(cfg, shape, scalars_ref, h_ref, w_ref, *refs, bias, view: TopkView):
  """Per token of a block: the raw max and the sum of ``exp(x - max_shift(max))`` of its tail
  (online softmax); with labels the cross entropy's sums (:func:`hard_tile`)."""
  head, _, out_refs = view.open(cfg, shape, scalars_ref, h_ref, w_ref, refs, bias, 0)
  r0 = head.pl.program_id(0) * head.bn
  row_in, kept, ids = head.rows(r0)

  def tile(j, carry):
    c0 = j * head.bv
    _, z, x = head.scaled_tail(r0, c0, row_in, kept)
    m, s, _, _ = _tile_softmax(x)
    hard = hard_tile(head, c0, ids, z, carry[1]) if view.labels else ()
    return _merge(carry[0], (m, s)), hard

  none = jnp.full((head.bn, 1), -jnp.inf, jnp.float32)
  init = ((none, jnp.zeros((head.bn, 1), jnp.float32)), hard_init(head) if view.labels else ())
  tail, hard = _loop(-(-head.vocab // head.bv), tile, init)
  _store(head, r0, row_in, out_refs, (*tail, *hard))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def pallas_topk_head(cfg, view: TopkView, h, w, b, slots, labels, mask, ok, scale, shift):
  """``(tail [n, 1], ce [n])`` of the logits ``h @ w + b`` from the kernels: the tail's
  :func:`kldiv_jax._sparse.tail_lse` and, with ``view.labels``, the cross entropy at ``T = 1``
  (NaN unless ``ok``; else 0). ``slots [n, k]`` int32 (-1: no id), ``labels [n, 1]`` int32 in
  range or 0, ``mask [n, 1]``, ``scale = 1 / T`` and ``shift [n, 1]`` float32 (no gradient for
  either, nor for the temperature in the XLA path)."""
  return _head_fwd(cfg, view, h, w, b, slots, labels, mask, ok, scale, shift)[0]


def _head_fwd(cfg, view, h, w, b, slots, labels, mask, ok, scale, shift):
  n = h.shape[0]
  outs = _call(
    cfg, _tail_kernel, (-(-n // cfg.blocks[0]),), [(n,)] * (2 + NUM_HARD * view.labels), h, w,
    b, labels, scale, mask, extra=(slots,), view=view, vocab=view.vocab,
  )  # fmt: skip
  m, (has, _, log_s) = max_shift(outs[0]), normalizer(outs[1])
  lse = jnp.where(has, log_s + (m - shift[:, 0]), -jnp.inf)[:, None]
  ce, hard_stats = hard_rows(outs[2:], ok) if view.labels else (jnp.zeros_like(m), ())
  return (lse, ce), (h, w, b, slots, labels, mask, ok, scale, shift, (m, log_s, *hard_stats))


def _head_bwd(cfg, view, residuals, g):
  h, w, b, slots, labels, mask, ok, scale, shift, (m, log_s, *hard_stats) = residuals
  g_tail, g_ce = (x.astype(jnp.float32) for x in g)
  stats = (m, log_s, g_tail[:, 0] * scale)
  if view.labels:
    m1, inv_s, okf = hard_stats
    stats += (m1, inv_s, g_ce * okf)
  run = functools.partial(
    _call, cfg, h=h, w=w, b=b, ids=labels, temperature=scale, mask=mask, view=view,
    vocab=view.vocab, extra=(slots, *stats),
  )  # fmt: skip
  return (
    *head_grads(cfg, run, h, w, b, view.vocab),
    *(zero_cotangent(x) for x in (slots, labels, mask, ok)),
    jnp.zeros_like(scale),
    jnp.zeros_like(shift),
  )


pallas_topk_head.defvjp(_head_fwd, _head_bwd)


def topk_logits(h, w, b, ids, low):
  """The student's logits at the top-k ids, ``h . W[:, ids] (+ b[ids])`` ``[n, k]`` in XLA, as
  :func:`kldiv_jax._fused_chunks.chunk_logits` rounds them (``rounded``: in ``low`` for
  bf16/f16 inputs)."""
  cols = jnp.take(w, ids, axis=1)  # [H, n, k]
  z = jnp.einsum("nh,hnk->nk", h, cols, preferred_element_type=jnp.float32)
  z = z if low is None else z.astype(low)
  return z if b is None else z + jnp.take(b, ids).astype(z.dtype)


def pallas_topk_totals(h, w, b, teacher, tokens, t, params, coefs, key, low, vocab, hard):
  """``(loss, soft, hard)`` of :func:`kldiv_jax._fused_distill._fused` for a top-k teacher
  (``ids``, ``lp``, ``keep``, ``dropped``, ``bucket``, ``floor``), differentiable wrt ``h``,
  ``w`` and ``b`` only: the logits at the ids and the ``k``-sized rule in XLA, the tail's
  log-sum-exp (and with ``hard`` the cross entropy) from the kernels, in one pass."""
  mask, labels, labelled = tokens
  t, params, coefs, lp = lax.stop_gradient((t, params, coefs, teacher.lp))
  n, k = teacher.ids.shape
  ids, ok = kernel_labels(labels, labelled, vocab, n, hard)
  cfg = head_kernel(n, h.shape[1], vocab, None, low)
  view = TopkView(vocab, k, hard)
  keep = teacher.keep & mask
  slots = jnp.where(keep, teacher.ids, -1).astype(jnp.int32)
  ce_rows = []  # the kernels' cross entropy per token, from the one call topk_student makes

  def log_tail(scale, shift):
    f32 = jnp.float32
    args = (h, w, b, slots, ids, mask, ok, scale.astype(f32), shift.astype(f32))
    # The cast restates pallas_topk_head's result, which the checker loses to jax.custom_vjp.
    out, rows = cast(tuple[jax.Array, jax.Array], pallas_topk_head(cfg, view, *args))
    ce_rows.append(rows)
    return out.astype(scale.dtype)

  log_q = topk_student(topk_logits(h, w, b, teacher.ids, low), keep, t, None, log_tail)
  spec = Divergence.tree_unflatten(key, params)
  rows = topk_divergence(log_q, lp, keep, teacher.dropped, t, spec, teacher.bucket, teacher.floor)
  soft = jnp.sum(rows)
  ce = jnp.sum(ce_rows[0]).astype(soft.dtype) if hard else jnp.zeros_like(soft)
  loss = coefs[0] * soft + coefs[1] * ce
  return loss, lax.stop_gradient(soft), lax.stop_gradient(ce)
