"""token_log_probs and fused_token_log_probs: sampled tokens' log-probabilities and the entropy,
against float64 NumPy and autodiff of the straightforward ``log_softmax`` code, on one device
and with axis_name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import collectives, enable_x64, matmuls_and_casts, platform_branch
from jax.sharding import PartitionSpec as P

import kldiv_jax as kd
from kldiv_jax._fused_chunks import FUSED_GRAD_W_SCOPE


def _reference(z, ids, temperature=1.0, cap=None, xp=np):
  """log_softmax + gather, and the entropy, straightforwardly (no -inf handling needed)."""
  if cap is not None:
    z = cap * xp.tanh(z / cap)
  u = z / temperature
  m = xp.max(u, axis=-1, keepdims=True)
  lp = u - m - xp.log(xp.sum(xp.exp(u - m), axis=-1, keepdims=True))
  picked = xp.take_along_axis(lp, ids[..., None], axis=-1)[..., 0]
  return picked, -xp.sum(xp.exp(lp) * lp, axis=-1)


@pytest.mark.parametrize(("temperature", "cap"), [(1.0, None), (0.7, None), (2.0, 5.0)])
def test_values_and_gradients_against_float64(x64, rng, temperature, cap):
  z = 3 * rng.normal(size=(3, 4, 17))
  ids = rng.integers(0, 17, size=(3, 4))
  lp, h = kd.token_log_probs(z, ids, temperature=temperature, softcap=cap, return_entropy=True)
  want_lp, want_h = _reference(z, ids, temperature, cap)
  np.testing.assert_allclose(lp, want_lp, rtol=1e-12)
  np.testing.assert_allclose(h, want_h, rtol=1e-12)
  a, b = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))

  def ours(z, t):
    lp, h = kd.token_log_probs(z, ids, temperature=t, softcap=cap, return_entropy=True)
    return jnp.sum(a * lp + b * h)

  def ref(z, t):
    lp, h = _reference(z, ids, t, cap, jnp)
    return jnp.sum(a * lp + b * h)

  got = jax.grad(ours, (0, 1))(z, jnp.float64(temperature))
  want = jax.grad(ref, (0, 1))(z, jnp.float64(temperature))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
  # Forward mode and second derivatives (the rule is plain JAX).
  dz = rng.normal(size=z.shape)
  _, t_ours = jax.jvp(lambda z: ours(z, temperature), (z,), (dz,))
  _, t_ref = jax.jvp(lambda z: ref(z, temperature), (z,), (dz,))
  np.testing.assert_allclose(t_ours, t_ref, rtol=1e-9)

  def row(fn):
    def f(zr):
      lp, h = fn(zr, ids[0, 0])
      return a[0, 0] * lp + b[0, 0] * h

    return jax.hessian(f)(z[0, 0])

  hess = row(
    lambda zr, i: kd.token_log_probs(
      zr, i, temperature=temperature, softcap=cap, return_entropy=True
    )
  )
  want = row(lambda zr, i: _reference(zr, i, temperature, cap, jnp))
  np.testing.assert_allclose(hess, want, atol=1e-10)


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_alone_against_float64(x64, rng, temperature, path, request):
  """Without the entropy (float32/64 logits, no soft-cap) a kernel of its own on CPU (the
  entropy kernel off CPU): the values, the gradients wrt the logits and T, forward mode and
  the hessian wrt the logits and T of float64 autodiff; the entropy's hessian too. (Off CPU
  the one-pass sums' derivative wrt T once missed the shift's: an H200 ran it.)"""
  if path == "accelerator":
    request.getfixturevalue("accelerator_branch")
  z = 3 * rng.normal(size=(3, 4, 17))
  ids = rng.integers(0, 17, size=(3, 4))
  np.testing.assert_allclose(
    kd.token_log_probs(z, ids, temperature=temperature),
    _reference(z, ids, temperature)[0],
    rtol=1e-12,
  )
  a = rng.normal(size=(3, 4))
  ours = lambda z, t: jnp.sum(a * kd.token_log_probs(z, ids, temperature=t))  # noqa: E731
  ref = lambda z, t: jnp.sum(a * _reference(z, ids, t, None, jnp)[0])  # noqa: E731
  t = jnp.float64(temperature)
  for g, w in zip(jax.grad(ours, (0, 1))(z, t), jax.grad(ref, (0, 1))(z, t)):
    np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
  dz = rng.normal(size=z.shape)
  got = jax.jvp(ours, (z, t), (dz, jnp.float64(0.3)))[1]
  np.testing.assert_allclose(got, jax.jvp(ref, (z, t), (dz, jnp.float64(0.3)))[1], rtol=1e-9)

  def hessian(fn):  # wrt one row's logits and T
    return jax.hessian(lambda zr, t: a[0, 0] * fn(zr, ids[0, 0], t), (0, 1))(z[0, 0], t)

  got = hessian(lambda zr, i, t: kd.token_log_probs(zr, i, temperature=t))
  want = hessian(lambda zr, i, t: _reference(zr, i, t, None, jnp)[0])
  got_h = hessian(lambda zr, i, t: kd.token_log_probs(zr, i, temperature=t, return_entropy=True)[1])
  want_h = hessian(lambda zr, i, t: _reference(zr, i, t, None, jnp)[1])
  for g, w in zip(jax.tree.leaves((got, got_h)), jax.tree.leaves((want, want_h)), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10)


def test_log_probs_alone_equal_the_entropy_kernels_at_the_edges():
  """-inf logits, a token on a class without mass (-inf), a row without mass (0) and a NaN
  row (NaN): the log-probabilities alone and their gradients (wrt the logits and a traced T)
  equal those computed with the entropy, in float32, to a few ulps (the entropy kernel sums
  the top class apart from the others)."""
  z = np.array(
    [[1, -np.inf, 2, 0], [0, 1, -np.inf, 3], [-np.inf] * 4, [0, np.nan, 1, 2]], np.float32
  )
  ids = np.array([2, 2, 1, 0])
  a = np.array([0.5, -1.0, 2.0, 1.5], np.float32)

  def lp(z, t, entropy, rows=4):
    out = kd.token_log_probs(z, ids[:rows], temperature=t, return_entropy=entropy)
    return out[0] if entropy else out

  for t in (1.0, 0.7):
    got, want = lp(z, t, False), lp(z, t, True)
    np.testing.assert_allclose(got, want, rtol=3e-7)
    assert got[1] == -np.inf and got[2] == 0 and np.isnan(got[3])
    total = lambda z, t, e, rows=4: jnp.sum(a[:rows] * lp(z, t, e, rows))  # noqa: E731
    grads = [jax.grad(total, (0, 1))(z, jnp.float32(t), e) for e in (False, True)]
    np.testing.assert_allclose(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-7)
    assert np.isnan(grads[0][1]) and np.isnan(grads[1][1])  # the NaN row reaches T
    g_t = [jax.grad(total, 1)(z[:3], jnp.float32(t), e, 3) for e in (False, True)]
    assert np.isfinite(g_t[0])
    np.testing.assert_allclose(g_t[0], g_t[1], rtol=4e-6)  # a few float32 ulps


def test_masks_padding_and_out_of_range(rng):
  z = rng.normal(size=(4, 6)).astype(np.float32)
  z[1, 2] = -np.inf
  z[3] = np.nan  # a masked token: cannot leak
  ids = np.array([0, 2, 7, -100])
  where = np.array([True, True, True, False])
  lp = jax.jit(lambda z, ids: kd.token_log_probs(z, ids, where=where))(z, ids)
  assert np.isposinf(-lp[1]) and np.isnan(lp[2]) and lp[3] == 0 and np.isfinite(lp[0])
  with pytest.raises(ValueError, match=r"token_ids must be in \[0, 6\); got 7 at position \(2,\)"):
    kd.token_log_probs(z, ids, where=where)  # known ids: raised, not NaN
  g = jax.grad(lambda z: kd.token_log_probs(z, np.array([0, 1, 1, -100]), where=where).sum())(z)
  assert np.all(np.isfinite(g)) and not np.any(np.asarray(g)[3])
  assert g[1, 2] == 0  # a class without mass
  with pytest.raises(ValueError, match="token_ids must have the logits' shape"):
    kd.token_log_probs(z, ids[:3])
  with pytest.raises(ValueError, match="temperature must be positive"):
    kd.token_log_probs(z, ids, temperature=0.0)
  assert np.isnan(jax.jit(lambda t: kd.token_log_probs(z[:1], ids[:1], temperature=t))(-1.0))


@pytest.mark.parametrize("temperature", [1e-2, 1.0, 1e2])
def test_extreme_logits_and_temperatures(rng, temperature):
  """Logits of magnitude 1e4, T from 1e-2 to 1e2: finite, entropy >= 0, exact 0 one-hot."""
  z = (1e4 * rng.normal(size=(8, 64))).astype(np.float32)
  ids = rng.integers(0, 64, size=8)
  lp, h = kd.token_log_probs(z, ids, temperature=temperature, return_entropy=True)
  assert np.all(np.isfinite(lp)) and np.all(np.asarray(lp) <= 0) and np.all(np.asarray(h) >= 0)
  want_lp, want_h = _reference(z.astype(np.float64), ids, temperature)
  np.testing.assert_allclose(lp, want_lp, rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(h, want_h, rtol=1e-4, atol=1e-5)
  one_hot = np.full((2, 5), -np.inf, np.float32)
  one_hot[:, 3] = [1e4, -1e4]
  lp, h = kd.token_log_probs(
    one_hot, np.array([3, 3]), temperature=temperature, return_entropy=True
  )
  np.testing.assert_array_equal(h, 0.0)
  np.testing.assert_array_equal(lp, 0.0)
  g = jax.grad(lambda z: sum(x.sum() for x in kd.token_log_probs(z, ids, return_entropy=True)))(z)
  assert np.all(np.isfinite(g))


@pytest.mark.multidevice
def test_vocab_parallel_equals_unsharded(cpu_devices):
  rng = np.random.default_rng(5)
  mesh = jax.sharding.Mesh(np.array(cpu_devices), ("vocab",))
  z = (3 * rng.normal(size=(6, 32))).astype(np.float32)
  z[0, :20] = -np.inf  # some devices without mass on a row
  ids = rng.integers(20, 32, size=6)
  a = rng.normal(size=6).astype(np.float32)

  def loss(z, t, axis_name=None):
    lp, h = kd.token_log_probs(
      z, ids, temperature=t, softcap=4.0, return_entropy=True, axis_name=axis_name
    )
    return jnp.sum(a * lp + h)

  sharded = jax.shard_map(
    lambda z, t: loss(z, t, "vocab"), mesh=mesh, in_specs=(P(None, "vocab"), P()), out_specs=P()
  )
  got = jax.jit(jax.value_and_grad(sharded, (0, 1)))(z, jnp.float32(1.5))
  want = jax.jit(jax.value_and_grad(loss, (0, 1)))(z, jnp.float32(1.5))
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- from hidden states


def _head(rng, tokens=11, hidden=6, vocab=24, dtype=np.float32):
  f = lambda *shape: (1.5 * rng.normal(size=shape)).astype(dtype)  # noqa: E731
  return f(tokens, hidden), f(hidden, vocab), f(vocab), rng.integers(0, vocab, size=tokens)


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize(("temperature", "cap", "chunk"), [(1.0, None, 4), (0.6, 3.0, 5)])
def test_fused_equals_materialised(rng, temperature, cap, chunk, path, request):
  """Values and gradients wrt hidden, weight and bias through both outputs, with a mask.
  ``accelerator``: the GPU/TPU branch, whose backward pass runs over chunks of the head's
  columns here (11 tokens, 24 columns: 8 or 10 a chunk, the last one uneven at 10)."""
  if path == "accelerator":
    request.getfixturevalue("accelerator_branch")
  h, w, b, ids = _head(rng)
  where = np.arange(11) != 4
  a, c = rng.normal(size=11).astype(np.float32), rng.normal(size=11).astype(np.float32)
  kw = dict(temperature=temperature, softcap=cap, where=where, return_entropy=True)

  def fused(h, w, b):
    lp, ent = kd.fused_token_log_probs(h, w, ids, bias=b, chunk_size=chunk, **kw)
    return jnp.sum(a * lp + c * ent), (lp, ent)

  def materialised(h, w, b):
    lp, ent = kd.token_log_probs(h @ w + b[None], ids, **kw)
    return jnp.sum(a * lp + c * ent), (lp, ent)

  got = jax.jit(jax.value_and_grad(fused, (0, 1, 2), has_aux=True))(h, w, b)
  want = jax.jit(jax.value_and_grad(materialised, (0, 1, 2), has_aux=True))(h, w, b)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)
  # Against float64 NumPy too.
  z = h.astype(np.float64) @ w.astype(np.float64) + b
  want_lp, want_h = _reference(z, ids, temperature, cap)
  np.testing.assert_allclose(got[0][1][0], np.where(where, want_lp, 0), rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(got[0][1][1], np.where(where, want_h, 0), rtol=2e-5, atol=2e-6)


def _head_structs(n, hidden, vocab, dtype):
  """Shapes of ``(hidden [n, H], weight [H, V], ids [n])`` for a compile-only test."""
  return (
    jax.ShapeDtypeStruct((n, hidden), dtype),
    jax.ShapeDtypeStruct((hidden, vocab), dtype),
    jax.ShapeDtypeStruct((n,), jnp.int32),
  )


def test_fused_memory_has_no_logits_array():
  """value_and_grad wrt hidden and weight: compiled temp far below one [tokens, vocab] array."""
  n, hidden, vocab = 2048, 64, 16384
  args = _head_structs(n, hidden, vocab, jnp.float32)

  def loss(h, w, ids):
    lp, ent = kd.fused_token_log_probs(h, w, ids, return_entropy=True, chunk_size=128)
    return jnp.sum(lp) + jnp.sum(ent)

  temp = jax.jit(jax.grad(loss, (0, 1))).lower(*args).compile().memory_analysis()
  assert temp.temp_size_in_bytes < 0.2 * n * vocab * 4, temp.temp_size_in_bytes


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_fused_backward_over_columns_holds_no_float32_head(path, request):
  """Fewer tokens than classes, bf16 inputs: off CPU (``accelerator``, the GPU/TPU branch)
  the backward pass runs over chunks of the head's columns, each column's weight gradient
  one matmul over every token, written once in bf16: the program has no float32 ``[H, V]``
  array, which the token chunks' weight-gradient accumulator is (``cpu``). (Read off the
  lowered program: XLA:CPU itself computes bf16 matmuls in float32 copies.)"""
  if path == "accelerator":
    request.getfixturevalue("accelerator_branch")
  n, hidden, vocab = 128, 256, 8192
  args = _head_structs(n, hidden, vocab, jnp.bfloat16)

  def loss(h, w, ids):
    lp = kd.fused_token_log_probs(h, w, ids, chunk_size=64)
    return jnp.sum(lp.astype(jnp.float32))

  text = jax.jit(jax.grad(loss, (0, 1))).lower(*args).as_text()
  assert (f"tensor<{hidden}x{vocab}xf32>" in text) == (path == "cpu")


@pytest.mark.parametrize(
  "case", ["-inf bias", "sampled id at -inf", "nan hidden", "chunk 1", "one token", "vmap"]
)
def test_fused_backward_over_columns_equals_over_tokens(case):
  """The GPU/TPU branch's backward over chunks of the head's columns (7 tokens, 300 columns,
  chunks of 128 and an uneven 44) against the CPU's over chunks of tokens, at the edges:
  masked classes, a sampled id without mass, a NaN hidden state (NaN where the token chunks
  have it), one token per chunk (42 columns), one token, ``vmap``."""
  rng = np.random.default_rng(3)
  n, hidden, vocab = 7, 5, 300
  h = rng.normal(size=(n, hidden)).astype(np.float32)
  w = rng.normal(size=(hidden, vocab)).astype(np.float32)
  b = rng.normal(size=vocab).astype(np.float32)
  ids = rng.integers(0, vocab, n)
  kw = {"chunk_size": 3}  # 3 * 300 / 7: 128 columns a chunk
  if case in ("-inf bias", "sampled id at -inf"):
    b[::7] = -np.inf
    ids[ids % 7 == 0] += 1
    ids[2] = 0 if case == "sampled id at -inf" else ids[2]
  if case == "nan hidden":
    h[3, 1] = np.nan
  if case == "chunk 1":
    kw["chunk_size"] = 1
  if case == "one token":
    h, ids = h[:1], ids[:1]

  def grads(h, w, b):
    def loss(h, w, b):
      lp, ent = kd.fused_token_log_probs(h, w, ids, bias=b, return_entropy=True, **kw)
      return jnp.sum(lp) + 0.3 * jnp.sum(ent)

    return jax.value_and_grad(loss, (0, 1, 2))(h, w, b)

  fn = jax.jit(grads)
  if case == "vmap":
    fn = jax.jit(jax.vmap(grads, in_axes=(0, None, None)))
    h = np.stack([h, 2 * h])
  with platform_branch():
    got = fn(h, w, b)
    text = fn.lower(h, w, b).as_text(debug_info=True)
  assert f"{FUSED_GRAD_W_SCOPE}columns" in text  # the columns' backward ran
  want = fn(h, w, b)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6, equal_nan=True)
  assert np.isnan(np.asarray(got[1][1])).any() == (case == "nan hidden")


def test_fused_errors_and_out_of_range(rng):
  h, w, _, ids = _head(rng)
  ids = ids.copy()
  ids[2] = 24
  lp = jax.jit(kd.fused_token_log_probs)(h, w, ids)
  assert np.isnan(lp[2]) and np.all(np.isfinite(np.delete(np.asarray(lp), 2)))
  with pytest.raises(ValueError, match=r"token_ids must be in \[0, 24\); got 24 at position"):
    kd.fused_token_log_probs(h, w, ids)
  with pytest.raises(ValueError, match="token_ids must have shape"):
    kd.fused_token_log_probs(h, w, ids[:3])
  with pytest.raises(ValueError, match="chunk_size must be a positive int"):
    kd.fused_token_log_probs(h, w, ids % 24, chunk_size=0)


@pytest.mark.multidevice
@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_fused_vocab_parallel_equals_unsharded(cpu_devices, path, request):
  """``accelerator``: each device's backward pass over chunks of its columns, the hidden
  states' gradient summed once."""
  if path == "accelerator":
    request.getfixturevalue("accelerator_branch")
  rng = np.random.default_rng(7)
  mesh = jax.sharding.Mesh(np.array(cpu_devices), ("vocab",))
  h, w, b, ids = _head(rng, vocab=32)

  def loss(h, w, b, axis_name=None):
    lp, ent = kd.fused_token_log_probs(
      h,
      w,
      ids,
      bias=b,
      temperature=1.3,
      softcap=4.0,
      return_entropy=True,
      chunk_size=4,
      axis_name=axis_name,
    )
    return jnp.sum(lp) + 0.5 * jnp.sum(ent)

  sharded = jax.shard_map(
    lambda h, w, b: loss(h, w, b, "vocab"),
    mesh=mesh,
    in_specs=(P(), P(None, "vocab"), P("vocab")),
    out_specs=P(),
  )
  compiled = jax.jit(jax.value_and_grad(sharded, (0, 1, 2))).lower(h, w, b).compile()
  got = compiled(h, w, b)
  want = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(h, w, b)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)
  # Only per-token statistics and the hidden states' gradient cross devices: no all-gather.
  ops = [op for op, _ in collectives(compiled.as_text())]
  assert ops and not any("all-gather" in op for op in ops), ops


def test_ignore_index_is_a_mask(rng):
  h, w, b, ids = _head(rng)
  ids = ids.copy()
  ids[[1, 5]] = -100
  where = ids != -100
  z = h @ w + b[None]
  for fn, args in ((kd.token_log_probs, (z,)), (kd.fused_token_log_probs, (h, w))):
    got = fn(*args, ids, ignore_index=-100, return_entropy=True)
    want = fn(*args, np.where(where, ids, 0), where=where, return_entropy=True)
    for x, y in zip(got, want):
      np.testing.assert_array_equal(x, y)
    assert np.all(np.asarray(got[0])[~where] == 0)


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_fused_dtypes(rng, dtype, path, request):
  """float64 (x64) and bf16 inputs, returned in the inputs' dtype. float64: the fused call
  equals the materialised one. bf16: the chunks' logits and their gradient are bf16 between
  the matmuls, as autodiff of the materialised ``token_log_probs(h @ w + b, ids)`` has them:
  against float64 (the same bf16 inputs), the fused values and gradients are as accurate as
  that materialised code's (each within twice its error and a few bf16 ulps of its scale).
  ``accelerator``: the GPU/TPU branch (the backward over the head's columns, each column's
  weight gradient rounded once to the inputs' dtype)."""
  if path == "accelerator":
    request.getfixturevalue("accelerator_branch")
  h, w, b, ids = _head(rng, dtype=np.float32)

  def total(lp, ent):
    acc = jnp.float64 if lp.dtype == jnp.float64 else jnp.float32
    return jnp.sum(lp.astype(acc)) + jnp.sum(ent.astype(acc)), lp

  def fused(h, w, b):
    return total(*kd.fused_token_log_probs(h, w, ids, bias=b, return_entropy=True, chunk_size=4))

  def materialised(h, w, b):
    return total(*kd.token_log_probs(h @ w + b[None], ids, return_entropy=True))

  def run(fn, dtype):
    args = (jnp.asarray(a, dtype) for a in (h, w, b))
    (value, lp), grads = jax.value_and_grad(fn, (0, 1, 2), has_aux=True)(*args)
    return [np.asarray(x, np.float64) for x in (value, lp, *grads)], (lp, *grads)

  if dtype == "bfloat16":
    h, w, b = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (h, w, b))
  with enable_x64(True):
    exact, _ = run(materialised, jnp.float64)
  with enable_x64(dtype == "float64"):
    got, outs = run(fused, dtype)
    want, _ = run(materialised, dtype)
  assert all(x.dtype == jnp.dtype(dtype) for x in outs)
  for g, m, e in zip(got, want, exact, strict=True):
    if dtype == "float64":
      np.testing.assert_allclose(g, m, rtol=1e-9, atol=1e-9)
    else:
      scale = 2.0**-6 * np.max(np.abs(e))
      assert np.max(np.abs(g - e)) <= 2 * np.max(np.abs(m - e)) + scale


def test_fused_bf16_logits_and_gradient_in_bf16(rng):
  """bf16 inputs: every matmul of the fused call's forward and backward takes bf16 operands,
  and each chunk's float32-accumulated logits are converted to bf16 (XLA:GPU writes them to
  HBM between its fusions; with float32 the backward's two matmuls ran in float32, and the
  fused call took 2.2x the materialised one's time on an H200)."""
  h, w, b, ids = (jnp.asarray(a, jnp.bfloat16) if a.dtype != np.int64 else a for a in _head(rng))

  def loss(h, w, b):
    lp, ent = kd.fused_token_log_probs(h, w, ids, bias=b, return_entropy=True, chunk_size=4)
    return jnp.sum(lp.astype(jnp.float32)) + jnp.sum(ent.astype(jnp.float32))

  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(h, w, b).jaxpr
  dots, to_bf16 = matmuls_and_casts(jaxpr, jnp.bfloat16)
  assert len(dots) >= 3 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
  assert (4, 24) in to_bf16 and (3, 24) in to_bf16  # a full chunk and the last one
