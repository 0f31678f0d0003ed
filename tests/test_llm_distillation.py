"""LLM distillation as it is run: vocabularies of different sizes, soft-capped logits, the
hard loss inside the fused head (with its parts), and top-k teachers with a tail bucket.

References: the same computation on materialised logits (cut to the shared classes,
soft-capped by hand) for the conventions, the float64 ports of the authors' formulas
(``_references.REFERENCES``) for the top-k divergences over ``k + 1`` classes, and the
unsharded calls for ``axis_name`` (``multidevice``: 8 simulated devices).
"""

import re

import _references as refs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kldiv_jax as kd
from kldiv_jax import Divergence

DIVERGENCES = {
  "forward_kl": Divergence("forward_kl"),
  "reverse_kl": Divergence("reverse_kl"),
  "jsd[0.3]": Divergence("jsd", beta=0.3),
  "symmetric_kl[0.7]": Divergence("symmetric_kl", lam=0.7),
  "skew_kl[0.2]": Divergence("skew_kl", alpha=0.2),
  "skew_reverse_kl[0.3]": Divergence("skew_reverse_kl", alpha=0.3),
  "tvd": Divergence("tvd"),
  "alpha_beta[0.6,0.3]": Divergence("alpha_beta", alpha=0.6, beta=0.3),
}
IDS = list(DIVERGENCES)


def _close(got, want, rtol=2e-5, atol=2e-6):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _cap(x, cap):
  """Soft-capping by hand; a -inf logit (no mass) stays -inf."""
  return x if cap is None else jnp.where(x == -jnp.inf, -jnp.inf, cap * jnp.tanh(x / cap))


def _head(rng, tokens=11, hidden=6, vocab=24, teacher_hidden=5, teacher_vocab=None):
  teacher_vocab = vocab if teacher_vocab is None else teacher_vocab
  f = lambda *shape: (1.5 * rng.normal(size=shape)).astype(np.float32)  # noqa: E731
  h, w, b = f(tokens, hidden), f(hidden, vocab), f(vocab)
  th, tw, tb = f(tokens, teacher_hidden), f(teacher_hidden, teacher_vocab), f(teacher_vocab)
  labels = rng.integers(0, min(vocab, teacher_vocab), size=tokens)
  labels[[1, tokens - 2]] = -100
  return (h, w, b), (th, tw, tb), labels


# ---------------------------------------------------------------- vocabularies of different sizes


@pytest.mark.parametrize(
  ("case", "teacher_vocab"),
  [("forward_kl", 20), ("jsd[0.3]", 28), ("tvd", 20), ("alpha_beta[0.6,0.3]", 28)],
)
def test_padded_vocabulary_is_the_shared_classes(rng, case, teacher_vocab):
  """Logits of different lengths equal both cut to the shared classes; the cut classes get
  zero gradient (distillation_loss, divergence_from_logits, a class where of either length)."""
  spec = DIVERGENCES[case]
  s = (2 * rng.normal(size=(3, 4, 24))).astype(np.float32)
  t = (2 * rng.normal(size=(3, 4, teacher_vocab))).astype(np.float32)
  labels = rng.integers(0, 20, size=(3, 4))
  labels[0, 1] = -100
  shared = min(24, teacher_vocab)

  def loss(s, t):
    return kd.distillation_loss(
      s, t, labels, divergence=spec, temperature=1.5, alpha=0.3, teacher_vocab_size=t.shape[-1]
    )

  def aligned(s, t):
    return loss(s[..., :shared], t[..., :shared])

  got = jax.value_and_grad(loss, argnums=(0, 1))(s, t)
  _close(got, jax.value_and_grad(aligned, argnums=(0, 1))(s, t))
  assert not np.any(np.asarray(got[1][0])[..., shared:])
  assert not np.any(np.asarray(got[1][1])[..., shared:])
  mask = rng.random(max(24, teacher_vocab)) > 0.2
  per = kd.divergence_from_logits(
    s, t, divergence=spec, where=mask[: s.shape[-1]], teacher_vocab_size=teacher_vocab
  )
  want = kd.divergence_from_logits(
    s[..., :shared], t[..., :shared], divergence=spec, where=mask[:shared]
  )
  _close(per, want)


def test_padded_vocabulary_fused_head(rng):
  """The fused head with a longer teacher head equals the head cut to the shared classes."""
  (h, w, b), (th, tw, tb), labels = _head(rng, vocab=24, teacher_vocab=30)

  def fused(h, w, b):
    return kd.fused_distillation_loss(
      h,
      w,
      th,
      tw,
      labels,
      bias=b,
      target_bias=tb,
      temperature=2.0,
      chunk_size=4,
      teacher_vocab_size=30,
    )

  def materialised(h, w, b):
    return kd.distillation_loss(
      h @ w + b[None], (th @ tw + tb[None])[:, :24], labels, temperature=2.0
    )

  _close(
    jax.value_and_grad(fused, (0, 1, 2))(h, w, b),
    jax.value_and_grad(materialised, (0, 1, 2))(h, w, b),
  )

  # A shorter teacher: the student's own classes are cut, with zero gradient.
  def short(w, b):
    return kd.fused_distillation_loss(
      h, w, th, tw[:, :20], bias=b, chunk_size=4, teacher_vocab_size=20
    )

  value, (gw, gb) = jax.value_and_grad(short, (0, 1))(w, b)
  want = kd.distillation_loss((h @ w + b[None])[:, :20], th @ tw[:, :20])
  np.testing.assert_allclose(value, want, rtol=2e-5)
  assert not np.any(np.asarray(gw)[:, 20:]) and not np.any(np.asarray(gb)[20:])


# Every logit path, (student, teacher) -> loss with keyword arguments: one registry for the
# vocabulary-size rule.
def _vocab_calls(rng):
  s, t = np.zeros((4, 10), np.float32), np.zeros((4, 11), np.float32)
  h, th = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)
  w, tw = np.zeros((3, 10), np.float32), np.zeros((2, 11), np.float32)
  metric = kd.DivergenceMetric.configure()
  return {
    "kl_div_from_logits": lambda **kw: kd.kl_div_from_logits(s, t, **kw),
    "generalized_jsd": lambda **kw: kd.generalized_jsd(s, t, **kw),
    "divergence_from_logits": lambda **kw: kd.divergence_from_logits(s, t, **kw),
    "distillation_loss": lambda **kw: kd.distillation_loss(s, t, **kw),
    "fused_distillation_loss": lambda **kw: kd.fused_distillation_loss(h, w, th, tw, **kw),
    "DivergenceMetric.from_model_output": lambda **kw: metric.from_model_output(s, t, **kw),
  }


@pytest.mark.parametrize(
  "name",
  [
    "kl_div_from_logits",
    "generalized_jsd",
    "divergence_from_logits",
    "distillation_loss",
    "fused_distillation_loss",
    "DivergenceMetric.from_model_output",
  ],
)
def test_vocabulary_sizes_that_differ_must_be_explicit(rng, name):
  """Student [4, 10] against teacher [4, 11]: ValueError naming both sizes and the keyword;
  with teacher_vocab_size=11 the shared first 10 classes, a wrong size raises too."""
  call = _vocab_calls(rng)[name]
  with pytest.raises(
    ValueError, match=rf"^{re.escape(name)}: .* 10 and 11; pass teacher_vocab_size=11"
  ):
    call()
  call(teacher_vocab_size=11)  # the padded teacher, explicit
  with pytest.raises(ValueError, match=r"teacher_vocab_size=12 but \w+ has 11 classes"):
    call(teacher_vocab_size=12)


def test_padded_vocabulary_errors(rng):
  s, t = np.zeros((2, 5), np.float32), np.zeros((2, 7), np.float32)
  with pytest.raises(ValueError, match="same number of classes"):
    kd.divergence_from_logits(s[:, :1], t)  # one class is not a vocabulary
  with pytest.raises(ValueError, match="same number of classes"):
    kd.divergence_from_logits(s.reshape(2, 5, 1), t.reshape(2, 7, 1), axis=(-2, -1))


# ---------------------------------------------------------------- soft-capping


CAPS = [(3.0, None), (None, 2.0), (4.0, 2.5)]


@pytest.mark.parametrize("case", IDS)
def test_softcap_equals_capping_by_hand(rng, case):
  """Every divergence (the student's, the teacher's or both soft-capped, in turn): value and
  gradients wrt both logits equal the logits capped by hand."""
  spec = DIVERGENCES[case]
  caps = CAPS[IDS.index(case) % len(CAPS)]
  s = (4 * rng.normal(size=(5, 16))).astype(np.float32)
  t = (4 * rng.normal(size=(5, 16))).astype(np.float32)
  s[0, 3] = -np.inf
  cap, tcap = caps

  def ours(s, t):
    return kd.divergence_from_logits(
      s, t, divergence=spec, temperature=1.3, softcap=cap, target_softcap=tcap
    ).sum()

  def by_hand(s, t):
    return kd.divergence_from_logits(
      _cap(s, cap), _cap(t, tcap), divergence=spec, temperature=1.3
    ).sum()

  _close(
    jax.value_and_grad(ours, (0, 1))(s, t), jax.value_and_grad(by_hand, (0, 1))(s, t), atol=1e-5
  )


def test_softcap_second_derivatives_and_ce(x64, rng):
  s = jnp.asarray(4 * rng.normal(size=(2, 7)))
  t = jnp.asarray(4 * rng.normal(size=(2, 7)))
  labels = np.array([3, 5])

  def ours(s):
    return kd.distillation_loss(s, t, labels, temperature=2.0, softcap=3.0, target_softcap=5.0)

  def by_hand(s):
    return kd.distillation_loss(_cap(s, 3.0), _cap(t, 5.0), labels, temperature=2.0)

  np.testing.assert_allclose(ours(s), by_hand(s), rtol=1e-12)
  np.testing.assert_allclose(jax.hessian(ours)(s), jax.hessian(by_hand)(s), rtol=1e-9, atol=1e-12)


def test_softcap_none_costs_nothing(rng):
  """``softcap=None`` traces the very program of a call without it (no tanh)."""
  s = rng.normal(size=(4, 8)).astype(np.float32)
  t = rng.normal(size=(4, 8)).astype(np.float32)
  plain = jax.make_jaxpr(jax.grad(lambda s: kd.distillation_loss(s, t)))(s)
  none = jax.make_jaxpr(jax.grad(lambda s: kd.distillation_loss(s, t, softcap=None)))(s)
  capped = jax.make_jaxpr(jax.grad(lambda s: kd.distillation_loss(s, t, softcap=30.0)))(s)
  assert str(plain) == str(none)
  assert "tanh" not in str(plain) and "tanh" in str(capped)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_softcap_errors(bad):
  s = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match="softcap must be positive and finite"):
    kd.divergence_from_logits(s, s, softcap=bad)
  with pytest.raises(TypeError, match="target_softcap must be None or a positive Python number"):
    kd.distillation_loss(s, s, target_softcap=jnp.float32(3.0))


# ---------------------------------------------------------------- the hard loss in the fused head


def _with_labels(teacher, labels, kwargs):
  """``(fused, materialised)``: functions of the student's ``(h, w, b)`` giving
  ``fused_distillation_loss`` (chunks of 4 tokens) and ``distillation_loss`` on the
  materialised logits, with ``labels`` and ``return_parts``."""
  th, tw, tb = teacher

  def fused(h, w, b):
    return kd.fused_distillation_loss(
      h, w, th, tw, bias=b, target_bias=tb, labels=labels, chunk_size=4, return_parts=True, **kwargs
    )

  def materialised(h, w, b):
    return kd.distillation_loss(
      h @ w + b[None], th @ tw + tb[None], labels, return_parts=True, **kwargs
    )

  return fused, materialised


@pytest.mark.parametrize(
  ("case", "alpha"),
  [
    ("forward_kl", 0.3),
    ("reverse_kl", 1.0),
    ("jsd[0.3]", 0.0),
    ("tvd", "traced"),
    ("alpha_beta[0.6,0.3]", 0.3),
  ],
)
def test_fused_with_labels_equals_distillation_loss(rng, case, alpha):
  """Value, every student gradient, and the parts, with soft-caps, where and ignore_index."""
  spec = DIVERGENCES[case]
  (h, w, b), (th, tw, tb), labels = _head(rng)
  where = np.ones(h.shape[0], bool)
  where[4] = False
  a = jnp.float32(0.6) if alpha == "traced" else alpha
  kwargs = dict(
    alpha=a, temperature=1.7, divergence=spec, softcap=6.0, target_softcap=4.0, where=where
  )

  fused, materialised = _with_labels((th, tw, tb), labels, kwargs)
  got = jax.jit(jax.value_and_grad(fused, (0, 1, 2), has_aux=True))(h, w, b)
  want = jax.jit(jax.value_and_grad(materialised, (0, 1, 2), has_aux=True))(h, w, b)
  _close(got, want, rtol=3e-5, atol=3e-6)
  (_, parts), _ = got
  valid = (labels != -100) & where
  assert int(parts.num_tokens) == valid.sum()
  # The parts recombine into the loss.
  alpha_value = 0.6 if alpha == "traced" else alpha
  total = (alpha_value * parts.soft + (1 - alpha_value) * parts.hard) / valid.sum()
  np.testing.assert_allclose(got[0][0], total, rtol=2e-5)


@pytest.mark.parametrize(
  ("case", "passes"), [("forward_kl", 1), ("symmetric_kl[0.7]", 1), ("jsd[0.3]", 2)]
)
def test_fused_with_labels_on_accelerators(rng, accelerator_platform, case, passes):
  """The GPU/TPU branches, run on CPU: with labels, a KL-family divergence's statistics and
  the cross entropy's come from one reduction over a chunk's logits (one pass over them: on
  XLA:TPU the student's logits were read twice), the others' from their two kernels; values,
  gradients and parts equal distillation_loss's with label smoothing, the z-loss, soft-caps,
  where and ignore_index."""
  spec = DIVERGENCES[case]
  (h, w, b), (th, tw, tb), labels = _head(rng)
  where = np.ones(h.shape[0], bool)
  where[4] = False
  kwargs = dict(
    alpha=0.4, temperature=1.7, divergence=spec, softcap=6.0, target_softcap=4.0, where=where,
    label_smoothing=0.1, z_loss=0.02,
  )  # fmt: skip

  fused, materialised = _with_labels((th, tw, tb), labels, kwargs)
  step = jax.jit(jax.value_and_grad(fused, (0, 1, 2), has_aux=True))
  _close(step(h, w, b), jax.value_and_grad(materialised, (0, 1, 2), has_aux=True)(h, w, b))
  # The reductions over the classes of a full chunk's logits (or their per-class terms).
  chunk = f"tensor<4x{w.shape[1]}x"
  text = step.lower(h, w, b).as_text().splitlines()
  rows = [x for x in text if "stablehlo.reduce" in x and "dimensions = [1]" in x and chunk in x]
  assert len(rows) == passes if passes == 1 else len(rows) >= passes, rows


def test_parts_add_up_over_micro_batches(rng):
  """Summed over micro-batches, the parts and the loss with the global normalizer equal the
  whole batch's; the hard part against a NumPy cross entropy."""
  (h, w, _), (th, tw, _), labels = _head(rng, tokens=12)
  n = int((labels != -100).sum())

  def call(sl, normalizer=None):
    return kd.fused_distillation_loss(
      h[sl],
      w,
      th[sl],
      tw,
      labels=labels[sl],
      temperature=2.0,
      normalizer=normalizer,
      return_parts=True,
      chunk_size=3,
    )

  whole, parts = call(slice(None))
  halves = [call(slice(0, 5), n), call(slice(5, None), n)]
  np.testing.assert_allclose(sum(x[0] for x in halves), whole, rtol=2e-6)
  for field in ("soft", "hard", "num_tokens"):
    np.testing.assert_allclose(
      sum(getattr(x[1], field) for x in halves), getattr(parts, field), rtol=2e-6
    )
  z = h.astype(np.float64) @ w.astype(np.float64)
  ce = -np.take_along_axis(refs.np_log_softmax(z), np.where(labels < 0, 0, labels)[:, None], 1)[
    :, 0
  ]
  np.testing.assert_allclose(parts.hard, ce[labels != -100].sum(), rtol=2e-5)


def test_parts_carry_no_gradient(rng):
  (h, w, _), (th, tw, _), labels = _head(rng)
  g = jax.grad(
    lambda w: kd.fused_distillation_loss(h, w, th, tw, labels=labels, return_parts=True)[1].soft
  )(w)
  assert not np.any(np.asarray(g))


def test_fused_losses_take_labels_positionally(rng):
  """``labels`` is the optional positional argument after the arrays, as in
  distillation_loss, on both fused losses."""
  (h, w, _), (th, tw, _), labels = _head(rng)
  keyword = kd.fused_distillation_loss(h, w, th, tw, labels=labels, temperature=2.0)
  np.testing.assert_array_equal(
    kd.fused_distillation_loss(h, w, th, tw, labels, temperature=2.0), keyword
  )
  _, ids, lp = _topk_case(rng, rows=h.shape[0], vocab=w.shape[1], k=3)
  lp = lp.astype(np.float32)
  keyword = kd.fused_topk_distillation_loss(h, w, ids, lp, labels=labels, alpha=0.3)
  np.testing.assert_array_equal(
    kd.fused_topk_distillation_loss(h, w, ids, lp, labels, alpha=0.3), keyword
  )
  with pytest.raises(ValueError, match="fused_distillation_loss: labels must have shape"):
    kd.fused_distillation_loss(h, w, th, tw, labels[:3])


# ---------------------------------------------------------------- top-k teachers


def _topk_case(rng, rows=6, vocab=20, k=5, scale=2.0):
  z = (scale * rng.normal(size=(rows, vocab))).astype(np.float64)
  teacher = refs.np_log_softmax(scale * rng.normal(size=(rows, vocab)))
  ids = np.argsort(-teacher, axis=-1)[:, :k]
  lp = np.take_along_axis(teacher, ids, -1)
  return z, ids, lp


def _support_reference(name, params, z, ids, lp, temperature, tail):
  """The divergence over k + 1 classes in float64 NumPy, from the authors' formula (a class
  without mass as a log-probability of -1e300)."""
  lq_full = refs.np_log_softmax(z / temperature)
  lq = np.take_along_axis(lq_full, ids, -1)
  q_tail = 1.0 - np.exp(lq).sum(-1, keepdims=True)
  if tail == "bucket":
    p = np.exp(lp)
    p_tail = 1.0 - p.sum(-1, keepdims=True)
  else:
    p = np.exp(refs.np_log_softmax(lp / temperature))
    p_tail = np.zeros_like(q_tail)
  with np.errstate(divide="ignore"):
    log_p = np.log(np.concatenate([p, p_tail], -1))
    log_q = np.log(np.concatenate([np.exp(lq), q_tail], -1))
  log_p, log_q = np.maximum(log_p, -1e300), np.maximum(log_q, -1e300)
  return refs.REFERENCES[name](log_q, log_p, 1.0, **params)


@pytest.mark.parametrize("tail", ["renormalize", "bucket"])
@pytest.mark.parametrize("case", IDS)
def test_topk_every_divergence(x64, rng, case, tail):
  spec = DIVERGENCES[case]
  if tail == "renormalize" and spec.name in ("reverse_kl", "symmetric_kl"):
    pytest.skip("+inf by definition (covered below)")
  name, params = spec.name, dict(spec.params)
  z, ids, lp = _topk_case(rng)
  got = kd.divergence_from_topk(
    z, ids, lp, divergence=spec, temperature=1.4 if tail == "renormalize" else 1.0, tail=tail
  )
  want = _support_reference(name, params, z, ids, lp, 1.4 if tail == "renormalize" else 1.0, tail)
  np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_topk_bucket_temperature_scales_the_student_only(x64, rng):
  z, ids, lp = _topk_case(rng)
  got = kd.divergence_from_topk(z, ids, lp, temperature=2.0, tail="bucket")
  want = _support_reference("forward_kl", {}, z / 2.0, ids, lp, 1.0, "bucket")
  np.testing.assert_allclose(got, want, rtol=1e-10)


def test_topk_renormalized_reverse_kl_is_inf(rng):
  z, ids, lp = _topk_case(rng)
  assert np.all(np.isposinf(kd.divergence_from_topk(z, ids, lp, divergence="reverse_kl")))
  assert np.all(
    np.isfinite(kd.divergence_from_topk(z, ids, lp, divergence="reverse_kl", tail="bucket"))
  )


@pytest.mark.parametrize("case", ["forward_kl", "jsd[0.3]", "tvd", "reverse_kl"])
def test_topk_gradients_against_autodiff_of_the_reference(x64, rng, case):
  spec = DIVERGENCES[case]
  z, ids, lp = _topk_case(rng)

  def ref(z, lp):
    lq_full = jax.nn.log_softmax(z / 1.5)
    lq = jnp.take_along_axis(lq_full, ids, -1)
    q = jnp.exp(lq)
    p = jnp.exp(lp)
    log_p = jnp.concatenate([lp, jnp.log1p(-p.sum(-1, keepdims=True))], -1)
    log_q = jnp.concatenate([lq, jnp.log1p(-q.sum(-1, keepdims=True))], -1)
    return refs.REFERENCES[spec.name](log_q, log_p, 1.0, xp=jnp, **dict(spec.params)).sum()

  def ours(z, lp):
    return kd.divergence_from_topk(
      z, ids, lp, divergence=spec, temperature=1.5, tail="bucket"
    ).sum()

  _close(jax.grad(ours, (0, 1))(z, lp), jax.grad(ref, (0, 1))(z, lp), rtol=1e-8, atol=1e-12)


def test_topk_padding_and_repeated_ids(rng):
  """-inf padding, padding ids out of range, and repeated ids (the first counts) equal the
  clean top-k list; for every divergence and both tails."""
  z, ids, lp = (a.astype(np.float32) if a.dtype == np.float64 else a for a in _topk_case(rng, k=4))
  pad_ids = np.concatenate([ids, np.full((ids.shape[0], 2), -1), ids[:, :1]], -1)
  pad_lp = np.concatenate([lp, np.full((lp.shape[0], 2), -np.inf), lp[:, :1]], -1)
  for spec in DIVERGENCES.values():
    for tail in ("renormalize", "bucket"):
      clean = kd.divergence_from_topk(z, ids, lp, divergence=spec, tail=tail)
      padded = kd.divergence_from_topk(z, pad_ids, pad_lp, divergence=spec, tail=tail)
      np.testing.assert_allclose(padded, clean, rtol=1e-6)
  g_clean = jax.grad(lambda z: kd.kl_div_from_topk(z, ids, lp, tail="bucket").sum())(z)
  g_pad = jax.grad(lambda z: kd.kl_div_from_topk(z, pad_ids, pad_lp, tail="bucket").sum())(z)
  np.testing.assert_allclose(g_pad, g_clean, rtol=1e-6, atol=1e-7)


def test_topk_identical_is_zero_and_masked_rows(rng):
  z, _, _ = _topk_case(rng, vocab=8, k=8)
  lq = refs.np_log_softmax(z)
  ids = np.argsort(-lq, -1)
  lp = np.take_along_axis(lq, ids, -1).astype(np.float32)
  for spec in DIVERGENCES.values():
    out = kd.divergence_from_topk(z.astype(np.float32), ids, lp, divergence=spec, tail="bucket")
    assert np.all(np.asarray(out) >= 0) and np.all(np.asarray(out) < 1e-5)
  where = np.array([True, False, True, True, True, False])
  out = kd.divergence_from_topk(z[:, :8], ids, lp, divergence="reverse_kl", where=where)
  assert np.all(np.asarray(out)[~where] == 0)


def test_topk_teacher_vocabulary(rng):
  """A teacher with more classes: its own ids leave it (renormalised over the shared ones);
  a teacher with fewer: the student's own classes are cut."""
  z, ids, lp = _topk_case(rng, vocab=20)
  ids = ids.copy()
  ids[:, -1] = 21  # a class only the 24-class teacher has
  got = kd.divergence_from_topk(z, ids, lp, teacher_vocab_size=24)
  want = kd.divergence_from_topk(z, ids[:, :-1], lp[:, :-1])
  np.testing.assert_allclose(got, want, rtol=1e-6)
  with pytest.raises(ValueError, match=r"token ids in \[0, 20\)"):
    kd.divergence_from_topk(z, ids, lp)
  small = np.where(ids < 16, ids, 0)
  keep_lp = np.where(ids < 16, lp, -np.inf)
  got = kd.divergence_from_topk(z, small, keep_lp, teacher_vocab_size=16, tail="bucket")
  want = kd.divergence_from_topk(z[:, :16], small, keep_lp, tail="bucket")
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("tail", ["renormalize", "bucket"])
def test_topk_memory_has_no_vocabulary_temporary(tail):
  """value_and_grad wrt the logits writes the gradient and nothing else of vocabulary size."""
  rows, vocab, k = 64, 32768, 16
  z = jax.ShapeDtypeStruct((rows, vocab), jnp.float32)
  ids = jax.ShapeDtypeStruct((rows, k), jnp.int32)
  lp = jax.ShapeDtypeStruct((rows, k), jnp.float32)
  fn = jax.jit(
    jax.value_and_grad(
      lambda z, i, lp: kd.divergence_from_topk(z, i, lp, divergence="jsd", tail=tail).sum()
    )
  )
  temp = fn.lower(z, ids, lp).compile().memory_analysis().temp_size_in_bytes
  assert temp < 0.1 * rows * vocab * 4, temp


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_fused_topk_equals_materialised(rng, request, path):
  """The fused top-k loss against the same loss on materialised logits, values and gradients
  wrt the hidden states, head and bias; ``accelerator``: both on the GPU/TPU path (the
  tail's one-pass statistics, the gather's tangent as masked sums), run here on CPU."""
  if path == "accelerator":
    request.getfixturevalue("accelerator_branch")
  (h, w, b), _, labels = _head(rng, vocab=30)
  teacher = refs.np_log_softmax(2 * rng.normal(size=(h.shape[0], 30)))
  ids = np.argsort(-teacher, -1)[:, :6]
  lp = np.take_along_axis(teacher, ids, -1).astype(np.float32)
  specs = ("forward_kl", "jsd[0.3]", "tvd") if path == "cpu" else ("jsd[0.3]",)
  for spec in (DIVERGENCES[name] for name in specs):

    def fused(h, w, b, spec=spec):
      return kd.fused_topk_distillation_loss(
        h,
        w,
        ids,
        lp,
        bias=b,
        labels=labels,
        alpha=0.7,
        divergence=spec,
        tail="bucket",
        temperature=1.3,
        softcap=5.0,
        chunk_size=4,
      )

    def materialised(h, w, b, spec=spec):
      z = h @ w + b[None]
      d = kd.divergence_from_topk(
        z, ids, lp, divergence=spec, tail="bucket", temperature=1.3, softcap=5.0
      )
      ce = -jnp.take_along_axis(
        jax.nn.log_softmax(_cap(z, 5.0)), np.maximum(labels, 0)[:, None], 1
      )[:, 0]
      valid = labels != -100
      return jnp.sum(jnp.where(valid, 0.7 * 1.3**2 * d + 0.3 * ce, 0.0)) / valid.sum()

    _close(
      jax.value_and_grad(fused, (0, 1, 2))(h, w, b),
      jax.value_and_grad(materialised, (0, 1, 2))(h, w, b),
      rtol=3e-5,
      atol=3e-6,
    )
  with pytest.raises(
    ValueError, match="fused_topk_distillation_loss: topk_indices must be token ids"
  ):
    kd.fused_topk_distillation_loss(h, w, np.full_like(ids, 30), lp)


# ---------------------------------------------------------------- vocabulary parallel


@pytest.mark.multidevice
@pytest.mark.parametrize("case", ["jsd[0.3]", "tvd"])
def test_vocab_parallel_softcap_labels_and_topk(cpu_devices, case):
  """axis_name: soft-capped distillation_loss, the fused head with labels, and the top-k path
  (both tails) equal the unsharded calls, values and gradients."""
  spec = DIVERGENCES[case]
  rng = np.random.default_rng(3)
  mesh = jax.sharding.Mesh(np.array(cpu_devices), ("vocab",))
  (h, w, _b), (th, tw, _tb), labels = _head(rng, tokens=6, vocab=32)
  kw = dict(labels=labels, alpha=0.4, divergence=spec, temperature=1.5, softcap=5.0, chunk_size=4)

  def fused(h, w, tw, axis_name=None):
    return kd.fused_distillation_loss(h, w, th, tw, target_softcap=3.0, axis_name=axis_name, **kw)

  sharded = jax.shard_map(
    lambda h, w, tw: fused(h, w, tw, "vocab"),
    mesh=mesh,
    in_specs=(P(), P(None, "vocab"), P(None, "vocab")),
    out_specs=P(),
  )
  _close(
    jax.jit(jax.value_and_grad(sharded, (0, 1)))(h, w, tw),
    jax.jit(jax.value_and_grad(fused, (0, 1)))(h, w, tw),
    rtol=1e-5,
    atol=1e-6,
  )
  teacher = refs.np_log_softmax(2 * rng.normal(size=(6, 32)))
  ids = np.argsort(-teacher, -1)[:, :5]
  lp = np.take_along_axis(teacher, ids, -1).astype(np.float32)
  z = (h @ w).astype(np.float32)
  for tail in ("renormalize", "bucket"):

    def topk(z, axis_name=None, tail=tail):
      return kd.divergence_from_topk(
        z, ids, lp, divergence=spec, tail=tail, softcap=5.0, temperature=1.5, axis_name=axis_name
      ).sum()

    sharded_topk = jax.shard_map(
      lambda z, tail=tail: topk(z, "vocab", tail),
      mesh=mesh,
      in_specs=P(None, "vocab"),
      out_specs=P(),
    )
    _close(
      jax.jit(jax.value_and_grad(sharded_topk))(z),
      jax.jit(jax.value_and_grad(topk))(z),
      rtol=1e-5,
      atol=1e-6,
    )

    def fused_topk(h, w, axis_name=None, tail=tail):
      return kd.fused_topk_distillation_loss(h, w, ids, lp, tail=tail, axis_name=axis_name, **kw)

    sharded_fused = jax.shard_map(
      lambda h, w, tail=tail: fused_topk(h, w, "vocab", tail),
      mesh=mesh,
      in_specs=(P(), P(None, "vocab")),
      out_specs=P(),
    )
    _close(
      jax.jit(jax.value_and_grad(sharded_fused, (0, 1)))(h, w),
      jax.jit(jax.value_and_grad(fused_topk, (0, 1)))(h, w),
      rtol=1e-5,
      atol=1e-6,
    )
  with pytest.raises(ValueError, match="slices of two vocabularies"):
    jax.shard_map(
      lambda s, t: kd.divergence_from_logits(s, t, axis_name="vocab"),
      mesh=mesh,
      in_specs=(P(None, "vocab"), P(None, "vocab")),
      out_specs=P(),
    )(np.zeros((2, 16), np.float32), np.zeros((2, 24), np.float32))


def test_topk_softcap_keeps_minus_inf_massless(rng):
  """A -inf student logit has no mass, capped or not (not -cap): equal to the logits capped by
  hand with the -inf kept, values and gradients."""
  z, ids, lp = (a.astype(np.float32) if a.dtype == np.float64 else a for a in _topk_case(rng))
  z = 4 * z
  z[:, 7] = -np.inf
  z[:, ids[0, 0]] = np.where(np.arange(z.shape[0]) == 1, -np.inf, z[:, ids[0, 0]])
  for tail in ("renormalize", "bucket"):

    def ours(z, tail=tail):
      return kd.divergence_from_topk(z, ids, lp, softcap=3.0, tail=tail, divergence="jsd").sum()

    def by_hand(z, tail=tail):
      return kd.divergence_from_topk(_cap(z, 3.0), ids, lp, tail=tail, divergence="jsd").sum()

    _close(jax.value_and_grad(ours)(z), jax.value_and_grad(by_hand)(z), rtol=1e-5, atol=1e-6)


def test_fused_topk_shorter_teacher_vocabulary(rng):
  """A student head longer than the teacher's vocabulary: its own classes are cut per chunk
  (zero gradient), equal to the head cut by hand."""
  (h, w, b), _, labels = _head(rng, vocab=24)
  labels = np.where(labels >= 18, 0, labels)
  teacher = refs.np_log_softmax(2 * rng.normal(size=(h.shape[0], 18)))
  ids = np.argsort(-teacher, -1)[:, :4]
  lp = np.take_along_axis(teacher, ids, -1).astype(np.float32)

  def fused(w, b):
    return kd.fused_topk_distillation_loss(
      h, w, ids, lp, bias=b, labels=labels, tail="bucket", teacher_vocab_size=18, chunk_size=4
    )

  def cut(w, b):
    return kd.fused_topk_distillation_loss(
      h, w[:, :18], ids, lp, bias=b[:18], labels=labels, tail="bucket", chunk_size=4
    )

  got = jax.value_and_grad(fused, (0, 1))(w, b)
  _close(got, jax.value_and_grad(cut, (0, 1))(w, b))
  assert not np.any(np.asarray(got[1][0])[:, 18:]) and not np.any(np.asarray(got[1][1])[18:])
