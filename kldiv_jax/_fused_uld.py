"""ULD's top-k form from hidden states and LM heads, chunked over tokens.

:func:`fused_uld_loss_from_topk` is :func:`kldiv_jax.uld_loss_from_topk` of the logits
``hidden @ weight + bias`` (the student) and ``target_hidden @ target_weight + target_bias``
(the teacher, another vocabulary), run over ``chunk_size`` tokens at a time with the
machinery of the other fused losses (:mod:`kldiv_jax._fused_chunks`): no ``[tokens,
vocab]`` array exists, forward or backward.

Two passes over the tokens. The teacher's: each chunk's logits reduced to what the top-k
distance reads of the teacher, its ``k`` largest probabilities and its tail mass
(``[n, k]`` and ``[n]``, no gradient: the teacher is stopped, as in the other fused
distillation losses). The student's, a :func:`jax.custom_vjp`: for a scalar reduction
(:func:`weighted_distance`, each token's weight in it known) the gradients computed in the
forward pass, as ``_fused_distill``'s; for per-token outputs (:func:`student_distance`, as
:func:`kldiv_jax.fused_token_log_probs`) the forward pass keeps the distances and the
backward pass recomputes each chunk's logits. A chunk's gradient wrt its logits, with ``S`` the
``k`` entries ``a_i g_i`` at the student's top ids, ``g_i = sign(a_i - b_i) - sign(A - B)``
and ``c = sum_i a_i g_i`` is sparse plus rank one, ``dz = (S - c p) / T``; it is folded into
the gradients wrt ``hidden``, ``weight`` and ``bias`` (two matmuls,
:func:`kldiv_jax._fused_chunks.fold_logit_grad`). ``dz`` comes from autodiff of the one
rule, :func:`kldiv_jax._uld_topk.side_topk` and :func:`~kldiv_jax._uld_topk.topk_gap`,
on the chunk's logits: the per-row distance and its derivatives are those of
:func:`kldiv_jax.uld_loss_from_topk`, selection and ties included.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kldiv_jax._checks import check_softcap, compute_dtype, result_dtype
from kldiv_jax._fused_chunks import (
  check_chunk,
  check_linear,
  chunk_logits,
  chunks,
  fold_logit_grad,
  head_cotangents,
  low_dtype,
  per_platform,
  token_zero,
  vary_like_tokens,
  zero_cotangent,
  zero_head_grads,
)
from kldiv_jax._numerics import nan_unless, soft_cap
from kldiv_jax._platform import compiled
from kldiv_jax._tokens import token_mask
from kldiv_jax._uld import check_reduction, check_temperature_of, reduce_rows
from kldiv_jax._uld_topk import check_k, side_topk, topk_gap

# Logits per chunk and side on CPU (chunk_size=None): 2**25, 128 tokens at V = 151936. Each
# chunk re-reads the head; fewer tokens per chunk leave the matmuls bound by that read: at
# N=512, H=512, V=151936 (value_and_grad, against the materialised loss's time) 64 tokens
# (2**24, fused_policy_loss's) took 1.5x, 128 tokens 1.0x, 512 0.85x; the 2**22 of the other
# fused losses (16 tokens) 3.5x at N=256 (per-token path). GPUs and TPUs: their defaults.
CHUNK_ELEMENTS = 1 << 25


class UldKernel(NamedTuple):
  """The static part of one side's chunked pass (hashable)."""

  chunk: int
  k: int
  cap: float | None  # the side's soft-cap
  low: Any = None  # bf16/f16 inputs: the logits and their gradient in that dtype (chunk_logits)


def _logits(kernel: UldKernel, hc, w, b, acc, keep):
  """A chunk's logits ``hc @ w + b`` in ``acc``; the rows ``keep`` leaves out read zeros (a
  NaN there reaches neither the value nor a gradient)."""
  return chunk_logits(jnp.where(keep[:, None], hc, 0), w, b, acc, kernel.low)


def _top(kernel: UldKernel, z, t, keep):
  """``(top k [size, k], tail [size])`` of ``softmax(soft_cap(z) / t)``, the rows ``keep``
  leaves out selected away (0) before the softmax."""
  return side_topk(soft_cap(jnp.where(keep[:, None], z, 0.0), kernel.cap), t, kernel.k)


def teacher_topk(kernel: UldKernel, h, w, b, t, keep):
  """The teacher's ``(top k [n, k], tail [n])``, a chunk of tokens at a time."""
  acc, k = t.dtype, kernel.k
  zero = token_zero(h, keep).astype(acc)
  init = (jnp.zeros((h.shape[0], k), acc) + zero, jnp.zeros(h.shape[:1], acc) + zero)

  def part(start, size, cut, out):
    hc, keep_c = cut((h, keep))
    top, tail = _top(kernel, _logits(kernel, hc, w, b, acc, keep_c), t, keep_c)
    return tuple(lax.dynamic_update_slice_in_dim(o, r, start, 0) for o, r in zip(out, (top, tail)))

  top, tail = chunks(h.shape[0], kernel.chunk, part, init)
  return lax.stop_gradient(top), lax.stop_gradient(tail)


teacher_topk = compiled(teacher_topk, static_argnums=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def student_distance(kernel: UldKernel, h, w, b, t, top_t, tail_t, keep):
  """The top-k distance per token ``[n]`` of the student's logits ``h @ w + b`` at
  temperature ``t`` against the teacher's ``(top_t, tail_t)``; the backward pass recomputes
  each chunk's logits. Gradients wrt ``h``, ``w`` and ``b``; zeros for the others."""
  return _student_fwd(kernel, h, w, b, t, top_t, tail_t, keep)[0]


def _student_fwd(kernel: UldKernel, h, w, b, t, top_t, tail_t, keep):
  acc = t.dtype
  out = jnp.zeros(h.shape[:1], acc) + token_zero(h, top_t, keep).astype(acc)

  def part(start, size, cut, out):
    hc, top_c, tail_c, keep_c = cut((h, top_t, tail_t, keep))
    z = _logits(kernel, hc, w, b, acc, keep_c)
    d = topk_gap(*_top(kernel, z, t, keep_c), top_c, tail_c)
    return lax.dynamic_update_slice_in_dim(out, d, start, 0)

  out = chunks(h.shape[0], kernel.chunk, part, out)
  return out, (h, w, b, t, top_t, tail_t, keep)


def _chunk_grad(kernel: UldKernel, hc, w, b, t, top_c, tail_c, keep_c, ct_c):
  """A chunk's distances ``[size]``, their gradient wrt its logits times the per-token
  cotangent ``ct_c`` (``[size, V]``: ``(S - c p) / T`` through autodiff of the rule) and
  the hidden states the logits read."""
  acc = t.dtype
  z = _logits(kernel, hc, w, b, acc, keep_c)
  rows = lambda z: topk_gap(*_top(kernel, z, t, keep_c), top_c, tail_c)  # noqa: E731
  d, vjp = jax.vjp(rows, z)
  # A NaN teacher row makes the row's gradient NaN, as its value: the derivative of
  # |a - NaN| alone would be finite.
  nan = jnp.any(jnp.isnan(top_c), axis=-1) | jnp.isnan(tail_c)
  ct_c = jnp.where(nan, jnp.nan, ct_c)
  (dz,) = vjp(jnp.where(keep_c, ct_c, 0.0).astype(acc))
  return d, dz, jnp.where(keep_c[:, None], hc, 0)  # as _logits read it: no NaN * 0 in grad_w


def _student_bwd(kernel: UldKernel, residuals, ct):
  h, w, b, t, top_t, tail_t, keep = residuals
  acc = t.dtype

  def part(start, size, cut, grads):
    hc, top_c, tail_c, keep_c, ct_c = cut((h, top_t, tail_t, keep, ct))
    _, dz, hc = _chunk_grad(kernel, hc, w, b, t, top_c, tail_c, keep_c, ct_c)
    return fold_logit_grad(grads, start, hc, w, dz, None, acc, kernel.low)

  grad_h, grad_w, grad_b = chunks(h.shape[0], kernel.chunk, part, zero_head_grads(h, w, acc))
  return (
    grad_h.astype(h.dtype),
    grad_w.astype(w.dtype),
    None if b is None else grad_b.astype(b.dtype),
    *(zero_cotangent(x) for x in (t, top_t, tail_t, keep)),
  )


student_distance.defvjp(_student_fwd, _student_bwd)
student_distance = compiled(student_distance, static_argnums=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def weighted_distance(kernel: UldKernel, h, w, b, t, top_t, tail_t, keep, weights):
  """``sum_r weights_r D_r`` (a scalar reduction's weights ``[n]``) of
  :func:`student_distance`'s distances, the gradients computed in the forward pass (as
  ``_fused_distill``'s): three matmuls per chunk, where a per-token output needs four."""
  return jnp.sum(weights * _student_fwd(kernel, h, w, b, t, top_t, tail_t, keep)[0])


def _weighted_fwd(kernel: UldKernel, h, w, b, t, top_t, tail_t, keep, weights):
  acc = t.dtype

  def part(start, size, cut, carry):
    total, grads = carry
    hc, top_c, tail_c, keep_c, ct_c = cut((h, top_t, tail_t, keep, weights))
    d, dz, hc = _chunk_grad(kernel, hc, w, b, t, top_c, tail_c, keep_c, ct_c)
    total = total + jnp.sum(ct_c * d)
    return total, fold_logit_grad(grads, start, hc, w, dz, None, acc, kernel.low)

  zero = token_zero(h, top_t, keep, weights).astype(acc)
  total, grads = chunks(h.shape[0], kernel.chunk, part, (zero, zero_head_grads(h, w, acc)))
  return total, (grads, (h, w, b, t, top_t, tail_t, keep, weights))


def _weighted_bwd(kernel: UldKernel, residuals, g):
  grads, (h, w, b, *operands) = residuals
  return head_cotangents(grads, g.astype(grads[0].dtype), h, w, b, operands)


weighted_distance.defvjp(_weighted_fwd, _weighted_bwd)
weighted_distance = compiled(weighted_distance, static_argnums=0)


def _teacher_rows(name, token_shape, hidden, weight, bias):
  """The teacher's ``(hidden [n, H_T], weight, bias, dtype)``, checked against the student's
  tokens."""
  dtype = check_linear(name, "teacher", hidden, weight, bias)
  if tuple(np.shape(hidden)[:-1]) != token_shape:
    raise ValueError(
      f"{name}: hidden [..., H] and target_hidden [..., H_T] must have the same tokens (one "
      f"row per aligned position); got {token_shape} and {tuple(np.shape(hidden)[:-1])}."
    )
  n = int(np.prod(token_shape, dtype=np.int64))
  h = jnp.asarray(hidden).reshape(n, np.shape(hidden)[-1])
  return h, jnp.asarray(weight), None if bias is None else jnp.asarray(bias), dtype


def fused_uld_loss_from_topk(
  hidden: jax.typing.ArrayLike,
  weight: jax.typing.ArrayLike,
  target_hidden: jax.typing.ArrayLike,
  target_weight: jax.typing.ArrayLike,
  *,
  k: int,
  bias: jax.typing.ArrayLike | None = None,
  target_bias: jax.typing.ArrayLike | None = None,
  student_temperature: float | jax.typing.ArrayLike = 1.0,
  teacher_temperature: float | jax.typing.ArrayLike = 1.0,
  softcap: float | None = None,
  target_softcap: float | None = None,
  where: jax.typing.ArrayLike | None = None,
  reduction: str = "mean",
  chunk_size: int | None = None,
  logits_dtype: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  r"""ULD's top-``k`` form from hidden states and LM heads of two vocabularies, chunked.

  :func:`uld_loss_from_topk` of the student's logits :math:`s = h W + b` (``V_s``
  classes) and the teacher's :math:`t = h_T W_T + b_T` (``V_t`` classes) in value and
  gradients, computed ``chunk_size`` tokens at a time: with :math:`a_1 \ge a_2 \ge \dots`
  the student's :math:`\mathrm{softmax}(s / T_s)` sorted, :math:`b_i` the teacher's and
  :math:`A`, :math:`B` their masses past rank :math:`k`,

  .. math::

     D_k = \sum_{i=1}^{k} |a_i - b_i| + |A - B|

  per token (its bound on ULD's distance: :func:`uld_loss_from_topk`). No ``[tokens,
  vocab]`` array exists, forward or backward: a pass over the teacher keeps its top ``k``
  and tail mass per token, then the student's pass computes the gradients as it goes
  (``reduction="none"``: the backward pass recomputes each chunk's logits;
  :doc:`/cross-tokenizer`). Reverse mode only;
  gradients wrt ``hidden``, ``weight`` and ``bias``, zeros for the teacher (stopped, as in
  :func:`fused_distillation_loss`) and the temperatures: :ref:`derivatives`. Ties: those of
  ``lax.top_k``, as :func:`uld_loss_from_topk` (at rank ``k`` the lower id is kept).

  Args:
    hidden, weight: the student's hidden states ``[..., H]`` and LM head ``[H, V_s]``.
    target_hidden, target_weight: the teacher's, ``[..., H_T]`` (the same tokens: one row per
      aligned position) and ``[H_T, V_t]``.
    k: the ranks compared one by one, a Python int ``>= 1``, as in :func:`uld_loss_from_topk`.
    bias, target_bias: optional biases ``[V_s]`` and ``[V_t]``.
    student_temperature, teacher_temperature: each side's softmax temperature.
    softcap, target_softcap: each side's logit soft-cap :math:`c \tanh(z / c)`, before the
      temperature (Gemma 2's ``final_logit_softcapping``), as in :func:`distillation_loss`.
    where: a token mask ``hidden.shape[:-1]``: masked tokens give 0 and are not counted.
    reduction: ``"mean"``, ``"sum"``, ``"none"`` or ``"sequence_mean"``, as in
      :func:`uld_loss`.
    chunk_size: tokens per chunk (``None``: a power of two per platform, per side).
    logits_dtype: bf16/f16 inputs: what each chunk's logits and their gradient are held in,
      as in :func:`fused_distillation_loss`.

  Returns:
    A scalar (``"none"``: per token, ``hidden.shape[:-1]``) in the promoted dtype.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kldiv_jax import fused_uld_loss_from_topk, uld_loss_from_topk
    >>> k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    >>> h, w = jax.random.normal(k1, (6, 4)), jax.random.normal(k2, (4, 10))
    >>> th, tw = jax.random.normal(k3, (6, 5)), jax.random.normal(k4, (5, 7))
    >>> fused = fused_uld_loss_from_topk(h, w, th, tw, k=3, chunk_size=4)
    >>> bool(jnp.allclose(fused, uld_loss_from_topk(h @ w, th @ tw, k=3)))
    True
  """
  name = "fused_uld_loss_from_topk"
  reduction = check_reduction(name, reduction)
  k = check_k(name, k)
  caps = (
    check_softcap(name, "softcap", softcap),
    check_softcap(name, "target_softcap", target_softcap),
  )
  s_dtype = check_linear(name, "student", hidden, weight, bias)
  token_shape = tuple(np.shape(hidden)[:-1])
  th, tw, tb, t_dtype = _teacher_rows(name, token_shape, target_hidden, target_weight, target_bias)
  vocab_s, vocab_t = np.shape(weight)[1], tw.shape[1]
  for what, v in (("weight", vocab_s), ("target_weight", vocab_t)):
    if v == 0:
      raise ValueError(f"{name}: {what} must have a vocabulary, [hidden, vocab >= 1]; got 0.")
  out_dtype = result_dtype(s_dtype, t_dtype)
  cdt = compute_dtype(out_dtype)
  ts, ok_s = check_temperature_of(name, "student_temperature", student_temperature)
  tt, ok_t = check_temperature_of(name, "teacher_temperature", teacher_temperature)
  n = th.shape[0]
  keep = token_mask(name, where, token_shape, n)[:, 0]
  lows = (low_dtype(name, s_dtype, logits_dtype), low_dtype(name, t_dtype, logits_dtype))
  check_chunk(name, chunk_size, n, vocab_s, CHUNK_ELEMENTS)  # a bad chunk_size fails early
  ts, tt = (jnp.asarray(x).astype(cdt) for x in (ts, tt))
  valid = keep.reshape(token_shape)
  if n == 0:
    loss = reduce_rows(jnp.zeros(token_shape, cdt), valid, reduction)
    return nan_unless(loss, ok_s, ok_t).astype(out_dtype)
  h = jnp.asarray(hidden).reshape(n, np.shape(hidden)[-1])

  def teacher(chunk):
    return teacher_topk(UldKernel(chunk, k, caps[1], lows[1]), th, tw, tb, tt, keep)

  top_t, tail_t = per_platform(chunk_size, name, n, vocab_t, teacher, CHUNK_ELEMENTS)
  w, b = vary_like_tokens(weight, bias, h, keep)
  if reduction == "none":  # a per-token output: its cotangent comes in the backward pass

    def student(chunk):
      kernel = UldKernel(chunk, k, caps[0], lows[0])
      return student_distance(kernel, h, w, b, ts, top_t, tail_t, keep)

    per_row = cast(jax.Array, per_platform(chunk_size, name, n, vocab_s, student, CHUNK_ELEMENTS))
    loss = reduce_rows(per_row.reshape(token_shape), valid, reduction)
  else:  # a scalar: the linear reduction's weights per token, gradients in the forward pass
    zeros = jnp.zeros(token_shape, cdt)
    weights = jax.grad(lambda r: reduce_rows(r, valid, reduction))(zeros).reshape(n)

    def scalar(chunk):
      kernel = UldKernel(chunk, k, caps[0], lows[0])
      return weighted_distance(kernel, h, w, b, ts, top_t, tail_t, keep, weights)

    loss = cast(jax.Array, per_platform(chunk_size, name, n, vocab_s, scalar, CHUNK_ELEMENTS))
  return nan_unless(loss, ok_s, ok_t).astype(out_dtype)
