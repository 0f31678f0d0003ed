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
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kldiv_jax._checks import (
  check_bool,
  check_float,
  check_normalizer,
  check_temperature,
  check_unit_interval,
  compute_dtype,
  mask_array,
)
from kldiv_jax._distill import loss_divergence
from kldiv_jax._divergence_api import Divergence
from kldiv_jax._engine import divergence_rows
from kldiv_jax._numerics import in_unit_interval, nan_unless, positive_finite
from kldiv_jax._rows import compiled
from kldiv_jax._vocab_parallel import check_axis_name

# Logit elements per chunk and side when chunk_size=None (16 MiB of float32).
_CHUNK_ELEMENTS = 1 << 22
# Vocabulary columns per block of the weight-gradient update.
_GRAD_W_BLOCK = 4096


def default_chunk_size(num_tokens: int, vocab_size: int) -> int:
  """A power of two near ``2**22 / vocab_size`` tokens, within ``[1, num_tokens]``."""
  size = max(1, _CHUNK_ELEMENTS // max(vocab_size, 1))
  size = 1 << (size.bit_length() - 1)
  return max(1, min(size, num_tokens))


def _matmul(a, w, b, dtype):
  out = lax.dot_general(a, w, (((1,), (0,)), ((), ())), preferred_element_type=dtype)
  return out if b is None else out + b.astype(dtype)[None, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(static, h, w, b, th, tw, tb, temperature, params, mask, scale) -> jax.Array:
  return _fused_fwd(static, h, w, b, th, tw, tb, temperature, params, mask, scale)[0]


def _fused_fwd(static, h, w, b, th, tw, tb, temperature, params, mask, scale):
  key, chunk, axis_name = static
  n = h.shape[0]
  # The divergence of the chunks: its static part from ``static``, traced parameters from ``params``.
  spec = Divergence.tree_unflatten(key, params)
  acc = scale.dtype  # float32, or float64 for float64 inputs

  def chunk_grads(hc, thc, mc):
    z = _matmul(hc, w, b, acc)
    y = lax.stop_gradient(_matmul(thc, tw, tb, acc))
    per_token = lambda z: divergence_rows(z, y, temperature, (mc,), spec, axis_name)  # noqa: E731
    loss, vjp = jax.vjp(lambda z: jnp.sum(per_token(z)), z)
    (dz,) = vjp(jnp.ones_like(loss))
    gh = lax.dot_general(dz, w, (((1,), (1,)), ((), ())), preferred_element_type=acc)
    if axis_name is not None:  # each device holds a slice of the head: sum the parts
      gh = lax.psum(gh, axis_name)
    return loss, gh, dz, jnp.sum(dz, axis=0)

  def add_weight_grad(grad_w, hc, dz):
    # grad_w += hc^T dz, a block of vocabulary columns at a time: a dot writes
    # a fresh buffer, so a whole [H, V] product would be a second [H, V] array.
    # Vocabulary parallel: a device's slice of the unsharded call's blocks.
    shards = 1 if axis_name is None else lax.axis_size(axis_name)
    block = min(w.shape[1], max(1, _GRAD_W_BLOCK // shards))
    num_blocks, rest = divmod(w.shape[1], block)

    def one(j, grad_w, width):
      cols = lambda a: lax.dynamic_slice_in_dim(a, j, width, axis=1)  # noqa: E731
      gw = lax.dot_general(hc, cols(dz), (((0,), (0,)), ((), ())), preferred_element_type=acc)
      return lax.dynamic_update_slice_in_dim(grad_w, cols(grad_w) + gw, j, axis=1)

    grad_w = lax.fori_loop(0, num_blocks, lambda k, g: one(k * block, g, block), grad_w)
    if rest:
      grad_w = one(num_blocks * block, grad_w, rest)
    return grad_w

  # ``full_like``: inside jax.shard_map, loop carries keep the mesh axes their
  # values vary over (the loss those of the tokens, the head's gradients the
  # head's, see fused_linear_kl_div).
  loss = _token_zero(h, th, mask).astype(acc)
  grad_h = lax.full_like(h, 0, acc)
  grad_w = lax.full_like(w, 0, acc)
  grad_b = lax.full_like(w, 0, acc, shape=w.shape[1:])

  def body(i, carry):
    loss, grad_h, grad_w, grad_b = carry
    start = i * chunk
    rows = lambda a: lax.dynamic_slice_in_dim(a, start, chunk, axis=0)  # noqa: E731
    hc = rows(h)
    part, gh, dz, gb = chunk_grads(hc, rows(th), rows(mask))
    grad_h = lax.dynamic_update_slice_in_dim(grad_h, gh, start, axis=0)
    return loss + part, grad_h, add_weight_grad(grad_w, hc, dz), grad_b + gb

  carry = (loss, grad_h, grad_w, grad_b)
  num_full = n // chunk
  if num_full:
    carry = lax.fori_loop(0, num_full, body, carry)
  loss, grad_h, grad_w, grad_b = carry
  tail = num_full * chunk
  if tail < n:  # the uneven last chunk, with static shapes
    part, gh, dz, gb = chunk_grads(h[tail:], th[tail:], mask[tail:])
    loss, grad_b = loss + part, grad_b + gb
    grad_w = add_weight_grad(grad_w, h[tail:], dz)
    grad_h = lax.dynamic_update_slice_in_dim(grad_h, gh, tail, axis=0)
  residuals = (grad_h, grad_w, grad_b, scale, (h, w, b, th, tw, tb, temperature, params))
  return loss * scale, residuals


def _fused_bwd(static, residuals, g):
  grad_h, grad_w, grad_b, scale, (h, w, b, th, tw, tb, temperature, params) = residuals
  s = (g * scale).astype(scale.dtype)
  zeros = lambda a: None if a is None else jnp.zeros_like(a)  # noqa: E731
  return (
    (grad_h * s).astype(h.dtype),
    (grad_w * s).astype(w.dtype),
    None if b is None else (grad_b * s).astype(b.dtype),
    zeros(th),
    zeros(tw),
    zeros(tb),
    zeros(temperature),
    tuple(jnp.zeros_like(x) for x in params),
    None,
    jnp.zeros_like(scale),
  )


_fused.defvjp(_fused_fwd, _fused_bwd)
_fused = compiled(_fused, static_argnums=0)


def _token_zero(*token_arrays):
  """A scalar 0 that varies over the mesh axes of the token arrays (inside ``jax.shard_map``)."""
  zero = jnp.zeros((), jnp.float32)
  for a in token_arrays:
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


def fused_linear_kl_div(
  hidden: jax.typing.ArrayLike,
  weight: jax.typing.ArrayLike,
  target_hidden: jax.typing.ArrayLike,
  target_weight: jax.typing.ArrayLike,
  *,
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
) -> jax.Array:
  r"""Distillation loss from hidden states and LM heads, chunked over tokens.

  With student logits :math:`s = h W + b` and teacher logits
  :math:`t = h_T W_T + b_T`, the distillation term of
  :func:`distillation_loss` (no labels):

  .. math::

     L = \frac{1}{N} \sum_{\text{tokens}} T^2\,
         D\big(\mathrm{softmax}(t/T), \mathrm{softmax}(s/T)\big)

  with :math:`D` any divergence of :func:`divergence_from_logits` (a name
  or a :class:`Divergence`; ``"jsd"`` as a string takes ``beta``), :math:`T^2` unless ``scale_by_temperature_squared=False``, and
  :math:`N` the number of tokens ``where`` selects (at least 1), or
  ``normalizer``. Equal to ``distillation_loss(hidden @ weight + bias,
  target_hidden @ target_weight + target_bias, ...)`` in value and gradients,
  but the ``[tokens, vocab]`` logits exist only ``chunk_size`` tokens at a
  time: the forward pass computes each chunk's gradients and folds them into
  the gradients wrt ``hidden``, ``weight`` and ``bias`` at once (as Liger
  Kernel's fused-linear losses do); the backward pass scales them.

  The teacher (``target_*``) receives no gradient, nor do ``temperature``,
  ``beta`` and traced :class:`Divergence` parameters (zeros). Reverse mode only (``jax.grad``, ``value_and_grad``);
  use :func:`distillation_loss` on materialised logits for ``jvp`` or
  Hessians. NaN and invalid traced options as in :func:`distillation_loss`:
  NaN in the hidden states, heads or biases of a selected token, or a traced
  ``temperature``, ``beta``, divergence parameter or ``normalizer`` outside
  its range, makes the
  loss and the gradients NaN. Matmuls accumulate in float32 (``preferred_element_type``);
  gradients come back in the inputs' dtypes.

  Args:
    hidden: the student's hidden states ``[..., H]``.
    weight: the student's LM head ``[H, V]`` (Flax ``Dense`` kernel layout).
    target_hidden: the teacher's hidden states ``[..., H_T]``, same tokens.
    target_weight: the teacher's LM head ``[H_T, V]``.
    bias: optional student bias ``[V]``.
    target_bias: optional teacher bias ``[V]``.
    temperature: positive, finite softmax temperature (a traced scalar is
      allowed).
    divergence: a divergence name (its default parameters) or a
      :class:`Divergence`, as in :func:`divergence_from_logits`.
    beta: the mixture weight of ``divergence="jsd"`` given as a string, in
      ``[0, 1]`` (a :class:`Divergence` carries its own parameters).
    scale_by_temperature_squared: multiply the divergence by :math:`T^2`.
    where: a token mask of shape ``hidden.shape[:-1]``.
    normalizer: the denominator instead of the number of selected tokens
      (a global token count for gradient accumulation), positive and finite.
    chunk_size: tokens per chunk; ``None`` picks a power of two giving about
      ``2**22`` logits per chunk and side. The last chunk may be smaller.
    axis_name: for vocabulary parallelism: the name of a mesh axis over which
      the V axis of ``weight``, ``bias``, ``target_weight`` and
      ``target_bias`` is split, when called inside ``jax.shard_map`` (hidden
      states whole on that axis). Each device computes its slice of every
      chunk's logits; the softmax statistics are combined with ``lax.pmax``
      and ``lax.psum`` (per-token scalars only), the gradient wrt ``hidden``
      is summed over the axis, the gradients wrt ``weight`` and ``bias`` stay
      local slices. Values and gradients equal the unsharded call's, with
      the same chunks (``chunk_size=None`` uses the global vocabulary), so a
      device holds ``1/num_shards`` of each chunk's logits; the result is
      replicated over ``axis_name``. E.g. ``jax.shard_map(lambda h, w, th,
      tw: fused_linear_kl_div(h, w, th, tw, axis_name="vocab"), mesh=mesh,
      in_specs=(P(), P(None, "vocab"), P(), P(None, "vocab")),
      out_specs=P())``; with the tokens also split over ``"data"``, pass the
      global token count as ``normalizer`` and ``lax.psum`` the result over
      ``"data"``.

  Returns:
    A scalar, in the promoted dtype of ``hidden`` and ``weight``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kldiv_jax import distillation_loss, fused_linear_kl_div
    >>> k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    >>> h, w = jax.random.normal(k1, (6, 4)), jax.random.normal(k2, (4, 10))
    >>> th, tw = jax.random.normal(k3, (6, 5)), jax.random.normal(k4, (5, 10))
    >>> fused = fused_linear_kl_div(h, w, th, tw, temperature=2.0, chunk_size=4)
    >>> bool(jnp.allclose(fused, distillation_loss(h @ w, th @ tw, temperature=2.0)))
    True

  References:
    Hsu et al., *Liger Kernel: Efficient Triton Kernels for LLM Training*
    (2024), arXiv:2410.10989.
  """
  name = "fused_linear_kl_div"
  beta, _ = check_unit_interval(name, "beta", beta)
  spec = loss_divergence(name, divergence, beta)
  temperature, _ = check_temperature(name, temperature)
  scale_by_temperature_squared = check_bool(
    name, "scale_by_temperature_squared", scale_by_temperature_squared
  )
  out_dtype = _check_linear(name, "student", hidden, weight, bias)
  _check_linear(name, "teacher", target_hidden, target_weight, target_bias)
  token_shape = tuple(np.shape(hidden)[:-1])
  if tuple(np.shape(target_hidden)[:-1]) != token_shape:
    raise ValueError(
      f"{name}: hidden and target_hidden must have the same tokens; got shapes "
      f"{np.shape(hidden)} and {np.shape(target_hidden)}."
    )
  if np.shape(weight)[1] != np.shape(target_weight)[1]:
    raise ValueError(
      f"{name}: weight and target_weight must have the same vocabulary size; got shapes "
      f"{np.shape(weight)} and {np.shape(target_weight)}."
    )
  num_shards = 1 if axis_name is None else check_axis_name(name, axis_name)
  cdt = compute_dtype(out_dtype)
  # The token count is explicit: reshape(-1, 0) is ambiguous for H = 0.
  n = int(np.prod(token_shape, dtype=np.int64))
  h = jnp.asarray(hidden).reshape(n, np.shape(hidden)[-1])
  th = jnp.asarray(target_hidden).reshape(n, np.shape(target_hidden)[-1])
  if where is None:
    mask = jnp.ones((n, 1), jnp.bool_)
  else:
    w_arr = mask_array(name, where)
    if w_arr.shape != token_shape:
      raise ValueError(
        f"{name}: where must be a token mask of shape {token_shape}; got {w_arr.shape}."
      )
    mask = w_arr.reshape(n, 1)
  if chunk_size is None:
    # The global vocabulary: a vocabulary-parallel call makes the unsharded
    # call's chunks, each device holding a slice of their logits.
    vocab_size = np.shape(weight)[1] * num_shards
    chunk = default_chunk_size(n, vocab_size)
  else:
    if (
      not isinstance(chunk_size, (int, np.integer))
      or isinstance(chunk_size, bool)
      or chunk_size < 1
    ):
      raise ValueError(f"{name}: chunk_size must be a positive int or None; got {chunk_size!r}.")
    chunk = int(min(chunk_size, max(n, 1)))
  valid = (positive_finite(temperature), in_unit_interval(beta), *spec.valid())
  if normalizer is None:
    denominator = jnp.maximum(jnp.sum(mask), 1).astype(cdt)
  else:
    normalizer = check_normalizer(name, normalizer)
    valid = (*valid, positive_finite(normalizer))
    denominator = jnp.asarray(normalizer).astype(cdt)
  t = jnp.asarray(temperature, cdt)
  scale = (t * t if scale_by_temperature_squared else jnp.ones((), cdt)) / denominator
  if n == 0 or np.shape(weight)[1] == 0:  # no tokens, or no vocabulary: nothing to sum
    return nan_unless(jnp.zeros((), out_dtype), *valid)
  b_arr = None if bias is None else jnp.asarray(bias)
  tb_arr = None if target_bias is None else jnp.asarray(target_bias)
  w_arr = jnp.asarray(weight)
  # Inside jax.shard_map with the tokens split (over "data", say), the head's
  # gradient in the custom VJP varies over the tokens' mesh axes, and must have
  # the head's type: adding a 0 that varies like the tokens makes the head vary
  # alike, and autodiff then sums its gradient over those axes. Outside
  # shard_map it is a no-op, which XLA folds away.
  zero = _token_zero(h, th, mask)
  w_arr = w_arr + zero.astype(w_arr.dtype)
  if b_arr is not None:
    b_arr = b_arr + zero.astype(b_arr.dtype)
  static = (spec.key, chunk, axis_name)
  params = tuple(jnp.asarray(x).astype(cdt) for x in spec.traced)
  loss = _fused(
    static,
    h,
    w_arr,
    b_arr,
    th,
    jnp.asarray(target_weight),
    tb_arr,
    t,
    params,
    mask,
    scale,
  )
  # An array: the cast restates ``_fused``'s annotation, which the checker loses
  # to jax.custom_vjp's unannotated ``__new__`` (it may return jax's custom_vjp3).
  loss = cast(jax.Array, loss)
  return nan_unless(loss.astype(out_dtype), *valid)
