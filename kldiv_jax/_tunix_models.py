"""A Flax NNX language model's last hidden states and LM head, without its logits.

Tunix 0.1.7's model families, in one table: Gemma, Gemma 3, Qwen 2 and Qwen 3 sow the
final-norm hidden states (``output_hidden_states=True``, ``nnx.Intermediate``
``'all_hidden_states'``); Llama 3 and Gemma 4 have no such switch, so the output of their
own ``final_norm`` is taken as it is computed. The head is ``lm_head`` (``[H, V]``, untied)
or the embedder's table (``[V, H]``, tied), in the dtype the model computes its logits in,
and the logit soft-cap where the model applies one. Under ``jit`` the model's own logits,
which nothing reads, are removed by XLA.
"""

# pyright: reportMissingImports=false
# (flax and tunix: the `tunix` extra; `make typecheck` runs where it is not installed.)

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


class Head(NamedTuple):
  """An LM head as the fused losses take it: ``logits = softcap(hidden @ weight + bias)``."""

  weight: jax.Array  # [H, V], in the dtype the model computes its logits in
  bias: jax.Array | None = None  # [V]
  softcap: float | None = None


class _Family(NamedTuple):
  switch: bool  # __call__ takes output_hidden_states and sows 'all_hidden_states'
  softcap: Callable[[Any], float | None]  # the soft-cap the model applies to its logits


_NO_CAP: Callable[[Any], float | None] = lambda model: None  # noqa: E731

# Tunix 0.1.7's model classes (tunix.models.<family>.model).
FAMILIES: dict[str, _Family] = {
  "Gemma": _Family(True, lambda model: model.final_logits_softcap),
  "Gemma3": _Family(True, _NO_CAP),
  "Qwen2": _Family(True, _NO_CAP),
  "Qwen3": _Family(True, _NO_CAP),
  "Llama3": _Family(False, _NO_CAP),
  "Gemma4": _Family(False, lambda model: model.config.final_logit_softcap),
}


def _missing(model, attribute: str, why: str) -> AttributeError:
  return AttributeError(
    f"kldiv_jax.tunix: {type(model).__name__} has no attribute {attribute!r} ({why}); the"
    " fused losses need the model's hidden states and head and do not fall back to its"
    " logits. Pass head=kldiv_jax.tunix.Head(weight, bias, softcap) and hidden states of"
    " your own (docs: 'With Tunix', 'Any Flax NNX model')."
  )


def _family(model) -> _Family:
  family = FAMILIES.get(type(model).__name__)
  if family is not None:
    return family
  try:
    switch = "output_hidden_states" in inspect.signature(model.__call__).parameters
  except (TypeError, ValueError):  # pragma: no cover - a builtin __call__
    switch = False
  return _Family(switch, lambda m: getattr(m, "final_logits_softcap", None))


def _head_dtype(module) -> Any:
  """The dtype a Tunix Embedder.decode / Einsum casts to, or None where it promotes."""
  dtype = getattr(module, "dtype", None)
  if dtype is None:
    dtype = getattr(getattr(module, "config", None), "dtype", None)
  return dtype


def lm_head(model: nnx.Module) -> Head:
  """The LM head of a Tunix causal LM: ``lm_head.w`` or, tied, the embedder's table.

  The weight comes ``[H, V]`` in the dtype the model casts to before its logits matmul
  (``config.dtype`` for Qwen, Llama's and Gemma 4's; the parameters' own for Gemma and
  Gemma 3, whose matmul promotes), with the logit soft-cap the model applies (Gemma 2's
  ``final_logit_softcap``, Gemma 4's). Differentiable: call it inside the loss, on the
  model being trained, and the gradient reaches the head (tied: the embedding too).

  Raises:
    AttributeError: naming the attribute that is missing (``lm_head`` or
      ``embedder.input_embedding``).
    NotImplementedError: a LoRA adapter on the head (its weight alone would miss it).
  """
  head = getattr(model, "lm_head", None)
  module = head if head is not None else getattr(model, "embedder", None)
  if module is not None and any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(module)):
    name = "lm_head" if head is not None else "embedder"
    raise NotImplementedError(
      f"kldiv_jax.tunix: {type(model).__name__}.{name} carries a LoRA adapter; the fused"
      " losses read the head's weight and would miss it. Leave the head out of the LoRA"
      " targets, or pass head=kldiv_jax.tunix.Head(weight with the adapter merged, ...)."
    )
  if head is not None:
    if not hasattr(head, "w"):
      raise _missing(model, "lm_head.w", "the untied head's [H, V] kernel")
    weight, dtype = head.w[...], _head_dtype(head)
  else:
    embedder = getattr(model, "embedder", None)
    if embedder is None or not hasattr(embedder, "input_embedding"):
      raise _missing(model, "embedder.input_embedding", "no lm_head: the tied head's table")
    weight, dtype = embedder.input_embedding[...].T, _head_dtype(embedder)
  if dtype is not None:
    weight = weight.astype(dtype)
  return Head(weight, None, _family(model).softcap(model))


@contextlib.contextmanager
def _tap(module, outputs: list) -> Iterator[None]:
  """Record ``module``'s outputs while the block runs (its class's __call__, this instance)."""
  cls = type(module)
  original = cls.__call__

  def call(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    if self is module:
      outputs.append(out)
    return out

  cls.__call__ = call
  try:
    yield
  finally:
    cls.__call__ = original


def hidden_states(
  model: nnx.Module,
  tokens: jax.Array,
  *,
  positions: jax.Array | None = None,
  attention_mask: jax.Array | None = None,
  **model_kwargs: Any,
) -> jax.Array:
  """The final-norm hidden states ``[B, L, H]`` of a Tunix causal LM, as its head reads them.

  Calls ``model(tokens, positions=, cache=None, attention_mask=, **model_kwargs)`` as Tunix's
  own ``compute_per_token_logps`` does; the families with ``output_hidden_states`` (Gemma,
  Gemma 3, Qwen 2, Qwen 3) sow them, the others' (Llama 3, Gemma 4) come from their
  ``final_norm`` as it runs. The logits the model computes as well are unused: under
  ``jit`` XLA removes them.

  Raises:
    AttributeError: a model with neither ``output_hidden_states`` nor ``final_norm``.
  """
  kwargs = {"positions": positions, "cache": None, "attention_mask": attention_mask}
  kwargs |= model_kwargs
  if _family(model).switch:
    forward = lambda m: m(tokens, output_hidden_states=True, **kwargs)  # noqa: E731
    _, sown = nnx.capture(forward, nnx.Intermediate)(model)
    sown_states: Any = sown.get("all_hidden_states")
    if sown_states is None:
      raise _missing(model, "all_hidden_states", "sown with output_hidden_states=True")
    return sown_states.get_value()[-1]
  norm = getattr(model, "final_norm", None)
  if norm is None:
    raise _missing(model, "final_norm", "no output_hidden_states switch either")
  outputs: list = []
  with _tap(norm, outputs):
    model(tokens, **kwargs)
  if len(outputs) != 1:
    raise ValueError(
      f"kldiv_jax.tunix: {type(model).__name__}.final_norm ran {len(outputs)} times in one"
      " forward pass; expected once (its output is the hidden states the head reads)."
    )
  return outputs[0]


def linear_inputs(hidden: jax.Array, head: Head) -> tuple[jax.Array, jax.Array]:
  """``hidden`` and ``head.weight`` in the dtype the model's matmul computes in."""
  dtype = jnp.result_type(hidden, head.weight)
  return hidden.astype(dtype), head.weight.astype(dtype)
