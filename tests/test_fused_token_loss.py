"""The private fused per-token loss engine under ``fused_policy_loss``
(``_fused_policy.fused_token_loss``, any per-token function of the log-probabilities and
entropies): chunked == materialised. The public ``fused_policy_loss`` is tested in
test_fused_policy_loss.py.

The references materialise the logits ``hidden @ weight + bias``, take
``token_log_probs(..., return_entropy=True)`` and apply the same per-token
function, differentiated by ``jax.grad``; the values are also checked against
float64 NumPy. Two losses written here stand for the policy losses: a
token-level PPO clipped surrogate (token-mean weights, an entropy bonus) run in
one pass, and a GSPO-like sequence-level loss (the sequence's geometric-mean
ratio, clipped) run with ``two_pass=True``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import (
  check_bf16_grads_digits,
  enable_x64,
  loop_dot_generals,
  matmuls_and_casts,
  np_log_softmax,
  platform_branch,
  rounded_matmul_outputs,
  vocab_sharded_and_whole,
)

import kldiv_jax as kd
from kldiv_jax._fused_policy import fused_token_loss

N, HIDDEN, VOCAB = 12, 6, 24
EPS_LOW, EPS_HIGH, ENTROPY_COEF = 0.2, 0.28, 0.01
# Four sequences of 3 tokens: the one-hot membership [N, 4] travels as a per-token arg.
SEQUENCES = np.repeat(np.arange(4), 3)
TOL = {"rtol": 2e-5, "atol": 2e-6}


def ppo(log_p, entropy, args):
  """Token-level PPO-clip surrogate and entropy bonus, times the aggregation weights."""
  old, adv, weights = args
  ratio = jnp.exp(log_p - old)
  clipped = jnp.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
  loss = -jnp.minimum(ratio * adv, clipped * adv)
  loss = loss if entropy is None else loss - ENTROPY_COEF * entropy  # with_entropy=False: None
  return weights * loss, ratio > 1 + EPS_HIGH  # aux: a clip flag per token


def gspo(log_p, entropy, args):
  """GSPO-like: s = exp(mean over the sequence of log r), clipped, seq-mean-token-mean;
  each token carries 1/(len * num_seqs) of its sequence's loss."""
  old, adv, member = args  # adv per token (constant over the sequence), member [N, S]
  del entropy
  per_sequence = lambda x: jnp.sum(member * x[:, None], axis=0)  # noqa: E731 (no matmul)
  lengths = per_sequence(jnp.ones_like(log_p))
  s = jnp.exp(per_sequence(log_p - old) / lengths)
  seq_adv = per_sequence(adv) / lengths
  seq_loss = -jnp.minimum(s * seq_adv, jnp.clip(s, 1 - EPS_LOW, 1 + EPS_HIGH) * seq_adv)
  return jnp.sum(member * (seq_loss / lengths)[None, :], axis=1) / member.shape[1]


def _data(rng, n=N, vocab=VOCAB, dtype=np.float32):
  f = lambda *shape: (1.5 * rng.normal(size=shape)).astype(dtype)  # noqa: E731
  h, w, b = f(n, HIDDEN), f(HIDDEN, vocab), f(vocab)
  ids = rng.integers(0, vocab, size=n)
  where = np.arange(n) != 4
  old = (rng.normal(size=n) - 3).astype(np.float32)
  adv = rng.normal(size=n).astype(np.float32)
  return h, w, b, ids, where, old, adv


def _ppo_args(where, old, adv):
  return old, adv, (where / where.sum()).astype(np.float32)


def _gspo_args(old, adv):
  member = (SEQUENCES[:, None] == np.arange(4)).astype(np.float32)
  return old, np.repeat(adv.reshape(4, 3).mean(1), 3).astype(np.float32), member


def _losses(fn, args, ids, where, *, two_pass, chunk, **kw):
  """(fused, materialised) value_and_grad wrt hidden, weight and bias, jitted."""
  aux = fn is ppo
  opts = dict(where=where, with_entropy=True, **kw)

  def fused(h, w, b):
    loss, outs = fused_token_loss(
      h, w, b, ids, fn, args, has_aux=aux, two_pass=two_pass, chunk_size=chunk, **opts
    )
    return loss, outs

  def materialised(h, w, b):
    kwargs = dict(temperature=kw.get("temperature", 1.0), softcap=kw.get("softcap"))
    z = jnp.matmul(h, w, precision=jax.lax.Precision.HIGHEST) + b[None]
    lp, ent = kd.token_log_probs(z, ids, where=where, return_entropy=True, **kwargs)
    out = fn(lp, ent, args)
    losses, extra = out if aux else (out, ())
    return jnp.sum(losses), (lp, ent, extra)

  vg = lambda f: jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))  # noqa: E731
  return vg(fused), vg(materialised)


def _np_reference(h, w, b, ids, temperature=1.0, cap=None):
  z = h.astype(np.float64) @ w.astype(np.float64) + b
  z = z if cap is None else cap * np.tanh(z / cap)
  lp = np_log_softmax(z / temperature)
  return lp[np.arange(len(ids)), ids], -np.sum(np.exp(lp) * lp, axis=-1)


@pytest.mark.parametrize(
  ("chunk", "temperature", "cap"), [(1, 1.0, None), (3, 0.7, 3.0), (N, 1.3, None)]
)
def test_token_level_matches_materialised(rng, chunk, temperature, cap):
  """One pass: loss, per-token outputs and gradients wrt hidden, weight and bias."""
  h, w, b, ids, where, old, adv = _data(rng)
  args = _ppo_args(where, old, adv)
  fused, materialised = _losses(
    ppo, args, ids, where, two_pass=False, chunk=chunk, temperature=temperature, softcap=cap
  )
  (loss, outs), grads = fused(h, w, b)
  (want, (lp, ent, clip)), want_grads = materialised(h, w, b)
  np.testing.assert_allclose(loss, want, **TOL)
  for x, y in zip((*outs, *grads), (lp, ent, clip, *want_grads), strict=True):
    np.testing.assert_allclose(x, y, **TOL)
  # The value against float64 NumPy.
  lp64, ent64 = _np_reference(h, w, b, ids, temperature, cap)
  np.testing.assert_allclose(outs.log_probs, np.where(where, lp64, 0), **TOL)
  r = np.exp(lp64 - old)
  per_token = -np.minimum(r * adv, np.clip(r, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
  np.testing.assert_allclose(
    loss, np.sum(args[2] * (per_token - ENTROPY_COEF * ent64)), rtol=2e-5, atol=1e-6
  )


@pytest.mark.parametrize(("chunk", "cap"), [(5, 3.0), (N, None)])
def test_sequence_level_two_pass_matches_materialised(rng, chunk, cap):
  h, w, b, ids, where, old, adv = _data(rng)
  args = _gspo_args(old, adv)
  fused, materialised = _losses(
    gspo, args, ids, where, two_pass=True, chunk=chunk, temperature=0.8, softcap=cap
  )
  (loss, outs), grads = fused(h, w, b)
  (want, (lp, ent, _)), want_grads = materialised(h, w, b)
  assert outs.aux == ()
  for x, y in zip((loss, outs.log_probs, outs.entropy, *grads), (want, lp, ent, *want_grads)):
    np.testing.assert_allclose(x, y, **TOL)


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_dtypes(rng, dtype):
  """float64 (x64) and bf16 inputs against the materialised loss of the same inputs with the
  fused matmuls' accumulator; gradients in the inputs' dtype."""
  h, w, b, ids, where, old, adv = _data(rng)
  args = _ppo_args(where, old, adv)
  with enable_x64(dtype == "float64"):
    h, w, b = (jnp.asarray(a, dtype) for a in (h, w, b))
    acc = jnp.float64 if dtype == "float64" else jnp.float32

    def fused(h, w, b):
      return fused_token_loss(h, w, b, ids, ppo, args, where=where, with_entropy=True,
                              has_aux=True, chunk_size=5)[0]  # fmt: skip

    def materialised(h, w, b):
      z = jnp.dot(h, w, preferred_element_type=acc) + b.astype(acc)[None]
      lp, ent = kd.token_log_probs(z, ids, where=where, return_entropy=True)
      return jnp.sum(ppo(lp, ent, args)[0]).astype(h.dtype)

    got = jax.value_and_grad(fused, (0, 1, 2))(h, w, b)
    want = jax.value_and_grad(materialised, (0, 1, 2))(h, w, b)
    tol = 1e-9 if dtype == "float64" else 2e-2
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert x.dtype == jnp.dtype(dtype)
      np.testing.assert_allclose(
        np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=tol, atol=tol
      )


def _liger_scale(rng, n=8, hidden=512, vocab=256):
  """bf16 hidden states and head drawn from U[0, 1) (Liger Kernel's fused-linear bf16
  tests): logits near 128, where bf16's step is 1."""
  bf16 = lambda *shape: jnp.asarray(rng.random(shape, np.float32), jnp.bfloat16)  # noqa: E731
  return bf16(n, hidden), bf16(hidden, vocab), rng.integers(0, vocab, size=n)


def test_bf16_float32_logits_keep_the_gradient(rng):
  """fused_token_log_probs (the backward pass recomputes the chunks) on logits near 128: the
  gradient of ``sum(log p) + sum(H)`` with bf16 chunk logits (the default) is off by over 5% in
  most entries against float64 of the same inputs; with ``logits_dtype=jnp.float32`` it
  matches to the gradient's own bf16 rounding."""
  h, w, ids = _liger_scale(rng)
  with enable_x64():
    hw = [jnp.asarray(np.asarray(a, np.float64)) for a in (h, w)]

    def want_loss(h, w):
      lp = jax.nn.log_softmax(h @ w)
      return jnp.sum(jnp.take_along_axis(lp, ids[:, None], -1)) - jnp.sum(jnp.exp(lp) * lp)

    want_grads = [np.asarray(g) for g in jax.grad(want_loss, (0, 1))(*hw)]
  for logits_dtype in (None, jnp.float32):

    def loss(h, w, logits_dtype=logits_dtype):
      lp, ent = kd.fused_token_log_probs(
        h, w, ids, return_entropy=True, chunk_size=3, logits_dtype=logits_dtype
      )
      return jnp.sum(lp.astype(jnp.float32)) + jnp.sum(ent.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, (0, 1)))(h, w)
    check_bf16_grads_digits(grads, want_grads, rounded=logits_dtype is None)


@pytest.mark.parametrize("two_pass", [False, True])
def test_bf16_float32_logits_matmul_dtypes(rng, two_pass):
  """``logits_dtype=jnp.float32`` with bf16 inputs (one pass, and two: the recomputing
  backward pass): every matmul takes bf16 operands and accumulates in float32, no matmul
  result is rounded to bf16 (by default: each chunk's logits), and each backward matmul (a
  [chunk, V] operand) runs twice, on the float32 gradient's two bf16 terms."""
  h, w, b, ids, where, old, adv = _data(rng)
  h, w, b = (jnp.asarray(a, jnp.bfloat16) for a in (h, w, b))
  fn, args = (gspo, _gspo_args(old, adv)) if two_pass else (ppo, _ppo_args(where, old, adv))

  def program(logits_dtype):
    def loss(h, w, b):
      return fused_token_loss(h, w, b, ids, fn, args, has_aux=fn is ppo, two_pass=two_pass,
                              chunk_size=5, logits_dtype=logits_dtype)[0]  # fmt: skip

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(h, w, b).jaxpr
    dots, _ = matmuls_and_casts(jaxpr, jnp.bfloat16)
    assert dots and all(e.outvars[0].aval.dtype == jnp.float32 for e in dots)
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    chunks = {(5, VOCAB), (2, VOCAB)}  # 12 tokens: 5, 5 and 2
    backward = sum(any(v.aval.shape in chunks for v in e.invars) for e in dots)
    return rounded_matmul_outputs(jaxpr, jnp.bfloat16), backward

  (rounded, backward), (rounded_f32, backward_f32) = program(None), program(jnp.float32)
  assert rounded > 0 and rounded_f32 == 0 and backward_f32 == 2 * backward > 0


def test_constants_out_of_range_and_errors(rng):
  """No gradient to the per-token args or temperature; an id out of range raises when known
  and gives NaN when traced, unless masked (where, ignore_index); clear errors for a per-token function or args of the wrong shape."""
  h, w, b, ids, where, old, adv = _data(rng)
  args = _ppo_args(where, old, adv)

  def loss(h, args, t):
    return fused_token_loss(h, w, b, ids, ppo, args, temperature=t, has_aux=True)[0]

  g_args, g_t = jax.grad(loss, (1, 2))(h, args, 1.0)
  for g in (*g_args, g_t):
    np.testing.assert_array_equal(g, 0.0)
  bad = ids.copy()
  bad[4] = VOCAB  # out of range, on the token `where` leaves out
  got, outs = fused_token_loss(h, w, b, bad, ppo, args, where=where, has_aux=True)
  want, _ = fused_token_loss(h, w, b, ids, ppo, args, where=where, has_aux=True)
  np.testing.assert_array_equal(got, want)
  bad[4] = -100  # padding, left out by ignore_index as by where
  got, _ = fused_token_loss(h, w, b, bad, ppo, args, ignore_index=-100, has_aux=True)
  np.testing.assert_array_equal(got, want)
  bad[4] = VOCAB  # counted: known ids raise (the id contract), traced ones give NaN
  with pytest.raises(
    ValueError, match=r"token_ids must be in \[0, 24\); got 24 at position \(4,\)"
  ):
    fused_token_loss(h, w, b, bad, ppo, args, has_aux=True)
  traced = jax.jit(lambda i: fused_token_loss(h, w, b, i, ppo, args, has_aux=True))
  got, outs = traced(bad)
  assert np.isnan(got) and np.isnan(outs.log_probs[4]) and not np.isnan(outs.log_probs[3])
  with pytest.raises(ValueError, match="one loss per token"):
    fused_token_loss(h, w, b, ids, lambda lp, ent, a: jnp.sum(lp), ())
  with pytest.raises(ValueError, match="one row per token"):
    fused_token_loss(h, w, b, ids, ppo, (old[:3], adv, args[2]), has_aux=True)


@pytest.mark.parametrize("platform", ["cpu", "default"])
@pytest.mark.parametrize(("two_pass", "loops"), [(False, [3]), (True, [1, 3])])
def test_matmuls_per_chunk(rng, two_pass, loops, platform):
  """value_and_grad: token-level, one loop over the chunks with three matmuls in its body
  (logits, grad_hidden, grad_weight); two-pass, a forward loop with one and a backward loop
  with three (over chunks of tokens on CPU; off CPU, ``default``, with fewer tokens than
  classes, over chunks of the head's columns). No matmul outside the loops (N and V are
  multiples of the chunks)."""
  h, w, b, ids, where, old, adv = _data(rng)
  fn, args = (gspo, _gspo_args(old, adv)) if two_pass else (ppo, _ppo_args(where, old, adv))

  def loss(h, w, b):
    return fused_token_loss(
      h, w, b, ids, fn, args, has_aux=fn is ppo, two_pass=two_pass, chunk_size=4
    )[0]

  with platform_branch(platform):
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(h, w, b)
  assert loop_dot_generals(jaxpr.jaxpr) == (0, loops)


def test_no_logits_array_in_compiled_memory():
  """value_and_grad wrt hidden and weight: compiled temp far below one [tokens, vocab] array."""
  n, hidden, vocab = 2048, 64, 16384
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  args = (f32(n, hidden), f32(hidden, vocab), jax.ShapeDtypeStruct((n,), jnp.int32), f32(n))

  def loss(h, w, ids, adv):
    weights = jnp.full((n,), 1.0 / n)
    return fused_token_loss(h, w, None, ids, ppo, (adv, adv, weights), has_aux=True,
                            with_entropy=True, chunk_size=128)[0]  # fmt: skip

  compiled = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(*args).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < 0.2 * n * vocab * 4, temp


@pytest.mark.multidevice
def test_vocab_parallel_equals_unsharded(cpu_devices):
  """axis_name: one pass and two passes inside shard_map, the head split over 8 devices."""
  rng = np.random.default_rng(7)
  mesh = jax.sharding.Mesh(np.array(cpu_devices), ("vocab",))
  h, w, b, ids, where, old, adv = _data(rng, vocab=32)
  cases = ((ppo, _ppo_args(where, old, adv), False), (gspo, _gspo_args(old, adv), True))
  for fn, args, two_pass in cases:

    def loss(h, w, b, axis_name=None, fn=fn, args=args, two_pass=two_pass):
      value, outs = fused_token_loss(
        h, w, b, ids, fn, args, where=where, temperature=1.3, softcap=4.0, with_entropy=True,
        has_aux=fn is ppo, two_pass=two_pass, chunk_size=5, axis_name=axis_name,
      )  # fmt: skip
      return value, outs.log_probs

    got, want = vocab_sharded_and_whole(loss, mesh, h, w, b)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)
