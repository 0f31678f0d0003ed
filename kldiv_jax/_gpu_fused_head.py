"""Opt-in Pallas Triton kernels for NVIDIA GPUs: the fused LM-head chunk of
:func:`kldiv_jax.fused_token_log_probs`, its logits only on chip.

Apple's Cut Cross-Entropy design (Wijmans et al. 2025, "Cut Your Losses in Large-Vocabulary
Language Models"): the logits ``z = h W + b`` of a ``[token block, vocabulary tile]`` are
computed by ``plgpu.dot`` into registers and reduced there; no ``[tokens, vocab]`` array and no
``[chunk, vocab]`` array is ever written to HBM, forward or backward. Three kernels:

- **forward**, a grid over token blocks, each looping over vocabulary tiles (each tile's
  logits a loop over hidden chunks, ``h[block, k] @ W[k, tile]`` accumulated in float32): an
  online log-sum-exp (Milakov & Gimelshein 2018) of ``x = (soft_cap(z) - m) / T`` with the
  centred sum ``sum e^x x`` of the entropy, and the label's logit; it writes four numbers per
  token ``[N]`` (the raw max ``m``, ``s = sum e^x``, ``sum e^x x``, ``z_y``), from which XLA
  forms ``log p_y`` and ``H`` exactly as :func:`kldiv_jax._tokens.token_stats` does;
- **dh**, a grid over token blocks looping over vocabulary tiles: the tile's logits
  recomputed, ``dz = (g_lp (onehot - p) - g_H p (log p + H)) / T`` (through the soft-cap's
  slope) on chip (:func:`kldiv_jax._tokens.class_derivatives`' formula), and
  ``dh[block] += dz W[:, tile]^T`` a hidden chunk at a time;
- **dW**, a grid over vocabulary tiles looping over token blocks: the same ``dz`` recomputed,
  ``dW[:, tile] += h[block]^T dz`` a hidden chunk at a time and ``db[tile] += sum dz``.

Each program owns the rows of ``dh`` (the columns of ``dW``) it adds to, so the sums are
deterministic (no atomics): the running sums live in the float32 outputs in HBM (an
``[H]``-wide accumulator does not fit a program's registers), read and written once per
vocabulary tile (token block), from L2 in practice, with a barrier between the tiles. This
backward recomputes the logits twice: five ``N H V`` matmuls in all, against the XLA chunk
loop's four. :data:`BACKWARD` ``= "atomic"`` has one backward kernel instead (CCE's, which
adds both gradients with atomics): per token block and vocabulary tile ``dz`` once, ``dh``
owned as above, ``dW`` and ``db`` by ``plgpu.atomic_add`` into zeroed float32 buffers padded
to whole blocks: four matmuls, the order of ``dW``'s sums left to the hardware (not
bit-reproducible run to run). CCE's skipping of tiles whose gradient is below rounding is
an option, off by default (:data:`SKIP_BELOW`): not exact (at ``2**-12`` on a peaked bf16
softmax in the tests' interpreter runs the gradient wrt ``hidden`` moved by 0.5% of its
largest entry, about one bf16 rounding, that wrt ``weight`` by 0.01%).

:func:`kldiv_jax.fused_policy_loss` (``_fused_policy.fused_token_loss``) runs through the same
kernels with ``implementation="pallas"``: the forward kernel's ``[N]`` statistics, the
per-token loss and its derivatives ``g_lp, g_H`` in XLA, then the backward kernels (the XLA
path's token-level losses take one pass of three matmuls a chunk, computing the gradient in
the forward; the kernels take two passes, four or five matmuls, with no logits in HBM).

The numbers are the XLA path's conventions (:mod:`kldiv_jax._fused_tokens`): bf16/f16 inputs
with the default ``logits_dtype`` round each logit to the inputs' dtype after the float32
matmul (then the bias, in that dtype) and feed ``dz`` to the backward matmuls in it; with
``logits_dtype=float32`` the logits stay float32 and ``dz`` enters the bf16 matmuls as two
terms ``hi + lo`` (:func:`kldiv_jax._fused_chunks.grad_operands`); float32 inputs use
float32 dots (Triton's TF32 on Hopper unless XLA's precision says otherwise, as JAX's own
float32 matmuls on GPUs). A masked token (``where``, ``ignore_index``) has no mass: 0 and
0, no gradient; the temperature gets a zero gradient; ``-inf`` logits (a ``-inf`` bias)
have no mass, NaN propagates (Triton's ``max`` skips a NaN that XLA's returns; the sums are
NaN either way).

**Where it runs** (:func:`takes`; XLA's chunk loop otherwise): ``implementation="pallas"``
(per call, or :func:`kldiv_jax.set_implementation`, ``KLDIV_JAX_IMPLEMENTATION``), in a
program lowered for CUDA (``lax.platform_dependent``: CPU, TPU and ROCm keep XLA's), with
``hidden`` and ``weight`` of one dtype among float32, bfloat16 and float16, no
``axis_name``. Any ``N``, ``H`` and ``V``: the blocks are powers of 2 (at least 16,
``plgpu.dot``'s minimum) and the ragged edges are masked loads (no padded copy: a column
past ``V`` is ``-inf``, a row past ``N`` is not stored, a hidden column past ``H`` is 0).
``chunk_size`` is not read (the kernels have blocks, not chunks). **Opt-in, never measured
on a GPU** (``benchmarks/README.md``): the default stays XLA's chunk loop until
``make bench-device`` times it (``bash benchmarks/gpu_check.sh``, its ``head`` steps).
Compiled for an H100 without a device (``bench_accel.py``, XLA's deviceless CUDA client), the
kernels' temp at 16384 x 2048 x 131072 bf16 is the float32 ``dW`` (1.0 GiB) against the
chunk loop's 1.1 GiB; XLA's cost analysis counts none of a Triton call's flops or bytes.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from kldiv_jax._gpu_head_kernels import (
  HeadKernel,
  _atomic_kernel,
  _dh_kernel,
  _dw_kernel,
  _forward_kernel,
)
from kldiv_jax._numerics import in_kernel, max_shift, nonnegative
from kldiv_jax._rows import normalizer

# Tokens per block, vocabulary columns per tile, hidden columns per matmul step (powers of 2,
# at least 16): a [64, 128] float32 logit tile is 64 registers a thread at 4 warps.
BLOCK_TOKENS = 64
BLOCK_VOCAB = 128
BLOCK_HIDDEN = 64
NUM_WARPS = 4
NUM_STAGES = 3
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Pallas' interpreter instead of Triton (the tests, on CPU); read at trace time.
INTERPRET = False
# The backward: "owned" (a dh kernel and a dW kernel, each program owning the rows or columns
# it adds to: deterministic, five N H V matmuls in all) or "atomic" (one kernel over token
# blocks: dz computed once per tile, dh owned, dW and db by atomic adds: four matmuls, CCE's
# design, the order of the dW sums not fixed). Read at trace time.
BACKWARDS = ("owned", "atomic")
BACKWARD = "owned"
# CCE's gradient filter, off (None) by default: a positive float skips the backward matmuls of
# a [token block, vocabulary tile] whose every |dz| is below it relative to its token's
# cotangents (|dz| / (|g_lp| + |g_H|), the scale of the softmax's own terms p and p log p);
# not exact (the skipped terms are dropped), so never on by default. Read at trace time.
SKIP_BELOW: float | None = None


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def blocks(n: int, hidden: int, vocab: int, sizes=None) -> tuple[int, int, int]:
  """The blocks for ``[n, hidden] @ [hidden, vocab]``: ``sizes`` (default :data:`BLOCK_TOKENS`
  etc.) cut to the next power of 2 of each dimension, at least 16."""
  bn, bv, bk = sizes or (BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_HIDDEN)

  def fit(b: int, d: int) -> int:
    return max(16, min(b, _pow2(d)))

  return fit(bn, n), fit(bv, vocab), fit(bk, hidden)


def head_kernel(n: int, hidden: int, vocab: int, cap, low) -> HeadKernel:
  """The kernels' setting for ``[n, hidden] @ [hidden, vocab]``: the module's blocks, warps,
  stages and backward, read now (the tests and the benchmarks' sweeps set them)."""
  if BACKWARD not in BACKWARDS:
    raise ValueError(f"_gpu_fused_head.BACKWARD must be one of {BACKWARDS}; got {BACKWARD!r}.")
  return HeadKernel(
    blocks(n, hidden, vocab), cap, low, NUM_WARPS, NUM_STAGES, INTERPRET, BACKWARD, SKIP_BELOW
  )


def takes(h, w, axis_name) -> bool:
  """Whether the kernels take these operands: ``h [N, H]`` and ``w [H, V]`` of one dtype
  among float32, bfloat16 and float16 (float64 keeps XLA's), no ``axis_name``."""
  return axis_name is None and h.dtype == w.dtype and any(h.dtype == d for d in DTYPES)


# ---------------------------------------------------------------------------- the calls


def _call(
  cfg: HeadKernel,
  kernel,
  grid,
  out_shapes,
  h,
  w,
  b,
  ids,
  temperature,
  mask,
  extra=(),
  zeros=(),
  view=None,
  vocab=None,
):
  """``kernel`` over ``grid`` with every operand whole in HBM (``pl.no_block_spec``);
  ``zeros``: float32 zero buffers aliased to the last outputs (their shapes), after
  ``out_shapes``. ``temperature``: the scalars (the temperature first, then any others a
  ``view`` reads: a vector, padded to a power of 2). ``view``: how the kernel opens its
  operands (:class:`kldiv_jax._gpu_head_kernels._Head`'s ``open``); ``vocab``: the
  classes the kernels see (default ``w``'s: a longer head's others are never read)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  shape = (h.shape[0], h.shape[1], w.shape[1] if vocab is None else vocab)
  scalars = jnp.reshape(temperature, (-1,)).astype(jnp.float32)
  scalars = jnp.pad(scalars, (0, _pow2(scalars.shape[0]) - scalars.shape[0]))
  operands = [scalars, h, w, *([] if b is None else [b])]
  operands += [ids[:, 0].astype(jnp.int32), mask[:, 0].astype(jnp.int32), *extra]
  first = len(operands)
  operands += [jnp.zeros(z, jnp.float32) for z in zeros]
  out_shapes = [*out_shapes, *zeros]
  aliases = {first + i: len(out_shapes) - len(zeros) + i for i in range(len(zeros))}
  views = {} if view is None else {"view": view}
  body = functools.partial(kernel, cfg, shape, bias=b is not None, **views)
  with warnings.catch_warnings():  # as _gpu_rows._lower: the backend's deprecation
    warnings.filterwarnings(
      "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
    )
    return pl.pallas_call(
      in_kernel(body),
      grid=grid,
      in_specs=[pl.no_block_spec for _ in operands],
      out_specs=[pl.no_block_spec for _ in out_shapes],
      out_shape=[jax.ShapeDtypeStruct(s, jnp.float32) for s in out_shapes],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.warps, num_stages=cfg.stages),
      input_output_aliases=aliases,
      interpret=cfg.interpret,
      name=f"kldiv_jax_gpu_head_{kernel.__name__.strip('_')}",
    )(*operands)


def _forward(cfg: HeadKernel, h, w, b, ids, temperature, mask):
  """``(log p_y, H, top, log s)`` per token ``[N]``: the forward kernel's sums, then
  :func:`kldiv_jax._tokens.token_stats`' closing formulas."""
  n = h.shape[0]
  m, s, centred, picked = _call(
    cfg, _forward_kernel, (-(-n // cfg.blocks[0]),), [(n,)] * 4, h, w, b, ids, temperature, mask
  )
  top = max_shift(m)
  has, inv_s, log_s = normalizer(s)
  keep = picked != -jnp.inf
  x_y = jnp.where(keep, jnp.where(keep, picked - top, 0.0) / temperature, -jnp.inf)
  log_p = jnp.where(has, x_y - log_s, 0.0)
  entropy = jnp.where(has, nonnegative(log_s - centred * inv_s), 0.0)
  return log_p, entropy, top, log_s


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def pallas_tokens(cfg: HeadKernel, h, w, b, ids, temperature, mask):
  """``(log p, H)`` per token ``[n]`` of the logits ``h @ w + b`` from the kernels; the
  arguments as :func:`kldiv_jax._fused_tokens.fused_tokens`' (``ids [n, 1]`` in range,
  ``mask [n, 1]``, ``temperature`` float32)."""
  return _forward(cfg, h, w, b, ids, temperature, mask)[:2]


def _pallas_tokens_fwd(cfg, h, w, b, ids, temperature, mask):
  log_p, entropy, top, log_s = _forward(cfg, h, w, b, ids, temperature, mask)
  return (log_p, entropy), (h, w, b, ids, temperature, mask, top, log_s, entropy)


def _pallas_tokens_bwd(cfg, residuals, g):
  from kldiv_jax._fused_chunks import zero_cotangent

  h, w, b, ids, temperature, mask, top, log_s, entropy = residuals
  g_lp, g_h = (x.astype(jnp.float32) for x in g)
  stats = (top, log_s, entropy, g_lp, g_h)
  run = functools.partial(
    _call, cfg, h=h, w=w, b=b, ids=ids, temperature=temperature, mask=mask, extra=stats
  )
  return (
    *head_grads(cfg, run, h, w, b, w.shape[1]),
    zero_cotangent(ids),
    jnp.zeros_like(temperature),
    zero_cotangent(mask),
  )


pallas_tokens.defvjp(_pallas_tokens_fwd, _pallas_tokens_bwd)


def head_grads(cfg: HeadKernel, run, h, w, b, vocab: int):
  """``(dh, dW, db or None)`` in the dtypes of ``h [n, hidden]``, ``w [hidden, width]`` and
  ``b``, from the backward kernels (``cfg.backward``'s: the dh and dW kernels, or the atomic
  one; float32 sums); ``run(kernel, grid, out_shapes, zeros=())`` calls one with the loss's
  operands (:func:`_call`), ``vocab`` the classes the kernels see: a ``width``-wide head's
  others get no gradient."""
  (n, hidden), width, bias = h.shape, w.shape[1], b is not None
  token_blocks = (-(-n // cfg.blocks[0]),)
  if cfg.backward == "atomic":
    _, bv, bk = cfg.blocks
    padded = [(-(-hidden // bk) * bk, -(-vocab // bv) * bv)]
    padded += [(padded[0][1],)] if bias else []
    dh, dw, *db = run(_atomic_kernel, token_blocks, [(n, hidden)], zeros=padded)
    dw, db = dw[:hidden, :vocab], [x[:vocab] for x in db]
  else:
    (dh,) = run(_dh_kernel, token_blocks, [(n, hidden)])
    outs = [(hidden, vocab)] + ([(vocab,)] if bias else [])
    dw, *db = run(_dw_kernel, (-(-vocab // cfg.blocks[1]),), outs)
  if width > vocab:  # a longer head: its own classes get no gradient
    dw, db = jnp.pad(dw, ((0, 0), (0, width - vocab))), [jnp.pad(x, (0, width - vocab)) for x in db]
  db = None if b is None else db[0].astype(b.dtype)
  return dh.astype(h.dtype), dw.astype(w.dtype), db


def cuda_or_xla(gpu, xla):
  """``gpu()`` (a loss through :func:`pallas_tokens`) in a program lowered for CUDA, ``xla()``
  (the chunk loop) elsewhere (``lax.platform_dependent``: lowering keeps the platform's
  own)."""
  out = lax.platform_dependent(cuda=gpu, default=xla)
  return jax.tree.map(lambda r: lax.convert_element_type(r, r.dtype), out)
