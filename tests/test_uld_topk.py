"""``uld_loss_from_topk`` and the bounded-memory exact sort, against float64 NumPy.

The references sort every row in NumPy (float64, one row at a time): ULD's distance, the
top-k form and the bound the docstring states; the gradients are checked by finite
differences (``check_grads``), not against our own formulas.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import kldiv_jax._uld_sorted as uld_sorted
from kldiv_jax import uld_loss, uld_loss_from_topk


def np_probs(z, t):
  u = np.asarray(z, np.float64) / t
  e = np.exp(u - u.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def np_sorted_pair(zs, zt, ts=1.0, tt=1.0):
  """Each side's probabilities sorted in descending order, zero-padded to ``L``."""
  a, b = -np.sort(-np_probs(zs, ts), -1), -np.sort(-np_probs(zt, tt), -1)
  length = max(a.shape[-1], b.shape[-1])
  pad = lambda x: np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, length - x.shape[-1])])  # noqa: E731
  return pad(a), pad(b)


def np_uld(zs, zt, ts=1.0, tt=1.0):
  a, b = np_sorted_pair(zs, zt, ts, tt)
  return np.abs(a - b).sum(-1)


def np_topk_and_bound(zs, zt, k, ts=1.0, tt=1.0):
  """``(D_k, bound)`` per row: the top-k form and the docstring's bound on ``D - D_k``."""
  a, b = np_sorted_pair(zs, zt, ts, tt)
  length = a.shape[-1]
  k = min(k, length)
  tail_a, tail_b = a[..., k:].sum(-1), b[..., k:].sum(-1)
  d_k = np.abs(a[..., :k] - b[..., :k]).sum(-1) + np.abs(tail_a - tail_b)
  m = length - k
  if m == 0:
    return d_k, np.zeros_like(d_k)
  top = np.maximum(a[..., k - 1], b[..., k - 1])
  return d_k, 2 * np.minimum(tail_a, tail_b) - 2 * tail_a * tail_b / (m * top)


def logits(rng, shape, scale):
  return rng.normal(size=shape) * scale


@pytest.mark.parametrize("vs,vt", [(40, 64), (64, 40), (50, 50)])
@pytest.mark.parametrize("k", [1, 5, 39])
@pytest.mark.parametrize("scale", [1.0, 8.0])  # spread and peaked
def test_topk_form_and_bound_float64(x64, vs, vt, k, scale):
  rng = np.random.default_rng(vs * 1000 + vt * 10 + k)
  zs, zt = logits(rng, (6, 3, vs), scale), logits(rng, (6, 3, vt), scale)
  got = uld_loss_from_topk(zs, zt, k=k, student_temperature=1.5, reduction="none")
  d_k, bound = np_topk_and_bound(zs, zt, k, 1.5, 1.0)
  exact = np_uld(zs, zt, 1.5, 1.0)
  assert got.dtype == jnp.float64
  np.testing.assert_allclose(got, d_k, rtol=1e-12, atol=1e-14)
  gap = exact - np.asarray(got)
  assert np.all(gap >= -1e-13)
  assert np.all(gap <= bound + 1e-13)
  a, b = np_sorted_pair(zs, zt, 1.5, 1.0)
  assert np.all(bound <= 2 * np.minimum(a[..., k:].sum(-1), b[..., k:].sum(-1)) + 1e-15)


def test_bound_is_attained():
  """Student (0.5, 0.5), teacher (0.5, 0.25, 0.25), k = 1: D - D_k = the bound = 0.5."""
  zs, zt = np.log([[0.5, 0.5]]), np.log([[0.5, 0.25, 0.25]])
  d_k, bound = np_topk_and_bound(zs, zt, 1)
  assert np_uld(zs, zt)[0] - d_k[0] == pytest.approx(bound[0]) == pytest.approx(0.5)
  got = uld_loss_from_topk(zs.astype(np.float32), zt.astype(np.float32), k=1, reduction="none")
  np.testing.assert_allclose(got, d_k, atol=1e-6)


@pytest.mark.parametrize("k", [64, 100])
def test_k_past_the_vocabularies_is_uld(x64, k):
  rng = np.random.default_rng(1)
  zs, zt = logits(rng, (5, 64), 3.0), logits(rng, (5, 33), 3.0)
  got = uld_loss_from_topk(zs, zt, k=k, teacher_temperature=0.5, reduction="none")
  np.testing.assert_allclose(got, np_uld(zs, zt, 1.0, 0.5), rtol=1e-12, atol=1e-14)


def test_gradients_by_finite_differences(x64):
  rng = np.random.default_rng(2)
  zs, zt = jnp.asarray(logits(rng, (4, 30), 2.0)), jnp.asarray(logits(rng, (4, 20), 2.0))
  f = lambda s, t: uld_loss_from_topk(s, t, k=6, student_temperature=2.0, reduction="sum")  # noqa: E731
  check_grads(f, (zs, zt), order=1, modes=("fwd", "rev"), eps=1e-6)


def test_where_reductions_jit_vmap():
  rng = np.random.default_rng(3)
  zs, zt = logits(rng, (2, 5, 30), 2.0), logits(rng, (2, 5, 20), 2.0)
  where = rng.uniform(size=(2, 5)) < 0.7
  d_k, _ = np_topk_and_bound(zs, zt, 4)
  f = jax.jit(uld_loss_from_topk, static_argnames=("k", "reduction"))
  np.testing.assert_allclose(f(zs, zt, k=4, where=where, reduction="none"), d_k * where, 1e-5)
  np.testing.assert_allclose(f(zs, zt, k=4, where=where), d_k[where].mean(), 1e-5)
  np.testing.assert_allclose(f(zs, zt, k=4, where=where, reduction="sum"), d_k[where].sum(), 1e-5)
  seq = (d_k * where).sum(-1) / where.sum(-1).clip(1)
  np.testing.assert_allclose(
    f(zs, zt, k=4, where=where, reduction="sequence_mean"), seq.mean(), 1e-5
  )
  per_seq = jax.vmap(lambda s, t: uld_loss_from_topk(s, t, k=4, reduction="none"))(zs, zt)
  np.testing.assert_allclose(per_seq, d_k, rtol=1e-5)


def test_bfloat16_kept_and_finite():
  rng = np.random.default_rng(4)
  zs = jnp.asarray(logits(rng, (8, 300), 3.0), jnp.bfloat16)
  zt = jnp.asarray(logits(rng, (8, 200), 3.0), jnp.bfloat16)
  value, grad = jax.value_and_grad(lambda s: uld_loss_from_topk(s, zt, k=16))(zs)
  assert value.dtype == grad.dtype == jnp.bfloat16
  d_k, _ = np_topk_and_bound(np.asarray(zs, np.float64), np.asarray(zt, np.float64), 16)
  np.testing.assert_allclose(float(value), d_k.mean(), rtol=1.6e-2)
  assert np.isfinite(np.asarray(grad, np.float32)).all()


def test_row_without_mass_is_zero():
  zs = jnp.array([[-jnp.inf, -jnp.inf, -jnp.inf], [0.0, 1.0, 2.0]])
  zt = jnp.array([[-jnp.inf, -jnp.inf], [1.0, 0.0]])
  got = uld_loss_from_topk(zs, zt, k=1, reduction="none")
  assert got[0] == 0.0 and np.isfinite(got[1])


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    ({"k": 0}, ValueError, "k must be at least 1"),
    ({"k": 2.5}, TypeError, "k"),
    ({"k": 2, "reduction": "batchmean"}, ValueError, "reduction"),
    ({"k": 2, "student_temperature": 0.0}, ValueError, "student_temperature"),
    ({"k": 2, "where": np.ones(3, bool)}, ValueError, "where must be a row mask"),
  ],
)
def test_errors_name_the_argument(kwargs, error, match):
  zs, zt = np.zeros((2, 4), np.float32), np.zeros((2, 5), np.float32)
  with pytest.raises(error, match=match):
    uld_loss_from_topk(zs, zt, **kwargs)


def test_rows_must_match():
  with pytest.raises(ValueError, match="same shape without the class axis"):
    uld_loss_from_topk(np.zeros((2, 4)), np.zeros((3, 5)), k=2)


# ----------------------------------------------------------------------------- the exact sort


@pytest.mark.parametrize("vs,vt", [(7, 11), (11, 7), (9, 9)])
def test_sorted_distance_chunked_value_and_grads(x64, monkeypatch, vs, vt):
  """Several chunks and an uneven last one (``CHUNK_ELEMENTS`` made small)."""
  monkeypatch.setattr(uld_sorted, "CHUNK_ELEMENTS", 4 * max(vs, vt))
  rng = np.random.default_rng(vs * 100 + vt)
  zs, zt = jnp.asarray(logits(rng, (13, vs), 2.0)), jnp.asarray(logits(rng, (13, vt), 2.0))
  ts, tt = jnp.float64(1.5), jnp.float64(0.7)
  keep = jnp.asarray(rng.uniform(size=13) < 0.7)
  zs_nan = jnp.where(keep[:, None], zs, jnp.nan)  # the rows keep leaves out reach nothing

  def f(zs, zt, ts, tt):
    return uld_sorted.sorted_distance(zs, zt, ts, tt, keep)

  np.testing.assert_allclose(f(zs_nan, zt, ts, tt)[keep], np_uld(zs, zt, 1.5, 0.7)[keep], 1e-12)
  check_grads(f, (zs, zt, ts, tt), order=1, modes=("rev",), eps=1e-6)
  grads = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1))(zs_nan, zt, ts, tt)
  assert all(np.isfinite(g).all() and (g[~keep] == 0).all() for g in grads)
  # a side not differentiated: the other's gradient alone, the same
  alone = jax.grad(lambda s: jnp.sum(f(s, jax.lax.stop_gradient(zt), ts, tt)))(zs)
  np.testing.assert_allclose(alone, jax.grad(lambda *a: jnp.sum(f(*a)))(zs, zt, ts, tt))


def test_sorted_distance_ties_take_their_index_slot(x64):
  """Equal student probabilities: each takes the sorted slot of its index order, and that
  slot's sign (torch's stable descending sort). Differentiated wrt ``p`` through
  ``log p`` (a softmax of ``log p`` divides by ``sum(p)``): ``s - <p, s>``."""
  p = jnp.array([[0.25, 0.25, 0.5]])
  zt = jnp.log(jnp.array([[0.45, 0.3, 0.25]]))  # sorted: 0.45, 0.3, 0.25
  one = jnp.float64(1.0)
  keep = jnp.ones(1, bool)
  g = jax.grad(lambda p: uld_sorted.sorted_distance(jnp.log(p), zt, one, one, keep)[0])(p)
  # student sorted: 0.5 (index 2), 0.25 (index 0), 0.25 (index 1); signs +, -, 0
  signs = np.array([[-1.0, 0.0, 1.0]])
  np.testing.assert_allclose(g, signs - np.sum(np.asarray(p) * signs), atol=1e-15)


def test_uld_loss_positions_take_the_chunked_sort(x64, monkeypatch):
  """``uld_loss`` without groups: float64 NumPy's value (``where``, a batch of sequences,
  traced temperatures under ``jit``) and finite-difference gradients wrt both logits and
  both temperatures, through several chunks."""
  monkeypatch.setattr(uld_sorted, "CHUNK_ELEMENTS", 3 * 12)
  rng = np.random.default_rng(5)
  zs, zt = jnp.asarray(logits(rng, (2, 7, 12), 2.0)), jnp.asarray(logits(rng, (2, 7, 9), 2.0))
  where = jnp.asarray(rng.uniform(size=(2, 7)) < 0.8)
  f = jax.jit(
    lambda s, t, ts, tt: uld_loss(
      s, t, student_temperature=ts, teacher_temperature=tt, where=where, reduction="sum"
    )
  )
  expected = np.sum(np_uld(zs, zt, 1.3, 0.8) * np.asarray(where))
  np.testing.assert_allclose(f(zs, zt, 1.3, 0.8), expected, rtol=1e-12)
  args = (zs, zt, jnp.float64(1.3), jnp.float64(0.8))
  check_grads(f, args, order=1, modes=("rev",), eps=1e-6)


def test_uld_loss_temp_at_most_twice_one_logits_array():
  """XLA's compiled temp of ``uld_loss``'s value_and_grad wrt the student (teacher stopped)
  at V = 151936, against one ``[N, V]`` float32 array; the straightforward ``jnp.sort``
  form's is above it (what the chunked sort avoids)."""
  n, vs, vt = 256, 151936, 128256
  student = jax.ShapeDtypeStruct((n, vs), jnp.float32)
  teacher = jax.ShapeDtypeStruct((n, vt), jnp.float32)
  one = jnp.float32(1.0)

  def temp(loss):
    compiled = jax.jit(jax.value_and_grad(loss)).lower(student, teacher).compile()
    return compiled.memory_analysis().temp_size_in_bytes / (n * vs * 4)

  ours = temp(lambda s, t: uld_loss(s, jax.lax.stop_gradient(t)))
  reference = uld_sorted.sorted_distance_reference
  straightforward = temp(lambda s, t: jnp.mean(reference(s, jax.lax.stop_gradient(t), one, one)))
  assert ours <= 2.0, ours
  assert straightforward > 2.0, straightforward
