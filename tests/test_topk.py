"""``kl_div_from_topk`` and ``divergence_from_topk`` against a float64 NumPy reference.

The reference renormalises the teacher over its top-k slots with mass at
temperature ``T`` and compares it with the student's full-vocabulary softmax,
one example at a time with explicit loops (no shared code with the library).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import (
  TOLERANCES,
  enable_x64,
  np_log_softmax,
  np_topk_divergence,
  np_topk_log_probs,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from kldiv_jax import (
  Divergence,
  divergence_from_logits,
  divergence_from_topk,
  fused_topk_distillation_loss,
  kl_div_from_logits,
  kl_div_from_topk,
)

# Jitted once per shape: one compilation instead of one per eager op keeps the file fast.
topk = jax.jit(kl_div_from_topk, static_argnames=("temperature",))


def reference(logits, ids, log_probs, temperature=1.0, slot_mask=None):
  """float64 per-example KL(renormalised top-k teacher || student)."""
  logits = np.asarray(logits, np.float64)
  ids = np.asarray(ids)
  log_probs = np.asarray(log_probs, np.float64)
  batch = logits.shape[:-1]
  out = np.zeros(batch)
  for b in np.ndindex(*batch):
    log_q = np_log_softmax(logits[b] / temperature)
    keep = np.isfinite(log_probs[b])
    if slot_mask is not None:
      keep &= np.broadcast_to(slot_mask, ids.shape)[b]
    if not keep.any():
      continue
    log_p = np_log_softmax(log_probs[b][keep] / temperature)
    out[b] = np.sum(np.exp(log_p) * (log_p - log_q[ids[b][keep]]))
  return out


def reference_grad(logits, ids, log_probs, temperature, cotangent):
  """(q - scatter(p)) / T per example, times the cotangent (float64)."""
  logits = np.asarray(logits, np.float64)
  grad = np.zeros_like(logits)
  for b in np.ndindex(*logits.shape[:-1]):
    q = np.exp(np_log_softmax(logits[b] / temperature))
    p = np.exp(np_log_softmax(np.asarray(log_probs[b], np.float64) / temperature))
    scattered = np.zeros_like(q)
    np.add.at(scattered, np.asarray(ids[b]), p)
    grad[b] = cotangent[b] * (q - scattered) / temperature
  return grad


def make_case(rng, batch, vocab, k, dtype=np.float32):
  """Student logits, and a teacher's top-k ids (distinct, best first) and log-probs."""
  logits = rng.normal(scale=2.0, size=(*batch, vocab)).astype(dtype)
  teacher = rng.normal(scale=2.0, size=(*batch, vocab))
  ids = np.argsort(-teacher, axis=-1)[..., :k].astype(np.int32)
  log_probs = np.take_along_axis(
    teacher - np.log(np.sum(np.exp(teacher), axis=-1, keepdims=True)), ids, axis=-1
  ).astype(dtype)
  return logits, ids, log_probs, teacher


@pytest.mark.parametrize("batch", [(), (4,), (2, 3)])
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_matches_float64_reference_float32(batch, k, temperature, rng):
  logits, ids, lp, _ = make_case(rng, batch, 7, k)
  out = topk(logits, ids, lp, temperature=temperature)
  assert out.shape == batch and out.dtype == jnp.float32
  np.testing.assert_allclose(out, reference(logits, ids, lp, temperature), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 3.0])
def test_matches_float64_reference_float64(temperature, rng, x64):
  logits, ids, lp, _ = make_case(rng, (5,), 11, 4, np.float64)
  out = topk(logits, ids, lp, temperature=temperature)
  assert out.dtype == jnp.float64
  np.testing.assert_allclose(out, reference(logits, ids, lp, temperature), *TOLERANCES["float64"])


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_k_equal_vocab_is_full_kl(temperature, rng, x64):
  logits, ids, lp, teacher = make_case(rng, (6,), 9, 9, np.float64)
  # Full KL(softmax(s / T) || softmax(z / T)), directly in NumPy.
  expected = []
  for z, s in zip(logits, teacher):
    log_p, log_q = np_log_softmax(s / temperature), np_log_softmax(z / temperature)
    expected.append(np.sum(np.exp(log_p) * (log_p - log_q)))
  out = topk(logits, ids, lp, temperature=temperature)
  np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
  # The order of the slots does not matter.
  perm = rng.permutation(9)
  np.testing.assert_allclose(
    topk(logits, ids[:, perm], lp[:, perm], temperature=temperature),
    expected,
    rtol=1e-12,
    atol=1e-12,
  )
  # And it agrees with the logits loss given the teacher's full logits.
  np.testing.assert_allclose(
    kl_div_from_logits(logits, teacher, temperature=temperature), expected, rtol=1e-10, atol=1e-12
  )


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_gradient_is_q_minus_scattered_p(temperature, rng, x64):
  logits, ids, lp, _ = make_case(rng, (2, 3), 8, 3, np.float64)
  cot = rng.normal(size=(2, 3))
  grad = jax.grad(lambda z: jnp.sum(cot * topk(z, ids, lp, temperature=temperature)))(logits)
  expected = reference_grad(logits, ids, lp, temperature, cot)
  np.testing.assert_allclose(grad, expected, rtol=1e-10, atol=1e-12)


def test_gradient_float32_matches_formula(rng):
  logits, ids, lp, _ = make_case(rng, (16,), 50, 5)
  grad = jax.jit(jax.grad(lambda z: jnp.sum(topk(z, ids, lp, temperature=2.0))))(logits)
  expected = reference_grad(logits, ids, lp, 2.0, np.ones(16))
  np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)


def test_check_grads(rng, x64):
  logits, ids, lp, _ = make_case(rng, (3,), 6, 4, np.float64)
  lp[0, -1] = -np.inf
  f = jax.jit(lambda z, w: kl_div_from_topk(z, ids, w, temperature=1.3))
  check_grads(f, (logits, lp), order=2, modes=("fwd", "rev"))
  # First order wrt a traced temperature too.
  g = jax.jit(lambda z, w, t: kl_div_from_topk(z, ids, w, temperature=t))
  check_grads(g, (logits, lp, 1.3), order=1, modes=("fwd", "rev"))


def test_hessian_wrt_logits_finite_with_inf_slots(rng):
  logits, ids, lp, _ = make_case(rng, (2,), 5, 3)
  lp[0, 1:] = -np.inf
  h = jax.hessian(lambda z: jnp.sum(topk(z, ids, lp)))(logits)
  assert h.shape == (2, 5, 2, 5)
  assert np.all(np.isfinite(h))


def test_jit_vmap_equal_batched(rng):
  logits, ids, lp, _ = make_case(rng, (4, 3), 10, 4)
  batched = topk(logits, ids, lp, temperature=1.5)
  vm = jax.vmap(lambda z, i, w: topk(z, i, w, temperature=1.5))(logits, ids, lp)
  np.testing.assert_allclose(vm, batched, rtol=1e-6, atol=1e-7)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(z, i, w, t):
    return kl_div_from_topk(z, i, w, temperature=t)

  np.testing.assert_allclose(f(logits, ids, lp, 1.5), batched, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(f(logits + 1.0, ids, lp, 1.5), batched, rtol=1e-5, atol=1e-6)


def test_traced_temperature_equals_static(rng):
  logits, ids, lp, _ = make_case(rng, (5,), 8, 3)
  lp[0, 2] = -np.inf
  static = topk(logits, ids, lp, temperature=2.0)
  traced = jax.jit(lambda t: kl_div_from_topk(logits, ids, lp, temperature=t))(jnp.float32(2.0))
  np.testing.assert_allclose(traced, static, rtol=1e-6)
  g = jax.jit(jax.grad(lambda t: jnp.sum(kl_div_from_topk(logits, ids, lp, temperature=t))))(2.0)
  assert np.isfinite(g)


def test_temperature_derivative_matches_finite_difference(rng, x64):
  logits, ids, lp, _ = make_case(rng, (3,), 7, 3, np.float64)
  lp[1, 0] = -np.inf
  logits[2, 5] = -np.inf  # a masked vocabulary entry outside the top-k
  ids[2] = [0, 1, 2]
  f = lambda t: np.sum(reference(logits, ids, lp, t))  # noqa: E731
  eps = 1e-6
  fd = (f(1.7 + eps) - f(1.7 - eps)) / (2 * eps)
  g = jax.jit(jax.grad(lambda t: jnp.sum(kl_div_from_topk(logits, ids, lp, temperature=t))))(1.7)
  np.testing.assert_allclose(g, fd, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits(dtype, rng):
  logits, ids, lp, _ = make_case(rng, (8,), 32, 4)
  z = jnp.asarray(logits, dtype)
  out = topk(z, ids, jnp.asarray(lp, dtype), temperature=2.0)
  assert out.dtype == dtype
  expected = reference(np.asarray(z, np.float64), ids, np.asarray(jnp.asarray(lp, dtype)), 2.0)
  rtol, _ = TOLERANCES[dtype]
  np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=rtol, atol=1e-3)
  # Half-precision logits with float32 teacher log-probs: float32 result.
  assert topk(z, ids, lp).dtype == jnp.float32
  grad = jax.grad(lambda z: jnp.sum(topk(z, ids, lp, temperature=2.0)))(z)
  assert grad.dtype == dtype
  expected_grad = reference_grad(np.asarray(z, np.float64), ids, lp, 2.0, np.ones(8))
  np.testing.assert_allclose(np.asarray(grad, np.float64), expected_grad, rtol=0, atol=4e-3)


def test_inf_slots_equal_dropping_them(rng):
  logits, ids, lp, _ = make_case(rng, (4,), 12, 5)
  lp_inf = lp.copy()
  lp_inf[:, 3:] = -np.inf
  ids_pad = ids.copy()
  ids_pad[:, 3:] = -1  # padding ids at slots without mass are ignored
  out = topk(logits, ids_pad, lp_inf, temperature=1.5)
  np.testing.assert_allclose(out, topk(logits, ids[:, :3], lp[:, :3], temperature=1.5), rtol=1e-6)
  np.testing.assert_allclose(out, reference(logits, ids[:, :3], lp[:, :3], 1.5), rtol=2e-6)
  g_z, g_lp = jax.grad(lambda z, w: jnp.sum(topk(z, ids_pad, w, temperature=1.5)), argnums=(0, 1))(
    logits, lp_inf
  )
  assert np.all(np.isfinite(g_z)) and np.all(np.isfinite(g_lp))
  np.testing.assert_array_equal(g_lp[:, 3:], 0.0)
  np.testing.assert_allclose(
    g_z, reference_grad(logits, ids[:, :3], lp[:, :3], 1.5, np.ones(4)), rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize("shape", ["full", "broadcast"])
def test_slot_mask_equals_dropping_slots(shape, rng):
  logits, ids, lp, _ = make_case(rng, (3,), 10, 4)
  if shape == "full":
    slot = np.array([[True, True, False, True]] * 3)
  else:
    slot = np.array([[True, True, False, True]])  # broadcasts over the batch
  lp_bad = lp.copy()
  lp_bad[:, 2] = np.nan  # masked slots may hold anything
  ids_bad = ids.copy()
  ids_bad[:, 2] = 10_000
  out = topk(logits, ids_bad, lp_bad, where=slot)
  keep = [0, 1, 3]
  np.testing.assert_allclose(out, reference(logits, ids[:, keep], lp[:, keep]), rtol=2e-6)
  g_z, g_lp = jax.grad(lambda z, w: jnp.sum(topk(z, ids_bad, w, where=slot)), (0, 1))(
    logits, lp_bad
  )
  assert np.all(np.isfinite(g_z))
  np.testing.assert_array_equal(g_lp[:, 2], 0.0)


def test_all_slots_masked_gives_zero(rng):
  logits, ids, lp, _ = make_case(rng, (3,), 6, 2)
  lp[0] = -np.inf
  slot = np.array([[True, True], [False, False], [True, True]])
  f = lambda z, w: topk(z, ids, w, where=slot)  # noqa: E731
  out = f(logits, lp)
  assert out[0] == 0.0 and out[1] == 0.0
  np.testing.assert_allclose(out[2], reference(logits[2:], ids[2:], lp[2:])[0], rtol=2e-6)
  g_z, g_lp = jax.grad(lambda z, w: jnp.sum(f(z, w)), (0, 1))(logits, lp)
  np.testing.assert_array_equal(g_z[:2], 0.0)
  np.testing.assert_array_equal(g_lp[:2], 0.0)


def test_example_mask(rng):
  logits, ids, lp, _ = make_case(rng, (2, 3), 7, 3)
  mask = np.array([[True, False, True], [False, True, True]])
  bad_logits = logits.copy()
  bad_logits[~mask] = np.nan  # masked examples may hold anything
  bad_lp = lp.copy()
  bad_lp[~mask] = np.inf
  out = topk(bad_logits, ids, bad_lp, where=mask)
  expected = np.where(mask, reference(logits, ids, lp), 0.0)
  np.testing.assert_allclose(out, expected, rtol=2e-6, atol=1e-7)
  grad = jax.grad(lambda z: jnp.sum(topk(z, ids, bad_lp, where=mask)))(bad_logits)
  np.testing.assert_array_equal(grad[~mask], 0.0)
  np.testing.assert_allclose(
    grad[mask], reference_grad(logits, ids, lp, 1.0, mask.astype(float))[mask], rtol=1e-5, atol=1e-6
  )
  # A per-example mask broadcasts over leading dimensions.
  row = np.array([True, False, True])
  np.testing.assert_allclose(
    topk(logits, ids, lp, where=row),
    np.where(row, reference(logits, ids, lp), 0.0),
    rtol=2e-6,
    atol=1e-7,
  )


def test_zero_iff_student_is_truncated_teacher(rng):
  logits, ids, lp, _ = make_case(rng, (3,), 8, 3)
  # Student: the teacher's top-k log-probs at the ids (+ any constant), -inf elsewhere.
  student = np.full_like(logits, -np.inf)
  np.put_along_axis(student, ids, lp + 0.7, axis=-1)
  out = topk(student, ids, lp, temperature=1.7)
  np.testing.assert_allclose(out, 0.0, atol=1e-6)
  grad = jax.grad(lambda z: jnp.sum(topk(z, ids, lp, temperature=1.7)))(student)
  np.testing.assert_allclose(grad, 0.0, atol=1e-6)
  # Mass on a top-k id the student rules out: the true value, +inf.
  student[0, ids[0, 0]] = -np.inf
  assert topk(student, ids, lp)[0] == np.inf


_traced_t = jax.jit(lambda z, i, w, t: kl_div_from_topk(z, i, w, temperature=t))


@settings(max_examples=30, deadline=None)
@given(
  seed=st.integers(0, 2**32 - 1),
  vocab=st.integers(1, 9),
  temperature=st.floats(0.25, 4.0),
  data=st.data(),
)
def test_nonnegative_and_matches_reference(seed, vocab, temperature, data):
  k = data.draw(st.integers(1, vocab))
  rng = np.random.default_rng(seed)
  logits, ids, lp, _ = make_case(rng, (3,), vocab, k)
  out = np.asarray(_traced_t(logits, ids, lp, temperature))
  assert np.all(out >= -1e-6)
  np.testing.assert_allclose(out, reference(logits, ids, lp, temperature), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad_id", [8, 100, -1, -9])
def test_out_of_range_ids_with_mass_give_nan(bad_id, rng):
  logits, ids, lp, _ = make_case(rng, (2,), 8, 3)
  ids[1, 1] = bad_id
  # Under jit the values are unknown: the example is NaN, never a wrapped or clamped id.
  out = np.asarray(jax.jit(kl_div_from_topk)(logits, ids, lp))
  assert np.isfinite(out[0]) and np.isnan(out[1])
  # Outside jit they are known: a clear error naming the id and its position.
  with pytest.raises(
    ValueError, match=rf"token ids in \[0, 8\).*got {bad_id} at position \(1, 1\)"
  ):
    kl_div_from_topk(logits, ids, lp)
  # Without mass (a -inf log-probability, or masked) any id is padding.
  lp[1, 1] = -np.inf
  assert np.isfinite(np.asarray(kl_div_from_topk(logits, ids, lp))).all()


def _args(rng):
  logits, ids, lp, _ = make_case(rng, (2,), 5, 3)
  return logits, ids, lp


def test_error_integer_logits(rng):
  logits, ids, lp = _args(rng)
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    kl_div_from_topk(logits.astype(np.int32), ids, lp)
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    kl_div_from_topk(logits, ids, lp.astype(np.int32))


def test_error_non_integer_indices(rng):
  logits, ids, lp = _args(rng)
  with pytest.raises(TypeError, match="topk_indices must be an integer array"):
    kl_div_from_topk(logits, ids.astype(np.float32), lp)


@pytest.mark.parametrize(
  ("ids_shape", "lp_shape", "match"),
  [
    ((2, 3), (2, 2), "same shape"),
    ((3, 3), (3, 3), r"logits.shape\[:-1\]"),
    ((3,), (3,), r"logits.shape\[:-1\]"),
    ((2, 0), (2, 0), r"k = 0"),
  ],
)
def test_error_shapes(ids_shape, lp_shape, match):
  logits = np.zeros((2, 5), np.float32)
  with pytest.raises(ValueError, match=match):
    kl_div_from_topk(logits, np.zeros(ids_shape, np.int32), np.zeros(lp_shape, np.float32))


def test_error_scalar_logits():
  with pytest.raises(ValueError, match="class axis"):
    kl_div_from_topk(1.0, np.zeros((1,), np.int32), np.zeros((1,), np.float32))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), np.float32(0)])
def test_error_bad_static_temperature(temperature, rng):
  logits, ids, lp = _args(rng)
  with pytest.raises(ValueError, match="temperature must be positive"):
    kl_div_from_topk(logits, ids, lp, temperature=temperature)


def test_error_non_scalar_temperature(rng):
  logits, ids, lp = _args(rng)
  with pytest.raises(ValueError, match="temperature must be a scalar"):
    kl_div_from_topk(logits, ids, lp, temperature=np.ones(2))
  with pytest.raises(ValueError, match="temperature must be a scalar"):
    kl_div_from_topk(logits, ids, lp, temperature=jnp.ones(2))


@pytest.mark.parametrize(
  ("where", "error"),
  [
    (np.ones((3,), bool), ValueError),
    (np.ones((2, 4), bool), ValueError),
    (np.ones((1, 2, 3), bool), ValueError),
    (np.ones((2,), np.float32), TypeError),
  ],
)
def test_error_bad_where(where, error, rng):
  logits, ids, lp = _args(rng)
  with pytest.raises(error, match="where"):
    kl_div_from_topk(logits, ids, lp, where=where)


def test_value_and_grad_writes_no_vocab_sized_temporary():
  # float32: the compiled value_and_grad writes the gradient (its output) and no
  # other [tokens, vocab] buffer (XLA's temp allocation stays below one of them).
  n, vocab, k = 256, 4096, 8
  f = jax.jit(jax.value_and_grad(lambda z, i, w: jnp.mean(kl_div_from_topk(z, i, w))))
  compiled = f.lower(
    jax.ShapeDtypeStruct((n, vocab), jnp.float32),
    jax.ShapeDtypeStruct((n, k), jnp.int32),
    jax.ShapeDtypeStruct((n, k), jnp.float32),
  ).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < n * vocab * 4 // 2


# ---------------------------------------------------------------- tails in log space
# The tails are log-sum-exps (the student's over the logits outside the top-k), never
# 1 - sum q: that difference rounds to 0 (+inf divergences) for a tail below the top-k's
# rounding, which a constant shift of the logits makes out of any tail.


def _fd_grad(fn, z, h=1e-5):
  """Central finite differences of a float64 NumPy function of ``z`` (summed over rows)."""
  z = np.asarray(z, np.float64)
  grad = np.zeros_like(z)
  for i in np.ndindex(*z.shape):
    e = np.zeros_like(z)
    e[i] = h
    grad[i] = (np.sum(fn(z + e)) - np.sum(fn(z - e))) / (2 * h)
  return grad


@pytest.mark.parametrize("scale", [1.0, 0.4])
def test_bucket_tail_below_the_top_k_rounding_is_finite(scale):
  # The student's tail holds e^-50 (e^-20 at scale 0.4) of its mass, the teacher's 0.5.
  z = np.array([[0.0, -50.0, -60.0]]) * scale
  ids, lp = np.array([[0]]), np.log(np.array([[0.5]]))
  # tail_floor=0: the exact tails (the default floors the student's at 1e-7, as TRL does).
  fn = lambda z: divergence_from_topk(z, ids, lp, tail="bucket", tail_floor=0.0).sum()  # noqa: E731
  value, grad = jax.value_and_grad(fn)(z.astype(np.float32))
  ref = lambda z: np_topk_divergence("forward_kl", {}, z, ids, lp, 1.0, "bucket")  # noqa: E731
  np.testing.assert_allclose(value, ref(z).sum(), rtol=2e-6)  # 24.3068 at scale 1
  # About 0.5 * (1, -1, 0): the tail's softmax, not 0.
  np.testing.assert_allclose(grad, _fd_grad(ref, z), rtol=1e-5, atol=1e-7)


def test_shifted_logits_covering_the_vocabulary_reverse_kl_is_zero():
  s = np.array([[1000.0, 1001.0, 999.0]], np.float32)
  t = np.array([[0.0, 1.0, -1.0]], np.float32)
  ids, lp = np.array([[0, 1, 2]]), np_log_softmax(t).astype(np.float32)
  fn = lambda s: divergence_from_topk(s, ids, lp, divergence="reverse_kl").sum()  # noqa: E731
  value, grad = jax.value_and_grad(fn)(s)
  # float64: the teacher is the student shifted by 1000, so the divergence is 0.
  want = np_topk_divergence("reverse_kl", {}, s, ids, lp.astype(np.float64), 1.0)
  np.testing.assert_allclose(value, want.sum(), atol=1e-6)
  np.testing.assert_allclose(grad, 0.0, atol=1e-6)
  np.testing.assert_allclose(divergence_from_logits(s, t, divergence="reverse_kl"), 0.0, atol=1e-6)


SHIFT_DIVERGENCES = {
  "forward_kl": Divergence("forward_kl"),
  "reverse_kl": Divergence("reverse_kl"),
  "jsd[0.3]": Divergence("jsd", beta=0.3),
  "symmetric_kl[0.7]": Divergence("symmetric_kl", lam=0.7),
  "skew_kl[0.2]": Divergence("skew_kl", alpha=0.2),
  "skew_reverse_kl[0.3]": Divergence("skew_reverse_kl", alpha=0.3),
  "tvd": Divergence("tvd"),
  "alpha_beta[0.6,0.3]": Divergence("alpha_beta", alpha=0.6, beta=0.3),
}
OFFSETS = (0.0, 1e2, 1e3, 1e4)
# Vocabulary 5, top-3 at T = 2: an ordinary row, and one whose student tail holds 2e-31 of
# its mass (logits -140 at T = 2). Logits on a grid of 1/4: shifted by 1e4, float32 holds them.
SHIFT_Z = np.array([[1.5, -0.25, 0.75, -1.0, 0.5], [0.0, -0.5, -140.0, -140.25, 0.25]])
SHIFT_IDS = np.array([[0, 2, 4], [0, 1, 4]])
SHIFT_LP = np.log(np.array([[0.5, 0.25, 0.125], [0.5, 0.25, 0.125]]))
SHIFT_T = 2.0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(SHIFT_DIVERGENCES))
def test_shift_invariance_and_tiny_tails(case, dtype):
  """Every divergence, both tails: the logits shifted by 0, 1e2, 1e3 and 1e4 give the
  float64 value and gradient (finite differences) of the unshifted logits."""
  spec = SHIFT_DIVERGENCES[case]
  rows = len(SHIFT_Z)
  ids, lp = np.tile(SHIFT_IDS, (len(OFFSETS), 1)), np.tile(SHIFT_LP, (len(OFFSETS), 1))

  def per_tail(z, lp):
    out = {}
    for tail in ("renormalize", "bucket"):

      def fn(z, tail=tail):
        # tail_floor=0: the exact tails, whose precision this checks (the default floor,
        # 1e-7, would replace the 2e-31 tail).
        return divergence_from_topk(
          z, ids, lp, divergence=spec, temperature=SHIFT_T, tail=tail, tail_floor=0.0
        )

      out[tail] = (fn(z), jax.grad(lambda z, fn=fn: fn(z).sum())(z))
    return out

  with enable_x64(dtype == "float64"):
    z = np.concatenate([SHIFT_Z + o for o in OFFSETS]).astype(dtype)
    # As NumPy inside the context: indexing a float64 jax.Array after it (grad[at][finite])
    # would lower a float64 gather in 32-bit mode, which jax 0.7 rejects.
    got = jax.tree.map(np.asarray, jax.jit(per_tail)(z, lp.astype(dtype)))
  rtol, atol = (2e-5, 2e-6) if dtype == "float32" else (1e-7, 1e-8)
  for tail, (value, grad) in got.items():
    want, want_grad = _topk_reference(spec, tail)
    finite = np.isfinite(want)
    for i, offset in enumerate(OFFSETS):
      at = slice(i * rows, (i + 1) * rows)
      msg = f"{case}, {tail}, offset {offset}"
      np.testing.assert_allclose(value[at], want, rtol=rtol, atol=atol, err_msg=msg)
      assert np.isfinite(grad[at]).all(), msg
      # On a +inf row (mass where the teacher has none) the gradient is finite, unchanged.
      np.testing.assert_allclose(grad[at][finite], want_grad[finite], rtol, atol, err_msg=msg)
      np.testing.assert_allclose(grad[at], grad[:rows], rtol=rtol, atol=atol, err_msg=msg)


def _topk_reference(spec, tail):
  """float64 value and gradient (finite differences, 0 on +inf rows) of the shift rows."""
  args = (SHIFT_IDS, SHIFT_LP, SHIFT_T, tail)

  def ref(z):
    return np_topk_divergence(spec.name, dict(spec.params), z, *args)

  want = ref(SHIFT_Z)
  finite = np.isfinite(want)
  return want, _fd_grad(lambda z: np.where(finite, ref(z), 0.0), SHIFT_Z)


@pytest.mark.parametrize("k", [5, 100])
def test_many_slots_scattered_few_compared(rng, k):
  """A teacher keeping more slots than are compared one by one (the tail mask scattered
  instead): the same float64 reference, with -inf padding and repeated-free ids."""
  rows, vocab = 3, 150
  z = rng.normal(size=(rows, vocab)).astype(np.float32)
  t = rng.normal(size=(rows, vocab))
  ids = np.argsort(-t, axis=-1)[:, :k]
  lp = np.take_along_axis(np_log_softmax(t), ids, axis=-1)
  got = divergence_from_topk(z, ids, lp.astype(np.float32), tail="bucket")
  want = np_topk_divergence("forward_kl", {}, z, ids, lp, 1.0, "bucket")
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


# ---------------------------------------------------------------- the GPU/TPU path on CPU
# Off CPU the tail's max and sum are one online-softmax pass; on TPU the top-k mask is k
# comparisons and the gather's tangent k masked row sums (its transpose fuses into the
# gradient pass), on GPU a scatter and the gather: each branch run here on CPU.


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["reverse_kl", "jsd[0.3]"])
def test_accelerator_path_shift_invariance_and_tiny_tails(accelerator_platform, case, dtype):
  """As :func:`test_shift_invariance_and_tiny_tails`, on the accelerator path: the tail's
  own max (not the row's) and the masked sums give the same values and gradients."""
  test_shift_invariance_and_tiny_tails(case, dtype)


@pytest.mark.parametrize("k", [4, 100])
def test_accelerator_path_derivatives(accelerator_platform, rng, x64, k):
  """Forward and reverse mode to second order (finite differences) on the accelerator path,
  with a slot without mass and a repeated id; ``k = 100`` keeps the gather (and its
  scatter) there too. Values against float64 NumPy."""
  vocab = 6 if k == 4 else 120
  z = rng.normal(size=(3, vocab))
  ids = np.stack([rng.permutation(vocab)[:k] for _ in range(3)]).astype(np.int32)
  lp = np.take_along_axis(np_log_softmax(rng.normal(size=(3, vocab))), ids, axis=-1)
  want = np_topk_divergence("jsd", {"beta": 0.3}, z, ids, lp, 1.3)
  got = divergence_from_topk(z, ids, lp, divergence=Divergence("jsd", beta=0.3), temperature=1.3)
  np.testing.assert_allclose(got, want, rtol=1e-10)
  lp[0, -1] = -np.inf
  ids[1, 1] = ids[1, 0]
  f = jax.jit(
    lambda z: divergence_from_topk(
      z, ids, lp, divergence="reverse_kl", tail="bucket", temperature=1.3
    )
  )
  # k = 100: the gather and its scatter, second order on CPU elsewhere; first order here.
  check_grads(f, (z,), order=2 if k == 4 else 1, modes=("fwd", "rev"))


def _floored_reference(name, z, ids, lp, floor):
  """float64: the divergence over the top-k and the tail, both tails as TRL's
  ``add_tail_bucket`` floors them (``np_topk_log_probs(floor=)``), summed term by term over
  the k + 1 classes (nothing renormalised, as TRL)."""
  log_q, log_p = np_topk_log_probs(z, ids, lp, 1.0, "bucket", floor)
  p, q = np.exp(log_p), np.exp(log_q)
  m = 0.5 * (p + q)
  terms = {
    "forward_kl": p * (log_p - log_q),
    "reverse_kl": q * (log_q - log_p),
    "jsd": 0.5 * p * (log_p - np.log(m)) + 0.5 * q * (log_q - np.log(m)),
    "tvd": 0.5 * np.abs(p - q),
  }
  return terms[name].sum(-1)


@pytest.mark.parametrize("name", ["reverse_kl", "jsd", "tvd", "forward_kl"])
def test_bucket_tail_floor_keeps_every_divergence_finite(name, rng):
  """A teacher whose top-k holds all its mass to rounding (row 0: masses summing to 1 in
  float32; row 1: one token at 1 - 1e-9) has an empty tail where the student's has mass:
  reverse KL is +inf without a floor. With TRL's floor (1e-7, the default) every
  divergence is finite and equals TRL's add_tail_bucket on both sides in float64, values
  and gradients; ``tail_floor=0`` keeps the exact (empty) tail."""
  z = rng.normal(size=(2, 8)).astype(np.float32)
  ids = np.array([[0, 3, 5], [2, 0, 1]])
  lp = np.log(np.array([[0.5, 0.3, 0.2], [1 - 1e-9, 1e-30, 1e-30]])).astype(np.float32)
  fn = functools.partial(divergence_from_topk, topk_indices=ids, topk_log_probs=lp,
                         divergence=name, tail="bucket")  # fmt: skip
  value, grad = fn(z), jax.grad(lambda z: fn(z).sum())(z)
  want = _floored_reference(name, z, ids, lp, 1e-7)
  assert np.all(np.isfinite(value)) and np.all(np.isfinite(grad))
  np.testing.assert_allclose(value, want, rtol=2e-5, atol=1e-7)
  ref = lambda z: _floored_reference(name, z, ids, lp, 1e-7)  # noqa: E731
  np.testing.assert_allclose(grad, _fd_grad(ref, z), rtol=2e-4, atol=1e-6)
  if name == "reverse_kl":  # the student's tail charged for mass the teacher lacks
    assert np.all(np.isposinf(fn(z, tail_floor=0.0)))
  # The fused loss from hidden states (an identity head: the logits are z) floors alike.
  fused = fused_topk_distillation_loss(z, np.eye(8, dtype=np.float32), ids, lp, divergence=name,
                                       tail="bucket")  # fmt: skip
  np.testing.assert_allclose(fused, value.mean(), rtol=1e-5)


def test_tail_floor_must_be_a_static_number_in_the_unit_interval():
  z, ids, lp = np.zeros((1, 4), np.float32), np.array([[0]]), np.zeros((1, 1), np.float32)
  for bad in (1.0, -1e-7, np.nan):
    with pytest.raises(ValueError, match=r"divergence_from_topk: tail_floor must be a number in"):
      divergence_from_topk(z, ids, lp, tail="bucket", tail_floor=bad)
  with pytest.raises(TypeError, match="kl_div_from_topk: tail_floor must be a Python number"):
    jax.jit(lambda f: kl_div_from_topk(z, ids, lp, tail="bucket", tail_floor=f))(1e-7)
