"""uld_loss, gold_loss, merge_spans, align_tokens and matched_vocabulary against float64 NumPy
ports of TRL 1.16.0's ULDLoss (tests/_references.py); TRL itself: test_integration_gold.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import (
  central_difference,
  np_gold_rows,
  np_merge_spans,
  np_softmax,
  np_uld_rows,
)
from jax.test_util import check_grads

import kldiv_jax as kd
from kldiv_jax import align_tokens, gold_loss, matched_vocabulary, merge_spans, uld_loss

B, T, VS, VT = 2, 5, 7, 11
S_IDS, T_IDS = np.array([0, 2, 3, 6]), np.array([1, 4, 5, 10])


def logits(rng, shape, scale=2.0):
  return scale * rng.normal(size=shape)


def np_loss(rows, valid, reduction):
  rows = np.where(valid, rows, 0.0)
  if reduction == "none":
    return rows
  if reduction == "sum":
    return rows.sum()
  if reduction == "mean":
    return rows.sum() / max(valid.sum(), 1)
  seq = rows.reshape(-1, rows.shape[-1])
  return np.mean(seq.sum(-1) / np.maximum(valid.reshape(seq.shape).sum(-1), 1))


@pytest.mark.parametrize("reduction", ["mean", "sum", "sequence_mean", "none"])
def test_uld_matches_numpy(x64, rng, reduction):
  s, t = logits(rng, (B, T, VS)), logits(rng, (B, T, VT))
  where = rng.uniform(size=(B, T)) < 0.7
  kw = dict(student_temperature=2.0, teacher_temperature=0.5)

  def ref(s, t):
    rows = np_uld_rows(np_softmax(t, 0.5), np_softmax(s, 2.0))
    return np_loss(rows, where, reduction)

  got = uld_loss(s, t, where=where, reduction=reduction, **kw)
  np.testing.assert_allclose(got, ref(s, t), rtol=1e-12, atol=1e-15)
  if reduction != "none":
    grad = jax.grad(lambda s: uld_loss(s, t, where=where, reduction=reduction, **kw))(s)
    np.testing.assert_allclose(grad, central_difference(lambda s: ref(s, t), s), atol=1e-8)


@pytest.mark.parametrize("strategy", ["observed", "bayesian"])
def test_merge_spans_matches_numpy(x64, rng, strategy):
  probs = np_softmax(logits(rng, (B, T, VS)))
  tokens = rng.integers(0, VS, (B, T))
  groups = [[[0, 1], [2], [3, 4, -1]], [[0], [1, 2, 3], [-1, -1, -1]]]
  padded = np.array([[g + [-1] * (3 - len(g)) for g in b] for b in groups])
  got = merge_spans(probs, tokens, padded, strategy=strategy)
  for b in range(B):
    want = np_merge_spans(
      probs[b], tokens[b], [[i for i in g if i >= 0] for g in groups[b]], strategy
    )
    np.testing.assert_allclose(got[b], want, rtol=1e-13)


def _aligned_case(rng):
  """Logits of two sides over T positions, groups of 1 to 3 positions, and token ids."""
  s, t = logits(rng, (B, T, VS)), logits(rng, (B, T + 1, VT))
  gs = np.array([[[0, 1, -1], [2, -1, -1], [3, 4, -1]], [[0, -1, -1], [1, 2, 3], [-1, -1, -1]]])
  gt = np.array([[[0, -1, -1], [1, 2, 3], [4, 5, -1]], [[0, 1, -1], [2, -1, -1], [-1, -1, -1]]])
  ys, yt = rng.integers(0, VS, (B, T)), rng.integers(0, VT, (B, T + 1))
  return s, t, gs, gt, ys, yt


def _np_aligned(s, t, gs, gt, ys, yt, strategy, ts=1.0, tt=1.0):
  """Per-group probabilities ``(q, p, valid)`` from the NumPy merge."""
  q, p = [], []
  for b in range(B):
    lists = [[[i for i in g if i >= 0] for g in x[b]] for x in (gs, gt)]
    q.append(np_merge_spans(np_softmax(s[b], ts), ys[b], lists[0], strategy))
    p.append(np_merge_spans(np_softmax(t[b], tt), yt[b], lists[1], strategy))
  return np.stack(q), np.stack(p), (gs[..., 0] >= 0) & (gt[..., 0] >= 0)


@pytest.mark.parametrize("strategy", ["observed", "bayesian"])
def test_uld_with_groups_matches_numpy(x64, rng, strategy):
  s, t, gs, gt, ys, yt = _aligned_case(rng)
  align = dict(
    student_groups=gs, teacher_groups=gt, student_tokens=ys, teacher_tokens=yt,
    merge_strategy=strategy, reduction="sequence_mean", teacher_temperature=1.5,
  )  # fmt: skip

  def ref(s):
    q, p, valid = _np_aligned(s, t, gs, gt, ys, yt, strategy, tt=1.5)
    return np_loss(np_uld_rows(p, q), valid, "sequence_mean")

  value, grad = jax.value_and_grad(lambda s: uld_loss(s, t, **align))(s)
  np.testing.assert_allclose(value, ref(s), rtol=1e-12)
  np.testing.assert_allclose(grad, central_difference(ref, s), atol=1e-8)


@pytest.mark.parametrize(
  "kw, weights",
  [
    (dict(), None),
    (dict(beta=0.0), None),
    (dict(beta=1.0, matched_weight=0.3, unmatched_weight=2.0), (0.3, 2.0)),
    (dict(beta=0.2, student_temperature=3.0), None),
  ],
)
def test_gold_matches_numpy(x64, rng, kw, weights):
  s, t = logits(rng, (B, T, VS)), logits(rng, (B, T, VT))
  beta, ts = kw.get("beta", 0.5), kw.get("student_temperature", 1.0)

  def ref(s):
    rows = np_gold_rows(np_softmax(s, ts), np_softmax(t), S_IDS, T_IDS, beta, weights)
    return rows.mean()

  loss = lambda s: gold_loss(s, t, student_ids=S_IDS, teacher_ids=T_IDS, **kw)  # noqa: E731
  value, grad = jax.value_and_grad(loss)(s)
  np.testing.assert_allclose(value, ref(s), rtol=1e-12)
  np.testing.assert_allclose(grad, central_difference(ref, s), atol=1e-8)


def test_gold_with_groups_and_other_divergences(x64, rng):
  s, t, gs, gt, ys, yt = _aligned_case(rng)
  align = dict(student_groups=gs, teacher_groups=gt, student_tokens=ys, teacher_tokens=yt)
  q, p, valid = _np_aligned(s, t, gs, gt, ys, yt, "observed")
  want = np_loss(np_gold_rows(q, p, S_IDS, T_IDS, 0.5), valid, "mean")
  got = gold_loss(s, t, student_ids=S_IDS, teacher_ids=T_IDS, **align)
  np.testing.assert_allclose(got, want, rtol=1e-12)
  # beta = 0 of the JSD is forward KL: the Divergence spec reaches the same per-class formula.
  a = gold_loss(s, t, student_ids=S_IDS, teacher_ids=T_IDS, divergence="forward_kl", **align)
  b = gold_loss(s, t, student_ids=S_IDS, teacher_ids=T_IDS, beta=0.0, **align)
  np.testing.assert_allclose(a, b, rtol=1e-13)
  tvd = gold_loss(s, t, student_ids=S_IDS, teacher_ids=T_IDS, divergence="tvd", **align)
  assert np.isfinite(tvd) and tvd > 0


def test_gold_without_unmatched_entries_on_one_side(x64, rng):
  """Every student entry is matched: TRL's unmatched term is 0 (it needs both sides)."""
  s, t = logits(rng, (B, VS)), logits(rng, (B, VT))
  sid, tid = np.arange(VS), np.arange(VS)
  got = gold_loss(s, t, student_ids=sid, teacher_ids=tid, reduction="none")
  want = np_gold_rows(np_softmax(s), np_softmax(t), sid, tid, 0.5)
  np.testing.assert_allclose(got, want, rtol=1e-12)


def test_jit_vmap_and_traced_options(rng):
  s = jnp.asarray(logits(rng, (B, T, VS)), jnp.float32)
  t = jnp.asarray(logits(rng, (B, T, VT)), jnp.float32)

  def f(s, t, temp, beta):
    return gold_loss(
      s, t, student_ids=S_IDS, teacher_ids=T_IDS, beta=beta, teacher_temperature=temp,
      reduction="none",
    )  # fmt: skip

  eager = f(s, t, 1.5, 0.3)
  jitted = jax.jit(f)(s, t, 1.5, 0.3)  # traced temperature and beta
  mapped = jax.vmap(f, in_axes=(0, 0, None, None))(s, t, 1.5, 0.3)
  np.testing.assert_allclose(jitted, eager, rtol=2e-6)
  np.testing.assert_allclose(mapped, eager, rtol=2e-6)
  assert np.isnan(jax.jit(f)(s, t, -1.0, 0.3)).all()  # invalid traced options: NaN
  assert np.isnan(jax.jit(f)(s, t, 1.0, 1.5)).all()
  u = jax.jit(lambda s, t: uld_loss(s, t, reduction="none"))(s, t)
  np.testing.assert_allclose(
    jax.vmap(lambda s, t: uld_loss(s, t, reduction="none"))(s, t), u, rtol=2e-6
  )


def test_float32_and_bfloat16_follow_float64(rng):
  s, t = logits(rng, (B, T, VS)), logits(rng, (B, T, VT))
  want = np_uld_rows(np_softmax(t), np_softmax(s)).mean()
  got32 = uld_loss(s.astype(np.float32), t.astype(np.float32))
  assert got32.dtype == jnp.float32
  np.testing.assert_allclose(got32, want, rtol=1.3e-6)
  got16 = uld_loss(jnp.asarray(s, jnp.bfloat16), jnp.asarray(t, jnp.bfloat16))
  assert got16.dtype == jnp.bfloat16
  np.testing.assert_allclose(float(got16), want, rtol=3e-2)  # bf16 logits, then bf16 output
  gold32 = gold_loss(
    s.astype(np.float32), t.astype(np.float32), student_ids=S_IDS, teacher_ids=T_IDS
  )
  want = np_gold_rows(np_softmax(s), np_softmax(t), S_IDS, T_IDS, 0.5).mean()
  np.testing.assert_allclose(gold32, want, rtol=1e-5)


def test_x64_check_grads(x64, rng):
  s, t = logits(rng, (3, VS)), logits(rng, (3, VT))
  uld = jax.jit(lambda s, t: uld_loss(s, t, student_temperature=1.3))
  gold = jax.jit(lambda s, t: gold_loss(s, t, student_ids=S_IDS, teacher_ids=T_IDS, beta=0.4))
  check_grads(uld, (s, t), 2, modes=("rev",))  # over positions: a jax.custom_vjp
  check_grads(gold, (s, t), 2, modes=("fwd", "rev"))


def test_where_and_masked_classes(x64, rng):
  s, t = logits(rng, (B, T, VS)), logits(rng, (B, T, VT))
  where = np.array([[True, False, True, True, False], [False] * T])
  s_nan = np.where(where[..., None], s, np.nan)  # masked rows' NaN reaches nothing
  value, grad = jax.value_and_grad(lambda s: uld_loss(s, t, where=where))(s_nan)
  np.testing.assert_allclose(value, uld_loss(s[where], t[where]), rtol=1e-13)
  assert np.isfinite(grad).all() and (grad[~where] == 0).all()
  # -inf classes are classes without mass: the same as leaving them out.
  s_inf = s.copy()
  s_inf[..., :2] = -np.inf
  np.testing.assert_allclose(uld_loss(s_inf, t), uld_loss(s[..., 2:], t), rtol=1e-13)
  # A row without a finite logit has no mass: finite, with zero gradients there.
  s_inf[0, 0] = -np.inf
  value, grad = jax.value_and_grad(lambda s: uld_loss(s, t))(s_inf)
  assert np.isfinite(value) and np.isfinite(grad[np.isfinite(s_inf)]).all()


def test_ties_take_index_order(x64):
  """Equal student probabilities take the sorted slots in index order (a stable sort)."""
  s = np.log(np.array([0.4, 0.3, 0.3]))
  t = np.log(np.array([0.35, 0.31, 0.29, 0.05]))
  # Sorted: student (.4, .3, .3, 0), teacher (.35, .31, .29, .05): the slots' signs are
  # (+, -, +, -); index 1 takes slot 1 (-1), index 2 slot 2 (+1); then through the softmax.
  p = np.exp(s)
  t2 = np.log(np.array([0.5, 0.31, 0.19]))  # slots (-, -, +)
  for teacher, g in ((t, [1.0, -1.0, 1.0]), (t2, [-1.0, -1.0, 1.0])):
    g = np.array(g)
    want = p * (g - np.sum(p * g))
    grad = jax.grad(lambda s, teacher=teacher: uld_loss(s, teacher))(s)
    np.testing.assert_allclose(grad, want, rtol=1e-12)


def test_errors_name_the_argument(rng):
  s, t = logits(rng, (B, T, VS)), logits(rng, (B, T, VT))
  with pytest.raises(ValueError, match="uld_loss: reduction must be one of"):
    uld_loss(s, t, reduction="batchmean")
  with pytest.raises(ValueError, match="uld_loss: teacher_temperature must be positive"):
    uld_loss(s, t, teacher_temperature=0.0)
  with pytest.raises(ValueError, match="same shape without the class axis"):
    uld_loss(s, t[:, :3])
  with pytest.raises(ValueError, match="where must be a row mask"):
    uld_loss(s, t, where=np.ones((B, T, 1), bool))
  with pytest.raises(ValueError, match="go together"):
    uld_loss(s, t, student_groups=np.zeros((B, 2, 2), np.int32))
  with pytest.raises(ValueError, match="merge_strategy must be one of"):
    uld_loss(s, t, merge_strategy="first")
  with pytest.raises(TypeError, match=r"uld_loss: .*Expected floating student_logits"):
    uld_loss(np.ones((2, 3), np.int32), t)
  with pytest.raises(ValueError, match="gold_loss: student_ids and teacher_ids must pair up"):
    gold_loss(s, t, student_ids=S_IDS[:2], teacher_ids=T_IDS)
  with pytest.raises(
    ValueError, match=r"gold_loss: teacher_ids must be vocabulary ids in \[0, 11\)"
  ):
    gold_loss(s, t, student_ids=S_IDS, teacher_ids=T_IDS + 1)
  with pytest.raises(ValueError, match="matched_weight and unmatched_weight go together"):
    gold_loss(s, t, student_ids=S_IDS, teacher_ids=T_IDS, matched_weight=0.5)
  with pytest.raises(ValueError, match="gold_loss: beta must be a number in"):
    gold_loss(s, t, student_ids=S_IDS, teacher_ids=T_IDS, beta=2.0)
  with pytest.raises(ValueError, match="merge_spans: strategy must be one of"):
    merge_spans(
      np_softmax(s), np.zeros((B, T), np.int32), np.zeros((B, 1, 1), np.int32), strategy="x"
    )
  with pytest.raises(ValueError, match="merge_spans: expected probs"):
    merge_spans(np_softmax(s), np.zeros((B, T + 1), np.int32), np.zeros((B, 1, 1), np.int32))


def test_groups_out_of_range_raise(rng):
  s, t, gs, gt, ys, yt = _aligned_case(rng)
  align = dict(student_groups=gs, teacher_groups=gt, student_tokens=ys, teacher_tokens=yt)
  with pytest.raises(ValueError, match=r"uld_loss: teacher_groups must be positions in \[0, 6\)"):
    uld_loss(s, t, **{**align, "teacher_groups": gt + 3})
  with pytest.raises(ValueError, match=r"merge_spans: groups must be positions in \[0, 5\)"):
    merge_spans(np_softmax(s), ys, gs + 5)


def test_align_tokens():
  # "abcdefghi": student a|bc|def|ghi, teacher abc|de|f|ghi -> [a, bc]~[abc], [def]~[de, f], ...
  s_off = [(0, 1), (1, 3), (3, 6), (6, 9)]
  t_off = [(0, 3), (3, 5), (5, 6), (6, 9), (9, 9)]  # a zero-width EOS at the end
  sg, tg = align_tokens(
    s_off, t_off, student_start=10, teacher_start=20, num_groups=4, group_size=3
  )
  assert sg.dtype == np.int32 and sg.shape == tg.shape == (4, 3)
  assert sg.tolist() == [[10, 11, -1], [12, -1, -1], [13, -1, -1], [-1, -1, -1]]
  assert tg.tolist() == [[20, -1, -1], [21, 22, -1], [23, -1, -1], [-1, -1, -1]]  # EOS dropped
  assert [x.shape for x in align_tokens([], t_off)] == [(0, 1), (0, 1)]
  with pytest.raises(ValueError, match="num_groups=2 is too small"):
    align_tokens(s_off, t_off, num_groups=2)
  with pytest.raises(ValueError, match="group_size=1 is too small"):
    align_tokens(s_off, t_off, group_size=1)
  with pytest.raises(ValueError, match=r"student_offsets must be \(start, end\) integer pairs"):
    align_tokens([1, 2, 3], t_off)


def test_matched_vocabulary():
  teacher_ids, student_ids = matched_vocabulary({"a": 3, "b": 0, "z": 1}, {"z": 2, "a": 0, "q": 1})
  assert teacher_ids.tolist() == [0, 2] and student_ids.tolist() == [3, 1]
  assert teacher_ids.dtype == np.int32
  with pytest.raises(TypeError, match="student_vocab must be a mapping"):
    matched_vocabulary([("a", 1)], {})


def test_exported_and_documented():
  for name in ("uld_loss", "gold_loss", "merge_spans", "align_tokens", "matched_vocabulary"):
    assert name in kd.__all__ and getattr(kd, name).__doc__


def test_invariances(rng):
  """ULD ignores which entry holds which probability, is symmetric, and is 0 between equal
  distributions of different lengths (the extra entries without mass)."""
  s, t = logits(rng, (B, VS)), logits(rng, (B, VT))
  perm = rng.permutation(VT)
  base = uld_loss(s, t, reduction="none")
  np.testing.assert_allclose(uld_loss(s, t[:, perm], reduction="none"), base, rtol=1e-6)
  np.testing.assert_allclose(uld_loss(t, s, reduction="none"), base, rtol=1e-6)
  padded = np.concatenate([s, np.full((B, 3), -np.inf)], axis=-1)[:, rng.permutation(VS + 3)]
  np.testing.assert_allclose(uld_loss(s, padded, reduction="none"), 0.0, atol=1e-6)


def test_one_trace_per_shape(rng):
  s, t = logits(rng, (B, T, VS)), logits(rng, (B, T, VT))
  traces = []

  @jax.jit
  def step(s, t):
    traces.append(None)
    return gold_loss(s, t, student_ids=S_IDS, teacher_ids=T_IDS, student_temperature=2.0)

  step(s, t)
  step(s + 1.0, t * 0.5)
  assert len(traces) == 1
