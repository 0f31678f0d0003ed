"""Tunix's distillation trainer on the fused path: strategies from hidden states and heads.

:class:`FusedLogitStrategy` hands the student's and the teacher's hidden states and heads to
:func:`kldiv_jax.fused_distillation_loss`; :class:`FusedTopKStrategy` a teacher stored as its
top-k to :func:`kldiv_jax.fused_topk_distillation_loss`. Neither builds a ``[B, L, V]`` array.
"""

# pyright: reportMissingImports=false
# (flax and tunix: the `tunix` extra; `make typecheck` runs where it is not installed.)

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from tunix.distillation.strategies import base_strategy
from tunix.sft import utils

from kldiv_jax._fused_distill import fused_distillation_loss, fused_topk_distillation_loss
from kldiv_jax._fused_tokens import fused_token_log_probs
from kldiv_jax._tunix_models import Head, _family, hidden_states, linear_inputs, lm_head


def model_forward(model, input_tokens, input_mask, positions=None, attention_mask=None, **_):
  """The final-norm hidden states of a Tunix LM on the distillation trainer's inputs.

  ``positions`` and ``attention_mask`` from the inputs where a ``gen_model_input_fn`` gave
  them, else from ``input_mask`` as Tunix's own recipes build them (left padding: positions
  counted from the first token, a causal mask that skips the padding).
  """
  mask = input_mask.astype(bool)
  positions = utils.build_positions_from_mask(mask) if positions is None else positions
  attention_mask = utils.make_causal_attn_mask(mask) if attention_mask is None else attention_mask
  return hidden_states(model, input_tokens, positions=positions, attention_mask=attention_mask)


def next_token_labels(input_tokens, input_mask, **_):
  """A causal LM's labels: token ``t + 1`` at position ``t`` (the last wraps round, masked)."""
  return jnp.roll(input_tokens, -1, axis=-1)


def next_token_mask(input_tokens, input_mask, **_):
  """The positions whose next token is a real one (the last position predicts nothing)."""
  return jnp.roll(input_mask.astype(bool), -1, axis=-1).at[..., -1].set(False)


class TeacherOutput(NamedTuple):
  """The teacher as :class:`FusedLogitStrategy` hands it over: no logits."""

  hidden: jax.Array  # [B, L, H_T]
  weight: jax.Array  # [H_T, V_T]
  bias: jax.Array | None = None  # [V_T]


class _Fused(base_strategy.BaseStrategy):
  """The student side both strategies share: hidden states, head, labels, mask, eval loss."""

  def __init__(self, teacher_forward_fn, labels_fn, mask_fn, student_forward_fn, options):
    super().__init__(student_forward_fn or model_forward, teacher_forward_fn, labels_fn)
    self._mask_fn = mask_fn
    self.options: dict[str, Any] = {
      "temperature": 2.0,
      "alpha": 0.5,
    } | options  # LogitStrategy's defaults

  def _student(self, student_model, inputs):
    hidden = self.get_student_outputs(student_model, inputs)
    head = lm_head(student_model)
    labels, mask = self._labels_fn(**inputs), self._mask_fn(**inputs)
    return hidden, head, labels, mask

  def get_train_loss(self, student_model, teacher_output, inputs):
    hidden, head, labels, mask = self._student(student_model, inputs)
    return self.compute_loss((hidden, head), teacher_output, labels, where=mask)

  def get_eval_loss(self, student_model, inputs):
    """The student's cross entropy over the masked tokens (LogitStrategy's task loss)."""
    hidden, head, labels, mask = self._student(student_model, inputs)
    h, w = linear_inputs(jax.lax.stop_gradient(hidden), head)
    lp = fused_token_log_probs(
      h, jax.lax.stop_gradient(w), labels, bias=head.bias, softcap=head.softcap, where=mask
    )
    lp = cast(jax.Array, lp)
    mask = jnp.broadcast_to(mask, lp.shape)
    return -jnp.sum(jnp.where(mask, lp, 0.0)) / jnp.maximum(jnp.sum(mask), 1), {}

  def compute_loss(self, student_output, teacher_output, labels, where=None):
    raise NotImplementedError  # pragma: no cover - each strategy's own

  def compute_eval_loss(self, student_output, labels, where=None):  # pragma: no cover
    raise NotImplementedError("get_eval_loss computes it from the model's hidden states")

  @staticmethod
  def _metrics(loss, parts):
    tokens = jnp.maximum(parts.num_tokens, 1)
    return loss, {
      "distill/soft_loss": parts.soft / tokens,
      "distill/hard_loss": parts.hard / tokens,
    }


class FusedLogitStrategy(_Fused):
  """Tunix's ``LogitStrategy`` as :func:`kldiv_jax.fused_distillation_loss`: no logits.

  The teacher's output is :class:`TeacherOutput` (its hidden states and head), the student's
  its hidden states, its head read from the model in the loss. ``labels_fn`` and ``mask_fn``
  take the trainer's inputs (``input_tokens=``, ``input_mask=``, ...) and return integer
  labels and a boolean token mask ``[B, L]`` (default: the next token, where it is real).
  ``options``: :func:`kldiv_jax.fused_distillation_loss`'s (``temperature=2.0``,
  ``alpha=0.5`` by default, as ``LogitStrategy``; ``divergence=``, ``chunk_size=``, ...).
  ``student_forward_fn``/``teacher_forward_fn``: ``(model, **inputs) -> hidden states``
  (default :func:`model_forward`).
  """

  def __init__(
    self,
    labels_fn: Callable[..., jax.Array] = next_token_labels,
    mask_fn: Callable[..., jax.Array] = next_token_mask,
    *,
    student_forward_fn: Callable[..., jax.Array] | None = None,
    teacher_forward_fn: Callable[..., jax.Array] | None = None,
    **options: Any,
  ):
    forward = teacher_forward_fn or model_forward
    super().__init__(self._teacher(forward), labels_fn, mask_fn, student_forward_fn, options)
    self._target_softcap: float | None = None

  @staticmethod
  def _teacher(forward):
    def teacher(model, **inputs) -> TeacherOutput:
      head = lm_head(model)
      h, w = linear_inputs(forward(model, **inputs), head)
      return TeacherOutput(h, w, head.bias)

    return teacher

  def get_teacher_outputs(self, teacher_model, inputs):
    self._target_softcap = _family(teacher_model).softcap(teacher_model)  # static, not traced
    return super().get_teacher_outputs(teacher_model, inputs)

  def compute_loss(self, student_output, teacher_output, labels, where=None):
    hidden, head = student_output
    h, w = linear_inputs(hidden, head)
    t = teacher_output
    loss, parts = fused_distillation_loss(
      h, w, t.hidden, t.weight, labels, bias=head.bias, target_bias=t.bias,
      softcap=head.softcap, target_softcap=self._target_softcap, where=where,
      return_parts=True, **self.options,
    )  # fmt: skip
    return self._metrics(loss, parts)


def topk_teacher(k: int, *, chunk_size: int = 1024, forward=model_forward):
  """A teacher forward for :class:`FusedTopKStrategy`: the teacher model's top-k, chunked.

  ``(indices, log_probs)`` ``[B, L, k]`` of the teacher's softmax, ``chunk_size`` tokens at a
  time (only ``[chunk_size, V]`` logits at once). A teacher stored offline needs no model:
  pass a ``teacher_forward_fn`` that returns the stored pair from the inputs instead.
  """

  def teacher(model, **inputs):
    head: Head = lm_head(model)
    h, w = linear_inputs(forward(model, **inputs), head)
    shape = h.shape[:-1]

    def one(row):
      z = row @ w
      if head.bias is not None:
        z = z + head.bias
      if head.softcap is not None:
        z = jnp.tanh(z / head.softcap) * head.softcap
      values, ids = jax.lax.top_k(jax.nn.log_softmax(z.astype(jnp.float32)), k)
      return ids, values

    ids, values = jax.lax.map(one, h.reshape(-1, h.shape[-1]), batch_size=chunk_size)
    return ids.reshape(*shape, k), values.reshape(*shape, k)

  return teacher


class FusedTopKStrategy(_Fused):
  """A teacher stored as its top-k: :func:`kldiv_jax.fused_topk_distillation_loss`.

  ``teacher_forward_fn(model, **inputs) -> (topk_indices, topk_log_probs)`` ``[B, L, k]``:
  :func:`topk_teacher` for a live teacher model, or one that returns stored arrays. Labels,
  mask, student forward and ``options`` (``tail=``, ``divergence=``, ...) as in
  :class:`FusedLogitStrategy`.
  """

  def __init__(
    self,
    teacher_forward_fn: Callable[..., tuple[jax.Array, jax.Array]],
    labels_fn: Callable[..., jax.Array] = next_token_labels,
    mask_fn: Callable[..., jax.Array] = next_token_mask,
    *,
    student_forward_fn: Callable[..., jax.Array] | None = None,
    **options: Any,
  ):
    super().__init__(teacher_forward_fn, labels_fn, mask_fn, student_forward_fn, options)

  def compute_loss(self, student_output, teacher_output, labels, where=None):
    hidden, head = student_output
    h, w = linear_inputs(hidden, head)
    ids, log_probs = teacher_output
    loss, parts = fused_topk_distillation_loss(
      h, w, ids, log_probs, labels, bias=head.bias, softcap=head.softcap, where=where,
      return_parts=True, **self.options,
    )  # fmt: skip
    return self._metrics(loss, parts)
