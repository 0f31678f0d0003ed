"""The opt-in Pallas Triton kernels of the fused LM-head chunk for NVIDIA GPUs
(``_gpu_fused_head``), through :func:`kldiv_jax.fused_token_log_probs`.

Without a GPU the kernels run in Pallas' interpreter on CPU (every ``lax.platform_dependent``
on its CUDA branch, ``_gpu_fused_head.INTERPRET``); with one (``jax.default_backend() ==
"gpu"``, as ``benchmarks/gpu_check.sh`` runs this file) Triton compiles them for real. Blocks
of 16 (the smallest ``plgpu.dot`` takes) on shapes that are no multiple of them (ragged
tokens, hidden and vocabulary edges). Against float64 NumPy (the materialised ``h W + b``,
its log-softmax, the gradients in closed form) and against the XLA chunk loop on the same
branch (``implementation="xla"``): values, entropies and the gradients wrt ``hidden``,
``weight`` and ``bias``, float32 and bfloat16 (both ``logits_dtype``), temperatures, a
soft-cap, ``where`` and ``ignore_index``, ``-inf`` classes, a NaN token, both backwards
(``_gpu_fused_head.BACKWARD``); and the program lowered for CUDA (three Triton calls with
``"pallas"``, two with the atomic backward, none otherwise).
"""

import _gpu_programs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gpu_programs import F32, GPU_KERNEL_MARKS, TRITON_CALL, cuda_branch, cuda_text
from _references import enable_x64

import kldiv_jax as kd
from kldiv_jax import _gpu_fused_head

pytestmark = GPU_KERNEL_MARKS
N, H, V = 37, 40, 70  # no multiple of the blocks of 16


small_blocks = _gpu_programs.small_blocks(_gpu_fused_head)  # several blocks of 16 on these shapes


def _operands(dtype, seed=0, bias=True):
  rng = np.random.default_rng(seed)
  h = rng.standard_normal((N, H)).astype(np.float32)
  w = (rng.standard_normal((H, V)) / 3).astype(np.float32)
  b = rng.standard_normal(V).astype(np.float32) if bias else None
  ids = rng.integers(0, V, N).astype(np.int32)
  h, w = jnp.asarray(h, dtype), jnp.asarray(w, dtype)
  return h, w, None if b is None else jnp.asarray(b, dtype), jnp.asarray(ids)


def _program(implementation, where=None, **options):
  """``jit(value_and_grad)`` of a weighted sum of the token log-probs and entropies wrt
  ``(hidden, weight, bias)``, with the per-token outputs."""
  coef = jnp.asarray(np.linspace(-1.0, 2.0, N), jnp.float32)

  def loss(h, w, b, ids):
    lp, ent = kd.fused_token_log_probs(
      h, w, ids, bias=b, where=where, return_entropy=True, implementation=implementation, **options
    )
    return jnp.sum(coef * lp.astype(jnp.float32)) + 0.3 * jnp.sum(ent.astype(jnp.float32)), (
      lp,
      ent,
    )

  argnums = (0, 1, 2)

  def run(h, w, b, ids):
    (value, outs), grads = jax.value_and_grad(loss, argnums, has_aux=True)(h, w, b, ids)
    return value, outs, grads

  return jax.jit(run), coef


def _float64(h, w, b, ids, coef, temperature=1.0, cap=None, keep=None, low=None):
  """The materialised reference in float64: ``(lp, H)`` and the gradients wrt ``(h, w, b)``
  of ``sum coef lp + 0.3 sum H`` (``low``: logits rounded to the inputs' dtype first)."""
  h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
  z = h64 @ w64
  if low is not None:
    z = np.asarray(jnp.asarray(z, low), np.float64)
  if b is not None:
    z = z + np.asarray(b, np.float64)
  zc = z if cap is None else cap * np.tanh(z / cap)
  u = zc / temperature
  m = u.max(1, keepdims=True)
  lse = m + np.log(np.exp(u - m).sum(1, keepdims=True))
  logp = u - lse
  p = np.exp(logp)
  hit = np.eye(V)[np.asarray(ids)]
  lp = logp[np.arange(N), np.asarray(ids)]
  ent = -(p * logp).sum(1)
  keep = np.ones(N, bool) if keep is None else keep
  g_lp, g_h = np.where(keep, np.asarray(coef, np.float64), 0.0), np.where(keep, 0.3, 0.0)
  du = g_lp[:, None] * (hit - p) + g_h[:, None] * (-p * (logp + ent[:, None]))
  dz = du / temperature * (1.0 if cap is None else 1.0 - (zc / cap) ** 2)
  grads = (dz @ w64.T, h64.T @ dz, dz.sum(0))
  return np.where(keep, lp, 0.0), np.where(keep, ent, 0.0), grads


def _close(got, want, rtol, atol):
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
  "dtype,logits_dtype,temperature,cap,bias,backward",
  [
    (jnp.float32, None, 1.0, None, True, "owned"),
    (jnp.float32, None, 0.7, 3.0, False, "owned"),
    (jnp.bfloat16, None, 1.3, None, True, "owned"),
    (jnp.bfloat16, jnp.float32, 1.0, None, True, "owned"),
    (jnp.float32, None, 0.7, 3.0, True, "atomic"),
    (jnp.bfloat16, None, 1.3, None, False, "atomic"),
  ],
)
def test_values_and_gradients_against_float64(
  dtype, logits_dtype, temperature, cap, bias, backward, monkeypatch
):
  """Log-probs, entropies and the gradients wrt hidden, weight and bias against the float64
  materialised loss, with a mask of tokens (``where``) and ``ignore_index``; both backwards
  (two kernels that own their sums, or one with atomic adds to the weight's gradient)."""
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", backward)
  h, w, b, ids = _operands(dtype, bias=bias)
  ids = ids.at[5].set(-100)
  where = jnp.asarray(np.arange(N) % 7 != 3)
  keep = np.asarray(where) & (np.asarray(ids) != -100)
  options = dict(temperature=temperature, softcap=cap, ignore_index=-100)
  options |= dict(logits_dtype=logits_dtype)
  run, coef = _program("pallas", where=where, **options)
  with cuda_branch():
    _, (lp, ent), grads = run(h, w, b, ids)
  low = dtype if dtype != jnp.float32 and logits_dtype is None else None
  safe = np.where(np.asarray(ids) == -100, 0, np.asarray(ids))
  want_lp, want_ent, want_grads = _float64(h, w, b, safe, coef, temperature, cap, keep, low)
  f32 = dtype == jnp.float32
  tol = dict(rtol=F32, atol=F32) if f32 else dict(rtol=2e-2, atol=2e-2)
  assert lp.dtype == ent.dtype == dtype
  _close(lp, want_lp, **tol)
  _close(ent, want_ent, **tol)
  np.testing.assert_array_equal(np.asarray(lp)[~keep], 0.0)
  np.testing.assert_array_equal(np.asarray(grads[0], np.float32)[~keep], 0.0)
  for got, want in zip(grads, want_grads):
    if got is None:
      assert not bias
      continue
    scale = np.abs(want).max()
    gtol = dict(rtol=5 * F32, atol=F32 * scale / 2) if f32 else dict(rtol=3e-2, atol=2e-2 * scale)
    _close(got, want[: got.shape[0]] if got.ndim == 1 else want, **gtol)


@pytest.mark.parametrize("backward", ["owned", "atomic"])
@pytest.mark.parametrize("dtype,logits_dtype", [(jnp.float32, None), (jnp.bfloat16, None),
                                                (jnp.bfloat16, jnp.float32)])  # fmt: skip
def test_the_xla_chunk_loop_agrees(dtype, logits_dtype, backward, monkeypatch):
  """The same program with ``implementation="xla"`` (the chunk loop, on the same branch):
  values and gradients, float32 and bfloat16 with both ``logits_dtype``, both backwards."""
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", backward)
  h, w, b, ids = _operands(dtype, seed=1)
  where = jnp.asarray(np.arange(N) % 5 != 1)
  options = dict(temperature=0.8, where=where, logits_dtype=logits_dtype, chunk_size=8)
  with cuda_branch():
    got = _program("pallas", **options)[0](h, w, b, ids)
    want = _program("xla", **options)[0](h, w, b, ids)
  f32 = dtype == jnp.float32
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, x = np.asarray(g, np.float64), np.asarray(x, np.float64)
    scale = np.abs(x).max(initial=1.0)
    rtol, atol = (F32, F32 * scale) if f32 else (2e-2, 1e-2 * scale)
    np.testing.assert_allclose(g, x, rtol=rtol, atol=atol)


def test_inf_and_nan():
  """``-inf`` bias entries are classes without mass (a token on one: ``-inf``); a NaN hidden
  state makes its token's outputs NaN and the weight's gradient NaN, and leaves the other
  tokens' values and hidden-state gradients finite, as the XLA chunk loop does."""
  h, w, b, ids = _operands(jnp.float32, seed=2)
  b = b.at[jnp.asarray([3, 17, 69])].set(-jnp.inf)
  ids = ids.at[4].set(17)
  h = h.at[9, 2].set(jnp.nan)
  with cuda_branch():
    got = _program("pallas", temperature=1.5, chunk_size=8)[0](h, w, b, ids)
    want = _program("xla", temperature=1.5, chunk_size=8)[0](h, w, b, ids)
  _, (lp, ent), (gh, gw, _) = got
  assert np.asarray(lp)[4] == -np.inf
  assert np.isnan(np.asarray(lp)[9]) and np.isnan(np.asarray(ent)[9])
  others = np.arange(N) != 9
  assert np.isfinite(np.asarray(ent)[others]).all()
  assert np.isfinite(np.asarray(gh)[others]).all() and np.isnan(np.asarray(gh)[9]).all()
  assert np.isnan(np.asarray(gw)).any()
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, x = np.asarray(g), np.asarray(x)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(x))
    scale = np.abs(x[np.isfinite(x)]).max(initial=1.0)
    np.testing.assert_allclose(g, x, rtol=F32, atol=F32 * scale)


def test_the_cuda_program_holds_the_kernels(monkeypatch):
  """Lowered for CUDA: ``implementation="pallas"`` (per call, or process-wide) puts the three
  kernels (forward, dh, dW) in the program of the value and gradient; the default, ``"xla"``,
  mixed dtypes and float64 keep the XLA chunk loop."""
  monkeypatch.setattr(_gpu_fused_head, "INTERPRET", False)
  h, w, _, ids = _operands(jnp.bfloat16, seed=3, bias=False)

  def calls(implementation=None, h=h, w=w):
    def loss(h, w):
      lp = kd.fused_token_log_probs(h, w, ids, implementation=implementation)
      return jnp.sum(lp.astype(jnp.float32))

    return cuda_text(jax.grad(loss, (0, 1)), h, w).count(f"@{TRITON_CALL}")

  assert calls("pallas") == 3
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", "atomic")
  assert calls("pallas") == 2  # the forward and one backward kernel
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", "owned")
  assert calls() == 0 and calls("xla") == 0
  assert calls("pallas", w=w.astype(jnp.float32)) == 0  # mixed dtypes
  previous = kd.set_implementation("pallas")
  try:
    assert calls() == 3
  finally:
    kd.set_implementation(previous)
  with enable_x64():
    assert calls("pallas", h.astype(jnp.float64), w.astype(jnp.float64)) == 0
  with pytest.raises(ValueError, match="fused_token_log_probs: implementation must be"):
    kd.fused_token_log_probs(h, w, ids, implementation="triton")


@pytest.mark.parametrize(
  "dtype,surrogate,backward",
  [(jnp.float32, "ppo", "owned"), (jnp.bfloat16, "ppo", "atomic"), (jnp.float32, "gspo", "atomic")],
)
def test_the_fused_policy_loss_through_the_kernels(dtype, surrogate, backward, monkeypatch):
  """``fused_policy_loss(implementation="pallas")`` (the loss in two passes around the
  kernels, token-level and sequence-level surrogates) against its XLA chunk loop on the same
  branch: loss, metrics and the gradients wrt hidden, weight and bias, with an entropy bonus,
  a clip-higher and a mask."""
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", backward)
  h, w, b, ids = _operands(dtype, seed=4)
  rng = np.random.default_rng(5)
  old = jnp.asarray(rng.normal(-4.0, 0.5, N), jnp.float32)
  adv = jnp.asarray(rng.standard_normal(N), jnp.float32)
  where = jnp.asarray(np.arange(N) % 6 != 4)
  segments = jnp.asarray(np.arange(N) // 10, jnp.int32)

  def program(implementation):
    def loss(h, w, b):
      return kd.fused_policy_loss(
        h, w, ids, old, adv, bias=b, surrogate=surrogate, clip_high=0.28,
        entropy_coef=0.01, where=where, segment_ids=segments, temperature=0.9,
        chunk_size=8, implementation=implementation,
      )  # fmt: skip

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))

  with cuda_branch():
    got = program("pallas")(h, w, b)
    want = program("xla")(h, w, b)
    text = str(jax.make_jaxpr(program("pallas"))(h, w, b))
  assert "kldiv_jax_gpu_head" in text
  f32 = dtype == jnp.float32
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, x = np.asarray(g, np.float64), np.asarray(x, np.float64)
    scale = np.abs(x).max(initial=1e-3)
    rtol, atol = (F32, F32 * scale) if f32 else (2e-2, 1e-2 * scale)
    np.testing.assert_allclose(g, x, rtol=rtol, atol=atol)


def test_x64_and_vmap():
  """Under ``jax_enable_x64`` float32 operands take the kernels (int32 indices beside int64
  Python ints) with the XLA path's values and gradients; ``vmap`` over sequences (a batched
  kernel call) too."""
  h, w, b, ids = _operands(jnp.float32, seed=6)
  with enable_x64(), cuda_branch():
    got = _program("pallas", temperature=1.2)[0](h, w, b, ids)
    want = _program("xla", temperature=1.2)[0](h, w, b, ids)
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == x.dtype
    np.testing.assert_allclose(g, x, rtol=F32, atol=F32 * np.abs(x).max(initial=1.0))
  hb, idsb = h[:36].reshape(3, 12, H), ids[:36].reshape(3, 12)

  def grads(implementation):
    def loss(h, w, y):
      lp = kd.fused_token_log_probs(h, w, y, implementation=implementation)
      return jnp.sum(lp)

    return jax.jit(jax.vmap(jax.grad(loss, (0, 1)), (0, None, 0)))

  with cuda_branch():
    text = str(jax.make_jaxpr(grads("pallas"))(hb, w, idsb))
    got, want = grads("pallas")(hb, w, idsb), grads("xla")(hb, w, idsb)
  assert "kldiv_jax_gpu_head" in text
  for g, x in zip(got, want):
    np.testing.assert_allclose(g, x, rtol=F32, atol=F32 * np.abs(x).max())


@pytest.mark.parametrize("backward", ["owned", "atomic"])
def test_the_gradient_filter(backward, monkeypatch):
  """``SKIP_BELOW`` (CCE's filter, off by default): at ``2**-8`` on a peaked softmax, bf16,
  some tiles are skipped (the gradients differ) and the gradients are the unfiltered
  kernels' to bf16's rounding; at a threshold above every
  relative gradient, no matmul runs (zero gradients wrt hidden and weight: the filter acts),
  but a NaN tile is never skipped (its NaN reaches the weight's gradient)."""
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", backward)
  # A peaked softmax over 19 tiles, 10 tokens: most tiles hold no label, and tiny gradients.
  rng = np.random.default_rng(7)
  h = jnp.asarray(rng.standard_normal((10, 32)), jnp.bfloat16)
  w = jnp.asarray(2 * rng.standard_normal((32, 300)), jnp.bfloat16)
  ids = jnp.asarray(rng.integers(0, 300, 10), jnp.int32)

  def grads():
    def loss(h, w):
      lp, ent = kd.fused_token_log_probs(h, w, ids, return_entropy=True, implementation="pallas")
      return jnp.mean(lp.astype(jnp.float32)) + 0.01 * jnp.mean(ent.astype(jnp.float32))

    return jax.jit(jax.grad(loss, (0, 1)))

  with cuda_branch():
    want = grads()(h, w)
    monkeypatch.setattr(_gpu_fused_head, "SKIP_BELOW", 2.0**-8)
    filtered = grads()(h, w)
    monkeypatch.setattr(_gpu_fused_head, "SKIP_BELOW", 1e3)
    nothing = grads()(h, w)
    nan = grads()(h.at[3, 0].set(jnp.nan), w)
  assert any(not np.array_equal(g, x) for g, x in zip(filtered, want))
  for g, x in zip(filtered, want):
    g, x = np.asarray(g, np.float32), np.asarray(x, np.float32)
    np.testing.assert_allclose(g, x, rtol=2e-2, atol=1e-2 * np.abs(x).max())
  for g in nothing:
    np.testing.assert_array_equal(np.asarray(g, np.float32), 0.0)
  assert np.isnan(np.asarray(nan[1], np.float32)).any()
  assert np.isnan(np.asarray(nan[0], np.float32)[3]).all()
