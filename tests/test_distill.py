"""distillation_loss: against the textbook Hinton loss, masks, accumulation, errors.

The reference (``_references.py``) is the usual PyTorch distillation code
(``log_softmax`` + ``F.kl_div`` at temperature T, ``F.cross_entropy`` with
``ignore_index``) in float64 NumPy with closed-form gradients, and the same
code run by torch autograd (``[torch]``, live); the JSD is TRL's formula.
"""

import functools

import _references as refs
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import TOLERANCES, docs_snippet, np_distillation
from jax.test_util import check_grads

import kldiv_jax
from kldiv_jax import distillation_loss

B, S, C = 2, 3, 6


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grads(static, s, t, labels, dynamic):
  return jax.value_and_grad(
    lambda s, t: distillation_loss(s, t, labels, **dict(static), **dynamic), argnums=(0, 1)
  )(s, t)


def value_and_grads(s, t, labels, *, dynamic=None, **static):
  """Jitted loss and gradients wrt both logits (one compile per static options/shape)."""
  out, (gs, gt) = _value_and_grads(tuple(sorted(static.items())), s, t, labels, dynamic or {})
  return out, gs, gt


def _data(rng, shape=(B, S, C)):
  s = rng.normal(size=shape) * 2.0
  t = rng.normal(size=shape) * 2.0
  labels = rng.integers(0, shape[-1], size=shape[:-1])
  labels.flat[[1, labels.size - 2]] = -100
  return s, t, labels


def _assert_close(ours, ref, rtol=1e-10):
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-14)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_matches_reference(x64, rng, source, divergence, temperature):
  s, t, labels = _data(rng)
  kwargs = {"alpha": 0.3, "divergence": divergence, "beta": 0.4}
  ours = value_and_grads(s, t, labels, dynamic={"temperature": temperature}, **kwargs)
  ref = refs.DISTILLATION[source](s, t, labels, temperature=temperature, **kwargs)
  _assert_close(ours, ref)


def test_without_temperature_squared(x64, rng, source):
  s, t, labels = _data(rng)
  ours = value_and_grads(s, t, labels, temperature=3.0, scale_by_temperature_squared=False)
  ref = refs.DISTILLATION[source](
    s, t, labels, temperature=3.0, alpha=0.5, divergence="forward_kl", scale=False
  )
  _assert_close(ours, ref)


def test_without_labels_is_the_distillation_term_over_where(x64, rng, source):
  s, t, _ = _data(rng)
  where = rng.uniform(size=(B, S)) > 0.3
  ours = value_and_grads(s, t, None, temperature=2.0, dynamic={"where": where})
  ref = refs.DISTILLATION[source](
    s, t, None, temperature=2.0, alpha=0.5, divergence="forward_kl", valid=where
  )
  _assert_close(ours, ref)


def test_where_and_ignore_index_equal_dropping_tokens(x64, rng):
  s, t, labels = _data(rng)
  where = np.array([[True, True, False], [True, True, True]])
  ours = value_and_grads(s, t, labels, temperature=2.0, dynamic={"where": where})
  keep = where & (labels != -100)
  sub = value_and_grads(s[keep], t[keep], labels[keep], temperature=2.0)
  np.testing.assert_allclose(ours[0], sub[0], rtol=1e-12)
  for g, g_sub in zip(ours[1:], sub[1:]):
    np.testing.assert_allclose(g[keep], g_sub, rtol=1e-12)
    np.testing.assert_array_equal(g[~keep], 0.0)


def test_all_ignored_gives_zero_without_nan(rng):
  s, t, labels = _data(rng)
  out, gs, gt = value_and_grads(s, t, np.full_like(labels, -100))
  assert out == 0.0
  np.testing.assert_array_equal(gs, 0.0)
  np.testing.assert_array_equal(gt, 0.0)


@jax.jit
def _accumulated(s, t, labels, normalizer):
  def loss(s, t, labels):
    return distillation_loss(s, t, labels, temperature=2.0, alpha=0.7, normalizer=normalizer)

  full = jax.grad(lambda s: distillation_loss(s, t, labels, temperature=2.0, alpha=0.7))(s)
  parts = [jax.grad(loss)(s[i : i + 1], t[i : i + 1], labels[i : i + 1]) for i in range(2)]
  values = [loss(s[i : i + 1], t[i : i + 1], labels[i : i + 1]) for i in range(2)]
  whole = distillation_loss(s, t, labels, temperature=2.0, alpha=0.7)
  return full, jnp.concatenate(parts), whole, values[0] + values[1]


def test_normalizer_makes_accumulation_match_one_batch(x64, rng):
  s, t, labels = _data(rng)
  labels[0] = -100  # micro-batches with different token counts: 0 and 2 valid
  labels[1, 0] = 2
  normalizer = np.sum(labels != -100)
  full, accumulated, whole, summed = _accumulated(s, t, labels, normalizer)
  np.testing.assert_allclose(accumulated, full, rtol=1e-12, atol=1e-16)
  np.testing.assert_allclose(summed, whole, rtol=1e-12)


@jax.jit
def _alphas(s, t, labels, alpha):
  def loss(**kw):
    return distillation_loss(s, t, labels, temperature=2.0, **kw)

  return loss(alpha=1.0), loss(alpha=0.0), loss(alpha=alpha), loss(alpha=0.25)


def test_alpha_endpoints_and_traced_alpha(x64, rng, source):
  s, t, labels = _data(rng)
  only_kd, only_ce, traced, static = _alphas(s, t, labels, 0.25)
  kd, ce = (
    refs.DISTILLATION[source](s, t, labels, temperature=2.0, alpha=a, divergence="forward_kl")[0]
    for a in (1.0, 0.0)
  )
  np.testing.assert_allclose(only_kd, kd, rtol=1e-12)
  np.testing.assert_allclose(only_ce, ce, rtol=1e-12)
  np.testing.assert_allclose(traced, static, rtol=1e-14)
  np.testing.assert_allclose(static, 0.25 * kd + 0.75 * ce, rtol=1e-12)


def test_traced_schedules_do_not_retrace(rng):
  s, t, labels = _data(rng)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(s, t, labels, temperature, alpha, beta, normalizer):
    return jax.value_and_grad(distillation_loss)(
      s,
      t,
      labels,
      temperature=temperature,
      alpha=alpha,
      divergence="jsd",
      beta=beta,
      normalizer=normalizer,
    )

  first = step(s, t, labels, 1.0, 0.5, 0.5, 4.0)
  second = step(s, t, labels, 3.0, 0.2, 0.9, 4.0)  # new values: no retrace
  assert first[0] != second[0]
  ref = np_distillation(s, t, labels, temperature=3.0, alpha=0.2, divergence="jsd", beta=0.9)
  assert np.sum(labels != -100) == 4  # the normalizer passed: the mean over valid tokens
  np.testing.assert_allclose(second[0], ref[0], rtol=2e-5)


def test_invalid_labels_and_masked_classes(rng):
  s, t, labels = _data(rng)
  bad = labels.copy()
  bad[0, 0] = C  # out of range: NaN under jit, not a silent wrong value; known, raised
  assert np.isnan(value_and_grads(s, t, bad)[0])
  with pytest.raises(ValueError, match="labels must be class indices in"):
    distillation_loss(s, t, bad)
  masked = s.copy()
  masked[0, 0, labels[0, 0]] = -np.inf  # the label has no mass: +inf
  assert value_and_grads(masked, t, labels)[0] == np.inf


def test_vocabulary_mask_equals_dropping_classes(x64, rng):
  s, t, labels = _data(rng)
  keep = np.array([True, True, False, True, True, False])
  labels = np.where(labels == 2, 0, np.where(labels == 5, 1, labels))
  ours = value_and_grads(s, t, labels, temperature=2.0, dynamic={"where": keep})
  remap = np.cumsum(keep) - 1
  sub = value_and_grads(
    s[..., keep],
    t[..., keep],
    np.where(labels >= 0, remap[np.maximum(labels, 0)], labels),
    temperature=2.0,
  )
  np.testing.assert_allclose(ours[0], sub[0], rtol=1e-12)
  for g, g_sub in zip(ours[1:], sub[1:]):
    np.testing.assert_allclose(g[..., keep], g_sub, rtol=1e-12)
    np.testing.assert_array_equal(g[..., ~keep], 0.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_gradient_error(rng, dtype):
  s, t, labels = _data(rng, shape=(2, 4, 32))
  s16, t16 = jnp.asarray(s, dtype), jnp.asarray(t, dtype)
  out, gs, gt = value_and_grads(s16, t16, labels, temperature=2.0, divergence="jsd")
  assert out.dtype == dtype and gs.dtype == dtype and gt.dtype == dtype
  ref = np_distillation(
    np.asarray(s16, np.float64),
    np.asarray(t16, np.float64),
    labels,
    temperature=2.0,
    alpha=0.5,
    divergence="jsd",
  )
  rtol, _ = TOLERANCES[jnp.dtype(dtype).name]
  np.testing.assert_allclose(np.float64(out), ref[0], rtol=rtol)
  for g, r in zip((gs, gt), ref[1:]):
    np.testing.assert_allclose(
      np.asarray(g, np.float64), r, rtol=rtol, atol=rtol * np.max(np.abs(r))
    )


def test_check_grads_and_vmap(x64, rng):
  s, t, labels = _data(rng, shape=(2, 2, 4))

  def loss(s, t):
    return distillation_loss(s, t, labels, temperature=1.5, alpha=0.4, divergence="reverse_kl")

  check_grads(jax.jit(loss), (s, t), order=2, modes=("fwd", "rev"))
  per_sequence = jax.jit(
    jax.vmap(
      lambda s, t, y: distillation_loss(
        s, t, y, temperature=1.5, alpha=0.4, divergence="reverse_kl"
      )
    )
  )(s, t, labels)
  for i in range(2):
    ref = np_distillation(
      s[i], t[i], labels[i], temperature=1.5, alpha=0.4, divergence="reverse_kl"
    )[0]
    np.testing.assert_allclose(per_sequence[i], ref, rtol=1e-12)


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    ({"divergence": "kl"}, ValueError, "divergence must be one of"),
    ({"alpha": 1.5}, ValueError, r"alpha must be a number in \[0, 1\]"),
    ({"beta": -0.5}, ValueError, r"beta must be a number in \[0, 1\]"),
    ({"temperature": 0}, ValueError, "temperature must be positive"),
    ({"normalizer": 0}, ValueError, "normalizer must be a positive"),
    ({"labels": np.zeros((2, 3), np.float32)}, TypeError, "integer array"),
    ({"labels": np.zeros((3, 2), np.int32)}, ValueError, "labels must have"),
    ({"where": np.ones((2, 4), np.bool_)}, ValueError, "where has shape"),
  ],
)
def test_bad_input(kwargs, error, match):
  labels = kwargs.pop("labels", np.zeros((2, 3), np.int32))
  with pytest.raises(error, match=match):
    distillation_loss(jnp.zeros((2, 3, 5)), jnp.zeros((2, 3, 5)), labels, **kwargs)


def test_bad_shapes_and_dtypes():
  with pytest.raises(ValueError, match="same number of classes"):
    distillation_loss(jnp.zeros((2, 5)), jnp.zeros((2, 1)))  # (vocabularies may differ in size)
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    distillation_loss(jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 5)))


def test_docs_snippet_runs():
  ns: dict = {}
  exec(docs_snippet("distillation.md", "## Distillation from logits"), ns)
  assert np.isfinite(ns["hinton"]) and ns["grad"].shape == (4, 16, 1000)
  assert ns["per_token"].shape == (4, 16) and 0 < ns["gkd"] < np.log(2)


# ---------------------------------------------------------------- porting recipes (docs)


def _run_docs_recipe(page, heading):
  ns = {"jax": jax, "jnp": jnp, "kldiv_jax": kldiv_jax}
  exec(docs_snippet(page, heading), ns)
  return ns


def test_torch_batchmean_recipe(x64, source):
  """migration.md: ``normalizer=B`` is torch's ``batchmean`` on ``[B, S, V]`` (times T**2)."""
  ns = _run_docs_recipe("migration.md", "### torch's `batchmean` and `distillation_loss`")
  s, t, temperature = np.asarray(ns["s"]), np.asarray(ns["t"]), ns["T"]
  want = refs.TORCH_BATCHMEAN[source](s, t, temperature)
  np.testing.assert_allclose(ns["fused"], want, rtol=1e-12)
  np.testing.assert_allclose(ns["per_token"] * s.shape[1], want, rtol=1e-12)
  assert not np.isclose(ns["per_token"], want, rtol=0.5)  # the trap: S times smaller


def test_trl_generalized_jsd_loss_recipes(x64, source):
  """distillation.md: each TRL reduction's equivalent; the default's T**2 is the trap."""
  ns = _run_docs_recipe("distillation.md", "### TRL's `generalized_jsd_loss`")
  s, t, y = np.asarray(ns["s"]), np.asarray(ns["t"]), np.asarray(ns["y"])
  assert ns["T"] != 1 and np.any(y == -100)
  trl = functools.partial(refs.TRL_JSD_LOSS[source], s, t, beta=ns["beta"], temperature=ns["T"])
  want = {
    "batchmean": trl(y),
    "batchmean, no labels": trl(None),
    "sum": trl(y, reduction="sum"),
    "mean": trl(y, reduction="mean"),
    "none": trl(y, reduction="none").sum(-1),
  }
  assert set(ns["trl"]) == set(want)
  for reduction, value in want.items():
    np.testing.assert_allclose(ns["trl"][reduction], value, rtol=1e-12, err_msg=reduction)
  gkd = dict(divergence="jsd", beta=ns["beta"], temperature=ns["T"])
  accumulated = distillation_loss(
    s, t, y, alpha=1.0, normalizer=7.0, scale_by_temperature_squared=False, **gkd
  )
  np.testing.assert_allclose(accumulated, trl(y, num_items_in_batch=7.0), rtol=1e-12)
  default = distillation_loss(s, t, y, alpha=1.0, **gkd)
  np.testing.assert_allclose(default, ns["T"] ** 2 * want["batchmean"], rtol=1e-12)


def _hf_shift(labels, ignore_index=-100):
  """Hugging Face's ForCausalLMLoss shift (transformers/loss/loss_utils.py) in NumPy:
  ``nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]``."""
  pad = [(0, 0)] * (labels.ndim - 1) + [(0, 1)]
  return np.pad(labels, pad, constant_values=ignore_index)[..., 1:]


def test_shift_labels_is_hugging_faces_shift(rng):
  """``shift_labels`` equals HF's pad-then-slice (any batch rank, under jit, another
  ``ignore_index``); with it, ``distillation_loss`` on a causal LM's logits equals the cross
  entropy of logits[:, :-1] against labels[:, 1:] (HF's loss)."""
  labels = rng.integers(0, 7, size=(2, 3, 5)).astype(np.int32)
  labels[0, 1, 2:] = -100
  np.testing.assert_array_equal(kldiv_jax.shift_labels(labels), _hf_shift(labels))
  got = jax.jit(functools.partial(kldiv_jax.shift_labels, ignore_index=-1))(labels[0])
  np.testing.assert_array_equal(got, _hf_shift(labels[0], -1))
  assert kldiv_jax.shift_labels(np.zeros((2, 0), np.int32)).shape == (2, 0)
  z = rng.normal(size=(3, 5, 7)).astype(np.float32)
  loss = distillation_loss(z, z, kldiv_jax.shift_labels(labels[0]), alpha=0.0)
  log_q = z[:, :-1] - np.log(np.exp(z[:, :-1]).sum(-1, keepdims=True))
  y = labels[0][:, 1:]
  valid = y != -100
  picked = np.take_along_axis(log_q, np.where(valid, y, 0)[..., None], -1)[..., 0]
  np.testing.assert_allclose(loss, -(picked * valid).sum() / valid.sum(), rtol=1e-5)
  with pytest.raises(TypeError, match="shift_labels: labels must be an integer array"):
    kldiv_jax.shift_labels(np.zeros(3))
  with pytest.raises(ValueError, match="shift_labels: labels must have a sequence axis"):
    kldiv_jax.shift_labels(np.int32(3))
  with pytest.raises(ValueError, match="ignore_index=-100 does not fit the labels' dtype uint8"):
    kldiv_jax.shift_labels(np.zeros(3, np.uint8))
