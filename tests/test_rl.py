"""kl_estimate (Schulman's k1/k2/k3 and verl's kl_penalty modes, against float64,
exact-decimal and torch references), its e^x - 1 - x, distillation_advantages, sequence_sum
and sequence_mean."""

import decimal
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import VERL_KL, docs_snippet, np_verl_kl_penalty
from jax.test_util import check_grads

import kldiv_jax as kd
from kldiv_jax import kl_estimate
from kldiv_jax._numerics import exp_minus_one_minus

decimal.getcontext().prec = 60


def exact_exp_minus_one_minus(x):
  """e^x - 1 - x to 60 digits (Python's decimal), as float64."""
  d = decimal.Decimal(float(x))
  return float(d.exp() - 1 - d)


@functools.partial(jax.jit, static_argnames=("estimator", "clip"))
def estimate_and_grads(logp, ref, where=None, *, estimator="k3", clip=None):
  def f(a, b):
    out = kl_estimate(a, b, estimator=estimator, clip=clip, where=where)
    return jnp.sum(out), out

  (_, out), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(logp, ref)
  return out, *grads


def test_estimators_match_float64_formulas(x64, rng):
  logp = np.log(rng.dirichlet(np.ones(8)))
  ref = np.log(rng.dirichlet(np.ones(8)))
  delta = logp - ref
  expected = {
    "k1": (delta, np.ones(8)),
    "k2": (0.5 * delta**2, delta),
    "k3": (np.exp(-delta) - 1 + delta, 1 - np.exp(-delta)),
  }
  for estimator, (value, d_logp) in expected.items():
    out, g_logp, g_ref = estimate_and_grads(logp, ref, estimator=estimator)
    np.testing.assert_allclose(out, value, rtol=1e-13, atol=1e-16)
    np.testing.assert_allclose(g_logp, d_logp, rtol=1e-13, atol=1e-16)
    np.testing.assert_allclose(g_ref, -d_logp, rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_k3_has_no_cancellation_near_zero(x64, dtype):
  x = np.concatenate([-np.logspace(-12, 1.5, 40), [0.0], np.logspace(-12, 1.5, 40)])
  exact = np.array([exact_exp_minus_one_minus(v) for v in x.astype(dtype)])
  out = jax.jit(exp_minus_one_minus)(x.astype(dtype))
  assert out.dtype == dtype
  rtol = 4 * np.finfo(dtype).eps
  np.testing.assert_allclose(np.asarray(out, np.float64), exact, rtol=rtol, atol=0)
  # The naive expm1(x) - x loses these digits (so the test can fail).
  naive = np.expm1(x.astype(dtype)) - x.astype(dtype)
  assert np.max(np.abs(naive - exact) / np.maximum(exact, 1e-300)) > 1e3 * rtol
  # Derivative e^x - 1, also accurate near 0.
  grad = jax.jit(jax.vmap(jax.grad(exp_minus_one_minus)))(x.astype(dtype))
  np.testing.assert_allclose(
    np.asarray(grad, np.float64),
    np.expm1(x.astype(dtype), dtype=np.float64),
    rtol=rtol,
    atol=np.finfo(dtype).tiny,
  )


def test_infinite_log_ratios():
  out = exp_minus_one_minus(jnp.array([jnp.inf, -jnp.inf, 100.0, -100.0, jnp.nan]))
  assert out[0] == jnp.inf and out[1] == jnp.inf and out[2] == jnp.inf
  np.testing.assert_allclose(out[3], 99.0)
  assert np.isnan(out[4])
  # A sampled token the reference forbids: k3 is +inf, the true penalty.
  assert kl_estimate(jnp.log(0.5), -jnp.inf) == jnp.inf


def test_unbiased_estimators_average_to_the_kl(x64):
  rng = np.random.default_rng(3)
  pi = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
  pi_ref = np.array([0.3, 0.3, 0.2, 0.1, 0.1])
  kl = np.sum(pi * np.log(pi / pi_ref))
  tokens = rng.choice(5, size=200_000, p=pi)
  logp, ref = np.log(pi)[tokens], np.log(pi_ref)[tokens]
  for estimator in ("k1", "k3"):
    samples = np.asarray(estimate_and_grads(logp, ref, estimator=estimator)[0])
    stderr = samples.std() / np.sqrt(samples.size)
    assert abs(samples.mean() - kl) < 4 * stderr, estimator
  k3 = np.asarray(estimate_and_grads(logp, ref, estimator="k3")[0])
  assert np.all(k3 >= 0)


def test_clip_bounds_the_log_ratio(x64):
  logp = np.log(np.array([0.9, 0.5, 0.01, 0.3]))
  ref = np.log(np.array([0.1, 0.5, 0.5, 0.2]))
  delta = logp - ref  # [2.197, 0, -3.91, 0.405]
  for clip, (low, high) in [(1.0, (-1.0, 1.0)), ((-0.5, 2.0), (-0.5, 2.0))]:
    out, g_logp, g_ref = estimate_and_grads(logp, ref, estimator="k3", clip=clip)
    clipped = np.clip(delta, low, high)
    np.testing.assert_allclose(out, np.exp(-clipped) - 1 + clipped, rtol=1e-13, atol=1e-16)
    inside = (delta > low) & (delta < high)
    np.testing.assert_allclose(g_logp, np.where(inside, 1 - np.exp(-delta), 0.0), atol=1e-16)
    np.testing.assert_allclose(g_ref, -g_logp, atol=1e-16)


def test_where_masks_tokens_with_garbage():
  logp = jnp.array([[-0.5, -jnp.inf, -1.0], [-0.2, -0.3, jnp.nan]])
  ref = jnp.array([[-0.7, -0.1, -jnp.inf], [-0.2, -0.9, 0.0]])
  where = jnp.array([[True, False, False], [True, True, False]])
  for estimator in ("k1", "k2", "k3"):
    out, g_logp, g_ref = estimate_and_grads(logp, ref, where, estimator=estimator)
    np.testing.assert_array_equal(out[~where], 0.0)
    np.testing.assert_array_equal(g_logp[~where], 0.0)
    np.testing.assert_array_equal(g_ref[~where], 0.0)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(g_logp))


def test_broadcasting_dtype_and_vmap(rng):
  logp = jnp.asarray(np.log(rng.uniform(0.1, 1, size=(3, 4))), jnp.bfloat16)
  ref = jnp.asarray(np.log(rng.uniform(0.1, 1, size=(4,))), jnp.float32)
  out = jax.jit(kl_estimate)(logp, ref)
  assert out.shape == (3, 4) and out.dtype == jnp.float32
  out16 = jax.jit(kl_estimate)(logp, ref.astype(jnp.bfloat16))
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(jax.vmap(kl_estimate, in_axes=(0, None))(logp, ref), out, rtol=1e-6)


def test_check_grads(x64, rng):
  logp = np.log(rng.uniform(0.1, 1, size=5))
  ref = np.log(rng.uniform(0.1, 1, size=5))
  ref[0] = logp[0] + 1e-3  # the series branch

  def f(a, b):
    return sum(kl_estimate(a, b, estimator=e) for e in ("k1", "k2", "k3"))

  check_grads(jax.jit(f), (logp, ref), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    ({"estimator": "k4"}, ValueError, "estimator must be one of"),
    ({"clip": (1.0, -1.0)}, ValueError, "low <= high"),
    ({"clip": -1.0}, ValueError, "low <= high"),
    ({"clip": (1.0,)}, ValueError, "pair"),
    ({"where": np.ones((3,), np.bool_)}, ValueError, "where has shape"),
  ],
)
def test_bad_input(kwargs, error, match):
  with pytest.raises(error, match=match):
    kl_estimate(jnp.zeros((2, 4)), jnp.zeros((2, 4)), **kwargs)


def test_integer_inputs_raise():
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    kl_estimate(jnp.zeros(3, jnp.int32), jnp.zeros(3))


def test_docs_snippet_runs():
  ns: dict = {}
  exec(docs_snippet("rl.md", "## A KL penalty against a reference policy"), ns)
  # The k3 estimate is close to the exact KL it estimates.
  np.testing.assert_allclose(ns["estimate"], ns["exact"], rtol=0.3)


# ---------------------------------------------------------------- straight-through and
# importance-corrected estimates


@pytest.mark.parametrize("estimator", ["k1+", "k3+", "k2+"])
def test_straight_through_value_of_k_gradient_of_k2(rng, estimator):
  """verl's k1+/k3+: the value of k1/k3 (clipped), the gradient of k2 of the unclipped ratio."""
  logp = np.log(rng.dirichlet(np.ones(10))).astype(np.float32)
  ref = np.log(rng.dirichlet(np.ones(10))).astype(np.float32)
  where = np.arange(10) != 3
  base = estimator.rstrip("+")
  kw = dict(clip=(-1.0, 0.7), where=where)
  assert np.sum(np.abs(logp - ref) > 1.0) >= 3  # tokens beyond the clip
  np.testing.assert_array_equal(
    kl_estimate(logp, ref, estimator=estimator, **kw), kl_estimate(logp, ref, estimator=base, **kw)
  )

  def grads(est, **kw):
    return jax.grad(lambda a, b: kl_estimate(a, b, estimator=est, **kw).sum(), (0, 1))(logp, ref)

  for got, want in zip(grads(estimator, **kw), grads("k2", where=where)):
    np.testing.assert_array_equal(got, want)


# verl's clamp edges: the log-ratio at and beyond +-20, the low_var_kl estimate crossing 10
# (delta about -2.61 and 11.0), 0 (abs), and ordinary values.
VERL_DELTAS = np.array(
  [-30.0, -20.5, -20.0, -19.5, -2.7, -2.6, -1.0, -1e-3, 0.0, 1e-3, 0.5, 3.0, 10.9, 11.1, 20.0, 25.0]
)


@pytest.mark.parametrize("plus", ["", "+"])
@pytest.mark.parametrize("mode", ["kl", "abs", "mse", "low_var_kl"])
def test_verl_modes_match_verl(x64, source, mode, plus):
  """Each verl 0.9 ``kl_penalty`` mode: verl's values and gradients (clamps, abs at 0, ``+``)."""
  rng = np.random.default_rng(4)
  ref = np.concatenate([np.full(VERL_DELTAS.size, -0.5), np.log(rng.dirichlet(np.ones(6)))])
  logp = np.concatenate([VERL_DELTAS - 0.5, np.log(rng.dirichlet(np.ones(6)))])
  value, grad = VERL_KL[source](logp, ref, mode + plus)
  out, g_logp, g_ref = estimate_and_grads(logp, ref, estimator=mode + plus)
  np.testing.assert_allclose(out, value, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(g_logp, grad, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(g_ref, -grad, rtol=1e-12, atol=1e-15)
  if mode == "low_var_kl":  # the clamps bind, so the test can fail
    assert np.sum(value == 10.0) >= 4 and (plus or np.sum(grad == 0.0) >= 4)


@pytest.mark.parametrize(("ours", "verl"), [("k1", "k1"), ("k2", "k2"), ("low_var_kl", "k3")])
def test_verl_aliases(x64, ours, verl):
  """verl's k1/k2 are Schulman's; verl's k3 is its low_var_kl, not Schulman's unclamped k3."""
  logp, ref = VERL_DELTAS, np.zeros_like(VERL_DELTAS)
  for suffix in ("", "+"):
    value, grad = np_verl_kl_penalty(logp, ref, verl + suffix)
    out, g_logp, _ = estimate_and_grads(logp, ref, estimator=ours + suffix)
    np.testing.assert_allclose(out, value, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(g_logp, grad, rtol=1e-12, atol=1e-15)
  k3 = estimate_and_grads(logp, ref, estimator="k3")[0]
  assert np.max(k3) > 1e8  # Schulman's k3, unclamped (as TRL's)


@pytest.mark.parametrize("estimator", ["k1+", "k3+", "low_var_kl+", "abs+"])
def test_plus_forms_take_the_gradient_beyond_the_clip(x64, estimator):
  """With ``clip=``, a ``+`` form's value uses the clipped ratio, its gradient the unclipped."""
  delta = np.array([-3.0, -1.0, -0.4, 0.0, 0.6, 1.0, 2.5])
  clipped = np.clip(delta, -1.0, 1.0)
  out, g_logp, g_ref = estimate_and_grads(delta, np.zeros(7), estimator=estimator, clip=1.0)
  value = np_verl_kl_penalty(clipped, 0.0, estimator.rstrip("+").replace("k3", "low_var_kl"))[0]
  np.testing.assert_allclose(out, value, rtol=1e-13, atol=1e-16)
  np.testing.assert_array_equal(g_logp, delta)
  np.testing.assert_array_equal(g_ref, -delta)


def test_clip_passes_the_gradient_at_its_bounds(x64):
  """``clip`` is torch.clamp: at a bound the gradient passes whole (jnp.clip: half)."""
  delta = np.array([-1.0, 1.0, 1.5])
  _, g_logp, _ = estimate_and_grads(delta, np.zeros(3), estimator="k3", clip=1.0)
  np.testing.assert_allclose(g_logp, [1 - np.e, 1 - np.exp(-1.0), 0.0], rtol=1e-14)


def _trl_bias_corrected_k3(logp, ref, old, xp=np):
  """TRL GRPOTrainer with use_bias_correction_kl: per_token_kl * coef_1 (ported)."""
  per_token_kl = xp.exp(ref - logp) - (ref - logp) - 1
  coef_1 = xp.exp(logp - old)
  return per_token_kl * coef_1


def test_importance_corrected_k3_matches_trl(x64, rng):
  logp = np.log(rng.dirichlet(np.ones(12)))
  ref = np.log(rng.dirichlet(np.ones(12)))
  old = np.log(rng.dirichlet(np.ones(12)))
  got = kl_estimate(logp, ref, old_log_probs=old)
  np.testing.assert_allclose(got, _trl_bias_corrected_k3(logp, ref, old), rtol=1e-12)
  ours = jax.grad(lambda a, b, c: kl_estimate(a, b, old_log_probs=c).sum(), (0, 1, 2))
  ref_grads = jax.grad(lambda a, b, c: _trl_bias_corrected_k3(a, b, c, jnp).sum(), (0, 1, 2))
  for got_g, want_g in zip(ours(logp, ref, old), ref_grads(logp, ref, old)):
    np.testing.assert_allclose(got_g, want_g, rtol=1e-10, atol=1e-14)
  # On-policy (old = the policy's log-probs, as values): the weight is 1.
  np.testing.assert_allclose(kl_estimate(logp, ref, old_log_probs=logp), kl_estimate(logp, ref))


def test_importance_clip_bounds_the_log_ratio_before_exp(rng):
  """Finite inputs never give inf once both log-ratios are clipped; the estimate is the
  formula at the clipped log-ratios, gradient 0 outside the bounds."""
  logp = np.array([0.0, -1e4, -3.0, -2.0], np.float32)
  ref = np.array([-1e4, 0.0, -3.0, -2.5], np.float32)
  old = np.array([-200.0, 0.0, -1e4, -2.0], np.float32)
  assert not np.all(np.isfinite(kl_estimate(logp, ref, old_log_probs=old)))  # unclipped
  out = kl_estimate(logp, ref, clip=20.0, old_log_probs=old, importance_clip=(-20.0, 20.0))
  assert np.all(np.isfinite(out)) and np.all(np.asarray(out) >= 0)
  delta = np.clip(logp - ref, -20, 20).astype(np.float64)
  log_w = np.clip(logp - old, -20, 20).astype(np.float64)
  want = np.exp(log_w) * (np.exp(-delta) - 1 + delta)
  np.testing.assert_allclose(out, want, rtol=1e-5)
  g = jax.grad(
    lambda a: kl_estimate(a, ref, clip=20.0, old_log_probs=old, importance_clip=20.0).sum()
  )(logp)
  assert np.all(np.isfinite(g))


def test_k3_never_negative(rng):
  logp = (5 * rng.normal(size=1000)).astype(np.float32)
  ref = (5 * rng.normal(size=1000)).astype(np.float32)
  old = (5 * rng.normal(size=1000)).astype(np.float32)
  for est in ("k3", "k3+"):
    out = kl_estimate(logp, ref, estimator=est, old_log_probs=old, importance_clip=10.0)
    assert np.all(np.asarray(out) >= 0)


def test_importance_clip_errors():
  with pytest.raises(ValueError, match="importance_clip must bound the log-ratio"):
    kl_estimate(0.0, 0.0, old_log_probs=0.0, importance_clip=(1.0, -1.0))
  with pytest.raises(ValueError, match="estimator must be one of 'k1', 'k2', 'k3', 'kl', 'abs'"):
    kl_estimate(0.0, 0.0, estimator="k4")
  out = jax.jit(lambda c: kl_estimate(0.0, 0.0, old_log_probs=0.0, importance_clip=(c, -c)))(
    jnp.float32(1.0)
  )
  assert np.isnan(out)


# ---------------------------------------------------------------- on-policy distillation


def test_distillation_advantages_match_float64(x64, rng):
  """-(log pi_s - log pi_t), times TRL's truncated importance ratio min(pi_s / pi_sampling, C);
  no gradient; masked tokens 0."""
  student = np.log(rng.dirichlet(np.ones(10)))
  teacher = np.log(rng.dirichlet(np.ones(10)))
  sampling = np.log(rng.dirichlet(np.ones(10)))
  where = np.arange(10) != 2
  got = kd.distillation_advantages(student, teacher, where=where)
  np.testing.assert_allclose(got, np.where(where, teacher - student, 0.0), rtol=1e-13)
  got = kd.distillation_advantages(
    student, teacher, sampling_log_probs=sampling, importance_cap=2.0, where=where
  )
  weight = np.minimum(np.exp(student - sampling), 2.0)
  np.testing.assert_allclose(got, np.where(where, weight * (teacher - student), 0.0), rtol=1e-12)
  grad = jax.grad(
    lambda s: kd.distillation_advantages(s, teacher, sampling_log_probs=sampling).sum()
  )(student)
  assert not np.any(np.asarray(grad))
  huge = kd.distillation_advantages(
    np.float32(0.0), np.float32(-1.0), sampling_log_probs=np.float32(-1e4)
  )
  assert np.isfinite(huge)
  with pytest.raises(ValueError, match="importance_cap must be positive"):
    kd.distillation_advantages(student, teacher, sampling_log_probs=sampling, importance_cap=0.0)


def test_sequence_sum_and_mean(rng):
  x = rng.normal(size=(3, 5)).astype(np.float32)
  x[1, 4] = np.nan  # masked: cannot leak
  where = np.ones((3, 5), bool)
  where[1, 3:] = False
  where[2] = False
  np.testing.assert_allclose(kd.sequence_sum(x, where=where), np.where(where, x, 0).sum(-1))
  want = np.where(where, x, 0).sum(-1) / np.maximum(where.sum(-1), 1)
  np.testing.assert_allclose(kd.sequence_mean(x, where=where), want, rtol=1e-6)
  assert kd.sequence_mean(x, where=where)[2] == 0
  np.testing.assert_allclose(kd.sequence_mean(x[:1]), x[:1].mean(-1), rtol=1e-6)
