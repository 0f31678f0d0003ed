"""shift_labels: a causal LM's labels aligned with its logits (Hugging Face's shift)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kldiv_jax._checks import check_int
from kldiv_jax._id_checks import index_array


def shift_labels(labels: jax.typing.ArrayLike, *, ignore_index: int = -100) -> jax.Array:
  r"""A causal LM's labels shifted to the logits' positions: the next token, then ``ignore_index``.

  The losses here compare ``logits[..., t, :]`` with ``labels[..., t]``: for a causal LM,
  whose logits at position :math:`t` predict token :math:`t + 1`, the labels must already be
  shifted. Hugging Face models shift inside their loss (``ForCausalLMLoss`` in
  ``transformers/loss/loss_utils.py``: ``labels`` padded with one ``ignore_index`` on the last
  axis, then ``labels[..., 1:]``); this is that shift, so that the labels a Hugging Face
  pipeline builds (``input_ids`` with ``-100`` on the prompt and the padding) can be passed
  to :func:`distillation_loss`, :func:`fused_distillation_loss` and
  :func:`fused_topk_distillation_loss` (``labels``), or as ``token_ids`` to
  :func:`token_log_probs` and :func:`fused_token_log_probs` with ``ignore_index``:

  .. math::

     \text{out}_{\ldots, t} = \text{labels}_{\ldots, t + 1} \ (t < T - 1), \qquad
     \text{out}_{\ldots, T - 1} = \text{ignore\_index}.

  The shape is kept (the logits need no slicing: their last position, which predicts no
  token, is ignored). Packed sequences: the last token of one sequence then labels the
  first position of the next only if they share a row; set the label at each sequence's
  end to ``ignore_index`` (Hugging Face's ``DataCollatorWithFlattening`` does so with
  ``-100`` at each sequence's first position before the shift).

  Args:
    labels: integer token ids ``[..., T]`` (``T`` the sequence axis, last).
    ignore_index: the label of the last position (it must fit ``labels``' dtype).

  Returns:
    The shifted labels, same shape and dtype.

  Raises:
    TypeError: non-integer labels or ``ignore_index``.
    ValueError: scalar labels, an ``ignore_index`` outside the labels' dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kldiv_jax import shift_labels
    >>> input_ids = jnp.array([[5, 6, 7, 8], [1, 2, -100, -100]])  # -100: padding
    >>> shift_labels(input_ids)
    Array([[   6,    7,    8, -100],
           [   2, -100, -100, -100]], dtype=int32)
  """
  name = "shift_labels"
  ids = index_array(name, "labels", labels, "token ids")
  ignore = check_int(name, "ignore_index", ignore_index)
  if ids.ndim == 0:
    raise ValueError(f"{name}: labels must have a sequence axis, shape [..., T]; got a scalar.")
  info = jnp.iinfo(ids.dtype)
  if not info.min <= ignore <= info.max:
    raise ValueError(
      f"{name}: ignore_index={ignore} does not fit the labels' dtype {ids.dtype} "
      f"([{info.min}, {info.max}]); cast the labels to a signed integer dtype."
    )
  last = jnp.full((*ids.shape[:-1], min(1, ids.shape[-1])), ignore, ids.dtype)
  return jnp.concatenate([ids[..., 1:], last], axis=-1)
