"""Per-token losses of the sampled tokens' log-probabilities from hidden states and an LM head.

The engine of the fused policy losses (PPO/GRPO clipped surrogates and their
kin): a scalar loss :math:`L = \\sum_i \\ell_i(\\log p_i, H_i)` of each token's
log-probability :math:`\\log p_i = \\log \\mathrm{softmax}(z_i / T)_{y_i}` and
entropy :math:`H_i`, with logits :math:`z = h W + b` that never exist for all
tokens at once. ``per_token_fn(log_probs, entropy, args)`` gives the
contributions :math:`\\ell_i` (aggregation weights, advantages, old
log-probabilities and coefficients come in ``args``, per token).

Token-level losses (each :math:`\\ell_i` depends on token ``i`` only): one pass
over chunks of ``chunk_size`` tokens. Per chunk, the logits (one matmul) give
:math:`\\log p` and :math:`H` (:func:`kldiv_jax._tokens.token_stats`), ``jax.vjp``
of ``per_token_fn`` gives :math:`g_{\\log p} = \\partial L/\\partial \\log p_i`
and :math:`g_H`, and

.. math::

   \\frac{\\partial L}{\\partial z_i} = \\frac{s'(z_i)}{T}\\Big(g_{\\log p}\\,(e_{y_i} - p_i)
   - g_H\\, p_i \\odot (\\log p_i + H_i)\\Big)

(:math:`s'` the soft-cap's slope) is folded into the gradients wrt ``hidden``
(one matmul) and ``weight`` (one matmul, a block of vocabulary columns at a
time) at once, as the fused distillation losses do (:mod:`kldiv_jax._fused_distill`,
after Liger Kernel's fused-linear losses): three matmuls per chunk, no
recomputation; the backward pass only scales the gradients by the cotangent.

Sequence-level losses (GSPO's sequence ratio, GMPO's geometric mean: an
:math:`\\ell_i` that depends on other tokens of its sequence), ``two_pass=True``:
a first pass keeps every token's :math:`\\log p` and :math:`H` (one matmul per
chunk, ``[N]`` outputs and two ``[N]`` statistics), ``per_token_fn`` runs on
the whole ``[N]`` arrays, and autodiff's backward pass (that of
:func:`kldiv_jax.fused_token_log_probs`) recomputes each chunk's logits and
folds :math:`g` into the gradients: four matmuls per chunk, about 4/3 of the
token-level time, same memory.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kldiv_jax._checks import check_bool, check_softcap, check_temperature, compute_dtype
from kldiv_jax._fused_chunks import (
  check_chunk,
  check_linear,
  chunk_logits,
  chunks,
  head_cotangents,
  low_dtype,
  per_platform,
  token_zero,
  vary_like_tokens,
  zero_head_grads,
)
from kldiv_jax._fused_tokens import TokenKernel, fold_token_grads, fused_tokens
from kldiv_jax._gpu_fused_head import cuda_or_xla, head_kernel, pallas_tokens, takes
from kldiv_jax._gpu_head_kernels import HeadKernel
from kldiv_jax._implementation import resolve_implementation
from kldiv_jax._numerics import nan_unless, positive_finite
from kldiv_jax._platform import compiled, gpu_kernels_for
from kldiv_jax._tokens import token_layout, token_stats
from kldiv_jax._vocab_parallel import check_axis_name, global_classes

# Logit elements per chunk on CPU when chunk_size=None: 2**24 (64 MiB of float32), four times
# the distillation losses' 2**22. Here a chunk's logits are the only [chunk, V] buffers
# (one side, no teacher), and each chunk reads and writes the whole [H, V] weight
# gradient once: at H = 1024, V = 32768 on 2 CPU cores (benchmarks/bench_rl.py,
# policy), 128 / 256 / 512 tokens per chunk took 1.08-1.14x / 0.99-1.02x / 0.91-0.96x the
# materialised loss's time (wall and process CPU time, side by side), and the temp at
# N = 8192, V = 65536 (256 tokens) is 0.042x of it (2**23: 0.025x; 2**25: 0.075x).
_CHUNK_ELEMENTS = 1 << 24

# ``per_token_fn(log_probs [n], entropy [n] | None, args) -> losses [n]`` (or
# ``(losses, aux)`` with ``has_aux``): ``args`` is the pytree of ``[n, ...]``
# arrays given as ``per_token_args``, cut to the same tokens.
PerTokenFn = Callable[[jax.Array, jax.Array | None, Any], Any]


class TokenOutputs(NamedTuple):
  """The per-token outputs of :func:`fused_token_loss`, for metrics (no gradient flows
  through them).

  ``log_probs`` and ``entropy`` are ``[N]`` in the compute dtype (float32 for bf16/f16
  inputs), 0 for tokens outside ``where`` and NaN for an id out of range. The entropy
  comes with the log-normaliser whether ``with_entropy`` or not (which only says whether
  ``per_token_fn`` sees it and differentiates it). ``aux`` is ``per_token_fn``'s aux
  (``()`` without ``has_aux``).
  """

  log_probs: jax.Array
  entropy: jax.Array
  aux: Any


class _Static(NamedTuple):
  """The static part of a call (hashable): the per-token function and how chunks run."""

  fn: PerTokenFn
  chunk: int
  axis_name: str | None
  cap: float | None
  with_entropy: bool
  has_aux: bool
  low: Any = None  # bf16/f16 inputs: the logits and their gradient in that dtype (chunk_logits)


def _call(static: _Static, log_p, entropy, args):
  """``(losses, aux)`` of ``per_token_fn`` (``aux = ()`` without ``has_aux``)."""
  out = static.fn(log_p, entropy if static.with_entropy else None, args)
  return out if static.has_aux else (out, ())


def _apply(static: _Static, log_p, entropy, mask, args):
  """``(sum of per_token_fn's losses, aux)`` with the tokens outside ``mask`` set to 0
  (so that they get no gradient), in the accumulation dtype of ``log_p``."""
  keep = mask[:, 0]
  log_p = jnp.where(keep, log_p, 0.0)
  losses, aux = _call(static, log_p, jnp.where(keep, entropy, 0.0), args)
  return jnp.sum(jnp.asarray(losses).astype(log_p.dtype)), aux


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _one_pass(static, h, w, b, ids, temperature, mask, args, aux):
  return _one_pass_fwd(static, h, w, b, ids, temperature, mask, args, aux)[0]


def _one_pass_fwd(static: _Static, h, w, b, ids, temperature, mask, args, aux):
  """The loss, its gradients and the per-token outputs in one pass over the chunks; ``aux``
  the buffers (zeros) of ``per_token_fn``'s aux outputs."""
  n, acc = h.shape[0], temperature.dtype
  # Inside jax.shard_map, loop carries keep the mesh axes their values vary over: the
  # outputs vary like the tokens (see fused_token_log_probs).
  zero = token_zero(h, ids, mask, *jax.tree.leaves(args)).astype(acc)
  per_token = lax.full_like(mask[:, 0], 0, acc) + zero
  varying = lambda a: jnp.where(zero == 0, a, jnp.zeros_like(a))  # noqa: E731
  outs = (per_token, per_token, jax.tree.map(varying, aux))
  grads = zero_head_grads(h, w, acc)

  def part(start, size, cut, carry):
    total, outs, grads = carry
    hc, mc, args_c = cut(h), cut(mask), cut(args)
    z = chunk_logits(hc, w, b, acc, static.low)
    log_p, entropy, (top, log_s, local) = token_stats(
      static.axis_name, static.cap, z, cut(ids), temperature, (mc,)
    )
    objective = lambda lp, ent: _apply(static, lp, ent, mc, args_c)  # noqa: E731
    loss, vjp, aux = jax.vjp(objective, log_p, entropy, has_aux=True)
    g_lp, g_h = vjp(jnp.ones_like(loss))
    tokens = (local, mc, (top, log_s, entropy))
    g_h = g_h if static.with_entropy else None
    grads = fold_token_grads(
      static.axis_name, static.cap, start, hc, w, z, tokens, temperature, g_lp, g_h, grads,
      static.low,
    )  # fmt: skip
    put = lambda o, r: lax.dynamic_update_slice_in_dim(o, r.astype(o.dtype), start, axis=0)  # noqa: E731
    outs = jax.tree.map(put, outs, (log_p, entropy, aux))
    return total + loss, outs, grads

  total, outs, grads = chunks(n, static.chunk, part, (zero, outs, grads))
  return (total, outs), (grads, (h, w, b, ids, temperature, mask, args, aux))


def _one_pass_bwd(static, residuals, g):
  grads, (h, w, b, *operands) = residuals  # operands: ids, temperature, mask, args, aux
  s = g[0].astype(grads[0].dtype)  # the per-token outputs carry no gradient
  return head_cotangents(grads, s, h, w, b, operands)


_one_pass.defvjp(_one_pass_fwd, _one_pass_bwd)
_one_pass = compiled(_one_pass, static_argnums=0)


def _two_pass(
  static: _Static, h, w, b, ids, temperature, mask, args, head: HeadKernel | None = None
):
  """Pass 1 (forward) and pass 2 (its backward) of :func:`fused_token_log_probs`'s kernel,
  ``per_token_fn`` on the whole ``[N]`` arrays between them; ``head``: with the opt-in GPU
  kernels (:func:`kldiv_jax._gpu_fused_head.pallas_tokens`) instead of the chunk loop."""
  if head is not None:
    out = pallas_tokens(head, h, w, b, ids, temperature.astype(jnp.float32), mask)
  else:
    kernel = TokenKernel(static.chunk, static.axis_name, static.cap, static.low)
    out = fused_tokens(kernel, h, w, b, ids, temperature, mask)
  # The cast restates fused_tokens' result, lost to jax.custom_vjp's unannotated __new__.
  log_p, entropy = cast(tuple[jax.Array, jax.Array], out)
  loss, aux = _apply(static, log_p, entropy, mask, lax.stop_gradient(args))
  outs = (log_p, entropy, aux)
  return loss, jax.tree.map(lax.stop_gradient, outs)


def fused_token_loss(
  hidden: jax.typing.ArrayLike,
  weight: jax.typing.ArrayLike,
  bias: jax.typing.ArrayLike | None,
  token_ids: jax.typing.ArrayLike,
  per_token_fn: PerTokenFn,
  per_token_args: Any = (),
  *,
  where: jax.typing.ArrayLike | None = None,
  ignore_index: int | None = None,
  temperature: float | jax.typing.ArrayLike = 1.0,
  softcap: float | None = None,
  axis_name: str | None = None,
  chunk_size: int | None = None,
  with_entropy: bool = False,
  has_aux: bool = False,
  two_pass: bool = False,
  name: str = "fused_token_loss",
  loss_dtype: Any = None,
  logits_dtype: Any = None,
  implementation: str | None = None,
) -> tuple[jax.Array, TokenOutputs]:
  """``(sum_i per_token_fn(log p, H, args)_i, TokenOutputs)`` from ``hidden @ weight + bias``.

  ``hidden [N, H]``, ``weight [H, V]``, ``bias [V]`` or ``None``, ``token_ids [N]``
  (the sampled tokens; an id outside ``[0, V)`` makes the loss NaN unless
  ``where`` or ``ignore_index`` leaves it out), ``per_token_args`` a pytree of ``[N, ...]`` arrays.
  ``per_token_fn(log_probs [n], entropy [n] or None, args)`` returns the
  per-token contributions ``[n]`` whose plain sum is the loss (or ``(losses,
  aux)`` with ``has_aux``, ``aux`` a pytree of ``[n, ...]`` arrays); tokens
  outside ``where`` reach it as ``log p = H = 0`` and get no gradient.
  Without ``two_pass`` it must be *token-separable* (each contribution a
  function of its own token's values: it is called on chunks of tokens);
  with ``two_pass`` it is called once on all ``N`` tokens and may mix them
  (sequence-level ratios), at the cost of a fourth matmul per chunk. It must
  be hashable and the same object across calls (a module-level function or
  a value-hashed callable: it is a static argument), traced options go in
  ``per_token_args``.

  Gradients flow to ``hidden``, ``weight`` and ``bias`` only: ``per_token_args``
  (advantages, old log-probabilities, weights), ``temperature`` and the
  per-token outputs are constants (zero gradients), as in the fused
  distillation losses. Reverse mode only. ``softcap``, ``temperature``,
  ``axis_name`` (vocabulary parallelism inside ``jax.shard_map``: ``weight``
  and ``bias`` split on V, the rest whole; the loss and outputs replicated)
  and ``chunk_size`` as in :func:`kldiv_jax.fused_token_log_probs`, whose
  kernels these are (``chunk_size=None``: per platform as there, on CPU
  about ``2**24`` logits per chunk, four times that default). Matmuls accumulate
  in float32 (float64 for float64 inputs); ``per_token_fn`` sees that dtype;
  for bf16/f16 inputs each chunk's logits and their gradient are held in the
  inputs' dtype between the matmuls and the softmax, as the materialised
  ``hidden @ weight + bias``'s (:func:`kldiv_jax._fused_chunks.chunk_logits`), or in
  float32 with ``logits_dtype=jnp.float32`` (:func:`kldiv_jax._fused_chunks.low_dtype`);
  the loss comes back in ``loss_dtype`` (``None``: the promoted dtype of
  ``hidden`` and ``weight``), NaN for an invalid traced temperature.
  ``implementation="pallas"``: in a program lowered for CUDA, where the kernels take the
  operands (:func:`kldiv_jax._gpu_fused_head.takes`), the two passes run as the opt-in
  fused-head kernels (a forward kernel, ``per_token_fn`` on the ``[N]`` statistics, the
  backward kernels), token-level losses too.
  """
  impl = resolve_implementation(name, implementation)
  out_dtype = check_linear(name, "student", hidden, weight, bias)
  temperature, _ = check_temperature(name, temperature)
  cap = check_softcap(name, "softcap", softcap)
  with_entropy = check_bool(name, "with_entropy", with_entropy)
  has_aux = check_bool(name, "has_aux", has_aux)
  two_pass = check_bool(name, "two_pass", two_pass)
  if not callable(per_token_fn):
    raise TypeError(f"{name}: per_token_fn must be callable; got {per_token_fn!r}.")
  if np.ndim(hidden) != 2:
    raise ValueError(f"{name}: hidden must be [tokens, H]; got shape {np.shape(hidden)}.")
  num_shards = 1 if axis_name is None else check_axis_name(name, axis_name)
  n, vocab = np.shape(hidden)[0], np.shape(weight)[1]
  for leaf in jax.tree.leaves(per_token_args):
    if np.ndim(leaf) < 1 or np.shape(leaf)[0] != n:
      raise ValueError(
        f"{name}: per_token_args must be arrays with one row per token ({n}); "
        f"got shape {np.shape(leaf)}."
      )
  classes = global_classes(vocab, axis_name)
  mask, in_range, safe = token_layout(
    name, token_ids, (n,), "shape hidden.shape[:1] =", where, ignore_index, classes
  )
  mask = jnp.ones((n, 1), jnp.bool_) if mask is None else mask
  t = jnp.asarray(temperature, compute_dtype(out_dtype))
  check_chunk(name, chunk_size, n, vocab * num_shards)  # a bad chunk_size fails early
  low = low_dtype(name, out_dtype, logits_dtype)
  static = _Static(per_token_fn, 0, axis_name, cap, with_entropy, has_aux, low)
  # What per_token_fn returns, checked once on abstract values.
  token = jax.ShapeDtypeStruct((n,), t.dtype)
  loss_shape, aux_shapes = jax.eval_shape(
    functools.partial(_call, static), token, token, per_token_args
  )
  if loss_shape.shape != (n,):
    raise ValueError(
      f"{name}: per_token_fn must return one loss per token, shape ({n},); got {loss_shape.shape}."
    )
  for leaf in jax.tree.leaves(aux_shapes):
    if leaf.ndim < 1 or leaf.shape[0] != n:
      raise ValueError(
        f"{name}: per_token_fn's aux must be per-token arrays ({n}, ...); got {leaf.shape}."
      )
  if n == 0 or vocab == 0:  # no tokens, or every counted id out of range (NaN)
    zeros = jnp.zeros(n, t.dtype)
    loss, aux = _apply(static, zeros, zeros, mask, per_token_args)
    outs = (zeros, zeros, aux)
  else:
    h = jnp.asarray(hidden)
    w, b = vary_like_tokens(weight, bias, h, safe, mask)
    buffers = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shapes)

    def call(chunk):
      s = static._replace(chunk=chunk)
      if two_pass:
        return _two_pass(s, h, w, b, safe, t, mask, per_token_args)
      return _one_pass(s, h, w, b, safe, t, mask, per_token_args, buffers)

    xla = lambda: per_platform(chunk_size, name, n, vocab * num_shards, call, _CHUNK_ELEMENTS)  # noqa: E731
    if gpu_kernels_for(impl) and takes(h, w, axis_name):
      head = head_kernel(n, h.shape[1], vocab, cap, low)
      gpu = lambda: _two_pass(static, h, w, b, safe, t, mask, per_token_args, head)  # noqa: E731
      out = cuda_or_xla(gpu, xla)
    else:
      out = xla()
    loss, outs = cast(tuple[jax.Array, tuple], out)
  valid = positive_finite(temperature)
  loss_dtype = out_dtype if loss_dtype is None else loss_dtype
  loss = nan_unless(loss.astype(loss_dtype), valid, jnp.all(in_range))
  log_p, entropy, aux = outs
  log_p = nan_unless(jnp.where(mask[:, 0], log_p, 0.0), in_range[:, 0], valid)
  entropy = nan_unless(jnp.where(mask[:, 0], entropy, 0.0), valid)
  return loss, TokenOutputs(log_p, entropy, aux)
