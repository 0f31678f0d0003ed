"""The chunk machinery of the fused LM-head losses: logits ``hidden @ weight + bias`` a chunk of
tokens at a time.

A fused loss never holds the ``[tokens, vocab]`` logits: it runs its chunk body over
``chunk_size`` tokens at a time (:func:`chunks`), each chunk's logits one matmul
(:func:`chunk_logits`), and folds each chunk's gradient wrt its logits into the gradients wrt
``hidden``, ``weight`` and ``bias`` (:func:`fold_logit_grad`: two matmuls, the weight's the way
of the platform). The chunk is chosen per platform when the program is lowered
(:func:`per_platform`). The losses plug in their chunk bodies: ``_fused_distill`` (gradients in
the forward pass) and ``_fused_tokens`` and ``_fused_policy`` (the token kernel), as Liger
Kernel's ``chunked_loss`` losses plug into its base class.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kldiv_jax._checks import check_float, compute_dtype

# Logit elements per chunk and side when chunk_size=None on CPU (16 MiB of float32).
CHUNK_ELEMENTS = 1 << 22
# On TPUs (chunk_size=None): about 2**27 logits per chunk (512 MiB of float32 per [chunk,
# vocab] array), at most 4096 tokens, and at least 1024 tokens while that is at most 2**28
# logits (V <= 262144). Each chunk reads both heads and reads and writes the float32 weight
# gradient: ~14 bytes per head element for 8 C H V flops (four [C, H] x [H, V] matmuls),
# C / 1.75 flops per byte whatever V, against a chip balance of ~240 (TPU v5e) to ~300
# (H100) flops per byte; the [C, V] float32 arrays' passes add bytes in proportion to the
# flops (4 C V a pass, for 8 C H V flops). So the tokens per chunk, not the logits, decide
# whether a chunk is bound by the heads' bytes: 1024 tokens at V = 131072 keeps the matmuls
# compute-bound, while 2**27 logits alone gave 512 tokens at Qwen 3's V = 151936 and Gemma
# 3's 262144, where each chunk's re-read head and accumulator made Tunix's whole v5e train
# step 1.14-1.34x stock's time (XLA's estimate; 0.93x with 1024). 32 (the CPU default at
# V = 131072) left them bound by weight bandwidth. Past V = 262144 the floor gives way to
# 2**28 logits (1 GiB of float32 per [chunk, vocab] array) for a 16 GiB v5e.
_ACCEL_CHUNK_ELEMENTS = 1 << 27
_ACCEL_MIN_CHUNK = 1024
_ACCEL_FLOOR_ELEMENTS = 1 << 28
# On GPUs: 2**28 logits, and at least 2048 tokens while V <= 262144 (2048 tokens at
# V = 131072, Qwen 3's 151936 and Gemma 3's 262144). XLA:GPU writes each chunk's float32
# logits and their gradient to HBM between its fusions (~13 passes over a [chunk, vocab]
# float32 array per chunk, the matmuls' epilogues not fused): at 1024 tokens that traffic
# plus the heads' made an H100 chunk bandwidth-bound (1.6x the materialised loss at
# V = 131072, 1.20-1.37x at 151936 and 262144, XLA's estimates), at 2048 it is 1.0-1.1x,
# with 1.2-3.2 GiB of temporaries against the 80 GiB. Past V = 262144, 2**28 logits.
_GPU_CHUNK_ELEMENTS = 1 << 28
_GPU_MIN_CHUNK = 2048
_GPU_FLOOR_VOCAB = 1 << 18
_ACCEL_MAX_CHUNK = 4096
# The name scope of a fused call's chunk loop, followed by its chunk (``..._1024``): it marks
# the chunking in a lowered module.
FUSED_CHUNK_SCOPE = "kldiv_jax_fused_chunk_"
# CPU: vocabulary columns per block of the weight-gradient update.
_GRAD_W_BLOCK = 4096
# The name scope of a chunk's weight-gradient update, followed by how it is done: the block
# width (``..._4096``, CPU) or ``whole`` (GPU and TPU) for a chunk of tokens, ``columns`` for a
# chunk of the head's columns (fold_column_grad): it marks the choice in a lowered module.
FUSED_GRAD_W_SCOPE = "kldiv_jax_fused_grad_w_"


def _power_of_two_chunk(elements: int, num_tokens: int, vocab_size: int, cap: int) -> int:
  size = max(1, min(cap, elements // max(vocab_size, 1)))
  size = 1 << (size.bit_length() - 1)
  return max(1, min(size, num_tokens))


def default_chunk_size(num_tokens: int, vocab_size: int, elements: int = CHUNK_ELEMENTS) -> int:
  """CPU: a power of two near ``elements / vocab_size`` tokens (``2**22`` elements unless
  given), within ``[1, num_tokens]``."""
  return _power_of_two_chunk(elements, num_tokens, vocab_size, num_tokens)


def platform_chunk_size(num_tokens: int, vocab_size: int, platform: str) -> int:
  """The default chunk for a platform: :func:`default_chunk_size` on ``"cpu"``; on ``"cuda"``
  and ``"rocm"`` a power of two near ``2**28 / vocab_size`` tokens but at least 2048 while
  ``vocab_size <= 262144``; elsewhere (TPU) a power
  of two near ``2**27 / vocab_size`` tokens but at least 1024 (while that is at most ``2**28``
  logits: ``vocab_size <= 262144``; past it near ``2**28 / vocab_size``); at most 4096, within
  ``[1, num_tokens]``."""
  if platform == "cpu":
    return default_chunk_size(num_tokens, vocab_size)
  if platform in ("cuda", "rocm"):
    size = _power_of_two_chunk(_GPU_CHUNK_ELEMENTS, num_tokens, vocab_size, _ACCEL_MAX_CHUNK)
    floor = min(_GPU_MIN_CHUNK, num_tokens) if vocab_size <= _GPU_FLOOR_VOCAB else 1
    return max(size, floor)
  # TPU: the tokens per chunk amortise the heads' bytes (see _ACCEL_CHUNK_ELEMENTS).
  floor = _power_of_two_chunk(_ACCEL_FLOOR_ELEMENTS, num_tokens, vocab_size, _ACCEL_MIN_CHUNK)
  size = _power_of_two_chunk(_ACCEL_CHUNK_ELEMENTS, num_tokens, vocab_size, _ACCEL_MAX_CHUNK)
  return max(size, floor)


def check_chunk(name, chunk_size, n, vocab_size, elements=CHUNK_ELEMENTS) -> int:
  """``chunk_size`` checked (a positive int or ``None``) and cut to ``n``; ``None``: the CPU
  default for ``vocab_size`` (the global vocabulary) and ``elements``."""
  if chunk_size is None:
    # The global vocabulary: a vocabulary-parallel call makes the unsharded
    # call's chunks, each device holding a slice of their logits.
    return default_chunk_size(n, vocab_size, elements)
  if (
    not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool) or chunk_size < 1
  ):
    raise ValueError(f"{name}: chunk_size must be a positive int or None; got {chunk_size!r}.")
  return int(min(chunk_size, max(n, 1)))


def check_linear(name, what, hidden, weight, bias):
  """Checks one side's hidden states, head and bias (``what``: ``"student"`` or
  ``"teacher"``, whose arguments are ``target_*``); returns their promoted dtype."""
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


def per_platform(chunk_size, name, n, vocab_size, call, elements=CHUNK_ELEMENTS):
  """``call(chunk)`` with ``chunk_size``, or by default the chunk of the platform the program
  is lowered for (:func:`platform_chunk_size`; on CPU, ``elements`` logits per chunk).

  As the row path's blocks (:func:`kldiv_jax._platform.map_rows`), the chunkings are staged
  out with ``lax.platform_dependent`` and lowering keeps the platform's own: a program
  exported with ``jax.export`` for several platforms holds each one's. Each runs in the
  name scope :data:`FUSED_CHUNK_SCOPE` followed by its chunk.
  """

  def scoped(chunk):
    def run():
      with jax.named_scope(f"{FUSED_CHUNK_SCOPE}{chunk}"):
        return call(chunk)

    return run

  chunk = check_chunk(name, chunk_size, n, vocab_size, elements)
  if chunk_size is not None:
    return scoped(chunk)()
  chunks_of = {p: platform_chunk_size(n, vocab_size, p) for p in ("cuda", "rocm", "tpu")}
  chunks_of["cpu"] = chunk  # the CPU default, with the caller's ``elements``
  if len(set(chunks_of.values())) == 1:
    return scoped(chunk)()
  # One traced branch per distinct chunk (``platform_dependent`` joins equal callables).
  runs = {c: scoped(c) for c in set(chunks_of.values())}
  default = runs[chunks_of.pop("tpu")]
  others = {p: runs[c] for p, c in chunks_of.items() if runs[c] is not default}
  return lax.platform_dependent(**others, default=default)


def matmul(a, w, b, dtype):
  """``a @ w (+ b)`` accumulated and returned in ``dtype``."""
  out = lax.dot_general(a, w, (((1,), (0,)), ((), ())), preferred_element_type=dtype)
  return out if b is None else out + b.astype(dtype)[None, :]


def low_dtype(name, out_dtype, logits_dtype=None):
  """The ``low`` of :func:`chunk_logits` for inputs promoted to ``out_dtype``, and the check of
  the fused losses' ``logits_dtype`` option: ``None`` (default), the inputs' dtype when it is
  computed in a wider one (bf16/f16), else ``None`` (float32 and float64 are held as they are);
  float32 (``jnp.float32``, ``np.float32`` or ``"float32"``): ``None``, the logits and their
  gradient held in the matmuls' float32 accumulators (float64 for float64 inputs).

  The one rule every fused loss reads (both heads and both backward matmuls of a chunk, the
  top-k path, ``axis_name``): Liger Kernel's ``accum_dtype`` of its fused linear cross entropy
  answers the same complaint (bf16 training that loses the gradient's digits), for its
  weight-gradient buffers, which here are float32 always.
  """
  if logits_dtype is not None:
    try:
      wide = jnp.dtype(logits_dtype) == jnp.float32 and not isinstance(logits_dtype, bool)
    except (TypeError, ValueError):
      wide = False
    if not wide:
      raise ValueError(
        f"{name}: logits_dtype must be None (the inputs' dtype) or float32 (jnp.float32); got "
        f"{logits_dtype!r}."
      )
    return None
  return None if compute_dtype(out_dtype) == out_dtype else out_dtype


def chunk_logits(a, w, b, acc, low=None, rounded=False):
  """``a @ w + b`` accumulated in ``acc``; with ``low`` (bf16/f16) in ``low`` between the
  matmul and the softmax, as the materialised ``a @ w + b`` of ``low`` inputs (the product
  rounded, then the bias), read in ``acc`` (``rounded``: returned in ``low``, for a caller
  that reads it in ``acc`` itself). XLA:GPU writes a chunk's logits and their gradient to
  HBM between its fusions: in ``low`` they move half the bytes of float32. Where XLA fuses
  the conversions away (``xla_allow_excess_precision``, its default, as on CPU), they stay
  in ``acc``, as the materialised loss's do."""
  if low is None:
    return matmul(a, w, b, acc)
  z = lax.dot_general(a, w, (((1,), (0,)), ((), ())), preferred_element_type=acc).astype(low)
  z = z if b is None else z + b.astype(low)[None, :]
  return z if rounded else z.astype(acc)


def chunks(n, chunk, part, carry, axis=0):
  """``part(start, size, cut, carry)`` over the chunks of ``n`` rows, ``cut`` slicing the
  chunk's rows of an array (or of each leaf of a pytree): a ``fori_loop`` over the full
  chunks, then the uneven last one with static shapes. ``axis=-1``: chunks of the last axis
  (the head's columns, :func:`column_width`)."""
  num_full = n // chunk
  if num_full:

    def body(i, carry):
      start = i * chunk

      def cut(tree):
        return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, chunk, axis), tree)

      return part(start, chunk, cut, carry)

    carry = lax.fori_loop(0, num_full, body, carry)
  start = num_full * chunk
  if start < n:
    rest = lambda tree: jax.tree.map(lambda a: lax.slice_in_dim(a, start, n, axis=axis), tree)  # noqa: E731
    carry = part(start, n - start, rest, carry)
  return carry


def column_width(chunk: int, n: int, vocab: int) -> int:
  """The columns of the head per chunk of a backward pass over the head's columns
  (:func:`fold_column_grad`): as many logits as ``chunk`` tokens' (``chunk * vocab / n``),
  rounded down to a multiple of 128 where it is at least 128 and less than ``vocab``."""
  width = max(1, chunk * vocab // max(n, 1))
  if width >= vocab:
    return vocab
  return width // 128 * 128 if width >= 128 else width


def by_columns(n: int, vocab: int) -> bool:
  """Whether a backward pass that recomputes the logits may run over chunks of the head's
  columns rather than of the tokens: when the tokens are fewer than the head's columns
  (``0 < n < vocab``, per device). Over tokens, every chunk re-reads the head and reads and
  writes the float32 ``[H, V]`` weight-gradient accumulator; over columns, every chunk
  re-reads the hidden states and reads and writes a float32 ``[n, H]`` one, the smaller of
  the two when ``n < vocab``, and each column's weight gradient is one matmul over all the
  tokens, written once in the head's dtype: no ``[H, V]`` float32 array. Same matmuls,
  same logits per chunk (:func:`column_width`). The callers keep the token chunks on CPU
  (``lax.platform_dependent``; there the weight gradient is a block of columns at a time,
  :func:`fold_logit_grad`)."""
  return 0 < n < vocab


def zero_column_grads(h, w, acc):
  """``(grad_h, grad_w, grad_b)`` zeros, the carry of :func:`fold_column_grad`: ``grad_h`` in
  ``acc`` (summed over the column chunks), ``grad_w`` in the head's dtype (each column
  written once), ``grad_b`` in ``acc``."""
  return (
    lax.full_like(h, 0, acc),
    lax.full_like(w, 0),
    lax.full_like(w, 0, acc, shape=w.shape[1:]),
  )


def fold_column_grad(carry, start, h, wc, dz, acc, grad_dtype=None):
  """Folds the gradient wrt a chunk of columns' logits ``dz`` (``[n, size]``, every token, in
  ``acc``) into ``carry = (grad_h, grad_w, grad_b)`` (:func:`zero_column_grads`).

  ``grad_h += dz wc^T`` (``wc``: the chunk's columns of the head); columns ``start:`` of
  ``grad_w`` are ``h^T dz``, the whole sum over the tokens (rounded once, to the head's
  dtype), and of ``grad_b`` ``sum(dz)``. ``dz`` enters the matmuls as :func:`grad_operands`.
  With ``axis_name`` the caller sums ``grad_h`` over the devices once, at the end (the
  chunk's columns are this device's: nothing to sum per chunk).
  """
  grad_h, grad_w, grad_b = carry
  grad_b = lax.dynamic_update_slice_in_dim(grad_b, jnp.sum(dz, axis=0, dtype=acc), start, axis=0)
  dz = grad_operands(dz, h, wc, grad_dtype)
  gh = _sum_dots(
    dz, lambda d: lax.dot_general(d, wc, (((1,), (1,)), ((), ())), preferred_element_type=acc)
  )
  with jax.named_scope(f"{FUSED_GRAD_W_SCOPE}columns"):
    gw = _sum_dots(
      dz, lambda d: lax.dot_general(h, d, (((0,), (0,)), ((), ())), preferred_element_type=acc)
    )
    grad_w = lax.dynamic_update_slice_in_dim(grad_w, gw.astype(grad_w.dtype), start, axis=1)
  return grad_h + gh, grad_w, grad_b


def zero_head_grads(h, w, acc):
  """``(grad_h, grad_w, grad_b)`` zeros in ``acc``: the carry of :func:`fold_logit_grad`.

  ``full_like``: inside ``jax.shard_map``, loop carries keep the mesh axes their values vary
  over (the head's gradients the head's, see :func:`vary_like_tokens`)."""
  return (
    lax.full_like(h, 0, acc),
    lax.full_like(w, 0, acc),
    lax.full_like(w, 0, acc, shape=w.shape[1:]),
  )


def fold_logit_grad(carry, start, hc, w, dz, axis_name, acc, grad_dtype=None):
  """Folds a chunk's gradient wrt its logits ``dz`` (``[size, V]``, in ``acc``) into
  ``carry = (grad_h, grad_w, grad_b)``.

  ``grad_b += sum(dz)``; ``dz W^T`` into rows ``start:`` of ``grad_h`` (summed over
  ``axis_name``: each device holds a slice of the head) and ``hc^T dz`` added to ``grad_w``
  (:func:`_add_weight_grad`); ``dz`` enters the two matmuls as :func:`grad_operands`.
  """
  grad_h, grad_w, grad_b = carry
  grad_b = grad_b + jnp.sum(dz, axis=0, dtype=acc)
  dz = grad_operands(dz, hc, w, grad_dtype)
  gh = _sum_dots(
    dz, lambda d: lax.dot_general(d, w, (((1,), (1,)), ((), ())), preferred_element_type=acc)
  )
  if axis_name is not None:  # each device holds a slice of the head: sum the parts
    gh = lax.psum(gh, axis_name)
  grad_h = lax.dynamic_update_slice_in_dim(grad_h, gh, start, axis=0)
  grad_w = _add_weight_grad(grad_w, hc, dz, axis_name, acc)
  return grad_h, grad_w, grad_b


def grad_operands(dz, hc, w, grad_dtype=None) -> tuple:
  """A chunk's logit gradient ``dz`` (in the accumulation dtype) as the operands of the
  backward matmuls, whose products are summed (:func:`fold_logit_grad`).

  ``grad_dtype`` given (bf16/f16 inputs, the default ``logits_dtype``): ``dz`` in it, the
  cotangent of logits in that dtype, as autodiff's of the materialised ``hc @ w`` (see
  :func:`chunk_logits`). bf16 inputs without it (``logits_dtype=float32``): two bf16 terms,
  ``hi = bf16(dz)`` and ``lo = bf16(dz - hi)``, whose sum is ``dz`` to ``2**-17`` relative:
  each matmul runs as two bf16 passes, with bf16 operands, so no platform rounds a float32
  operand (TPUs take one bf16 pass of a float32 matmul at JAX's default precision, NVIDIA
  GPUs TF32) and XLA:GPU does not run it as a float32 GEMM. Otherwise (float32/float64
  inputs, f16 with ``logits_dtype=float32``) ``dz`` itself.
  """
  if grad_dtype is not None:
    return (dz.astype(grad_dtype),)
  if hc.dtype == w.dtype == jnp.bfloat16:
    hi = dz.astype(jnp.bfloat16)
    return hi, (dz - hi.astype(dz.dtype)).astype(jnp.bfloat16)
  return (dz,)


def _sum_dots(parts, dot):
  """``dot(parts[0]) + dot(parts[1]) + ...``."""
  out = dot(parts[0])
  for part in parts[1:]:
    out = out + dot(part)
  return out


def _add_weight_grad(grad_w, hc, dz, axis_name, acc):
  """``grad_w += hc^T dz`` (``dz``: :func:`grad_operands`, their products summed), the way of
  the platform the program is lowered for.

  CPU: a block of vocabulary columns at a time (a dot writes a fresh buffer, so a
  whole ``[H, V]`` product is a second ``[H, V]`` array in cache-unfriendly passes).
  GPU and TPU: one ``[H, V]`` dot per chunk added to the carry, which XLA fuses into
  the matmul's output (cuBLAS's ``beta = 1``, TPU output fusion) in place; the
  blocks there each re-read and re-wrote the whole float32 accumulator. Chosen with
  ``lax.platform_dependent`` as the chunk is (:func:`per_platform`): an exported
  program holds each platform's own. Vocabulary parallel: a device's slice of the
  unsharded call's blocks.
  """

  def blocked(grad_w, hc, dz):
    shards = 1 if axis_name is None else lax.axis_size(axis_name)
    block = min(grad_w.shape[1], max(1, _GRAD_W_BLOCK // shards))
    num_blocks, rest = divmod(grad_w.shape[1], block)

    def one(j, grad_w, width):
      cols = lambda a: lax.dynamic_slice_in_dim(a, j, width, axis=1)  # noqa: E731
      gw = _sum_dots(dz, lambda d: lax.dot_general(hc, cols(d), (((0,), (0,)), ((), ())),
                                                    preferred_element_type=acc))  # fmt: skip
      return lax.dynamic_update_slice_in_dim(grad_w, cols(grad_w) + gw, j, axis=1)

    with jax.named_scope(f"{FUSED_GRAD_W_SCOPE}{block}"):
      grad_w = lax.fori_loop(0, num_blocks, lambda k, g: one(k * block, g, block), grad_w)
      if rest:
        grad_w = one(num_blocks * block, grad_w, rest)
    return grad_w

  def whole(grad_w, hc, dz):
    with jax.named_scope(f"{FUSED_GRAD_W_SCOPE}whole"):
      gw = _sum_dots(
        dz, lambda d: lax.dot_general(hc, d, (((0,), (0,)), ((), ())), preferred_element_type=acc)
      )
      return grad_w + gw

  return lax.platform_dependent(grad_w, hc, dz, cpu=blocked, default=whole)


def head_cotangents(grads, s, h, w, b, operands):
  """The cotangents of ``(h, w, b, *operands)`` of a kernel that computed the gradients
  ``grads`` in its forward pass: those times the loss's cotangent ``s``, in the head's dtypes
  (``None`` for no bias), and zeros for the other operands (:func:`zero_cotangent`)."""
  grad_h, grad_w, grad_b = grads
  return (
    (grad_h * s).astype(h.dtype),
    (grad_w * s).astype(w.dtype),
    None if b is None else (grad_b * s).astype(b.dtype),
    *jax.tree.map(zero_cotangent, tuple(operands)),
  )


def zero_cotangent(x):
  """A zero cotangent: float0 for integer and boolean operands."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def vary_like_tokens(weight, bias, *token_arrays):
  """``(weight, bias)`` plus a 0 that varies like the token arrays.

  Inside ``jax.shard_map`` with the tokens split (over "data", say), the head's
  gradient in a custom VJP varies over the tokens' mesh axes, and must have the
  head's type: adding a 0 that varies like the tokens makes the head vary
  alike, and autodiff then sums its gradient over those axes. Outside
  ``shard_map`` it is a no-op, which XLA folds away.
  """
  zero = token_zero(*token_arrays)
  w = jnp.asarray(weight)
  b = None if bias is None else jnp.asarray(bias)
  return w + zero.astype(w.dtype), None if b is None else b + zero.astype(b.dtype)


def token_zero(*token_arrays):
  """A scalar 0 that varies over the mesh axes of the token arrays (inside ``jax.shard_map``)."""
  zero = jnp.zeros((), jnp.float32)
  for a in token_arrays:
    if a is not None:
      zero = zero + lax.full_like(a, 0, jnp.float32, shape=())
  return zero
