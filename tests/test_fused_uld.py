"""fused_uld_loss_from_topk: chunked == uld_loss_from_topk of the materialised logits.

The reference materialises ``hidden @ weight + bias`` and ``target_hidden @ target_weight +
target_bias`` and calls ``uld_loss_from_topk`` on them (the teacher stopped); independently
of the library, the float64 NumPy references of ``_references.py`` give the value (each
side's probabilities sorted) and the gradient wrt the logits (the closed form ``(S - c p) /
T``, at ties too), and finite differences (``check_grads``) the gradients wrt the head.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import np_softmax, np_uld_topk_logit_grad, np_uld_topk_rows
from jax.test_util import check_grads

from kldiv_jax import fused_uld_loss_from_topk, uld_loss_from_topk
from kldiv_jax._fused_uld import CHUNK_ELEMENTS

F32 = {"rtol": 2e-5, "atol": 1e-6}
BF16 = {"rtol": 1.6e-2, "atol": 2e-3}
F64 = {"rtol": 1e-11, "atol": 1e-14}
REDUCTIONS = ("mean", "sum", "none", "sequence_mean")


def make(rng, tokens=(3, 5), hs=8, ht=6, vs=37, vt=29, dtype=np.float64, scale=2.0):
  """Student ``(h, w, b)`` and teacher ``(th, tw, tb)``: other hidden sizes, vocabularies."""
  normal = lambda *shape, s=1.0: (s * rng.normal(size=shape)).astype(dtype)  # noqa: E731
  student = (normal(*tokens, hs), normal(hs, vs, s=scale / np.sqrt(hs)), normal(vs, s=0.5))
  teacher = (normal(*tokens, ht), normal(ht, vt, s=scale / np.sqrt(ht)), normal(vt, s=0.5))
  return student, teacher


def logits(h, w, b=None):
  z = jnp.matmul(h, w, precision=jax.lax.Precision.HIGHEST)
  return z if b is None else z + jnp.reshape(b, (1,) * (z.ndim - 1) + (-1,))


def materialised(h, w, b, th, tw, tb, **kw):
  return uld_loss_from_topk(logits(h, w, b), jax.lax.stop_gradient(logits(th, tw, tb)), **kw)


def fused(h, w, b, th, tw, tb, **kw):
  return fused_uld_loss_from_topk(h, w, th, tw, bias=b, target_bias=tb, **kw)


def grads(loss, args, kw, weights):
  """Gradients wrt ``(h, w, b)`` of the loss (``"none"``: its sum weighted by ``weights``)."""
  reduction = kw["reduction"]

  def scalar(h, w, b):
    out = loss(h, w, b, *args, **kw)
    return jnp.sum(out * weights) if reduction == "none" else out

  return jax.grad(scalar, argnums=(0, 1, 2))


@pytest.mark.parametrize(
  "k,chunk,vs,vt,reduction",
  [
    (1, 4, 37, 29, "mean"),
    (5, 6, 29, 37, "none"),
    (5, 15, 37, 29, "sum"),
    (40, 4, 37, 29, "sequence_mean"),  # k past the student's vocabulary
    (7, None, 30, 30, "none"),
    (3, 4, 29, 37, "sequence_mean"),
  ],
)
def test_float64_value_and_grads_equal_the_materialised(x64, k, chunk, vs, vt, reduction):
  """Tokens (15) not a multiple of the chunk, vocabularies of their own sizes, ``k`` past the
  student's vocabulary (40), a mask and temperatures; the value also against NumPy."""
  rng = np.random.default_rng(k * 100 + vs)
  (h, w, b), (th, tw, tb) = make(rng, vs=vs, vt=vt)
  where = rng.uniform(size=(3, 5)) < 0.75
  kw = dict(k=k, where=where, reduction=reduction, student_temperature=1.5)
  kw |= dict(teacher_temperature=0.8)
  got = fused(h, w, b, th, tw, tb, chunk_size=chunk, **kw)
  want = materialised(h, w, b, th, tw, tb, **kw)
  assert got.dtype == jnp.float64 and got.shape == want.shape
  np.testing.assert_allclose(got, want, **F64)
  rows = (
    np_uld_topk_rows(
      np_softmax(np.asarray(logits(h, w, b)), 1.5),
      np_softmax(np.asarray(logits(th, tw, tb)), 0.8),
      k,
    )
    * where
  )
  ref = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / where.sum()}
  ref["sequence_mean"] = (rows.sum(-1) / where.sum(-1).clip(1)).mean()
  np.testing.assert_allclose(got, ref[reduction], **F64)
  weights = rng.uniform(size=(3, 5))
  got_g = grads(fused, (th, tw, tb), kw | {"chunk_size": chunk}, weights)(h, w, b)
  want_g = grads(materialised, (th, tw, tb), kw, weights)(h, w, b)
  for g, r in zip(got_g, want_g, strict=True):
    np.testing.assert_allclose(g, r, **F64)


def test_gradients_against_the_closed_form_and_finite_differences(x64):
  rng = np.random.default_rng(1)
  (h, w, b), (th, tw, tb) = make(rng, tokens=(11,), vs=23, vt=31)
  ts, k = 1.3, 4

  def loss(h, w, b):
    return fused(h, w, b, th, tw, tb, k=k, student_temperature=ts, reduction="sum", chunk_size=4)

  dz = np_uld_topk_logit_grad(np.asarray(logits(h, w, b)), np.asarray(logits(th, tw, tb)), k, ts)
  got = jax.grad(loss, argnums=(0, 1, 2))(h, w, b)
  for g, r in zip(got, (dz @ w.T, h.T @ dz, dz.sum(0)), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-13)
  check_grads(loss, (h, w, b), order=1, modes=("rev",), eps=1e-6)


def test_ties_keep_the_lower_id(x64):
  """Two equal columns of the student's head: equal logits in every row. At rank ``k`` the
  lower id is kept (``lax.top_k``), inside the top ``k`` the tied ids take their slots in id
  order: the gradient is the closed form's with NumPy's stable order, and the two columns'
  gradients differ."""
  rng = np.random.default_rng(2)
  (h, w, b), (th, tw, tb) = make(rng, tokens=(9,), vs=12, vt=10)
  w[:, 7] = w[:, 3]
  b = np.zeros_like(b)
  z = np.asarray(logits(h, w))
  order = np.argsort(-z, axis=-1, kind="stable")
  slot = np.argmax(order == 3, axis=-1)  # where id 3 sits; id 7 just after it
  assert np.any(slot == 2) and np.any(slot == 5), "the tie falls at rank k=3 and k=6"
  for k in (3, 6):
    dz = np_uld_topk_logit_grad(z, np.asarray(logits(th, tw, tb)), k)
    loss = lambda h, w, k=k: fused(h, w, None, th, tw, tb, k=k, reduction="sum", chunk_size=4)  # noqa: E731
    gh, gw = jax.grad(loss, argnums=(0, 1))(h, w)
    np.testing.assert_allclose(gw, h.T @ dz, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(gh, dz @ w.T, rtol=1e-10, atol=1e-13)
    want = jax.grad(lambda w, k=k: materialised(h, w, None, th, tw, tb, k=k, reduction="sum"))(w)
    np.testing.assert_allclose(gw, want, **F64)
  assert not np.allclose(gw[:, 3], gw[:, 7])


@pytest.mark.parametrize("bias", [True, False])
def test_float32_jit_and_softcap(bias):
  rng = np.random.default_rng(3)
  (h, w, b), (th, tw, tb) = make(rng, tokens=(2, 9), vs=50, vt=41, dtype=np.float32, scale=6.0)
  b, tb = (b, tb) if bias else (None, None)
  kw = dict(k=6, student_temperature=2.0, reduction="sequence_mean")

  def capped(h, w, b):
    z = 5.0 * jnp.tanh(logits(h, w, b) / 5.0)
    y = 3.0 * jnp.tanh(logits(th, tw, tb) / 3.0)
    return uld_loss_from_topk(z, jax.lax.stop_gradient(y), **kw)

  f = jax.jit(
    jax.value_and_grad(
      lambda h, w, b: fused(
        h, w, b, th, tw, tb, softcap=5.0, target_softcap=3.0, chunk_size=4, **kw
      ),
      argnums=(0, 1, 2) if bias else (0, 1),
    )
  )
  got = f(h, w, b)
  want = jax.value_and_grad(capped, argnums=(0, 1, 2) if bias else (0, 1))(h, w, b)
  assert got[0].dtype == jnp.float32
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, r, **F32)


@pytest.mark.parametrize("logits_dtype", [None, jnp.float32])
def test_bfloat16_kept_and_close(logits_dtype):
  """bf16 inputs: the value and gradients in bf16, against the materialised loss of the
  same inputs (bf16 logits; float32 ones for ``logits_dtype=float32``)."""
  rng = np.random.default_rng(4)
  (h, w, _), (th, tw, _) = make(rng, tokens=(16,), vs=300, vt=200, dtype=np.float32, scale=4.0)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
  h, w, th, tw = map(bf, (h, w, th, tw))
  kw = dict(k=16, reduction="mean")
  value, (gh, gw) = jax.value_and_grad(
    lambda h, w: fused_uld_loss_from_topk(
      h, w, th, tw, chunk_size=5, logits_dtype=logits_dtype, **kw
    ),
    argnums=(0, 1),
  )(h, w)
  assert value.dtype == gh.dtype == gw.dtype == jnp.bfloat16
  if logits_dtype is None:
    ref = lambda h, w: uld_loss_from_topk(h @ w, jax.lax.stop_gradient(th @ tw), **kw)  # noqa: E731
  else:
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = lambda h, w: uld_loss_from_topk(  # noqa: E731
      logits(up(h), up(w)), jax.lax.stop_gradient(logits(up(th), up(tw))), **kw
    )
  want, (rh, rw) = jax.value_and_grad(ref, argnums=(0, 1))(h, w)
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  np.testing.assert_allclose(f32(value), f32(want), **BF16)
  scale = np.abs(f32(rw)).max()
  np.testing.assert_allclose(f32(gw), f32(rw), rtol=BF16["rtol"], atol=2e-2 * scale)
  np.testing.assert_allclose(f32(gh), f32(rh), rtol=BF16["rtol"], atol=2e-2 * np.abs(f32(rh)).max())


def test_vmap_and_traced_temperatures():
  rng = np.random.default_rng(5)
  (h, w, _), (th, tw, _) = make(rng, tokens=(4, 7), vs=20, vt=26, dtype=np.float32)
  per_seq = jax.vmap(
    lambda h, th, t: fused_uld_loss_from_topk(
      h, w, th, tw, k=3, reduction="none", chunk_size=3, student_temperature=t
    ),
    in_axes=(0, 0, None),
  )
  want = uld_loss_from_topk(logits(h, w), logits(th, tw), k=3, reduction="none",
                            student_temperature=1.7)  # fmt: skip
  np.testing.assert_allclose(jax.jit(per_seq)(h, th, jnp.float32(1.7)), want, **F32)
  # an invalid traced temperature: NaN, as uld_loss_from_topk
  bad = jax.jit(lambda t: fused_uld_loss_from_topk(h, w, th, tw, k=3, teacher_temperature=t))
  assert np.isnan(bad(jnp.float32(-1.0)))


def test_masked_tokens_reach_nothing(x64):
  """A NaN hidden state in a masked token: finite value and gradients, equal to the loss
  without that token."""
  rng = np.random.default_rng(6)
  (h, w, b), (th, tw, tb) = make(rng, tokens=(10,), vs=15, vt=12)
  where = np.ones(10, bool)
  where[[2, 7]] = False
  h_nan, th_nan = h.copy(), th.copy()
  h_nan[2], th_nan[7] = np.nan, np.nan

  def loss(h, w, b, th):
    return fused(h, w, b, th, tw, tb, k=4, where=where, chunk_size=3)

  value, got = jax.value_and_grad(loss, argnums=(0, 1, 2))(h_nan, w, b, th_nan)
  keep = np.flatnonzero(where)
  want_v, want = jax.value_and_grad(loss, argnums=(0, 1, 2))(h, w, b, th)
  alone = fused(h[keep], w, b, th[keep], tw, tb, k=4)
  np.testing.assert_allclose(value, alone, **F64)
  np.testing.assert_allclose(value, want_v, **F64)
  for g, r in zip(got, want, strict=True):
    assert np.isfinite(g).all()
    np.testing.assert_allclose(g, r, **F64)
  assert not np.any(got[0][~where])


def test_teacher_and_temperatures_get_zero_gradients():
  rng = np.random.default_rng(7)
  (h, w, _), (th, tw, _) = make(rng, tokens=(5,), dtype=np.float32)
  g = jax.grad(
    lambda th, tw, t: fused_uld_loss_from_topk(h, w, th, tw, k=3, student_temperature=t),
    argnums=(0, 1, 2),
  )(th, tw, jnp.float32(1.5))
  assert all(not np.any(x) for x in g)


def test_no_tokens():
  rng = np.random.default_rng(8)
  (h, w, _), (th, tw, _) = make(rng, tokens=(0,), dtype=np.float32)
  assert fused_uld_loss_from_topk(h, w, th, tw, k=2) == 0.0
  assert fused_uld_loss_from_topk(h, w, th, tw, k=2, reduction="none").shape == (0,)


@pytest.mark.parametrize(
  "changes,error,match",
  [
    ({"k": 0}, ValueError, "k must be at least 1"),
    ({"k": 2.5}, TypeError, "k must be an int"),
    ({"reduction": "batchmean"}, ValueError, "reduction"),
    ({"student_temperature": 0.0}, ValueError, "student_temperature"),
    ({"teacher_temperature": np.inf}, ValueError, "teacher_temperature"),
    ({"where": np.ones(4, bool)}, ValueError, "where must be a token mask"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"logits_dtype": jnp.bfloat16}, ValueError, "logits_dtype"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"target_softcap": jnp.float32(3.0)}, TypeError, "target_softcap"),
    ({"target_hidden": np.zeros((4, 6), np.float32)}, ValueError, "same tokens"),
    ({"target_weight": np.zeros((5, 9), np.float32)}, ValueError, "teacher hidden"),
    ({"weight": np.zeros(8, np.float32)}, ValueError, "student weight must be"),
    ({"target_weight": np.zeros((6, 0), np.float32)}, ValueError, "target_weight must have"),
    ({"bias": np.zeros(3, np.float32)}, ValueError, "student bias"),
    ({"hidden": np.zeros((5, 8), np.int32)}, TypeError, "hidden"),
  ],
)
def test_errors_name_the_argument(changes, error, match):
  rng = np.random.default_rng(9)
  (h, w, _), (th, tw, _) = make(rng, tokens=(5,), dtype=np.float32)
  kw = dict(hidden=h, weight=w, target_hidden=th, target_weight=tw, k=2) | changes
  with pytest.raises(error, match=match):
    fused_uld_loss_from_topk(**kw)


def test_temp_is_a_few_chunks_at_any_token_count():
  """XLA's compiled temp of value_and_grad wrt the student's hidden states and head
  (compiled, not run): the fused loss's is a few chunks' logits (each side's chunk and its
  gradient, at the default chunk) and does not grow with the tokens; the materialised
  loss's is above one ``[N, Vs]`` float32 array and doubles with them."""
  hs, ht, vs, vt = 64, 48, 151936, 128256
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731

  def temp(loss, n):
    args = (f32(n, hs), f32(hs, vs), f32(n, ht), f32(ht, vt))
    c = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    return c.memory_analysis().temp_size_in_bytes

  ours = lambda h, w, th, tw: fused_uld_loss_from_topk(h, w, th, tw, k=64)  # noqa: E731
  theirs = lambda h, w, th, tw: materialised(h, w, None, th, tw, None, k=64)  # noqa: E731
  n = 4096
  chunk = CHUNK_ELEMENTS * 4  # one chunk's float32 logits
  assert temp(ours, n) < 4 * chunk < n * vs * 4 < temp(theirs, n), (temp(ours, n), chunk)
  assert temp(ours, 2 * n) < 1.1 * temp(ours, n) + 2 * n * 64 * 8  # per-token top-k only
  assert temp(theirs, 2 * n) > 1.9 * temp(theirs, n)


def test_vmap_of_grad_of_the_scalar_reduction():
  """The scalar path (gradients in the forward pass) under vmap: per sequence, as the
  materialised loss's."""
  rng = np.random.default_rng(10)
  (h, w, b), (th, tw, tb) = make(rng, tokens=(3, 7), vs=20, vt=26, dtype=np.float32)

  def per_seq(loss):
    f = lambda h, th: loss(h, w, b, th, tw, tb, k=4, reduction="mean", **kw)  # noqa: E731
    return jax.vmap(jax.value_and_grad(f))(h, th)

  kw = {}
  want = per_seq(materialised)
  kw = {"chunk_size": 3}
  got = jax.jit(lambda: per_seq(fused))()
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, r, **F32)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_accelerator_branch(accelerator_platform, reduction):
  """The GPU/TPU code run on CPU (each platform's chunk and weight-gradient update)."""
  rng = np.random.default_rng(11)
  (h, w, b), (th, tw, tb) = make(rng, tokens=(11,), vs=40, vt=33, dtype=np.float32)
  weights = rng.uniform(size=11)
  args = (th, tw, tb)
  kw = {"k": 5, "reduction": reduction, "teacher_temperature": 0.7}
  for chunk in (None, 4):
    got = grads(fused, args, kw | {"chunk_size": chunk}, weights)(h, w, b)
    want = grads(materialised, args, kw, weights)(h, w, b)
    for g, r in zip(got, want, strict=True):
      np.testing.assert_allclose(g, r, **F32)
