"""Chunked fused-linear distillation loss: logits never materialised for all tokens.

The student's and the teacher's logits are ``hidden @ weight (+ bias)``; for
a 128k vocabulary they take gigabytes per side. Here the tokens are processed
``chunk_size`` at a time: each chunk's logits are computed, reduced to the
chunk's loss and its gradient wrt the student's logits, and that gradient is
folded straight into the gradients wrt ``hidden``, ``weight`` and ``bias``
(the approach of Liger Kernel's fused-linear losses). The forward pass thus
computes the gradients too, and the backward pass only scales them by the
cotangent: no recomputation, and memory of one chunk's logits plus the
gradients themselves.
"""

import functools
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kldiv_jax._checks import (
  check_bool,
  check_choice,
  check_float,
  check_ids,
  check_int,
  check_normalizer,
  check_softcap,
  check_temperature,
  check_unit_interval,
  compute_dtype,
  index_array,
  teacher_classes,
)
from kldiv_jax._distill import (
  DistillationParts,
  LossWeights,
  check_labels,
  hard_rows,
  loss_divergence,
  loss_weights,
)
from kldiv_jax._divergence_api import Divergence, check_softcaps
from kldiv_jax._engine import divergence_rows
from kldiv_jax._numerics import in_unit_interval, nan_unless, positive_finite
from kldiv_jax._rows import compiled, shared_classes, times_slope
from kldiv_jax._sparse import topk_rows
from kldiv_jax._tokens import (
  class_derivatives,
  local_ids,
  token_layout,
  token_mask,
  token_outputs,
  token_stats,
)
from kldiv_jax._topk import TAILS, TOPK_PADDING, topk_teacher
from kldiv_jax._vocab_parallel import (
  VOCAB_PARALLEL_PADDING,
  check_axis_name,
  global_classes,
)

# Logit elements per chunk and side when chunk_size=None on CPU (16 MiB of float32).
_CHUNK_ELEMENTS = 1 << 22
# On TPUs (chunk_size=None): about 2**27 logits per chunk (512 MiB of float32 per [chunk,
# vocab] array), at most 4096 tokens. Each chunk reads both heads and reads and writes the
# float32 weight gradient: ~14 bytes per head element for 8 C H V flops (four [C, H] x
# [H, V] matmuls), C / 1.75 flops per byte, against a chip balance of ~240 (TPU v5e) to
# ~300 (H100) flops per byte. 1024 tokens at V = 131072 keeps the matmuls compute-bound;
# 32 (the CPU default there) left them bound by weight bandwidth.
_ACCEL_CHUNK_ELEMENTS = 1 << 27
# On GPUs: twice that (2048 tokens at V = 131072). XLA:GPU writes each chunk's float32
# logits and their gradient to HBM between its fusions (~13 passes over a [chunk, vocab]
# float32 array per chunk, the matmuls' epilogues not fused): at 1024 tokens that traffic
# plus the heads' made an H100 chunk bandwidth-bound (1.6x the materialised loss, XLA's
# estimate), at 2048 it is 1.1x, with 3.1 GiB of temporaries against the 80 GiB.
_GPU_CHUNK_ELEMENTS = 1 << 28
_ACCEL_MAX_CHUNK = 4096
# The name scope of a fused call's chunk loop, followed by its chunk (``..._1024``): it marks
# the chunking in a lowered module.
FUSED_CHUNK_SCOPE = "kldiv_jax_fused_chunk_"
# CPU: vocabulary columns per block of the weight-gradient update.
_GRAD_W_BLOCK = 4096
# The name scope of a chunk's weight-gradient update, followed by how it is done: the block
# width (``..._4096``, CPU) or ``whole`` (GPU and TPU): it marks the choice in a lowered module.
FUSED_GRAD_W_SCOPE = "kldiv_jax_fused_grad_w_"


def _power_of_two_chunk(elements: int, num_tokens: int, vocab_size: int, cap: int) -> int:
  size = max(1, min(cap, elements // max(vocab_size, 1)))
  size = 1 << (size.bit_length() - 1)
  return max(1, min(size, num_tokens))


def default_chunk_size(num_tokens: int, vocab_size: int, elements: int = _CHUNK_ELEMENTS) -> int:
  """CPU: a power of two near ``elements / vocab_size`` tokens (``2**22`` elements unless
  given), within ``[1, num_tokens]``."""
  return _power_of_two_chunk(elements, num_tokens, vocab_size, num_tokens)


def platform_chunk_size(num_tokens: int, vocab_size: int, platform: str) -> int:
  """The default chunk for a platform: :func:`default_chunk_size` on ``"cpu"``; on ``"cuda"``
  and ``"rocm"`` a power of two near ``2**28 / vocab_size`` tokens, elsewhere (TPU) near
  ``2**27 / vocab_size``, at most 4096, within ``[1, num_tokens]``."""
  if platform == "cpu":
    return default_chunk_size(num_tokens, vocab_size)
  elements = _GPU_CHUNK_ELEMENTS if platform in ("cuda", "rocm") else _ACCEL_CHUNK_ELEMENTS
  return _power_of_two_chunk(elements, num_tokens, vocab_size, _ACCEL_MAX_CHUNK)


def _per_platform(chunk_size, name, n, vocab_size, call, elements=_CHUNK_ELEMENTS):
  """``call(chunk)`` with ``chunk_size``, or by default the chunk of the platform the program
  is lowered for (:func:`platform_chunk_size`; on CPU, ``elements`` logits per chunk).

  As the row path's blocks (:func:`kldiv_jax._rows.map_rows`), the chunkings are staged
  out with ``lax.platform_dependent`` and lowering keeps the platform's own: a program
  exported with ``jax.export`` for several platforms holds each one's. Each runs in the
  name scope :data:`FUSED_CHUNK_SCOPE` followed by its chunk.
  """

  def scoped(chunk):
    def run():
      with jax.named_scope(f"{FUSED_CHUNK_SCOPE}{chunk}"):
        return call(chunk)

    return run

  chunk = _check_chunk(name, chunk_size, n, vocab_size, elements)
  if chunk_size is not None:
    return scoped(chunk)()
  chunks = {p: platform_chunk_size(n, vocab_size, p) for p in ("cuda", "rocm", "tpu")}
  chunks["cpu"] = chunk  # the CPU default, with the caller's ``elements``
  if len(set(chunks.values())) == 1:
    return scoped(chunk)()
  # One traced branch per distinct chunk (``platform_dependent`` joins equal callables).
  runs = {c: scoped(c) for c in set(chunks.values())}
  default = runs[chunks.pop("tpu")]
  others = {p: runs[c] for p, c in chunks.items() if runs[c] is not default}
  return lax.platform_dependent(**others, default=default)


def _matmul(a, w, b, dtype):
  out = lax.dot_general(a, w, (((1,), (0,)), ((), ())), preferred_element_type=dtype)
  return out if b is None else out + b.astype(dtype)[None, :]


def _logits(a, w, b, acc, low=None):
  """``a @ w + b`` accumulated in ``acc``; with ``low`` (bf16/f16) in ``low`` between the
  matmul and the softmax, as the materialised ``a @ w + b`` of ``low`` inputs (the product
  rounded, then the bias), read in ``acc``. XLA:GPU writes a chunk's logits and their
  gradient to HBM between its fusions: in ``low`` they move half the bytes of float32. Where
  XLA fuses the conversions away (``xla_allow_excess_precision``, its default, as on CPU),
  they stay in ``acc``, as the materialised loss's do."""
  if low is None:
    return _matmul(a, w, b, acc)
  z = lax.dot_general(a, w, (((1,), (0,)), ((), ())), preferred_element_type=acc).astype(low)
  return (z if b is None else z + b.astype(low)[None, :]).astype(acc)


class Static(NamedTuple):
  """The static part of a fused call (hashable): what each chunk computes."""

  teacher: str  # "dense" (hidden states and a head) or "topk"
  key: tuple  # the divergence's Divergence.key
  chunk: int
  axis_name: str | None
  caps: tuple[float | None, float | None]
  weights: LossWeights
  tail: bool  # top-k: the tail bucket
  shared: int  # the classes both sides have (per device): longer logits are cut per chunk


def _chunk_soft(static: Static, z, teacher, whole, temperature, spec, mask):
  """The divergence per row of a chunk's student logits ``z`` against its teacher."""
  if static.teacher == "dense":
    (thc,) = teacher
    tw, tb = whole
    y = lax.stop_gradient(shared_classes(_matmul(thc, tw, tb, z.dtype), static.shared, 1))
    return divergence_rows(z, y, temperature, (mask,), spec, static.axis_name, static.caps)
  ids, lp, keep, dropped = teacher
  keep = keep & mask
  return topk_rows(
    z, ids, lp, keep, dropped, temperature, spec, static.tail, static.caps[0], static.axis_name
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(static, h, w, b, teacher, whole, temperature, params, tokens, coefs) -> tuple:
  return _fused_fwd(static, h, w, b, teacher, whole, temperature, params, tokens, coefs)[0]


def _fused_fwd(static: Static, h, w, b, teacher, whole, temperature, params, tokens, coefs):
  n = h.shape[0]
  chunk, axis_name, weights = static.chunk, static.axis_name, static.weights
  # The divergence of the chunks: its static part from ``static``, traced parameters from ``params``.
  spec = Divergence.tree_unflatten(static.key, params)
  acc = coefs.dtype  # float32, or float64 for float64 inputs

  def chunk_grads(hc, teacher_c, tokens_c):
    mask, labels, labelled = tokens_c
    # A longer student head: its own classes are cut from each chunk's logits (their
    # gradient is 0, padded back below).
    z = shared_classes(_matmul(hc, w, b, acc), static.shared, 1)

    def objective(z):
      soft = hard = jnp.zeros((), acc)
      if weights.soft:
        soft = jnp.sum(_chunk_soft(static, z, teacher_c, whole, temperature, spec, mask))
      if weights.hard:
        hard = jnp.sum(hard_rows(z, labels, labelled, (mask,), axis_name, static.caps[0]))
      return coefs[0] * soft + coefs[1] * hard, (soft, hard)

    loss, vjp, parts = jax.vjp(objective, z, has_aux=True)
    (dz,) = vjp(jnp.ones_like(loss))
    if dz.shape[1] < w.shape[1]:
      dz = jnp.pad(dz, ((0, 0), (0, w.shape[1] - dz.shape[1])))
    gh = lax.dot_general(dz, w, (((1,), (1,)), ((), ())), preferred_element_type=acc)
    if axis_name is not None:  # each device holds a slice of the head: sum the parts
      gh = lax.psum(gh, axis_name)
    return (loss, *parts), gh, dz, jnp.sum(dz, axis=0)

  # ``full_like``: inside jax.shard_map, loop carries keep the mesh axes their
  # values vary over (the loss those of the tokens, the head's gradients the
  # head's, see _vary_like_tokens).
  zero = _token_zero(h, *teacher, *tokens).astype(acc)
  totals = (zero, zero, zero)
  grad_h = lax.full_like(h, 0, acc)
  grad_w = lax.full_like(w, 0, acc)
  grad_b = lax.full_like(w, 0, acc, shape=w.shape[1:])

  def part(start, size, cut, carry):
    totals, grad_h, grad_w, grad_b = carry
    hc = cut(h)
    parts, gh, dz, gb = chunk_grads(hc, cut(teacher), cut(tokens))
    grad_h = lax.dynamic_update_slice_in_dim(grad_h, gh, start, axis=0)
    totals = tuple(t + p for t, p in zip(totals, parts))
    return totals, grad_h, _add_weight_grad(grad_w, hc, dz, axis_name, acc), grad_b + gb

  totals, grad_h, grad_w, grad_b = _chunks(n, chunk, part, (totals, grad_h, grad_w, grad_b))
  operands = (h, w, b, teacher, whole, temperature, params, tokens, coefs)
  return totals, (grad_h, grad_w, grad_b, operands)


def _fused_bwd(static, residuals, g):
  grad_h, grad_w, grad_b, (h, w, b, teacher, whole, temperature, params, tokens, coefs) = residuals
  s = g[0].astype(coefs.dtype)  # the parts (g[1], g[2]) carry no gradient
  zeros = lambda tree: jax.tree.map(_zero_cotangent, tree)  # noqa: E731
  return (
    (grad_h * s).astype(h.dtype),
    (grad_w * s).astype(w.dtype),
    None if b is None else (grad_b * s).astype(b.dtype),
    zeros(teacher),
    zeros(whole),
    zeros(temperature),
    zeros(params),
    zeros(tokens),
    zeros(coefs),
  )


def _zero_cotangent(x):
  """A zero cotangent: float0 for integer and boolean operands."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


_fused.defvjp(_fused_fwd, _fused_bwd)
_fused = compiled(_fused, static_argnums=0)


def _add_weight_grad(grad_w, hc, dz, axis_name, acc):
  """``grad_w += hc^T dz``, the way of the platform the program is lowered for.

  CPU: a block of vocabulary columns at a time (a dot writes a fresh buffer, so a
  whole ``[H, V]`` product is a second ``[H, V]`` array in cache-unfriendly passes).
  GPU and TPU: one ``[H, V]`` dot per chunk added to the carry, which XLA fuses into
  the matmul's output (cuBLAS's ``beta = 1``, TPU output fusion) in place; the
  blocks there each re-read and re-wrote the whole float32 accumulator. Chosen with
  ``lax.platform_dependent`` as the chunk is (:func:`_per_platform`): an exported
  program holds each platform's own. Vocabulary parallel: a device's slice of the
  unsharded call's blocks.
  """

  def blocked(grad_w, hc, dz):
    shards = 1 if axis_name is None else lax.axis_size(axis_name)
    block = min(grad_w.shape[1], max(1, _GRAD_W_BLOCK // shards))
    num_blocks, rest = divmod(grad_w.shape[1], block)

    def one(j, grad_w, width):
      cols = lambda a: lax.dynamic_slice_in_dim(a, j, width, axis=1)  # noqa: E731
      gw = lax.dot_general(hc, cols(dz), (((0,), (0,)), ((), ())), preferred_element_type=acc)
      return lax.dynamic_update_slice_in_dim(grad_w, cols(grad_w) + gw, j, axis=1)

    with jax.named_scope(f"{FUSED_GRAD_W_SCOPE}{block}"):
      grad_w = lax.fori_loop(0, num_blocks, lambda k, g: one(k * block, g, block), grad_w)
      if rest:
        grad_w = one(num_blocks * block, grad_w, rest)
    return grad_w

  def whole(grad_w, hc, dz):
    with jax.named_scope(f"{FUSED_GRAD_W_SCOPE}whole"):
      gw = lax.dot_general(hc, dz, (((0,), (0,)), ((), ())), preferred_element_type=acc)
      return grad_w + gw

  return lax.platform_dependent(grad_w, hc, dz, cpu=blocked, default=whole)


def _chunks(n, chunk, part, carry):
  """``part(start, size, cut, carry)`` over the chunks of ``n`` rows, ``cut`` slicing the
  chunk's rows of an array (or of each leaf of a pytree): a ``fori_loop`` over the full
  chunks, then the uneven last one with static shapes."""
  num_full = n // chunk
  if num_full:

    def body(i, carry):
      start = i * chunk

      def cut(tree):
        return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, chunk, axis=0), tree)

      return part(start, chunk, cut, carry)

    carry = lax.fori_loop(0, num_full, body, carry)
  start = num_full * chunk
  if start < n:
    carry = part(start, n - start, lambda tree: jax.tree.map(lambda a: a[start:], tree), carry)
  return carry


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_tokens(static, h, w, b, ids, temperature, mask):
  return _fused_tokens_fwd(static, h, w, b, ids, temperature, mask)[0]


def _token_chunk(static, hc, w, b, idc, temperature, mc, acc):
  """A chunk's ``(log p, H, row max, log s)`` per token, ``[size]`` each."""
  _, axis_name, cap, low = static
  z = _logits(hc, w, b, acc, low)
  log_p, entropy, (top, log_s, _) = token_stats(axis_name, cap, z, idc, temperature, (mc,))
  return log_p, entropy, top[:, 0], log_s[:, 0]


def _fused_tokens_fwd(static, h, w, b, ids, temperature, mask):
  chunk = static[0]
  n, acc = h.shape[0], temperature.dtype
  zero = _token_zero(h, ids, mask).astype(acc)
  outs = tuple(lax.full_like(mask[:, 0], 0, acc) + zero for _ in range(4))

  def part(start, size, rows, outs):
    res = _token_chunk(static, rows(h), w, b, rows(ids), temperature, rows(mask), acc)
    return tuple(lax.dynamic_update_slice_in_dim(o, r, start, axis=0) for o, r in zip(outs, res))

  outs = _chunks(n, chunk, part, outs)
  log_p, entropy, top, log_s = outs
  return (log_p, entropy), (h, w, b, ids, temperature, mask, top, log_s, entropy)


def _fused_tokens_bwd(static, residuals, g):
  chunk, axis_name, cap, low = static
  h, w, b, ids, temperature, mask, top, log_s, entropy = residuals
  g_lp, g_h = g
  n, acc = h.shape[0], temperature.dtype
  grad_h = lax.full_like(h, 0, acc)
  grad_w = lax.full_like(w, 0, acc)
  grad_b = lax.full_like(w, 0, acc, shape=w.shape[1:])
  local = local_ids(ids, axis_name, w.shape[1])

  def part(start, size, rows, carry):
    hc = rows(h)
    z = _logits(hc, w, b, acc, low)
    stats = (rows(top)[:, None], rows(log_s)[:, None], rows(entropy))
    tokens = (rows(local), rows(mask), stats)
    return fold_token_grads(
      axis_name, cap, start, hc, w, z, tokens, temperature, rows(g_lp), rows(g_h), carry, low
    )

  grad_h, grad_w, grad_b = _chunks(n, chunk, part, (grad_h, grad_w, grad_b))
  return (
    grad_h.astype(h.dtype),
    grad_w.astype(w.dtype),
    None if b is None else grad_b.astype(b.dtype),
    _zero_cotangent(ids),
    jnp.zeros_like(temperature),
    _zero_cotangent(mask),
  )


def fold_token_grads(
  axis_name, cap, start, hc, w, z, tokens, temperature, g_lp, g_h, carry, grad_dtype=None
):
  """Folds a chunk's cotangents of ``(log p_y, H)`` per token into ``(grad_h, grad_w, grad_b)``.

  ``z`` are the chunk's logits ``hc @ w + b``, ``tokens = (local ids [size, 1], mask [size,
  1], (top, log s, H))`` from :func:`token_stats`; ``g_h`` may be ``None`` (no entropy).
  ``dz = g_lp (hit - p) + g_h dH/du`` through the soft-cap and the temperature
  (:func:`class_derivatives`), then two matmuls: ``dz W^T`` into rows ``start:`` of
  ``grad_h`` (summed over ``axis_name``) and ``hc^T dz`` added to ``grad_w``
  (:func:`_add_weight_grad`), ``dz`` in ``grad_dtype`` for them when given (the cotangent
  of logits in that dtype, as autodiff's of the materialised ``hc @ w``; see :func:`_logits`). Shared
  by the backward pass of :func:`fused_token_log_probs` and the forward pass of the fused
  policy losses (``_fused_policy``).
  """
  grad_h, grad_w, grad_b = carry
  acc = temperature.dtype
  local, mask, stats = tokens
  d_lp, d_h, zc, _, _ = class_derivatives(z, local, temperature, (mask,), cap, stats)
  dz = d_lp * g_lp.astype(acc)[:, None]
  if g_h is not None:
    dz = dz + d_h * g_h.astype(acc)[:, None]
  dz = times_slope(dz, zc, cap) / temperature
  grad_b = grad_b + jnp.sum(dz, axis=0)
  if grad_dtype is not None:
    dz = dz.astype(grad_dtype)
  gh = lax.dot_general(dz, w, (((1,), (1,)), ((), ())), preferred_element_type=acc)
  if axis_name is not None:  # each device holds a slice of the head: sum the parts
    gh = lax.psum(gh, axis_name)
  grad_h = lax.dynamic_update_slice_in_dim(grad_h, gh, start, axis=0)
  grad_w = _add_weight_grad(grad_w, hc, dz, axis_name, acc)
  return grad_h, grad_w, grad_b


_fused_tokens.defvjp(_fused_tokens_fwd, _fused_tokens_bwd)
_fused_tokens = compiled(_fused_tokens, static_argnums=0)


def _vary_like_tokens(weight, bias, *token_arrays):
  """``(weight, bias)`` plus a 0 that varies like the token arrays.

  Inside ``jax.shard_map`` with the tokens split (over "data", say), the head's
  gradient in a custom VJP varies over the tokens' mesh axes, and must have the
  head's type: adding a 0 that varies like the tokens makes the head vary
  alike, and autodiff then sums its gradient over those axes. Outside
  ``shard_map`` it is a no-op, which XLA folds away.
  """
  zero = _token_zero(*token_arrays)
  w = jnp.asarray(weight)
  b = None if bias is None else jnp.asarray(bias)
  return w + zero.astype(w.dtype), None if b is None else b + zero.astype(b.dtype)


def _token_zero(*token_arrays):
  """A scalar 0 that varies over the mesh axes of the token arrays (inside ``jax.shard_map``)."""
  zero = jnp.zeros((), jnp.float32)
  for a in token_arrays:
    if a is not None:
      zero = zero + lax.full_like(a, 0, jnp.float32, shape=())
  return zero


def _check_linear(name, what, hidden, weight, bias):
  """Checks one side's hidden states, head and bias; returns their promoted dtype."""
  prefix = "" if what == "student" else "target_"
  names = ("hidden", "weight") if bias is None else ("hidden", "weight", "bias")
  arrays = (hidden, weight) if bias is None else (hidden, weight, bias)
  dtype = check_float(name, [prefix + n for n in names], *arrays)
  if np.ndim(weight) != 2:
    raise ValueError(
      f"{name}: {what} weight must be [hidden, vocab]; got shape {np.shape(weight)}."
    )
  if np.ndim(hidden) < 1 or np.shape(hidden)[-1] != np.shape(weight)[0]:
    raise ValueError(
      f"{name}: {what} hidden [..., H] and weight [H, V] disagree on H; got shapes "
      f"{np.shape(hidden)} and {np.shape(weight)}."
    )
  if bias is not None and tuple(np.shape(bias)) != (np.shape(weight)[1],):
    raise ValueError(
      f"{name}: {what} bias must have shape ({np.shape(weight)[1]},); got {np.shape(bias)}."
    )
  return dtype


def _check_chunk(name, chunk_size, n, vocab_size, elements=_CHUNK_ELEMENTS):
  if chunk_size is None:
    # The global vocabulary: a vocabulary-parallel call makes the unsharded
    # call's chunks, each device holding a slice of their logits.
    return default_chunk_size(n, vocab_size, elements)
  if (
    not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool) or chunk_size < 1
  ):
    raise ValueError(f"{name}: chunk_size must be a positive int or None; got {chunk_size!r}.")
  return int(min(chunk_size, max(n, 1)))


# The options every fused loss reads (``_options``), with their defaults where a loss lacks one.
_OPTION_DEFAULTS = dict(
  labels=None,
  alpha=0.5,
  ignore_index=-100,
  temperature=1.0,
  divergence="forward_kl",
  beta=0.5,
  scale_by_temperature_squared=True,
  where=None,
  normalizer=None,
  chunk_size=None,
  axis_name=None,
  softcap=None,
  target_softcap=None,
  teacher_vocab_size=None,
  return_parts=False,
)


def _options(arguments: dict) -> dict:
  """A public fused loss's options from its arguments (``locals()``), defaults for the rest."""
  return {k: arguments.get(k, default) for k, default in _OPTION_DEFAULTS.items()}


def _fused_loss(name, hidden, weight, bias, teacher_kind, teacher_args, options):
  """The body of the fused losses: validate, lay out (tokens as rows, shared classes), run the
  chunked kernel, normalise. ``teacher_args``: ``(target_hidden, target_weight, target_bias)``
  or ``(topk_indices, topk_log_probs, tail)``."""
  o = options
  alpha, alpha_static = check_unit_interval(name, "alpha", o["alpha"])
  beta, _ = check_unit_interval(name, "beta", o["beta"])
  spec = loss_divergence(name, o["divergence"], beta)
  temperature, t_static = check_temperature(name, o["temperature"])
  scale_t2 = check_bool(name, "scale_by_temperature_squared", o["scale_by_temperature_squared"])
  ignore_index = check_int(name, "ignore_index", o["ignore_index"])
  return_parts = check_bool(name, "return_parts", o["return_parts"])
  caps = check_softcaps(name, o["softcap"], o["target_softcap"])
  axis_name = o["axis_name"]
  out_dtype = _check_linear(name, "student", hidden, weight, bias)
  num_shards = 1 if axis_name is None else check_axis_name(name, axis_name)
  sharded = None if axis_name is None else VOCAB_PARALLEL_PADDING
  token_shape = tuple(np.shape(hidden)[:-1])
  n = int(np.prod(token_shape, dtype=np.int64))  # explicit: reshape(-1, 0) is ambiguous
  cdt = compute_dtype(out_dtype)
  vocab = np.shape(weight)[1]
  w_arr = jnp.asarray(weight)
  b_arr = None if bias is None else jnp.asarray(bias)
  tail = False
  bad = None
  mask = token_mask(name, o["where"], token_shape, n)
  if teacher_kind == "dense":
    target_hidden, target_weight, target_bias = teacher_args
    _check_linear(name, "teacher", target_hidden, target_weight, target_bias)
    if tuple(np.shape(target_hidden)[:-1]) != token_shape:
      raise ValueError(
        f"{name}: hidden and target_hidden must have the same tokens; got shapes "
        f"{np.shape(hidden)} and {np.shape(target_hidden)}."
      )
    tw = jnp.asarray(target_weight)
    tb = None if target_bias is None else jnp.asarray(target_bias)
    sizes = (vocab * num_shards, tw.shape[1] * num_shards)
    teacher_classes(name, o["teacher_vocab_size"], *sizes, ("weight", "target_weight"), sharded)
    # The shared classes (see _rows.shared_classes): each chunk's logits are cut to them,
    # not the heads (a copy of a [H, V] head would cost more than the chunks).
    vocab = min(vocab, tw.shape[1])
    th = jnp.asarray(target_hidden).reshape(n, np.shape(target_hidden)[-1])
    teacher, whole = (th,), (tw, tb)
  else:
    ids_in, lp_in, tail_name = teacher_args
    check_float(name, ("topk_log_probs",), lp_in)
    idx = index_array(name, "topk_indices", ids_in, "token ids")
    lp = jnp.asarray(lp_in)
    if idx.shape != lp.shape or idx.shape[:-1] != token_shape or idx.ndim != len(token_shape) + 1:
      raise ValueError(
        f"{name}: topk_indices and topk_log_probs must both have shape hidden.shape[:-1] + (k,) "
        f"= {token_shape} + (k,); got {idx.shape} and {lp.shape}."
      )
    if idx.shape[-1] < 1:
      raise ValueError(f"{name}: the number of top-k entries must be at least 1; got k = 0.")
    check_choice(name, "tail", tail_name, TAILS)
    tail = tail_name == "bucket"
    global_vocab = vocab * num_shards
    teacher_vocab = teacher_classes(name, o["teacher_vocab_size"], global_vocab, sharded=sharded)
    check_ids(
      name,
      "topk_indices",
      idx,
      teacher_vocab,
      o["where"],
      what="token ids",
      log_probs=lp,
      fix=TOPK_PADDING,
    )
    shared = min(global_vocab, teacher_vocab)  # equal with axis_name (checked)
    vocab = shared // num_shards
    k = idx.shape[-1]
    t = topk_teacher(idx.reshape(n, k), lp.astype(cdt).reshape(n, k), None, shared, teacher_vocab)
    teacher, whole, bad = (t.ids, t.lp, t.keep, t.dropped), (), t.bad[:, None]
  h = jnp.asarray(hidden).reshape(n, np.shape(hidden)[-1])
  labels = labelled = None
  if o["labels"] is not None:
    labels, labelled = check_labels(
      name,
      o["labels"],
      token_shape,
      "shape hidden.shape[:-1] =",
      ignore_index,
      vocab * num_shards,
      mask,
    )
    mask = labelled = mask & labelled  # a masked token's label is not read (no NaN from it)
  _check_chunk(name, o["chunk_size"], n, vocab * num_shards)  # a bad chunk_size fails early
  weights = loss_weights(alpha, alpha_static, labels is not None, return_parts)
  checks = (positive_finite(temperature), in_unit_interval(alpha), in_unit_interval(beta))
  checks = (*checks, *spec.valid())
  normalizer = o["normalizer"]
  if normalizer is None:
    denominator = jnp.maximum(jnp.sum(mask), 1).astype(cdt)
  else:
    normalizer = check_normalizer(name, normalizer)
    checks = (*checks, positive_finite(normalizer))
    denominator = jnp.asarray(normalizer).astype(cdt)
  if bad is not None:
    checks = (*checks, ~jnp.any(bad & mask))
  t = jnp.asarray(temperature, cdt)
  t2 = (t * t if not t_static else jnp.asarray(temperature**2, cdt)) if scale_t2 else None
  t2 = jnp.ones((), cdt) if t2 is None else t2
  if labels is None:
    coefs = jnp.stack([t2, jnp.zeros((), cdt)])
  else:
    a = jnp.asarray(alpha, cdt)
    coefs = jnp.stack([a * t2, 1.0 - a])
  coefs = coefs / denominator
  num_tokens = jnp.sum(mask)
  if n == 0 or vocab == 0:  # no tokens, or no vocabulary: nothing to sum
    zero = jnp.zeros((), out_dtype)
    loss = nan_unless(zero, *checks)
    return (loss, DistillationParts.of(zero, zero, num_tokens, checks)) if return_parts else loss
  w_arr, b_arr = _vary_like_tokens(w_arr, b_arr, h, *teacher, mask)
  params = tuple(jnp.asarray(x).astype(cdt) for x in spec.traced)
  tokens = (mask, labels, labelled)

  def call(chunk):
    static = Static(teacher_kind, spec.key, chunk, axis_name, caps, weights, tail, vocab)
    return _fused(static, h, w_arr, b_arr, teacher, whole, t, params, tokens, coefs)

  totals = _per_platform(o["chunk_size"], name, n, vocab * num_shards, call)
  # Arrays: the cast restates ``_fused``'s annotation, which the checker loses
  # to jax.custom_vjp's unannotated ``__new__`` (it may return jax's custom_vjp3).
  loss, soft, hard = cast(tuple[jax.Array, jax.Array, jax.Array], totals)
  loss = nan_unless(loss.astype(out_dtype), *checks)
  if not return_parts:
    return loss
  return loss, DistillationParts.of(soft * t2, hard, num_tokens, checks)


def fused_distillation_loss(
  hidden: jax.typing.ArrayLike,
  weight: jax.typing.ArrayLike,
  target_hidden: jax.typing.ArrayLike,
  target_weight: jax.typing.ArrayLike,
  labels: jax.typing.ArrayLike | None = None,
  *,
  alpha: float | jax.typing.ArrayLike = 0.5,
  ignore_index: int = -100,
  bias: jax.typing.ArrayLike | None = None,
  target_bias: jax.typing.ArrayLike | None = None,
  temperature: float | jax.typing.ArrayLike = 1.0,
  divergence: str | Divergence = "forward_kl",
  beta: float | jax.typing.ArrayLike = 0.5,
  scale_by_temperature_squared: bool = True,
  where: jax.typing.ArrayLike | None = None,
  normalizer: float | jax.typing.ArrayLike | None = None,
  chunk_size: int | None = None,
  axis_name: str | None = None,
  softcap: float | None = None,
  target_softcap: float | None = None,
  teacher_vocab_size: int | None = None,
  return_parts: bool = False,
) -> jax.Array | tuple[jax.Array, DistillationParts]:
  r"""The whole distillation loss from hidden states and LM heads, chunked over tokens.

  With student logits :math:`s = h W + b` and teacher logits
  :math:`t = h_T W_T + b_T`, exactly :func:`distillation_loss`:

  .. math::

     L = \frac{1}{N} \sum_{\text{valid tokens}} \Big[\alpha\, T^2\,
         D\big(\mathrm{softmax}(t/T), \mathrm{softmax}(s/T)\big)
         + (1 - \alpha)\, \big(-\log \mathrm{softmax}(s)_{y}\big)\Big]

  with the cross-entropy term only when ``labels`` are given (else
  :math:`T^2 D` alone), :math:`D` any divergence of
  :func:`divergence_from_logits` (a name or a :class:`Divergence`;
  ``"jsd"`` as a string takes ``beta``), :math:`T^2` unless
  ``scale_by_temperature_squared=False``, and :math:`N` the number of valid
  tokens (``where`` and ``labels != ignore_index``, at least 1) or
  ``normalizer``. Equal to ``distillation_loss(hidden @ weight + bias,
  target_hidden @ target_weight + target_bias, labels, ...)`` in value and
  gradients wrt ``hidden``, ``weight`` and ``bias``, but the ``[tokens,
  vocab]`` logits exist only ``chunk_size`` tokens at a time: each chunk's
  logits give its divergence *and* its cross entropy (no second pass over the
  head for the hard loss), and the forward pass folds the chunk's gradient
  into the gradients wrt ``hidden``, ``weight`` and ``bias`` at once (as
  Liger Kernel's fused-linear distillation losses do); the backward pass
  scales them.

  The teacher (``target_*``) receives no gradient, nor do ``temperature``,
  ``alpha``, ``beta`` and traced :class:`Divergence` parameters (zeros).
  Reverse mode only (``jax.grad``, ``value_and_grad``); use
  :func:`distillation_loss` on materialised logits for ``jvp`` or Hessians.
  NaN and invalid traced options as in :func:`distillation_loss`. Matmuls
  accumulate in float32 (``preferred_element_type``); gradients come back in
  the inputs' dtypes.

  Args:
    hidden: the student's hidden states ``[..., H]``.
    weight: the student's LM head ``[H, V]`` (Flax ``Dense`` kernel layout).
    target_hidden: the teacher's hidden states ``[..., H_T]``, same tokens.
    target_weight: the teacher's LM head ``[H_T, V_T]``, ``V_T = V`` unless
      ``teacher_vocab_size`` says otherwise.
    labels: optional integer token ids ``hidden.shape[:-1]`` (positional or
      keyword, as in :func:`distillation_loss`): adds the cross entropy,
      weighted ``1 - alpha``, inside the same chunks. Known labels outside
      ``[0, V)`` (not ``ignore_index``) raise ``ValueError``; under ``jit``
      they make the loss NaN.
    alpha: weight of the distillation term with labels, in ``[0, 1]``.
    ignore_index: the label of tokens to leave out.
    bias: optional student bias ``[V]``.
    target_bias: optional teacher bias ``[V_T]``.
    temperature: positive, finite softmax temperature (a traced scalar is
      allowed).
    divergence: a divergence name (its default parameters) or a
      :class:`Divergence`, as in :func:`divergence_from_logits`.
    beta: the mixture weight of ``divergence="jsd"`` given as a string.
    scale_by_temperature_squared: multiply the divergence by :math:`T^2`.
    where: a token mask of shape ``hidden.shape[:-1]``.
    normalizer: the denominator instead of the number of valid tokens (a
      global token count for gradient accumulation), positive and finite.
    chunk_size: tokens per chunk; ``None`` picks a power of two per platform
      when the program is lowered: about ``2**22`` logits per chunk and side on
      CPU, ``2**27`` on TPU and ``2**28`` on GPU (at most 4096 tokens), where
      each chunk reads both heads and the float32 weight gradient and small
      chunks are bound by that traffic. The last chunk may be smaller.
    axis_name: for vocabulary parallelism: the name of a mesh axis over which
      the V axis of ``weight``, ``bias``, ``target_weight`` and
      ``target_bias`` is split, when called inside ``jax.shard_map`` (hidden
      states and labels whole on that axis). Each device computes its slice of
      every chunk's logits; the softmax statistics are combined with
      ``lax.pmax`` and ``lax.psum`` (per-token scalars only; a label's logit
      comes from the device that holds it), the gradient wrt ``hidden`` is
      summed over the axis, the gradients wrt ``weight`` and ``bias`` stay
      local slices. Values and gradients equal the unsharded call's, with the
      same chunks (``chunk_size=None`` uses the global vocabulary); the
      result is replicated over ``axis_name``. E.g. ``jax.shard_map(lambda h,
      w, th, tw, y: fused_distillation_loss(h, w, th, tw, labels=y,
      axis_name="vocab"), mesh=mesh, in_specs=(P(), P(None, "vocab"), P(),
      P(None, "vocab"), P()), out_specs=P())``; with the tokens also split
      over ``"data"``, pass the global token count as ``normalizer`` and
      ``lax.psum`` the result over ``"data"``.
    softcap: soft-cap the student's logits, ``softcap * tanh(s / softcap)``
      (Gemma 2), before the temperature and for the cross entropy;
      ``None`` costs nothing.
    target_softcap: likewise for the teacher's logits.
    teacher_vocab_size: ``V_T`` when it differs from ``V`` (``None``: they
      must be equal, else ``ValueError``): the shared classes are then the
      first ``min(V, V_T)`` and the others carry no mass on either side (as in
      :func:`distillation_loss`; not with ``axis_name``).
    return_parts: also return a :class:`DistillationParts` ``(soft, hard,
      num_tokens)``: sums over the valid tokens, for logging that stays right
      when summed over micro-batches and hosts.

  Returns:
    A scalar in the promoted dtype of ``hidden`` and ``weight``; with
    ``return_parts``, ``(loss, parts)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kldiv_jax import distillation_loss, fused_distillation_loss
    >>> k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    >>> h, w = jax.random.normal(k1, (6, 4)), jax.random.normal(k2, (4, 10))
    >>> th, tw = jax.random.normal(k3, (6, 5)), jax.random.normal(k4, (5, 10))
    >>> y = jnp.array([1, 2, 3, -100, 4, 5])
    >>> fused, parts = fused_distillation_loss(
    ...   h, w, th, tw, y, temperature=2.0, chunk_size=4, return_parts=True
    ... )
    >>> bool(jnp.allclose(fused, distillation_loss(h @ w, th @ tw, y, temperature=2.0)))
    True
    >>> int(parts.num_tokens)
    5

  References:
    Hsu et al., *Liger Kernel: Efficient Triton Kernels for LLM Training*
    (2024), arXiv:2410.10989.
  """
  options = _options(locals())
  teacher = (target_hidden, target_weight, target_bias)
  return _fused_loss("fused_distillation_loss", hidden, weight, bias, "dense", teacher, options)


def fused_topk_distillation_loss(
  hidden: jax.typing.ArrayLike,
  weight: jax.typing.ArrayLike,
  topk_indices: jax.typing.ArrayLike,
  topk_log_probs: jax.typing.ArrayLike,
  labels: jax.typing.ArrayLike | None = None,
  *,
  alpha: float | jax.typing.ArrayLike = 0.5,
  ignore_index: int = -100,
  bias: jax.typing.ArrayLike | None = None,
  temperature: float | jax.typing.ArrayLike = 1.0,
  divergence: str | Divergence = "forward_kl",
  tail: str = "renormalize",
  scale_by_temperature_squared: bool = True,
  where: jax.typing.ArrayLike | None = None,
  normalizer: float | jax.typing.ArrayLike | None = None,
  chunk_size: int | None = None,
  axis_name: str | None = None,
  softcap: float | None = None,
  teacher_vocab_size: int | None = None,
  return_parts: bool = False,
) -> jax.Array | tuple[jax.Array, DistillationParts]:
  r"""Distillation loss from the student's hidden states and LM head and a top-k teacher.

  :func:`fused_distillation_loss` with the teacher given as its stored top-k
  token ids and log-probabilities (offline distillation, an inference
  server's logprobs): per valid token

  .. math::

     \alpha\, T^2\, D_k\big(p, \mathrm{softmax}(s/T)\big)
     + (1 - \alpha)\, \big(-\log \mathrm{softmax}(s)_{y}\big),

  averaged over the valid tokens (or divided by ``normalizer``), with
  :math:`s = h W + b` computed ``chunk_size`` tokens at a time and
  :math:`D_k` the top-k divergence of :func:`divergence_from_topk` (``tail``
  ``"renormalize"`` or ``"bucket"``, padding with ``-inf`` log-probabilities,
  repeated ids, ``teacher_vocab_size``). Equal, in value and gradients wrt
  ``hidden``, ``weight`` and ``bias``, to :func:`divergence_from_topk` on the
  materialised logits ``hidden @ weight + bias`` mixed with their cross
  entropy as :func:`distillation_loss` mixes them; no ``[tokens, vocab]``
  array exists, forward or backward. Without ``labels``: :math:`T^2 D_k`
  alone.

  Ids with mass outside ``[0, teacher_vocab_size)``: ``ValueError`` when
  the values are known, NaN loss under ``jit``. Gradients, options and
  ``axis_name`` as in :func:`fused_distillation_loss` (the top-k arrays and
  labels whole on the vocabulary axis).

  Args:
    hidden: the student's hidden states ``[..., H]``.
    weight: the student's LM head ``[H, V]``.
    topk_indices: the teacher's token ids ``[..., k]`` (``hidden``'s tokens).
    topk_log_probs: the teacher's log-probabilities at those ids ``[..., k]``.
    labels: optional token ids ``hidden.shape[:-1]``: adds the cross entropy.
    alpha: weight of the distillation term with labels, in ``[0, 1]``.
    ignore_index: the label of tokens to leave out.
    bias: optional student bias ``[V]``.
    temperature: positive, finite softmax temperature.
    divergence: a divergence name or a :class:`Divergence`.
    tail: ``"renormalize"`` or ``"bucket"`` (:func:`divergence_from_topk`).
    scale_by_temperature_squared: multiply the divergence by :math:`T^2`.
    where: a token mask of shape ``hidden.shape[:-1]``.
    normalizer: the denominator instead of the number of valid tokens.
    chunk_size: tokens per chunk (``None``: per platform, as in
      :func:`fused_distillation_loss`).
    axis_name: vocabulary parallelism over the V axis of ``weight`` and
      ``bias``.
    softcap: the student's logit soft-cap.
    teacher_vocab_size: the teacher's vocabulary size when it differs.
    return_parts: also return the :class:`DistillationParts`.

  Returns:
    A scalar in the promoted dtype of ``hidden`` and ``weight``; with
    ``return_parts``, ``(loss, parts)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kldiv_jax import divergence_from_topk, fused_topk_distillation_loss
    >>> k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    >>> h, w = jax.random.normal(k1, (6, 4)), jax.random.normal(k2, (4, 10))
    >>> top_lp, top_ids = jax.lax.top_k(jax.nn.log_softmax(jax.random.normal(k3, (6, 10))), 3)
    >>> fused = fused_topk_distillation_loss(h, w, top_ids, top_lp, tail="bucket", chunk_size=4)
    >>> direct = divergence_from_topk(h @ w, top_ids, top_lp, tail="bucket").mean()
    >>> bool(jnp.allclose(fused, direct))
    True
  """
  options = _options(locals())
  teacher = (topk_indices, topk_log_probs, tail)
  return _fused_loss("fused_topk_distillation_loss", hidden, weight, bias, "topk", teacher, options)


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
) -> jax.Array | tuple[jax.Array, jax.Array]:
  r"""Sampled tokens' log-probabilities (and the entropy) from hidden states and an LM head.

  :func:`token_log_probs` of the logits :math:`z = h W + b`, computed
  ``chunk_size`` tokens at a time: no ``[tokens, vocab]`` array exists,
  forward or backward. The forward pass keeps two per-token statistics (the
  row max and the log-normaliser); the backward pass recomputes each chunk's
  logits from them and folds the chunk's gradient into the gradients wrt
  ``hidden``, ``weight`` and ``bias`` at once (the weight's on CPU a block of
  vocabulary columns at a time, as the fused distillation losses do). PPO and
  GRPO need these for the policy's and the reference model's sampled tokens
  (see :func:`kl_estimate`); Liger Kernel's fused linear cross entropy is the
  same design.

  Values and gradients (wrt ``hidden``, ``weight`` and ``bias``, through both
  outputs) equal the materialised computation; ``temperature`` receives no
  gradient (zeros). Reverse mode only (``jax.grad``, ``vjp``); use
  :func:`token_log_probs` on logits for ``jvp`` or Hessians. Matmuls
  accumulate in float32 (``preferred_element_type``); results come back in
  the promoted dtype of ``hidden`` and ``weight``.

  Args:
    hidden: hidden states ``[..., H]``.
    weight: the LM head ``[H, V]`` (Flax ``Dense`` kernel layout).
    token_ids: the sampled token ids ``hidden.shape[:-1]``: an id outside
      ``[0, V)`` raises ``ValueError`` when the ids are known, gives NaN
      under ``jit``.
    bias: optional bias ``[V]``.
    temperature: positive softmax temperature (a traced scalar is allowed;
      NaN unless positive and finite).
    softcap: soft-cap the logits before the temperature (``None``: none).
    where: a per-token mask ``hidden.shape[:-1]``: a masked token gives 0
      and zero gradients.
    ignore_index: a token id meaning "no token" (padding such as -100): such
      tokens give 0 and zero gradients, like masked ones.
    return_entropy: also return the entropy per token.
    chunk_size: tokens per chunk; ``None`` picks a power of two per platform,
      as in :func:`fused_distillation_loss`.
    axis_name: the mesh axis over which the V axis of ``weight`` and ``bias``
      is split inside ``jax.shard_map`` (hidden states and ids whole): each
      device computes its slice of every chunk's logits; the statistics are
      combined with ``lax.pmax``/``lax.psum``, the token's logit comes from
      the device that holds it, the gradient wrt ``hidden`` is summed over
      the axis and those wrt ``weight`` and ``bias`` stay local slices. No
      all-gather; the result is replicated over ``axis_name``.

  Returns:
    The log-probabilities ``hidden.shape[:-1]``; with ``return_entropy``,
    ``(log_probs, entropy)``.

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
  out_dtype = _check_linear(name, "student", hidden, weight, bias)
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
  _check_chunk(name, chunk_size, n, vocab * num_shards)  # a bad chunk_size fails early
  if n == 0 or vocab == 0:  # every counted id is out of range (NaN)
    log_p = entropy = jnp.zeros(n, t.dtype)
  else:
    h = jnp.asarray(hidden).reshape(n, np.shape(hidden)[-1])
    w_arr, b_arr = _vary_like_tokens(weight, bias, h, safe, mask)
    kernel = lambda chunk: (chunk, axis_name, cap, None)  # noqa: E731
    call = lambda chunk: _fused_tokens(kernel(chunk), h, w_arr, b_arr, safe, t, mask)  # noqa: E731
    out = _per_platform(chunk_size, name, n, vocab * num_shards, call)
    log_p, entropy = cast(tuple[jax.Array, jax.Array], out)
  return token_outputs(
    log_p, entropy, in_range, mask, token_shape, out_dtype, temperature, return_entropy
  )
