"""fused_distillation_loss (dense teacher, no labels): chunked == materialised, in value and
gradients; options, masks, shapes, dtypes, errors and compiled memory.

The reference materialises the logits and calls ``distillation_loss`` (no labels) on
``hidden @ weight + bias`` and the stopped teacher logits; the float64 references of
``_references.py`` (the authors' formulas) and finite differences (``check_grads``) check
the fused function independently of the library's kernels. Labels, top-k teachers and every
divergence of the fused losses are in test_llm_distillation.py and test_engine_paths.py.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import (
  check_bf16_grads_digits,
  docs_snippet,
  enable_x64,
  matmuls_and_casts,
  ref_forward_kl,
  ref_jsd,
  ref_reverse_kl,
  rounded_matmul_outputs,
)
from jax.test_util import check_grads

from kldiv_jax import (
  distillation_loss,
  divergence_from_topk,
  fused_distillation_loss,
  fused_topk_distillation_loss,
)

F32 = {"rtol": 1e-5, "atol": 1e-6}
# bf16 inputs, float32 accumulation: the value and the gradients are rounded to
# bf16 once at the end (relative step 2**-8), against a float32 reference on
# the same (bf16-rounded) inputs. atol covers elements near zero.
BF16 = {"rtol": 1.6e-2, "atol": 1e-3}

DIVERGENCES = [
  pytest.param({"divergence": "forward_kl"}, id="forward_kl"),
  pytest.param({"divergence": "reverse_kl"}, id="reverse_kl"),
  pytest.param({"divergence": "jsd", "beta": 0.0}, id="jsd0"),
  pytest.param({"divergence": "jsd", "beta": 0.3}, id="jsd0.3"),
  pytest.param({"divergence": "jsd", "beta": 1.0}, id="jsd1"),
]
# Fewer cases where a whole divergence x option grid would only add compile time.
SOME_DIVERGENCES = [DIVERGENCES[0], DIVERGENCES[3]]


def make(rng, tokens=(13,), hidden=8, teacher_hidden=None, vocab=37, bias=True, scale=1.5):
  """Student params ``{h, w, b}`` and teacher ``{th, tw, tb}`` as float32 NumPy arrays."""
  teacher_hidden = hidden if teacher_hidden is None else teacher_hidden
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
  student = {
    "h": normal(*tokens, hidden),
    "w": normal(hidden, vocab) * np.float32(scale / np.sqrt(hidden)),
    "b": normal(vocab) * np.float32(0.5) if bias else None,
  }
  teacher = {
    "th": normal(*tokens, teacher_hidden),
    "tw": normal(teacher_hidden, vocab) * np.float32(scale / np.sqrt(teacher_hidden)),
    "tb": normal(vocab) * np.float32(0.5) if bias else None,
  }
  return student, teacher


def _logits(h, w, b):
  z = jnp.matmul(h, w, precision=jax.lax.Precision.HIGHEST)
  return z if b is None else z + jnp.reshape(b, (1,) * (z.ndim - 1) + (-1,))


def materialised(student, teacher, **kw):
  z = _logits(student["h"], student["w"], student["b"])
  y = jax.lax.stop_gradient(_logits(teacher["th"], teacher["tw"], teacher["tb"]))
  return distillation_loss(z, y, **kw)


def fused(student, teacher, **kw):
  return fused_distillation_loss(
    student["h"],
    student["w"],
    teacher["th"],
    teacher["tw"],
    bias=student["b"],
    target_bias=teacher["tb"],
    **kw,
  )


@functools.cache
def value_and_grads(fn, static):
  """Jitted ``(loss, (student grads, teacher grads))`` of ``fn`` with options ``static``.

  ``static`` is a sorted tuple of items; the jitted function takes the array
  options (``where``) as a third argument.
  """
  loss = lambda s, t, arrays: fn(s, t, **dict(static), **arrays)  # noqa: E731
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def run(fn, student, teacher, **kw):
  """``value_and_grads`` of ``fn``; equal options share one compilation per shape."""
  arrays = {k: v for k, v in kw.items() if isinstance(v, np.ndarray)}
  static = {"divergence": "forward_kl", **{k: v for k, v in kw.items() if k not in arrays}}
  return value_and_grads(fn, tuple(sorted(static.items())))(student, teacher, arrays)


def assert_tree_close(actual, expected, **tol):
  leaves_a, tree_a = jax.tree.flatten(actual)
  leaves_e, tree_e = jax.tree.flatten(expected)
  assert tree_a == tree_e
  for a, e in zip(leaves_a, leaves_e, strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), **tol)


def assert_fused_matches(student, teacher, tol=F32, **kw):
  chunk_size = kw.pop("chunk_size", None)
  value, (grads, teacher_grads) = run(fused, student, teacher, chunk_size=chunk_size, **kw)
  ref_value, (ref_grads, _) = run(materialised, student, teacher, **kw)
  assert np.isfinite(float(value))
  assert_tree_close(value, ref_value, **tol)
  assert_tree_close(grads, ref_grads, **tol)
  for key, g in teacher_grads.items():  # the teacher gets zero gradients
    if teacher[key] is not None:
      assert g.shape == np.shape(teacher[key])
      np.testing.assert_array_equal(g, 0.0)
  return value, grads


def numpy_reference(
  student,
  teacher,
  temperature=1.0,
  divergence="forward_kl",
  beta=0.5,
  scale_by_temperature_squared=True,
  where=None,
):
  """The fused loss in float64 NumPy from the materialised logits."""
  f64 = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
  z = f64(student["h"]) @ f64(student["w"])
  y = f64(teacher["th"]) @ f64(teacher["tw"])
  z = z if student["b"] is None else z + f64(student["b"])
  y = y if teacher["tb"] is None else y + f64(teacher["tb"])
  if divergence == "jsd":  # TRL's: beta 0 and 1 are the forward and reverse KL
    per_token = ref_jsd(z, y, temperature, beta=beta)
  else:
    per_token = (ref_forward_kl if divergence == "forward_kl" else ref_reverse_kl)(
      z, y, temperature
    )
  if scale_by_temperature_squared:
    per_token = per_token * temperature**2
  where = np.ones(per_token.shape, bool) if where is None else where
  return np.sum(per_token[where]) / max(where.sum(), 1)


# Values and gradients against the materialised loss. Most tests share the
# options below (and the shapes of ``make``) so that they share compilations.

OPTIONS = {"chunk_size": 4, "temperature": 2.0}  # 13 tokens: an uneven last chunk


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_matches_materialised(rng, divergence):
  student, teacher = make(rng)
  value, grads = assert_fused_matches(student, teacher, **OPTIONS, **divergence)
  assert value.dtype == jnp.float32
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  np.testing.assert_allclose(value, numpy_reference(student, teacher, 2.0, **divergence), rtol=2e-6)


@pytest.mark.parametrize(
  "options",
  [
    pytest.param({"divergence": "forward_kl"}, id="forward_kl-T1"),
    pytest.param(
      {"divergence": "jsd", "beta": 0.3, "temperature": 3.0, "scale_by_temperature_squared": False},
      id="jsd0.3-T3_unscaled",
    ),
  ],
)
def test_temperature_options(rng, options):
  student, teacher = make(rng)
  assert_fused_matches(student, teacher, chunk_size=4, **options)


@pytest.mark.parametrize("chunk_size", [1, 5, 100, None])
def test_chunk_sizes(rng, chunk_size):
  # 13 tokens: an uneven last chunk (5), larger than N (100), the default (one chunk here).
  student, teacher = make(rng)
  assert_fused_matches(student, teacher, chunk_size=chunk_size, divergence="jsd", beta=0.3)


def test_token_mask(rng):
  student, teacher = make(rng)
  where = rng.random(13) < 0.6
  assert 0 < where.sum() < 13
  kw = {"divergence": "jsd", "beta": 0.3}
  value, _ = assert_fused_matches(student, teacher, where=where, **OPTIONS, **kw)
  np.testing.assert_allclose(
    value, numpy_reference(student, teacher, 2.0, where=where, **kw), rtol=2e-6
  )


def test_token_mask_equals_dropping_tokens(rng):
  student, teacher = make(rng)
  where = rng.random(13) < 0.5
  value, (grads, _) = run(fused, student, teacher, where=where, **OPTIONS)
  kept_s = {**student, "h": student["h"][where]}
  kept_t = {**teacher, "th": teacher["th"][where]}
  kept_value, (kept_grads, _) = run(fused, kept_s, kept_t, **OPTIONS)
  np.testing.assert_allclose(value, kept_value, **F32)
  np.testing.assert_allclose(grads["w"], kept_grads["w"], **F32)
  np.testing.assert_allclose(grads["b"], kept_grads["b"], **F32)
  np.testing.assert_allclose(grads["h"][where], kept_grads["h"], **F32)
  np.testing.assert_array_equal(grads["h"][~where], 0.0)


def test_all_tokens_masked_gives_zero(rng):
  student, teacher = make(rng)
  value, (grads, _) = run(fused, student, teacher, where=np.zeros(13, bool), **OPTIONS)
  assert float(value) == 0.0
  for g in jax.tree.leaves(grads):
    np.testing.assert_array_equal(g, 0.0)


def test_normalizer(rng):
  student, teacher = make(rng)
  mask = rng.random(13) < 0.7
  assert_fused_matches(student, teacher, normalizer=40.0, where=mask, **OPTIONS)


def test_normalizer_gradient_accumulation(rng):
  # Two micro-batches of 6 tokens with the global token count as normalizer sum
  # to the full batch of 12 (13 tokens, the last one masked out).
  student, teacher = make(rng)
  where = np.arange(13) < 12
  full, (full_grads, _) = run(fused, student, teacher, where=where, **OPTIONS)
  total, grads = 0.0, None
  for part in (slice(0, 6), slice(6, 12)):
    s = {**student, "h": student["h"][part]}
    t = {**teacher, "th": teacher["th"][part]}
    value, (g, _) = run(fused, s, t, normalizer=12.0, **OPTIONS)
    total += float(value)
    grads = (
      g
      if grads is None
      else {k: jnp.concatenate([grads[k], g[k]]) if k == "h" else grads[k] + g[k] for k in g}
    )
  np.testing.assert_allclose(total, full, **F32)
  full_grads["h"] = full_grads["h"][:12]
  assert_tree_close(grads, full_grads, **F32)


def test_traced_normalizer_temperature_and_beta(rng):
  student, teacher = make(rng)
  traced = jax.jit(
    jax.value_and_grad(
      lambda s, t, temperature, beta, normalizer: fused(
        s,
        t,
        chunk_size=4,
        temperature=temperature,
        beta=beta,
        normalizer=normalizer,
        divergence="jsd",
      )
    )
  )
  for beta in (0.0, 0.3, 1.0):
    # normalizer = the number of tokens: the static options' mean.
    value, grads = traced(student, teacher, 2.0, beta, 13.0)
    ref, (ref_grads, _) = run(
      materialised, student, teacher, temperature=2.0, divergence="jsd", beta=beta
    )
    np.testing.assert_allclose(value, ref, **F32)
    assert_tree_close(grads, ref_grads, **F32)


def test_multidim_tokens(rng):
  student, teacher = make(rng, tokens=(3, 5))
  where = rng.random((3, 5)) < 0.7
  _, grads = assert_fused_matches(student, teacher, where=where, **OPTIONS)
  assert grads["h"].shape == (3, 5, 8)


def test_teacher_with_other_hidden_size_and_no_bias(rng):
  student, teacher = make(rng, hidden=6, teacher_hidden=11, bias=False)
  assert_fused_matches(student, teacher, divergence="reverse_kl", **OPTIONS)


def test_bias_on_the_teacher_only(rng):
  student, teacher = make(rng)
  assert_fused_matches({**student, "b": None}, teacher, **OPTIONS)


def test_masked_vocabulary_through_bias(rng):
  # A -inf bias entry removes a token from both vocabularies.
  student, teacher = make(rng)
  student["b"][[3, 20]] = -np.inf
  teacher["tb"][[3, 20]] = -np.inf
  _, grads = assert_fused_matches(student, teacher, **OPTIONS)
  np.testing.assert_array_equal(grads["w"][:, [3, 20]], 0.0)


def test_jit_does_not_retrace(rng):
  traces = []

  @jax.jit
  def loss(student, teacher):
    traces.append(1)
    return fused(student, teacher, **OPTIONS)

  for _ in range(3):
    student, teacher = make(rng)
    np.testing.assert_allclose(
      loss(student, teacher), run(fused, student, teacher, **OPTIONS)[0], **F32
    )
  assert len(traces) == 1


def test_zero_tokens(rng):
  student, teacher = make(rng, tokens=(0,))
  value, (grads, _) = run(fused, student, teacher)
  assert float(value) == 0.0
  assert grads["h"].shape == (0, 8)
  np.testing.assert_array_equal(grads["w"], 0.0)


# float64: finite differences.


@pytest.mark.parametrize("divergence", SOME_DIVERGENCES)
def test_float64_and_finite_differences(x64, rng, divergence):
  student, teacher = make(rng, tokens=(5,), hidden=3, teacher_hidden=4, vocab=6)
  student = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), student)
  teacher = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), teacher)
  kw = {"temperature": 1.5, **divergence}
  loss = jax.jit(lambda s: fused(s, teacher, chunk_size=2, **kw))
  value = loss(student)
  assert value.dtype == jnp.float64
  np.testing.assert_allclose(value, numpy_reference(student, teacher, **kw), rtol=1e-12)
  check_grads(loss, (student,), order=1, modes=("rev",))


# bf16.


@pytest.mark.parametrize("divergence", SOME_DIVERGENCES)
def test_bf16_against_float32_reference(rng, divergence):
  student, teacher = make(rng, tokens=(2, 7), vocab=40)
  bf16 = lambda a: None if a is None else jnp.asarray(a, jnp.bfloat16)  # noqa: E731
  student16, teacher16 = jax.tree.map(bf16, student), jax.tree.map(bf16, teacher)
  up = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  kw = {"temperature": 2.0, **divergence}
  value, (grads, teacher_grads) = run(fused, student16, teacher16, chunk_size=4, **kw)
  ref, (ref_grads, _) = run(
    materialised, jax.tree.map(up, student16), jax.tree.map(up, teacher16), **kw
  )
  assert value.dtype == jnp.bfloat16
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves((grads, teacher_grads)))
  np.testing.assert_allclose(np.float32(value), ref, **BF16)
  for key in grads:
    g, r = np.asarray(grads[key], np.float32), np.asarray(ref_grads[key])
    np.testing.assert_allclose(g, r, rtol=BF16["rtol"], atol=BF16["atol"] * np.abs(r).max())


# bf16 with logits_dtype=float32: Liger Kernel's fused-linear JSD bf16 test
# (test/transformers/test_fused_linear_jsd.py: heads and inputs drawn from U[0, 1), the
# student's hidden size half the teacher's), at 8 tokens and 256 classes. The logits are
# sums of 512 and 1024 products near 0.25: about 128 and 256, where bf16's step is 1 and 2.


def _liger_jsd_inputs(rng, n=8, hidden=1024, vocab=256):
  bf16 = lambda *shape: jnp.asarray(rng.random(shape, np.float32), jnp.bfloat16)  # noqa: E731
  return bf16(n, hidden // 2), bf16(hidden // 2, vocab), bf16(n, hidden), bf16(hidden, vocab)


def _float64_jsd(h, w, th, tw):
  """The mean JSD (beta 0.5) of the bf16 inputs' exact logits and its gradients wrt ``h``
  and ``w``, in float64 JAX from TRL's formula (``ref_jsd``): no rounding but the inputs'."""
  with enable_x64():
    f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
    y = f64(th) @ f64(tw)
    loss = lambda h, w: jnp.mean(ref_jsd(h @ w, y, beta=0.5, xp=jnp))  # noqa: E731
    value, grads = jax.value_and_grad(loss, (0, 1))(f64(h), f64(w))
    return np.asarray(value), tuple(np.asarray(g) for g in grads)


def _jsd_fused(logits_dtype):
  loss = lambda h, w, th, tw: fused_distillation_loss(  # noqa: E731
    h, w, th, tw, divergence="jsd", chunk_size=4, logits_dtype=logits_dtype
  )
  return jax.jit(jax.value_and_grad(loss, (0, 1)))


def test_bf16_float32_logits_keep_the_gradient_liger_jsd(rng):
  """bf16 logits (the default) cost the gradient its digits on Liger's JSD test (most
  entries off by over 5% of the float64 value); ``logits_dtype=jnp.float32`` matches float64
  to the gradient's own bf16 rounding (2**-9 relative, plus a small absolute part where
  the entries cancel)."""
  h, w, th, tw = _liger_jsd_inputs(rng)
  want, want_grads = _float64_jsd(h, w, th, tw)
  for logits_dtype in (None, jnp.float32):
    value, grads = _jsd_fused(logits_dtype)(h, w, th, tw)
    assert value.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float64(value), want, rtol=2**-8)
    check_bf16_grads_digits(grads, want_grads, rounded=logits_dtype is None)


def test_docs_logits_dtype_snippet():
  """large-vocabularies.md's ``logits_dtype`` snippet runs and says what it shows: its bf16
  gradient far from float64 (over 10% norm-wise), the float32 option's within 2**-8."""
  ns: dict = {}
  exec(docs_snippet("large-vocabularies.md", "### bf16 inputs: `logits_dtype`"), ns)
  _, (want, _) = _float64_jsd(ns["h"], ns["w"], ns["th"], ns["tw"])
  error = lambda g: np.linalg.norm(np.asarray(g, np.float64) - want) / np.linalg.norm(want)  # noqa: E731
  assert error(ns["grad_bf16"]) > 0.1 and error(ns["grad_f32"]) < 2**-8


def _materialised_f32(h, w, b, th, tw, **kw):
  """``distillation_loss`` of the float32 logits of the bf16 inputs (unrounded)."""
  dot = lambda a, m: jax.lax.dot_general(  # noqa: E731
    a, m, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
  )
  z = dot(h, w) + b.astype(jnp.float32)[None]
  return distillation_loss(z, jax.lax.stop_gradient(dot(th, tw)), **kw)


def _topk_teacher(th, tw, k=5):
  y = np.asarray(th, np.float64) @ np.asarray(tw, np.float64)
  lp = y - y.max(-1, keepdims=True)
  lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
  ids = np.argsort(-lp, axis=-1)[..., :k]
  return ids.astype(np.int32), np.take_along_axis(lp, ids, -1).astype(np.float32)


@pytest.mark.parametrize("teacher", ["dense", "topk"])
def test_bf16_float32_logits_equal_materialised_float32_logits(rng, teacher):
  """``logits_dtype=jnp.float32``: value and gradients (hidden, weight, bias) equal the
  materialised loss on the float32 logits of the same bf16 inputs, with labels (the cross
  entropy too), dense and top-k teachers; to the result's bf16 rounding."""
  h, w, th, tw = _liger_jsd_inputs(rng, n=7, hidden=64, vocab=40)
  b = jnp.asarray(rng.normal(size=40), jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, 40, size=7))
  kw = {"temperature": 2.0, "divergence": "reverse_kl", "alpha": 0.7}
  if teacher == "dense":
    fused_loss = lambda h, w, b: fused_distillation_loss(  # noqa: E731
      h, w, th, tw, labels, bias=b, chunk_size=3, logits_dtype=jnp.float32, **kw
    )
    want_loss = lambda h, w, b: _materialised_f32(h, w, b, th, tw, labels=labels, **kw)  # noqa: E731
  else:
    ids, lp = _topk_teacher(th, tw)
    fused_loss = lambda h, w, b: fused_topk_distillation_loss(  # noqa: E731
      h, w, ids, lp, labels, bias=b, chunk_size=3, logits_dtype="float32", tail="bucket", **kw
    )

    def want_loss(h, w, b):
      z = jax.lax.dot_general(h, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
      z = z + b.astype(jnp.float32)[None]
      soft = divergence_from_topk(z, ids, lp, temperature=2.0, divergence="reverse_kl",
                                  tail="bucket")  # fmt: skip
      hard = -jnp.take_along_axis(jax.nn.log_softmax(z), labels[:, None], -1)[:, 0]
      return jnp.mean(0.7 * 4.0 * soft + 0.3 * hard)

  value, grads = jax.jit(jax.value_and_grad(fused_loss, (0, 1, 2)))(h, w, b)
  want, want_grads = jax.jit(jax.value_and_grad(want_loss, (0, 1, 2)))(h, w, b)
  np.testing.assert_allclose(np.float32(value), want, rtol=2**-8)
  for g, r in zip(grads, want_grads, strict=True):
    assert g.dtype == r.dtype == jnp.bfloat16
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    np.testing.assert_allclose(g, r, rtol=2**-7, atol=1e-3 * np.abs(r).max())


def _chunk_matmuls(dots, chunks) -> tuple[int, set]:
  """``(how many of ``dots`` take a [chunk, V] operand, the dtypes of those operands)``: the
  backward matmuls of a fused loss (the forward ones take [chunk, H] and [H, V])."""
  backward = [e for e in dots if any(v.aval.shape in chunks for v in e.invars)]
  dtypes = {v.aval.dtype for e in backward for v in e.invars if v.aval.shape in chunks}
  return len(backward), dtypes


@pytest.mark.parametrize("low", [jnp.bfloat16, jnp.float16])
def test_low_precision_matmul_dtypes_follow_logits_dtype(rng, low):
  """The jaxpr of value_and_grad (dense teacher), bf16 and f16 inputs: every matmul
  accumulates in float32. By default both heads' chunk logits are rounded to the inputs'
  dtype and the backward matmuls take the logit gradient in it. ``logits_dtype=float32``: no
  matmul result is rounded; the backward matmuls take, for bf16 inputs, the float32 gradient
  as two bf16 terms (twice the matmuls, each operand bf16: no float32 GEMM, no platform
  rounding of a float32 operand), for f16 inputs the float32 gradient itself."""
  h, w, th, tw = (a.astype(low) for a in _liger_jsd_inputs(rng, n=7, hidden=16, vocab=24))
  chunks = {(4, 24), (3, 24)}  # a full chunk and the last one

  def program(logits_dtype):
    def loss(h, w):
      return fused_distillation_loss(h, w, th, tw, chunk_size=4, logits_dtype=logits_dtype)

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(h, w).jaxpr
    dots, _ = matmuls_and_casts(jaxpr, low)
    assert dots and all(e.outvars[0].aval.dtype == jnp.float32 for e in dots)
    return rounded_matmul_outputs(jaxpr, low), *_chunk_matmuls(dots, chunks)

  rounded, backward, dtypes = program(None)
  # both heads' logits, per chunk body (the full chunks' loop and the last chunk)
  assert rounded == 4 and dtypes == {jnp.dtype(low)}
  rounded_f32, backward_f32, dtypes_f32 = program(jnp.float32)
  assert rounded_f32 == 0
  if low == jnp.bfloat16:
    assert backward_f32 == 2 * backward and dtypes_f32 == {jnp.dtype(low)}
  else:
    assert backward_f32 == backward and dtypes_f32 == {jnp.dtype(jnp.float32)}


def test_logits_dtype_leaves_float32_and_float64_inputs_alone(x64, rng):
  """float32 and float64 (x64) inputs: ``logits_dtype=jnp.float32`` traces the same program
  as the default (their logits are not narrowed, nor float64 ones rounded to float32)."""

  def trace(logits_dtype, h, w, th, tw):
    loss = lambda h: fused_distillation_loss(h, w, th, tw, logits_dtype=logits_dtype)  # noqa: E731
    return str(jax.make_jaxpr(jax.grad(loss))(h))

  for dtype in (jnp.float32, jnp.float64):
    args = [a.astype(dtype) for a in _liger_jsd_inputs(rng, n=7, hidden=16, vocab=24)]
    assert trace(jnp.float32, *args) == trace(None, *args)


# Bad input.


def _bad_call(student, teacher, **kw):
  return fused(student, teacher, **kw)


@pytest.mark.parametrize(
  "change, error, match",
  [
    ({"w": np.zeros((9, 37), np.float32)}, ValueError, "disagree on H"),
    ({"w": np.zeros((8, 37, 1), np.float32)}, ValueError, r"\[hidden, vocab\]"),
    ({"b": np.zeros(36, np.float32)}, ValueError, "bias must have shape"),
    ({"th": np.zeros((12, 8), np.float32)}, ValueError, "same tokens"),
    (
      {"tw": np.zeros((8, 36), np.float32)},
      ValueError,
      "target_bias must have shape|bias must have shape",
    ),
    ({"tb": np.zeros((1, 37), np.float32)}, ValueError, "bias must have shape"),
    ({"h": np.zeros((13, 8), np.int32)}, TypeError, "Integral inputs"),
  ],
)
def test_bad_shapes_and_dtypes(rng, change, error, match):
  student, teacher = make(rng)
  student = {**student, **{k: v for k, v in change.items() if k in student}}
  teacher = {**teacher, **{k: v for k, v in change.items() if k in teacher}}
  with pytest.raises(error, match=match):
    _bad_call(student, teacher)


@pytest.mark.parametrize(
  "kw, error, match",
  [
    ({"divergence": "kl"}, ValueError, "divergence"),
    ({"divergence": "jsd", "beta": 1.5}, ValueError, "beta"),
    ({"temperature": 0.0}, ValueError, "temperature"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"chunk_size": 2.5}, ValueError, "chunk_size"),
    ({"chunk_size": True}, ValueError, "chunk_size"),
    ({"where": np.ones(13, np.int32)}, TypeError, "boolean"),
    ({"where": np.ones((13, 37), bool)}, ValueError, "token mask of shape"),
    ({"where": np.ones(12, bool)}, ValueError, "token mask of shape"),
    ({"normalizer": np.ones(2)}, ValueError, "normalizer"),
    ({"normalizer": 0.0}, ValueError, "normalizer"),
    ({"normalizer": -3}, ValueError, "normalizer"),
    ({"logits_dtype": jnp.bfloat16}, ValueError, "logits_dtype must be None"),
    ({"logits_dtype": "f32x"}, ValueError, "logits_dtype must be None"),
    ({"logits_dtype": True}, ValueError, "logits_dtype must be None"),
  ],
)
def test_bad_options(rng, kw, error, match):
  student, teacher = make(rng)
  with pytest.raises(error, match=match):
    _bad_call(student, teacher, **kw)


# Memory: no [N, V] buffer in the fused computation.


def test_no_full_logits_buffer_in_compiled_memory():
  n, h, v = 4096, 64, 16384
  full_logits = n * v * 4
  shapes = {
    "h": jax.ShapeDtypeStruct((n, h), jnp.float32),
    "w": jax.ShapeDtypeStruct((h, v), jnp.float32),
    "b": None,
  }
  teacher = {
    "th": jax.ShapeDtypeStruct((n, h), jnp.float32),
    "tw": jax.ShapeDtypeStruct((h, v), jnp.float32),
    "tb": None,
  }

  def compiled(fn):
    return jax.jit(jax.value_and_grad(fn)).lower(shapes, teacher).compile()

  def largest_array(compiled):
    """Elements of the largest array in the optimized program."""
    dims = re.findall(r"\b(?:f32|f16|bf16|pred|s32)\[([\d,]+)\]", compiled.as_text())
    return max(math.prod(int(d) for d in ds.split(",")) for ds in dims)

  fused_c, materialised_c = compiled(fused), compiled(materialised)
  assert materialised_c.memory_analysis().temp_size_in_bytes > full_logits
  assert largest_array(materialised_c) >= n * v
  # No array of more than one chunk's logits (256 tokens here), and a temp well under one
  # [N, V] array: 0.14x with jaxlib 0.10, 0.38x with jaxlib 0.7 (whose XLA:CPU keeps more
  # chunk-sized buffers live at once).
  assert largest_array(fused_c) <= 256 * v, largest_array(fused_c)
  fused_bytes = fused_c.memory_analysis().temp_size_in_bytes
  assert fused_bytes < 0.5 * full_logits, (fused_bytes, full_logits)
