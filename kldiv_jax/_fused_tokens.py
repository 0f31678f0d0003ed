"""Sampled tokens' log-probabilities from hidden states and an LM head, chunked over tokens.

:func:`fused_token_log_probs` runs the token kernel (:func:`kldiv_jax._tokens.token_stats`)
over chunks of tokens (:mod:`kldiv_jax._fused_chunks`). The forward pass keeps, per token, the
log-probability, the entropy and two statistics (the row max and the log-normaliser); the
backward pass *recomputes* each chunk's logits from them and folds the chunk's gradient into
the gradients wrt ``hidden``, ``weight`` and ``bias`` (:func:`fold_token_grads`, shared with
the forward pass of the fused policy losses, ``_fused_policy``). Off CPU, with fewer tokens
than the head's columns, the backward pass runs over chunks of the head's columns instead,
every token at once (:func:`kldiv_jax._fused_chunks.by_columns`): no float32 ``[H, V]``
weight-gradient accumulator. Liger Kernel's fused linear
cross entropy is the same design. With ``implementation="pallas"``, a program lowered for CUDA
runs the opt-in Pallas Triton kernels of :mod:`kldiv_jax._gpu_fused_head` instead (no chunk's
logits in HBM), where they take the operands.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kldiv_jax._checks import check_bool, check_softcap, check_temperature, compute_dtype
from kldiv_jax._fused_chunks import (
  by_columns,
  check_chunk,
  check_linear,
  chunk_logits,
  chunks,
  column_width,
  fold_column_grad,
  fold_logit_grad,
  low_dtype,
  per_platform,
  token_zero,
  vary_like_tokens,
  zero_column_grads,
  zero_cotangent,
  zero_head_grads,
)
from kldiv_jax._gpu_fused_head import cuda_or_xla, head_kernel, pallas_tokens, takes
from kldiv_jax._implementation import resolve_implementation
from kldiv_jax._platform import compiled, gpu_kernels_for
from kldiv_jax._rows import times_slope
from kldiv_jax._tokens import class_derivatives, local_ids, token_layout, token_outputs, token_stats
from kldiv_jax._vocab_parallel import check_axis_name, global_classes


class TokenKernel(NamedTuple):
  """The static part of :func:`fused_tokens` (hashable): how its chunks run."""

  chunk: int
  axis_name: str | None
  cap: float | None  # the soft-cap
  low: Any = None  # bf16/f16 inputs: the logits and their gradient in that dtype (chunk_logits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_tokens(kernel: TokenKernel, h, w, b, ids, temperature, mask):
  """``(log p, H)`` per token ``[n]`` of the logits ``h @ w + b``, a chunk at a time; the
  backward pass recomputes each chunk's logits. ``ids`` in range, ``mask [n, 1]``."""
  return _fused_tokens_fwd(kernel, h, w, b, ids, temperature, mask)[0]


def _token_chunk(kernel: TokenKernel, hc, w, b, idc, temperature, mc, acc):
  """A chunk's ``(log p, H, row max, log s)`` per token, ``[size]`` each."""
  z = chunk_logits(hc, w, b, acc, kernel.low)
  stats = token_stats(kernel.axis_name, kernel.cap, z, idc, temperature, (mc,))
  log_p, entropy, (top, log_s, _) = stats
  return log_p, entropy, top[:, 0], log_s[:, 0]


def _fused_tokens_fwd(kernel: TokenKernel, h, w, b, ids, temperature, mask):
  n, acc = h.shape[0], temperature.dtype
  zero = token_zero(h, ids, mask).astype(acc)
  outs = tuple(lax.full_like(mask[:, 0], 0, acc) + zero for _ in range(4))

  def part(start, size, rows, outs):
    res = _token_chunk(kernel, rows(h), w, b, rows(ids), temperature, rows(mask), acc)
    return tuple(lax.dynamic_update_slice_in_dim(o, r, start, axis=0) for o, r in zip(outs, res))

  outs = chunks(n, kernel.chunk, part, outs)
  log_p, entropy, top, log_s = outs
  return (log_p, entropy), (h, w, b, ids, temperature, mask, top, log_s, entropy)


def _fused_tokens_bwd(kernel: TokenKernel, residuals, g):
  axis_name, low = kernel.axis_name, kernel.low
  h, w, b, ids, temperature, mask, top, log_s, entropy = residuals
  g_lp, g_h = g
  n, acc = h.shape[0], temperature.dtype
  local = local_ids(ids, axis_name, w.shape[1])

  def part(start, size, rows, carry):
    hc = rows(h)
    z = chunk_logits(hc, w, b, acc, low)
    stats = (rows(top)[:, None], rows(log_s)[:, None], rows(entropy))
    tokens = (rows(local), rows(mask), stats)
    return fold_token_grads(
      axis_name, kernel.cap, start, hc, w, z, tokens, temperature, rows(g_lp), rows(g_h), carry,
      low,
    )  # fmt: skip

  def over_tokens():  # the weight's gradient in its dtype, as over_columns gives it
    grad_h, grad_w, grad_b = chunks(n, kernel.chunk, part, zero_head_grads(h, w, acc))
    return grad_h, grad_w.astype(w.dtype), grad_b

  every_token = (top[:, None], log_s[:, None], entropy)  # the rows' statistics, all tokens

  def columns(start, size, cols, carry):
    wc, bc = cols(w), None if b is None else cols(b)
    z = chunk_logits(h, wc, bc, acc, low)
    tokens = (local - start, mask, every_token)
    dz = token_logit_grad(kernel.cap, z, tokens, temperature, g_lp, g_h)
    return fold_column_grad(carry, start, h, wc, dz, acc, low)

  def over_columns():
    width = column_width(kernel.chunk, n, w.shape[1])
    grad_h, grad_w, grad_b = chunks(w.shape[1], width, columns, zero_column_grads(h, w, acc), -1)
    return (grad_h if axis_name is None else lax.psum(grad_h, axis_name)), grad_w, grad_b

  if by_columns(n, w.shape[1]):
    grads = lax.platform_dependent(cpu=over_tokens, default=over_columns)
  else:
    grads = over_tokens()
  grad_h, grad_w, grad_b = grads
  return (
    grad_h.astype(h.dtype),
    grad_w.astype(w.dtype),
    None if b is None else grad_b.astype(b.dtype),
    zero_cotangent(ids),
    jnp.zeros_like(temperature),
    zero_cotangent(mask),
  )


def fold_token_grads(
  axis_name, cap, start, hc, w, z, tokens, temperature, g_lp, g_h, carry, grad_dtype=None
):
  """Folds a chunk's cotangents of ``(log p_y, H)`` per token into ``(grad_h, grad_w, grad_b)``.

  ``z`` are the chunk's logits ``hc @ w + b``, ``tokens = (local ids [size, 1], mask [size,
  1], (top, log s, H))`` from :func:`token_stats`; ``g_h`` may be ``None`` (no entropy).
  ``dz = g_lp (hit - p) + g_h dH/du`` through the soft-cap and the temperature
  (:func:`class_derivatives`), then :func:`kldiv_jax._fused_chunks.fold_logit_grad` (``dz``
  in ``grad_dtype`` for its matmuls when given). Shared by the backward pass of
  :func:`fused_token_log_probs` and the forward pass of the fused policy losses
  (``_fused_policy``).
  """
  dz = token_logit_grad(cap, z, tokens, temperature, g_lp, g_h)
  return fold_logit_grad(carry, start, hc, w, dz, axis_name, temperature.dtype, grad_dtype)


def token_logit_grad(cap, z, tokens, temperature, g_lp, g_h):
  """The gradient wrt logits ``z`` (a chunk of tokens, or of the head's columns for every
  token: ``tokens`` as in :func:`fold_token_grads`, the ids local to the chunk's columns) of
  the cotangents ``g_lp`` and ``g_h`` (``None``: no entropy) per token, in the temperature's
  dtype: ``dz = g_lp (hit - p) + g_h dH/du`` through the soft-cap and the temperature
  (:func:`class_derivatives`, elementwise given the rows' statistics)."""
  acc = temperature.dtype
  local, mask, stats = tokens
  d_lp, d_h, zc, _, _ = class_derivatives(z, local, temperature, (mask,), cap, stats)
  dz = d_lp * g_lp.astype(acc)[:, None]
  if g_h is not None:
    dz = dz + d_h * g_h.astype(acc)[:, None]
  return times_slope(dz, zc, cap) / temperature


fused_tokens.defvjp(_fused_tokens_fwd, _fused_tokens_bwd)
fused_tokens = compiled(fused_tokens, static_argnums=0)


def fused_token_log_probs(
  hidden: jax.typing.ArrayLike,
  weight: jax.typing.ArrayLike,
  token_ids: jax.typing.ArrayLike,
  *,
  bias: jax.typing.ArrayLike | None = None,
  temperature: float | jax.typing.ArrayLike = 1.0,
  softcap: float | None = None,
  where: jax.typing.ArrayLike | None = None,
  ignore_index: int | None = None,
  return_entropy: bool = False,
  chunk_size: int | None = None,
  axis_name: str | None = None,
  logits_dtype: jax.typing.DTypeLike | None = None,
  implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  r"""Sampled tokens' log-probabilities (and the entropy) from hidden states and an LM head.

  :func:`token_log_probs` of the logits :math:`z = h W + b`, computed
  ``chunk_size`` tokens at a time: no ``[tokens, vocab]`` array exists,
  forward or backward. The forward pass keeps two statistics per token; the
  backward pass recomputes each chunk's logits (:doc:`/rl`), on GPUs and TPUs
  with fewer tokens than classes over chunks of the head's columns (as many
  logits each), with no float32 ``[H, V]`` accumulator. Reverse mode
  only, ``temperature`` gets zero gradient: :ref:`derivatives`; ids:
  :doc:`/conventions`; ``axis_name``: :ref:`vocab-parallel`.

  Args:
    hidden, weight: hidden states ``[..., H]``, the LM head ``[H, V]``; ``bias``: ``[V]``.
    token_ids: the sampled token ids ``hidden.shape[:-1]``, aligned with ``hidden``
      (``token_ids[t]`` the token predicted from ``hidden[t]``, the next one for a causal LM:
      :func:`shift_labels`).
    temperature, softcap, where, ignore_index, return_entropy: as in :func:`token_log_probs`.
    chunk_size: tokens per chunk (``None``: a power of two per platform).
    axis_name: the mesh axis the V axis of ``weight`` and ``bias`` is split over.
    logits_dtype: bf16/f16 inputs: ``None`` (default) holds each chunk's logits and their
      gradient in the inputs' dtype, as the materialised ``hidden @ weight``; ``jnp.float32``
      keeps the matmuls' float32 results (the accuracy of float32 logits, at a cost:
      :ref:`fused-logits-dtype`), as in :func:`fused_distillation_loss`.
    implementation: ``"pallas"``: in a program lowered for CUDA, the opt-in Pallas Triton
      kernels (the logits of a block only on chip, Cut Cross-Entropy's design; never yet
      measured on a GPU) where they take the operands (hidden and weight of one dtype among
      float32, bf16, f16; no ``axis_name``), else the XLA chunk loop; ``"xla"``: the chunk
      loop; ``None`` (default): the process-wide default (:func:`set_implementation`), the
      chunk loop unless set.

  Returns:
    The log-probabilities ``hidden.shape[:-1]``; with ``return_entropy``, ``(lp, entropy)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kldiv_jax import fused_token_log_probs, token_log_probs
    >>> k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    >>> h, w = jax.random.normal(k1, (6, 4)), jax.random.normal(k2, (4, 10))
    >>> ids = jax.random.randint(k3, (6,), 0, 10)
    >>> fused = fused_token_log_probs(h, w, ids, temperature=0.7, chunk_size=4)
    >>> bool(jnp.allclose(fused, token_log_probs(h @ w, ids, temperature=0.7), atol=1e-6))
    True
  """
  name = "fused_token_log_probs"
  impl = resolve_implementation(name, implementation)
  out_dtype = check_linear(name, "student", hidden, weight, bias)
  temperature, _ = check_temperature(name, temperature)
  cap = check_softcap(name, "softcap", softcap)
  return_entropy = check_bool(name, "return_entropy", return_entropy)
  num_shards = 1 if axis_name is None else check_axis_name(name, axis_name)
  token_shape = tuple(np.shape(hidden)[:-1])
  vocab = np.shape(weight)[1]
  mask, in_range, safe = token_layout(
    name,
    token_ids,
    token_shape,
    "shape hidden.shape[:-1] =",
    where,
    ignore_index,
    global_classes(vocab, axis_name),
  )
  n = safe.shape[0]
  mask = jnp.ones((n, 1), jnp.bool_) if mask is None else mask
  t = jnp.asarray(temperature, compute_dtype(out_dtype))
  check_chunk(name, chunk_size, n, vocab * num_shards)  # a bad chunk_size fails early
  low = low_dtype(name, out_dtype, logits_dtype)
  if n == 0 or vocab == 0:  # every counted id is out of range (NaN)
    log_p = entropy = jnp.zeros(n, t.dtype)
  else:
    h = jnp.asarray(hidden).reshape(n, np.shape(hidden)[-1])
    w_arr, b_arr = vary_like_tokens(weight, bias, h, safe, mask)
    call = lambda chunk: fused_tokens(  # noqa: E731
      TokenKernel(chunk, axis_name, cap, low), h, w_arr, b_arr, safe, t, mask
    )
    xla = lambda: per_platform(chunk_size, name, n, vocab * num_shards, call)  # noqa: E731
    gpu = gpu_kernels_for(impl)
    if gpu and takes(h, w_arr, axis_name):
      cfg = head_kernel(n, h.shape[1], vocab, cap, low)
      t32 = t.astype(jnp.float32)
      out = cuda_or_xla(lambda: pallas_tokens(cfg, h, w_arr, b_arr, safe, t32, mask), xla)
    else:
      out = xla()
    log_p, entropy = cast(tuple[jax.Array, jax.Array], out)
  return token_outputs(
    log_p, entropy, in_range, mask, token_shape, out_dtype, temperature, return_entropy
  )
