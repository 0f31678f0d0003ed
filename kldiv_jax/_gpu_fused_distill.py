"""Opt-in Pallas Triton kernels for NVIDIA GPUs: the fused LM-head chunk of
:func:`kldiv_jax.fused_distillation_loss`, both sides' logits only on chip.

Cut Cross-Entropy's design (:mod:`kldiv_jax._gpu_fused_head`, whose kernels' blocks, calls
and backward this reuses) for the distillation loss: the student's logits ``z = h W + b``
and the teacher's ``y = h_T W_T + b_T`` of a ``[token block, vocabulary tile]`` are computed
by ``plgpu.dot`` into registers (each a loop over hidden chunks, accumulated in float32) and
reduced there; no ``[tokens, vocab]`` or ``[chunk, vocab]`` array is written to HBM.

- **statistics**, a grid over token blocks, each looping over vocabulary tiles: the online
  max and sum of exponentials of both sides' ``u = z / T``, ``v = y / T`` (Milakov &
  Gimelshein 2018), the identical-rows gap (:func:`kldiv_jax._class_sums.identical_gap`),
  and with labels the max and sum of ``z`` at ``T = 1`` and the label's logit;
- **class sums**, the same grid, the tiles recomputed: the row sums of the divergence's
  ``f`` and ``b`` (the engine's :func:`~kldiv_jax._class_sums.summands` of
  :func:`~kldiv_jax._class_sums.normalized`, as :mod:`kldiv_jax._gpu_rows`' kernels), for
  every divergence alike (JSD, skew KL, TVD, alpha-beta need both normalisers first; the KL
  family's one-pass form is not used here: a second pass for it too);
- **backward**: :mod:`kldiv_jax._gpu_head_kernels`' dh and dW kernels (or the atomic one,
  ``_gpu_fused_head.BACKWARD``) with this loss's view of the operands
  (:class:`kldiv_jax._gpu_distill_kernels.DistillView`): per tile both sides' logits
  recomputed and ``dz = g_D (b - q sum b) / T + g_CE (softmax(z) - onehot)``, the engine's
  rule and the cross entropy's (:func:`kldiv_jax._rows.ce_grad`), their per-row
  coefficients from the forward's statistics in XLA (:func:`kldiv_jax._engine._outcomes`:
  0 on identical rows, NaN on rows with a NaN or ``+inf`` logit). The teacher gets no
  gradient, as in the XLA path (its logits under ``stop_gradient``; zeros for its operands).

Matmuls of ``N H V`` size (a teacher as wide as the student): the forward two (the
statistics kernel, both sides), four for a divergence without a one-pass form; the backward
six with the owned kernels (each recomputes both sides), four with the atomic one; against
four in all for the XLA chunk loop (the gradient folded in its one pass) and for the
materialised loss. Compiled for an H100 without a device (``benchmarks/bench_accel.py
--targets h100 --cases fused_distillation``) at 16384 x 2048 x 131072 bf16, forward KL with
labels: temp 1.0 GiB (the float32 ``dW``; the chunk loop's 1.6 GiB, the materialised
loss's 8.1 GiB); ptxas (sm_90a): 171-188 registers a thread at 256 threads, no spill; the
compute-bound model (the matmuls at the bf16 peak) 1.99x XLA's estimate of the materialised
loss with the owned backward (8), 1.49x with the atomic one (6): the kernels save memory,
and time only where the materialised loss is bound by its ``[N, V]`` traffic.

The numbers are the XLA path's conventions (:mod:`kldiv_jax._fused_distill`): bf16/f16
inputs with the default ``logits_dtype`` round each logit (both sides) to the student's
dtype after the float32 matmul, then add the bias in it; ``logits_dtype=float32`` keeps
them float32 (``dz`` enters the bf16 matmuls as two terms); a masked token (``where``,
``ignore_index`` with labels) has no mass: 0, no gradient; ``-inf`` logits (a ``-inf``
bias) have no mass; NaN propagates (the token's value, and the gradients it reaches).

**Where it runs** (:func:`takes`; XLA's chunk loop otherwise): ``implementation="pallas"``
(per call, :func:`kldiv_jax.set_implementation`, ``KLDIV_JAX_IMPLEMENTATION``) in a program
lowered for CUDA (CPU, TPU and ROCm keep XLA's), every ``divergence=`` of the engine
(static or traced parameters), any temperature, ``where``, labels with ``alpha`` and
``ignore_index``, ``teacher_vocab_size`` and heads of different widths, with: each side's
``hidden`` and ``weight`` of one dtype among float32, bfloat16 and float16; the divergence
term on (not a static ``alpha=0`` without ``return_parts``); no ``axis_name``, no
``softcap``/``target_softcap``, no ``label_smoothing``/``z_loss`` (each keeps the chunk
loop). ``chunk_size`` is not read. **Opt-in, never measured on a GPU**
(``benchmarks/README.md``): the default stays XLA's chunk loop until ``make bench-device``
times it (``bash benchmarks/gpu_check.sh``, its ``distill`` steps).
"""

import functools

import jax
import jax.numpy as jnp

from kldiv_jax._class_sums import formula_params, norms
from kldiv_jax._distill import safe_labels
from kldiv_jax._divergences import FORMULAS, OnePass
from kldiv_jax._engine import _outcomes, one_pass_outcomes
from kldiv_jax._fused_chunks import zero_cotangent
from kldiv_jax._gpu_distill_kernels import NEEDS, DistillView, _stats_kernel, _sums_kernel
from kldiv_jax._gpu_fused_head import DTYPES, _call, blocks, head_grads, head_kernel
from kldiv_jax._gpu_head_kernels import HeadKernel
from kldiv_jax._gpu_rows import _num_sums
from kldiv_jax._numerics import max_shift, nan_unless
from kldiv_jax._rows import normalizer

# Tokens per block, vocabulary columns per tile, hidden columns per matmul step (powers of 2,
# at least 16), warps, stages: a program holds both sides' [64, 64] float32 tiles and their
# terms. Compiled for an H100 (sm_90a, ptxas -v; benchmarks/bench_accel.py) at 2048 x 256 x
# 8192 bf16, forward KL and JSD: at 64 x 64 x 64, 8 warps, 159-197 registers a thread and no
# spill in any kernel; at the token kernels' 64 x 128 x 64, 4 warps, 255 registers and 80 B
# (dh) to 2.5 KB (statistics) spilled. Read at trace time (the tests set them).
BLOCK_TOKENS = 64
BLOCK_VOCAB = 64
BLOCK_HIDDEN = 64
NUM_WARPS = 8
NUM_STAGES = 3


def _one_dtype(h, w) -> bool:
  return h.dtype == w.dtype and any(h.dtype == d for d in DTYPES)


def takes(h, w, th, tw, axis_name, caps, ce_opts, soft: bool) -> bool:
  """Whether the kernels take these operands and options (:mod:`kldiv_jax._gpu_fused_distill`'s
  list): each side's hidden states and head of one dtype among float32, bfloat16 and
  float16, the divergence term on, no ``axis_name``, soft-cap, label smoothing or z-loss."""
  return (
    soft
    and axis_name is None
    and caps == (None, None)
    and all(x is None for x in ce_opts)
    and _one_dtype(h, w)
    and _one_dtype(th, tw)
  )


def distill_kernel(n, hidden, vocab, low, key, teacher_hidden, teacher_bias, labels, kind=None):
  """``(HeadKernel, DistillView)`` for ``[n, hidden] @ [hidden, vocab]`` (``vocab`` the shared
  classes) beside the teacher's ``[n, teacher_hidden] @ [teacher_hidden, vocab]``: this
  module's blocks, warps and stages, ``_gpu_fused_head``'s backward and interpreter switch,
  read now; no gradient filter."""
  sizes = (BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_HIDDEN)
  cfg = head_kernel(n, hidden, vocab, None, low)._replace(
    blocks=blocks(n, hidden, vocab, sizes), warps=NUM_WARPS, stages=NUM_STAGES, skip=None
  )
  teacher_block = blocks(n, teacher_hidden, vocab, sizes)
  view = DistillView(key, vocab, teacher_hidden, teacher_block[2], teacher_bias, labels, kind)
  return cfg, view


def _teacher(th, tw, tb):
  return (th, tw) if tb is None else (th, tw, tb)


def _one_pass(key, params) -> OnePass | None:
  """The divergence's one-pass form at ``params``, where the kernels take it (the engine's
  choice off CPU: the KL family's sums or alpha-beta's at static powers), else ``None``."""
  one_pass = FORMULAS[key[0]].one_pass
  form = None if one_pass is None else one_pass(formula_params(key, params, jnp.float32))
  if form is None or not (form.kl_sums or form.powers is not None):
    return None
  return form


def one_pass_kind(key, params):
  """The kernels' one-pass form (:func:`kldiv_jax._gpu_rows._one_pass_form`'s ``kind``) of
  the divergence ``key`` at ``params`` (its traced ones), or ``None`` (a second pass for its
  class sums)."""
  form = _one_pass(key, params)
  if form is None:
    return None
  return ("kl",) if form.powers is None else ("ab", *form.powers)


def _forward(cfg: HeadKernel, view: DistillView, h, w, b, th, tw, tb, labels, mask, ok, scalars):
  """``(soft [n], hard [n])`` per token and the backward's row statistics."""
  n = h.shape[0]
  teacher = _teacher(th, tw, tb)
  run = functools.partial(
    _call, cfg, h=h, w=w, b=b, ids=labels, temperature=scalars, mask=mask, view=view,
    vocab=view.vocab,
  )  # fmt: skip
  grid = (-(-n // cfg.blocks[0]),)
  num = 4 + (1 if view.kind is None else _num_sums(view.kind))
  outs = run(_stats_kernel, grid, [(n,)] * (num + 3 * view.labels), extra=teacher)
  mu, su, mv, sv, *sums = outs[:num]
  mu, mv = max_shift(mu), max_shift(mv)
  n_ = norms(su, sv)
  row_norms = (mu, n_.inv_su, n_.log_su, mv, n_.inv_sv, n_.log_sv)
  if view.kind is None:
    gap = sums[0]
    sums = run(_sums_kernel, grid, [(n,)] * NEEDS.num_sums(), extra=(*teacher, *row_norms))
    rows = _outcomes(NEEDS, mu, su, mv, sv, n_, gap == 0, tuple(sums))
  else:
    traced = sum(v is None for _, v in view.key[1])
    one_pass = _one_pass(view.key, [scalars[1 + i] for i in range(traced)])
    assert one_pass is not None  # view.kind is one_pass_kind's
    if one_pass.powers is None:
      sums = [{"v": sums[0], "u": sums[1]}[k] for k in one_pass.kl_sums]
    rows = one_pass_outcomes(one_pass, NEEDS, mu, su, mv, sv, tuple(sums))
  zero, total = rows.b
  soft_stats = (*row_norms, zero.astype(jnp.float32), total, rows.nan)
  if not view.labels:
    return rows.value, jnp.zeros_like(rows.value), (soft_stats, ())
  hard, hard_stats = hard_rows(outs[num:], ok)
  return rows.value, hard, (soft_stats, hard_stats)


def kernel_labels(labels, labelled, vocab, n, hard):
  """``(ids [n, 1] int32, ok [n])`` for the kernels: the labels made safe to index with
  (``_distill.safe_labels``) where the cross entropy is taken (``hard``), else zeros (no
  label read) and all rows ok."""
  if not hard:
    return jnp.zeros((n, 1), jnp.int32), jnp.ones((n,), jnp.bool_)
  return safe_labels(labels, labelled, vocab)


def hard_rows(sums, ok):
  """The cross entropy per token ``[n]`` from the kernels' sums ``(max, sum, label's logit)``
  (:func:`kldiv_jax._gpu_distill_kernels.hard_tile`'s), NaN unless ``ok``, and the backward's
  row statistics ``(max, 1/s, 1 or NaN)`` (the last times the cotangent:
  :func:`~kldiv_jax._gpu_distill_kernels.hard_grad`'s ``g_CE``)."""
  m, s, picked = sums
  m = max_shift(m)
  has, inv_s, log_s = normalizer(s)
  hard = nan_unless(jnp.where(has, log_s + m - picked, 0.0), ok)
  return hard, (m, inv_s, nan_unless(jnp.ones_like(m), ok))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def pallas_distill(cfg, view, h, w, b, th, tw, tb, labels, mask, ok, scalars, coefs):
  """``(loss, soft, hard)``, sums over the tokens as :func:`kldiv_jax._fused_distill._fused`'s
  (``loss = coefs[0] soft + coefs[1] hard``), from the kernels: ``labels [n, 1]`` int32 in
  range or 0 (``ok [n]``: not a labelled token out of range), ``mask [n, 1]``, ``scalars``
  float32 ``(T, *traced parameters)``, ``coefs`` float32 ``[2]``."""
  return _pallas_distill_fwd(cfg, view, h, w, b, th, tw, tb, labels, mask, ok, scalars, coefs)[0]


def _pallas_distill_fwd(cfg, view, h, w, b, th, tw, tb, labels, mask, ok, scalars, coefs):
  soft, hard, stats = _forward(cfg, view, h, w, b, th, tw, tb, labels, mask, ok, scalars)
  soft, hard = jnp.sum(soft), jnp.sum(hard)
  out = (coefs[0] * soft + coefs[1] * hard, soft, hard)
  return out, (h, w, b, th, tw, tb, labels, mask, ok, scalars, coefs, stats)


def _pallas_distill_bwd(cfg, view, residuals, g):
  h, w, b, th, tw, tb, labels, mask, ok, scalars, coefs, stats = residuals
  soft_stats, hard_stats = stats
  g = g[0].astype(jnp.float32)  # the parts (g[1], g[2]) carry no gradient, as the XLA path's
  ones = jnp.ones_like(soft_stats[0])
  row_stats = (*soft_stats, coefs[0] * g * ones)
  if view.labels:
    m, inv_s, okf = hard_stats
    row_stats += (m, inv_s, coefs[1] * g * okf)
  run = functools.partial(
    _call, cfg, h=h, w=w, b=b, ids=labels, temperature=scalars, mask=mask, view=view,
    vocab=view.vocab, extra=(*_teacher(th, tw, tb), *row_stats),
  )  # fmt: skip
  return (
    *head_grads(cfg, run, h, w, b, view.vocab),
    *(None if x is None else jnp.zeros_like(x) for x in (th, tw, tb)),
    zero_cotangent(labels),
    zero_cotangent(mask),
    zero_cotangent(ok),
    jnp.zeros_like(scalars),
    jnp.zeros_like(coefs),
  )


pallas_distill.defvjp(_pallas_distill_fwd, _pallas_distill_bwd)
