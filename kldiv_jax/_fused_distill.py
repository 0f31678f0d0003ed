"""Fused distillation losses: logits from hidden states and LM heads, gradients in the forward pass.

:func:`fused_distillation_loss` (a dense teacher: hidden states and a head) and
:func:`fused_topk_distillation_loss` (a teacher stored as its top-k) run over ``chunk_size``
tokens at a time (:mod:`kldiv_jax._fused_chunks`): each chunk's logits are reduced to the
chunk's loss and its gradient wrt the student's logits, folded at once into the gradients wrt
``hidden``, ``weight`` and ``bias`` (as Liger Kernel's fused-linear distillation losses do).
The backward pass only scales those gradients by the cotangent: no recomputation, memory of
one chunk's logits plus the gradients. A teacher is a :class:`Teacher` (dense or top-k); the
options are parsed by :func:`distillation_loss`'s parse (``_distill.distill_options``), a
top-k teacher by :func:`divergence_from_topk`'s (``_topk.check_topk_teacher``). With
``implementation="pallas"``, a program lowered for CUDA runs the dense teacher's loss through
the opt-in Pallas Triton kernels of :mod:`kldiv_jax._gpu_fused_distill` instead (no chunk's
logits in HBM), and the top-k teacher's through :mod:`kldiv_jax._gpu_fused_topk`'s, where
they take the operands and options.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kldiv_jax._checks import check_float, compute_dtype
from kldiv_jax._distill import (
  DistillationParts,
  DistillOptions,
  LossWeights,
  distill_options,
  hard_rows,
  soft_hard_rows,
)
from kldiv_jax._divergence_spec import Divergence
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
  zero_head_grads,
)
from kldiv_jax._gpu_fused_distill import (
  distill_kernel,
  kernel_labels,
  one_pass_kind,
  pallas_distill,
)
from kldiv_jax._gpu_fused_distill import takes as gpu_takes
from kldiv_jax._gpu_fused_head import cuda_or_xla
from kldiv_jax._gpu_fused_topk import pallas_topk_totals
from kldiv_jax._gpu_fused_topk import takes as topk_takes
from kldiv_jax._id_checks import teacher_classes
from kldiv_jax._implementation import resolve_implementation
from kldiv_jax._platform import compiled, gpu_kernels_for
from kldiv_jax._rows import shared_classes
from kldiv_jax._sparse import topk_rows
from kldiv_jax._tokens import token_mask
from kldiv_jax._topk import TAIL_FLOOR, check_topk_teacher, topk_teacher
from kldiv_jax._vocab_parallel import VOCAB_PARALLEL_PADDING, check_axis_name


class Static(NamedTuple):
  """The static part of a fused call (hashable): what each chunk computes."""

  key: tuple  # the divergence's Divergence.key
  chunk: int
  axis_name: str | None
  caps: tuple[float | None, float | None]
  weights: LossWeights
  shared: int  # the classes both sides have (per device): longer logits are cut per chunk
  low: Any = None  # bf16/f16 inputs: the logits and their gradient in that dtype (chunk_logits)
  implementation: str = "auto"  # resolved (kldiv_jax._implementation): "xla", "pallas", "auto"


class Teacher(Protocol):
  """What a chunk needs of a teacher (a pytree: an operand of the chunked kernel).

  ``tokens()``: its arrays with one row per token (cut per chunk); ``chunk(cut)``: the teacher
  of a chunk of tokens, ``cut`` slicing the chunk's rows of an array; ``rows(z, temperature,
  spec, mask, static, labels, labelled, ce_opts)``: ``(divergence rows, cross entropy rows)``
  of a chunk's student logits ``z`` against it (0 for a term ``static.weights`` leaves out),
  ``z`` as the matmul rounded them (``static.low`` for bf16/f16 inputs: the top-k path reads
  them raw, so no float32 copy is written for its gather).
  """

  def tokens(self) -> tuple: ...
  def chunk(self, cut) -> Teacher: ...
  def rows(
    self, z, temperature, spec: Divergence, mask, static: Static, labels, labelled, ce_opts
  ) -> tuple[jax.Array, jax.Array]: ...


@dataclasses.dataclass(frozen=True)
class DenseTeacher:
  """A :class:`Teacher` given by its hidden states ``[n, H_T]`` and its LM head."""

  hidden: jax.Array
  weight: jax.Array
  bias: jax.Array | None

  def tokens(self) -> tuple:
    return (self.hidden,)

  def chunk(self, cut) -> DenseTeacher:
    return dataclasses.replace(self, hidden=cut(self.hidden))

  def rows(self, z, temperature, spec, mask, static: Static, labels, labelled, ce_opts):
    # Both terms as distillation_loss takes them (one kernel where both count).
    z = z.astype(compute_dtype(z.dtype))
    y = chunk_logits(self.hidden, self.weight, self.bias, z.dtype, static.low)
    y = lax.stop_gradient(shared_classes(y, static.shared, 1))
    return soft_hard_rows(
      z, y, temperature, (mask,), spec, labels, labelled, static.weights, static.axis_name,
      static.caps, static.implementation, ce_opts,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TopkTeacher:
  """A :class:`Teacher` stored as its top-k, laid out by :func:`kldiv_jax._topk.topk_teacher`."""

  ids: jax.Array
  lp: jax.Array
  keep: jax.Array
  dropped: jax.Array
  bucket: bool  # static: tail="bucket"
  floor: float = 0.0  # static: the least tail mass with the bucket

  def tokens(self) -> tuple:
    return (self.ids, self.lp, self.keep, self.dropped)

  def chunk(self, cut) -> TopkTeacher:
    ids, lp, keep, dropped = cut(self.tokens())
    return dataclasses.replace(self, ids=ids, lp=lp, keep=keep, dropped=dropped)

  def rows(self, z, temperature, spec, mask, static: Static, labels, labelled, ce_opts):
    acc = compute_dtype(z.dtype)
    soft = hard = jnp.zeros((z.shape[0],), acc)
    if static.weights.soft:
      soft = topk_rows(
        z, self.ids, self.lp, self.keep & mask, self.dropped, temperature, spec, self.bucket,
        static.caps[0], static.axis_name, self.floor,
      )  # fmt: skip
    if static.weights.hard:
      cap = static.caps[0]
      hard = hard_rows(z.astype(acc), labels, labelled, (mask,), static.axis_name, cap, ce_opts)
    return soft, hard


jax.tree_util.register_dataclass(DenseTeacher, ["hidden", "weight", "bias"], [])
jax.tree_util.register_dataclass(TopkTeacher, ["ids", "lp", "keep", "dropped"], ["bucket", "floor"])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(
  static: Static, h, w, b, teacher: Teacher, temperature, params, tokens, coefs, ce_opts
) -> tuple:
  return _fused_fwd(static, h, w, b, teacher, temperature, params, tokens, coefs, ce_opts)[0]


def _fused_fwd(
  static: Static, h, w, b, teacher: Teacher, temperature, params, tokens, coefs, ce_opts
):
  """``(loss, soft, hard)`` summed over the chunks, and the gradients of ``loss`` wrt ``h``,
  ``w`` and ``b``: each chunk's logit gradient folded in as the chunk is computed.
  ``ce_opts``: the cross entropy's (``_ce.CEOptions``)."""
  axis_name = static.axis_name
  # The divergence of the chunks: its static part from ``static``, traced parameters from ``params``.
  spec = Divergence.tree_unflatten(static.key, params)
  acc = coefs.dtype  # float32, or float64 for float64 inputs

  def part(start, size, cut, carry):
    totals, grads = carry
    hc, teacher_c = cut(h), teacher.chunk(cut)
    mask, labels, labelled = cut(tokens)
    # A longer student head: its own classes are cut from each chunk's logits (their
    # gradient is 0, padded back below).
    z = shared_classes(chunk_logits(hc, w, b, acc, static.low, rounded=True), static.shared, 1)

    def objective(z):
      rows = teacher_c.rows(z, temperature, spec, mask, static, labels, labelled, ce_opts)
      soft, hard = (jnp.sum(r).astype(acc) for r in rows)
      return coefs[0] * soft + coefs[1] * hard, (soft, hard)

    loss, vjp, parts = jax.vjp(objective, z, has_aux=True)
    (dz,) = vjp(jnp.ones_like(loss))
    if dz.shape[1] < w.shape[1]:
      dz = jnp.pad(dz, ((0, 0), (0, w.shape[1] - dz.shape[1])))
    totals = tuple(t + p for t, p in zip(totals, (loss, *parts)))
    return totals, fold_logit_grad(grads, start, hc, w, dz, axis_name, acc, static.low)

  # Inside jax.shard_map, loop carries keep the mesh axes their values vary over: the loss
  # those of the tokens (the head's gradients the head's, see vary_like_tokens).
  zero = token_zero(h, *teacher.tokens(), *tokens).astype(acc)
  carry = ((zero, zero, zero), zero_head_grads(h, w, acc))
  totals, grads = chunks(h.shape[0], static.chunk, part, carry)
  return totals, (grads, (h, w, b, teacher, temperature, params, tokens, coefs, ce_opts))


def _fused_bwd(static, residuals, g):
  grads, (h, w, b, *operands) = residuals
  s = g[0].astype(grads[0].dtype)  # the parts (g[1], g[2]) carry no gradient
  return head_cotangents(grads, s, h, w, b, operands)


_fused.defvjp(_fused_fwd, _fused_bwd)
_fused = compiled(_fused, static_argnums=0)


class _Student(NamedTuple):
  """The student's side of a fused call, checked and laid out as tokens."""

  h: jax.Array  # [n, H]
  w: jax.Array
  b: jax.Array | None
  out_dtype: jnp.dtype
  token_shape: tuple[int, ...]
  vocab: int  # the head's (per device)
  num_shards: int
  mask: jax.Array  # where, [n, 1]


def _student(name, hidden, weight, bias, where, axis_name) -> _Student:
  out_dtype = check_linear(name, "student", hidden, weight, bias)
  num_shards = 1 if axis_name is None else check_axis_name(name, axis_name)
  token_shape = tuple(np.shape(hidden)[:-1])
  n = int(np.prod(token_shape, dtype=np.int64))  # explicit: reshape(-1, 0) is ambiguous
  mask = token_mask(name, where, token_shape, n)
  h = jnp.asarray(hidden).reshape(n, np.shape(hidden)[-1])
  w, b = jnp.asarray(weight), None if bias is None else jnp.asarray(bias)
  return _Student(h, w, b, out_dtype, token_shape, w.shape[1], num_shards, mask)


def _dense_teacher(name, s: _Student, hidden, weight, bias, teacher_vocab_size, axis_name):
  """``(DenseTeacher, shared classes per device)``, checked."""
  check_linear(name, "teacher", hidden, weight, bias)
  if tuple(np.shape(hidden)[:-1]) != s.token_shape:
    raise ValueError(
      f"{name}: hidden and target_hidden must have the same tokens; got shapes "
      f"{(*s.token_shape, s.h.shape[1])} and {np.shape(hidden)}."
    )
  tw = jnp.asarray(weight)
  tb = None if bias is None else jnp.asarray(bias)
  sizes = (s.vocab * s.num_shards, tw.shape[1] * s.num_shards)
  sharded = None if axis_name is None else VOCAB_PARALLEL_PADDING
  teacher_classes(name, teacher_vocab_size, *sizes, ("weight", "target_weight"), sharded)
  th = jnp.asarray(hidden).reshape(s.h.shape[0], np.shape(hidden)[-1])
  # The shared classes (see _rows.shared_classes): each chunk's logits are cut to them,
  # not the heads (a copy of a [H, V] head would cost more than the chunks).
  return DenseTeacher(th, tw, tb), min(s.vocab, tw.shape[1])


def _topk_teacher(
  name, s: _Student, indices, log_probs, tail, where, teacher_vocab_size, axis_name, tail_floor
):
  """``(TopkTeacher, shared classes per device, rows with an id out of range [n, 1])``."""
  check_float(name, ("topk_log_probs",), log_probs)
  global_vocab = s.vocab * s.num_shards
  shape_text = "hidden.shape[:-1]"
  args = check_topk_teacher(
    name, indices, log_probs, tail, where, s.token_shape, shape_text, global_vocab,
    teacher_vocab_size, axis_name, tail_floor,
  )  # fmt: skip
  shared = min(global_vocab, args.teacher_vocab)  # equal with axis_name (checked)
  n, k = s.h.shape[0], args.indices.shape[-1]
  lp = args.log_probs.astype(compute_dtype(s.out_dtype)).reshape(n, k)
  t = topk_teacher(args.indices.reshape(n, k), lp, None, shared, args.teacher_vocab)
  teacher = TopkTeacher(t.ids, t.lp, t.keep, t.dropped, args.bucket, args.floor)
  return teacher, shared // s.num_shards, t.bad[:, None]


def _fused_loss(
  name,
  o: DistillOptions,
  s: _Student,
  teacher: Teacher,
  vocab,
  bad,
  labels,
  chunk_size,
  axis_name,
  logits_dtype=None,
  implementation="auto",
):
  """The body of the fused losses once the teacher is laid out: labels, the chunked kernel,
  the mean. ``vocab``: the classes both sides share (per device)."""
  low = low_dtype(name, s.out_dtype, logits_dtype)
  n, mask, cdt = s.h.shape[0], s.mask, compute_dtype(s.out_dtype)
  labelled = None
  if labels is not None:
    shape_text = "shape hidden.shape[:-1] ="
    labels, labelled = o.labels(name, labels, s.token_shape, shape_text, vocab * s.num_shards, mask)
    mask = labelled = mask & labelled  # a masked token's label is not read (no NaN from it)
  check_chunk(name, chunk_size, n, vocab * s.num_shards)  # a bad chunk_size fails early
  weights = o.weights(labels is not None)
  ce_opts = o.ce_options(name, labels is not None, cdt)
  checks = o.checks()
  if bad is not None:
    checks = (*checks, ~jnp.any(bad & mask))
  t = jnp.asarray(o.temperature, cdt)
  t2 = jnp.asarray(o.t2(t), cdt)
  if labels is None:
    coefs = jnp.stack([t2, jnp.zeros((), cdt)])
  else:
    a = jnp.asarray(o.alpha, cdt)
    coefs = jnp.stack([a * t2, 1.0 - a])
  coefs = coefs / o.denominator(mask, cdt)
  num_tokens = jnp.sum(mask)
  if n == 0 or vocab == 0:  # no tokens, or no vocabulary: nothing to sum
    zero = jnp.zeros((), s.out_dtype)
    return o.finish(zero, zero, zero, num_tokens, checks, s.out_dtype)
  w, b = vary_like_tokens(s.w, s.b, s.h, *teacher.tokens(), mask)
  params = tuple(jnp.asarray(x).astype(cdt) for x in o.spec.traced)
  tokens = (mask, labels, labelled)

  def static(chunk):
    return Static(o.spec.key, chunk, axis_name, o.caps, weights, vocab, low, implementation)

  def call(chunk):
    return _fused(static(chunk), s.h, w, b, teacher, t, params, tokens, coefs, ce_opts)

  def xla():
    return per_platform(chunk_size, name, n, vocab * s.num_shards, call)

  gpu = gpu_kernels_for(implementation)
  if gpu and isinstance(teacher, DenseTeacher):
    totals = _gpu_or_xla(s, w, b, teacher, static(0), ce_opts, tokens, t, params, coefs, xla)
  elif gpu and isinstance(teacher, TopkTeacher):
    totals = _gpu_topk_or_xla(s, w, b, teacher, static(0), ce_opts, tokens, t, params, coefs, xla)
  else:
    totals = xla()
  # Arrays: the cast restates ``_fused``'s annotation, which the checker loses
  # to jax.custom_vjp's unannotated ``__new__`` (it may return jax's custom_vjp3).
  loss, soft, hard = cast(tuple[jax.Array, jax.Array, jax.Array], totals)
  return o.finish(loss, soft * t2, hard, num_tokens, checks, s.out_dtype)


def _gpu_or_xla(s, w, b, teacher: DenseTeacher, static: Static, ce_opts, tokens, t, params,
                coefs, xla):  # fmt: skip
  """The totals ``(loss, soft, hard)`` from the opt-in Pallas Triton kernels
  (:mod:`kldiv_jax._gpu_fused_distill`) in a program lowered for CUDA, where they take the
  operands and options; ``xla()`` (the chunk loop) elsewhere."""
  th, tw, tb = teacher.hidden, teacher.weight, teacher.bias
  soft, hard = static.weights.soft, static.weights.hard
  if not gpu_takes(s.h, w, th, tw, static.axis_name, static.caps, ce_opts, soft):
    return xla()
  mask, labels, labelled = tokens
  n, vocab = s.h.shape[0], static.shared
  ids, ok = kernel_labels(labels, labelled, vocab, n, hard and labels is not None)
  kind = one_pass_kind(static.key, params)
  cfg, view = distill_kernel(
    n, s.h.shape[1], vocab, static.low, static.key, th.shape[1], tb is not None, hard, kind
  )
  scalars = jnp.stack([t, *params]).astype(jnp.float32)
  coefs32 = coefs.astype(jnp.float32)

  def gpu():
    out = pallas_distill(cfg, view, s.h, w, b, th, tw, tb, ids, mask, ok, scalars, coefs32)
    # The cast restates pallas_distill's result, which the checker loses to jax.custom_vjp.
    return tuple(x.astype(coefs.dtype) for x in cast(tuple[jax.Array, ...], out))

  return cuda_or_xla(gpu, xla)


def _gpu_topk_or_xla(s, w, b, teacher: TopkTeacher, static: Static, ce_opts, tokens, t, params,
                     coefs, xla):  # fmt: skip
  """:func:`_gpu_or_xla` for a top-k teacher (:mod:`kldiv_jax._gpu_fused_topk`)."""
  hard = static.weights.hard and tokens[1] is not None
  k = teacher.ids.shape[1]
  if not topk_takes(s.h, w, static.axis_name, static.caps[0], ce_opts, static.weights.soft, k):
    return xla()

  def gpu():
    out = pallas_topk_totals(
      s.h, w, b, teacher, tokens, t, params, coefs, static.key, static.low, static.shared, hard
    )
    return tuple(x.astype(coefs.dtype) for x in out)

  return cuda_or_xla(gpu, xla)


def fused_distillation_loss(
  hidden: jax.typing.ArrayLike,
  weight: jax.typing.ArrayLike,
  target_hidden: jax.typing.ArrayLike,
  target_weight: jax.typing.ArrayLike,
  labels: jax.typing.ArrayLike | None = None,
  *,
  alpha: float | jax.typing.ArrayLike = 0.5,
  ignore_index: int = -100,
  label_smoothing: float | jax.typing.ArrayLike = 0.0,
  z_loss: float | jax.typing.ArrayLike = 0.0,
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
  logits_dtype: jax.typing.DTypeLike | None = None,
  implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, DistillationParts]:
  r"""The whole distillation loss from hidden states and LM heads, chunked over tokens.

  ``distillation_loss(hidden @ weight + bias, target_hidden @ target_weight +
  target_bias, labels, ...)`` in value and gradients, computed ``chunk_size``
  tokens at a time: with :math:`s = h W + b` and :math:`t = h_T W_T + b_T`,

  .. math::

     L = \frac{1}{N} \sum_{\text{valid tokens}} \Big[\alpha\, T^2\,
         D\big(\mathrm{softmax}(t/T), \mathrm{softmax}(s/T)\big)
         + (1 - \alpha)\, \big(-\log \mathrm{softmax}(s)_{y}\big)\Big]

  (:math:`T^2 D` alone without ``labels``; ``label_smoothing`` and ``z_loss`` change the
  cross entropy as in :func:`distillation_loss`). The chunks: :doc:`/large-vocabularies`;
  reverse mode only, zero gradients for the teacher and the options:
  :ref:`derivatives`; ``axis_name``: :ref:`vocab-parallel`.

  .. note::

     ``alpha`` weights the distillation (soft) term and ``1 - alpha`` the cross entropy, as
     in :func:`distillation_loss`; the Hugging Face blog's ``DistillationTrainer`` and the
     Keras example weight the cross entropy with theirs: ``alpha = 1 - alpha_hf``.

  Args:
    hidden, weight: the student's hidden states ``[..., H]`` and LM head ``[H, V]``.
    target_hidden, target_weight: the teacher's, ``[..., H_T]`` and ``[H_T, V_T]``.
    labels: optional integer token ids ``hidden.shape[:-1]``: adds the cross entropy; for a
      causal LM already shifted (``labels[t]`` is the token after ``hidden[t]``):
      :func:`shift_labels`.
    bias, target_bias: optional biases ``[V]`` and ``[V_T]``.
    where: a token mask ``hidden.shape[:-1]``.
    chunk_size: tokens per chunk (``None``: a power of two per platform).
    axis_name: the mesh axis the V axis of the heads is split over.
    alpha, ignore_index, temperature, divergence, beta, normalizer: as in :func:`distillation_loss`.
    label_smoothing, z_loss: the cross entropy's, as in :func:`distillation_loss`.
    scale_by_temperature_squared, softcap, target_softcap, teacher_vocab_size, return_parts:
      as in :func:`distillation_loss`.
    implementation: as in :func:`distillation_loss`; ``"pallas"`` also runs, in a program
      lowered for CUDA, the opt-in Pallas Triton kernels of the fused head (both sides'
      logits of a block only on chip, Cut Cross-Entropy's design; never yet measured on a
      GPU) where they take the operands and options (each side's hidden states and head of
      one dtype among float32, bf16, f16; no ``axis_name``, soft-caps, ``label_smoothing``
      or ``z_loss``: :mod:`kldiv_jax._gpu_fused_distill`), else the chunk loop.
    logits_dtype: bf16/f16 inputs: what each chunk's logits (both sides) and their gradient
      are held in between the matmuls and the softmax. ``None`` (default): the inputs' dtype,
      as in the materialised ``hidden @ weight`` (half the bytes on GPUs); where the logits are
      large and close together (``|z|`` in the tens or more: bf16's step is ``|z| / 128``)
      that rounding costs the gradient its digits. ``jnp.float32``: the matmuls' float32
      results, the loss on float32 logits of the same inputs, at the cost of the float32
      ``[chunk, V]`` traffic and, for bf16, the two backward matmuls run twice (on the
      gradient's two bf16 terms, :ref:`fused-logits-dtype`). No effect on float32/float64
      inputs.

  Returns:
    A scalar in the promoted dtype; with ``return_parts``, ``(loss, parts)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kldiv_jax import distillation_loss, fused_distillation_loss
    >>> h, th = jax.random.normal(jax.random.key(0), (2, 6, 4))
    >>> w, tw = jax.random.normal(jax.random.key(1), (2, 4, 10))
    >>> y = jnp.array([1, 2, 3, -100, 4, 5])
    >>> fused, parts = fused_distillation_loss(
    ...   h, w, th, tw, y, temperature=2.0, chunk_size=4, return_parts=True
    ... )
    >>> want = distillation_loss(h @ w, th @ tw, y, temperature=2.0)
    >>> bool(jnp.allclose(fused, want)), int(parts.num_tokens)
    (True, 5)
  """
  name = "fused_distillation_loss"
  o = distill_options(
    name, alpha, beta, divergence, temperature, scale_by_temperature_squared, ignore_index,
    softcap, target_softcap, return_parts, normalizer, label_smoothing, z_loss,
  )  # fmt: skip
  impl = resolve_implementation(name, implementation)
  s = _student(name, hidden, weight, bias, where, axis_name)
  teacher, vocab = _dense_teacher(
    name, s, target_hidden, target_weight, target_bias, teacher_vocab_size, axis_name
  )
  return _fused_loss(
    name, o, s, teacher, vocab, None, labels, chunk_size, axis_name, logits_dtype, impl
  )


def fused_topk_distillation_loss(
  hidden: jax.typing.ArrayLike,
  weight: jax.typing.ArrayLike,
  topk_indices: jax.typing.ArrayLike,
  topk_log_probs: jax.typing.ArrayLike,
  labels: jax.typing.ArrayLike | None = None,
  *,
  alpha: float | jax.typing.ArrayLike = 0.5,
  ignore_index: int = -100,
  label_smoothing: float | jax.typing.ArrayLike = 0.0,
  z_loss: float | jax.typing.ArrayLike = 0.0,
  bias: jax.typing.ArrayLike | None = None,
  temperature: float | jax.typing.ArrayLike = 1.0,
  divergence: str | Divergence = "forward_kl",
  tail: str = "renormalize",
  tail_floor: float = TAIL_FLOOR,
  scale_by_temperature_squared: bool = True,
  where: jax.typing.ArrayLike | None = None,
  normalizer: float | jax.typing.ArrayLike | None = None,
  chunk_size: int | None = None,
  axis_name: str | None = None,
  softcap: float | None = None,
  teacher_vocab_size: int | None = None,
  return_parts: bool = False,
  logits_dtype: jax.typing.DTypeLike | None = None,
  implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, DistillationParts]:
  r"""Distillation loss from the student's hidden states and LM head and a top-k teacher.

  :func:`fused_distillation_loss` (gradients, chunks and ``axis_name`` alike) with
  the teacher stored as its top-k ids and log-probabilities: per valid token,
  averaged as in :func:`distillation_loss`, with :math:`s = h W + b` and
  :math:`D_k` the divergence of :func:`divergence_from_topk`,

  .. math::

     \alpha\, T^2\, D_k\big(p, \mathrm{softmax}(s/T)\big)
     + (1 - \alpha)\, \big(-\log \mathrm{softmax}(s)_{y}\big)

  (the cross entropy with ``label_smoothing`` and ``z_loss`` as in :func:`distillation_loss`).

  .. note::

     ``alpha`` weights the distillation (soft) term and ``1 - alpha`` the cross entropy, as
     in :func:`distillation_loss`; the Hugging Face blog's ``DistillationTrainer`` and the
     Keras example weight the cross entropy with theirs: ``alpha = 1 - alpha_hf``.

  Args:
    hidden, weight: the student's hidden states ``[..., H]`` and head ``[H, V]``; ``bias``: ``[V]``.
    topk_indices, topk_log_probs: the teacher's token ids and log-probabilities ``[..., k]``.
    labels: optional token ids ``hidden.shape[:-1]``: adds the cross entropy; for a causal LM
      already shifted: :func:`shift_labels`.
    tail, tail_floor: ``"renormalize"`` or ``"bucket"``, and the bucket's least tail mass
      (TRL's ``1e-7``), as in :func:`divergence_from_topk`.
    alpha, ignore_index, temperature, divergence, where, normalizer, chunk_size, axis_name: as
      in :func:`fused_distillation_loss`.
    label_smoothing, z_loss: the cross entropy's, as in :func:`distillation_loss`.
    scale_by_temperature_squared, softcap, teacher_vocab_size, return_parts, logits_dtype: as in
      :func:`fused_distillation_loss`.
    implementation: as in :func:`distillation_loss`; ``"pallas"`` also runs, in a program
      lowered for CUDA, the opt-in Pallas Triton kernels of the student's head (its logits of
      a block only on chip, the tail's log-sum-exp and its gradient; never yet run on a GPU)
      where they take the operands and options (``hidden`` and ``weight`` of one dtype among
      float32, bf16, f16; at most 256 slots; no ``axis_name``, ``softcap``,
      ``label_smoothing`` or ``z_loss``: :mod:`kldiv_jax._gpu_fused_topk`), else the chunk loop.

  Returns:
    A scalar in the promoted dtype; with ``return_parts``, ``(loss, parts)``.

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
  name = "fused_topk_distillation_loss"
  o = distill_options(
    name, alpha, 0.5, divergence, temperature, scale_by_temperature_squared, ignore_index,
    softcap, None, return_parts, normalizer, label_smoothing, z_loss,
  )  # fmt: skip
  impl = resolve_implementation(name, implementation)
  s = _student(name, hidden, weight, bias, where, axis_name)
  teacher, vocab, bad = _topk_teacher(
    name, s, topk_indices, topk_log_probs, tail, where, teacher_vocab_size, axis_name,
    tail_floor,
  )  # fmt: skip
  return _fused_loss(
    name, o, s, teacher, vocab, bad, labels, chunk_size, axis_name, logits_dtype, impl
  )
