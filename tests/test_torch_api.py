"""kl_div / KLDivLoss: torch's semantics, checked without torch.

Live parity against torch lives in ``test_torch_parity.py``; here every
expected value comes from float64 NumPy, closed forms, or the numbers recorded
in ``../shared/reference/torch-kl-div.md``.
"""

import dataclasses
import functools
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import np_pointwise
from jax.test_util import check_grads

from kldiv_jax import KLDivLoss, kl_div

REDUCTIONS = ("none", "sum", "mean", "batchmean")
MEAN_WARNING = (
  r"reduction: 'mean' divides the total loss by both the batch size and the support size"
)
# pytest's filterwarnings spec splits on ':', so match the message's start only.
ignore_mean_warning = pytest.mark.filterwarnings("ignore:reduction")


def np_kl_div(x, t, reduction, log_target=False):
  """torch's reductions in float64 NumPy (the table in the reference doc)."""
  terms = np_pointwise(x, t, log_target)
  if reduction == "none":
    return terms
  if reduction == "sum":
    return terms.sum()
  if reduction == "mean":
    return terms.mean() if terms.size else np.nan
  total = terms.sum()
  n = np.shape(x)[0] if np.ndim(x) else 1
  with np.errstate(all="ignore"):
    return total / n


def scale(reduction, x_shape, out_shape):
  """The ``s`` of the reference's closed-form gradients."""
  if reduction == "mean":
    return 1.0 / int(np.prod(out_shape))
  if reduction == "batchmean" and len(x_shape):
    return 1.0 / x_shape[0]
  return 1.0


def call(x, t, reduction, log_target=False):
  """kl_div without the 'mean' UserWarning (tested on its own below)."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=MEAN_WARNING)
    return kl_div(x, t, reduction=reduction, log_target=log_target)


def sample(rng, shape, log_target=False, dtype=np.float64):
  """Log-probabilities and targets of ``shape``, normalised over the last axis."""
  x = np.log(rng.dirichlet(np.ones(shape[-1]), size=shape[:-1])) if shape else np.log(0.3)
  t = rng.dirichlet(np.ones(shape[-1]), size=shape[:-1]) if shape else 0.6
  if log_target:
    t = np.log(t)
  return np.asarray(x, dtype), np.asarray(t, dtype)


# ---------------------------------------------------------------------------
# Reductions.


@functools.partial(jax.jit, static_argnames="log_target")
def all_reductions(x, t, log_target=False):
  """kl_div under every reduction, one compile per shape (faster than eager)."""
  return {r: call(x, t, r, log_target) for r in REDUCTIONS}


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("shape", [(), (7,), (2, 5), (2, 3, 4)])
def test_reductions_match_numpy(log_target, shape, rng, x64):
  x, t = sample(rng, shape, log_target)
  outs = all_reductions(jnp.asarray(x), jnp.asarray(t), log_target)
  for reduction, out in outs.items():
    expected = np_kl_div(x, t, reduction, log_target)
    assert out.shape == np.shape(expected)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-15, err_msg=reduction)


@pytest.mark.parametrize("log_target", [False, True])
def test_batchmean_is_sum_over_batch(log_target, rng, x64):
  # torch's test_KLDivLoss_batch_mean(_log_target): shape (2, 5).
  x, t = sample(rng, (2, 5), log_target)
  bm = kl_div(jnp.asarray(x), jnp.asarray(t), reduction="batchmean", log_target=log_target)
  total = kl_div(jnp.asarray(x), jnp.asarray(t), reduction="sum", log_target=log_target)
  np.testing.assert_allclose(bm, total / 2, rtol=1e-14)
  np.testing.assert_allclose(bm, np_pointwise(x, t, log_target).sum() / 2, rtol=1e-12)


@pytest.mark.parametrize(
  ("x_shape", "t_shape", "divisor"),
  [
    ((1, 5), (4, 5), 1),  # the input's leading dim, not the broadcast one
    ((5,), (3, 5), 5),
    ((), (3,), 1),  # no division for a 0-d input
    ((4, 1), (1, 6), 4),
  ],
)
def test_batchmean_divides_by_input_leading_dim(x_shape, t_shape, divisor, rng, x64):
  x = -rng.uniform(0.1, 3.0, size=x_shape)
  t = rng.uniform(0.05, 1.0, size=t_shape)
  out = kl_div(jnp.asarray(x), jnp.asarray(t), reduction="batchmean")
  np.testing.assert_allclose(out, np_pointwise(x, t).sum() / divisor, rtol=1e-12)


@pytest.mark.parametrize(
  ("x_shape", "t_shape"),
  [((3, 1), (1, 4)), ((4,), (2, 3, 4)), ((2, 1, 3), (5, 1)), ((), (2, 2))],
)
def test_broadcasting_reductions(x_shape, t_shape, rng, x64):
  x = -rng.uniform(0.1, 3.0, size=x_shape)
  t = rng.uniform(0.05, 1.0, size=t_shape)
  for reduction, out in all_reductions(jnp.asarray(x), jnp.asarray(t)).items():
    expected = np_kl_div(x, t, reduction)
    assert out.shape == np.shape(expected)
    np.testing.assert_allclose(out, expected, rtol=1e-12, err_msg=reduction)


@ignore_mean_warning
@pytest.mark.parametrize("dx", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64])
def test_torch_own_mean_value_every_dtype_pair(dx, dt, x64):
  # torch's test: input [[2,3,5],[3,2,1]], target [[1,2,3],[4,5,6]], 'mean'.
  x = jnp.asarray([[2, 3, 5], [3, 2, 1]], dx)
  t = jnp.asarray([[1, 2, 3], [4, 5, 6]], dt)
  out = kl_div(x, t)
  assert out.dtype == jnp.result_type(dx, dt)
  np.testing.assert_allclose(np.float64(out), -3.6624908251428976, atol=1e-3, rtol=0)


def test_identical_log_softmax_gives_zeros(rng):
  # torch's test_kl_div_log_softmax_target.
  z = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
  a = jax.nn.log_softmax(z)
  out = kl_div(a, a, reduction="none", log_target=True)
  np.testing.assert_allclose(out, np.zeros((3, 5)), atol=0)


@pytest.mark.parametrize("log_target", [False, True])
def test_zero_targets_and_minus_inf_inputs_reduce_finitely(log_target, x64):
  x = np.array([[-np.inf, np.log(0.5), np.log(0.5)], [np.log(0.2), np.log(0.8), -np.inf]])
  t = np.array([[0.0, 0.25, 0.75], [1.0, 0.0, 0.0]])
  with np.errstate(divide="ignore"):
    t_in = np.log(t) if log_target else t
  for reduction in ("sum", "batchmean"):
    out = kl_div(jnp.asarray(x), jnp.asarray(t_in), reduction=reduction, log_target=log_target)
    expected = 0.25 * np.log(0.5) + 0.75 * np.log(1.5) + np.log(5.0)
    expected = expected / 2 if reduction == "batchmean" else expected
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    g = jax.grad(kl_div, argnums=(0, 1))(
      jnp.asarray(x), jnp.asarray(t_in), reduction=reduction, log_target=log_target
    )
    assert all(np.all(np.isfinite(gi)) for gi in g)


@ignore_mean_warning
@pytest.mark.parametrize(
  ("shape", "expected"),
  [
    ((0,), {"none": (0,), "mean": np.nan, "sum": 0.0, "batchmean": np.nan}),
    ((0, 5), {"none": (0, 5), "mean": np.nan, "sum": 0.0, "batchmean": np.nan}),
    ((5, 0), {"none": (5, 0), "mean": np.nan, "sum": 0.0, "batchmean": 0.0}),
  ],
)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_arrays(shape, expected, reduction):
  out = kl_div(jnp.zeros(shape), jnp.zeros(shape), reduction=reduction)
  want = expected[reduction]
  if reduction == "none":
    assert out.shape == want
  else:
    assert out.shape == ()
    np.testing.assert_array_equal(out, want)


# ---------------------------------------------------------------------------
# Warnings and the legacy arguments.


def test_mean_warns_with_torch_message():
  with pytest.warns(UserWarning, match=MEAN_WARNING) as record:
    kl_div(jnp.zeros((2, 3)), jnp.full((2, 3), 0.5))
  assert len(record) == 1
  assert "'mean' will be changed to behave the same as 'batchmean'" in str(record[0].message)


@pytest.mark.parametrize("reduction", ["none", "sum", "batchmean"])
def test_other_reductions_do_not_warn(reduction):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    kl_div(jnp.zeros((2, 3)), jnp.full((2, 3), 0.5), reduction=reduction)


def test_mean_warns_once_under_jit_at_trace_time():
  f = jax.jit(kl_div)
  with pytest.warns(UserWarning, match=MEAN_WARNING):
    f(jnp.zeros((2, 3)), jnp.full((2, 3), 0.5))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    f(jnp.ones((2, 3)), jnp.full((2, 3), 0.25))  # cached: no trace, no warning


@pytest.mark.parametrize(
  ("args", "kwargs", "error"),
  [
    ((jnp.zeros((2, 3)), None), {}, TypeError),
    (("abc", jnp.zeros((2, 3))), {}, TypeError),
    ((jnp.zeros((2, 3)), jnp.zeros((4, 3))), {}, ValueError),
    ((jnp.zeros((2, 3)), None), {"size_average": False}, TypeError),
    ((jnp.zeros((2, 3)), jnp.zeros((4, 3))), {"reduce": False}, ValueError),
  ],
)
def test_argument_errors_come_before_any_warning(args, kwargs, error):
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    with pytest.raises(error, match="kl_div"):
      kl_div(*args, **kwargs)
    with pytest.raises(error, match="kl_div"):
      KLDivLoss()(*args)  # 'mean' by default
  assert not record, [str(w.message) for w in record]


@pytest.mark.parametrize("reduction", ["none", "sum", "batchmean", "mean"])
def test_nested_lists_give_no_jax_deprecation_warning(reduction):
  x = np.log(np.array([[0.2, 0.8], [0.5, 0.5]]))
  t = np.array([[0.3, 0.7], [0.9, 0.1]])
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    out = kl_div(x.tolist(), t.tolist(), reduction=reduction)
    module = KLDivLoss(reduction=reduction)(x.tolist(), t.tolist())
  messages = [str(w.message) for w in record]
  assert messages == [messages[0]] * 2 if reduction == "mean" else not messages, messages
  if reduction == "mean":
    assert re.match(MEAN_WARNING, messages[0])
  np.testing.assert_allclose(out, np_kl_div(x, t, reduction), rtol=1e-6)
  np.testing.assert_allclose(module, out)


# (size_average, reduce) -> the reduction torch's legacy_get_string gives.
LEGACY = [
  ((True, None), "mean"),
  ((False, None), "sum"),
  ((None, True), "mean"),
  ((None, False), "none"),
  ((True, True), "mean"),
  ((False, True), "sum"),
  ((True, False), "none"),
  ((False, False), "none"),
]


@pytest.mark.parametrize(("legacy", "mode"), LEGACY)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_legacy_args_override_reduction(legacy, mode, reduction, rng, x64):
  size_average, reduce = legacy
  x, t = sample(rng, (3, 4))
  msg = f"size_average and reduce args will be deprecated, please use reduction='{mode}' instead."
  with pytest.warns(UserWarning, match=re.escape(msg)):
    out = kl_div(jnp.asarray(x), jnp.asarray(t), size_average, reduce, reduction)
  expected = np_kl_div(x, t, mode)
  if reduction == "batchmean":  # torch still divides afterwards
    expected = expected / 3
  np.testing.assert_allclose(out, expected, rtol=1e-12)


@pytest.mark.parametrize(("legacy", "mode"), LEGACY)
def test_module_converts_legacy_args_at_construction(legacy, mode, rng, x64):
  size_average, reduce = legacy
  with pytest.warns(UserWarning, match="size_average and reduce args will be deprecated"):
    loss = KLDivLoss(size_average, reduce, "batchmean")
  # The batchmean is dropped, as torch's module does.
  assert loss.reduction == mode
  assert loss.size_average is None and loss.reduce is None
  x, t = sample(rng, (3, 4))
  out = call(jnp.asarray(x), jnp.asarray(t), loss.reduction) if mode == "mean" else loss(x, t)
  np.testing.assert_allclose(out, np_kl_div(x, t, mode), rtol=1e-12)


# ---------------------------------------------------------------------------
# KLDivLoss.


@pytest.mark.parametrize("reduction", ["none", "sum", "batchmean"])
@pytest.mark.parametrize("log_target", [False, True])
def test_module_equals_functional(reduction, log_target, rng, x64):
  x, t = sample(rng, (3, 4), log_target)
  loss = KLDivLoss(reduction=reduction, log_target=log_target)
  expected = np_kl_div(x, t, reduction, log_target)
  np.testing.assert_allclose(loss(jnp.asarray(x), jnp.asarray(t)), expected, rtol=1e-12)
  np.testing.assert_allclose(loss.forward(jnp.asarray(x), jnp.asarray(t)), expected, rtol=1e-12)


def test_module_default_is_mean_and_warns(rng):
  loss = KLDivLoss()
  assert (loss.reduction, loss.log_target) == ("mean", False)
  x, t = sample(rng, (2, 3), dtype=np.float32)
  with pytest.warns(UserWarning, match=MEAN_WARNING):
    out = loss(x, t)
  np.testing.assert_allclose(out, np_pointwise(x, t).mean(), rtol=1e-6)


def test_module_is_frozen_and_hashable():
  a = KLDivLoss(reduction="sum")
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.reduction = "none"  # type: ignore[misc]
  assert a == KLDivLoss(reduction="sum")
  assert hash(a) == hash(KLDivLoss(reduction="sum"))
  assert KLDivLoss(log_target=np.bool_(True)) == KLDivLoss(log_target=True)
  assert hash(KLDivLoss(log_target=np.bool_(True))) == hash(KLDivLoss(log_target=True))
  assert a != KLDivLoss(reduction="none")
  assert a != KLDivLoss(reduction="sum", log_target=True)
  with pytest.warns(UserWarning, match="deprecated"):
    legacy = KLDivLoss(size_average=False)
  assert legacy == a and hash(legacy) == hash(a)
  assert len({a, KLDivLoss(reduction="sum"), legacy, KLDivLoss(reduction="none")}) == 2


def test_module_as_static_argument_traces_once_per_options(rng):
  traces = []

  @functools.partial(jax.jit, static_argnums=0)
  def step(loss, x, t):
    traces.append(loss)
    return jax.value_and_grad(loss)(x, t)

  x, t = sample(rng, (4, 3), dtype=np.float32)
  for _ in range(3):
    step(KLDivLoss(reduction="batchmean"), x + rng.normal(size=x.shape).astype(np.float32), t)
  assert len(traces) == 1
  step(KLDivLoss(reduction="batchmean", log_target=True), x, np.log(t))
  assert len(traces) == 2
  value, grad = step(KLDivLoss(reduction="batchmean"), x, t)
  np.testing.assert_allclose(value, np_pointwise(x, t).sum() / 4, rtol=2e-6)
  np.testing.assert_allclose(grad, -t / 4, rtol=2e-6)
  assert len(traces) == 2


@pytest.mark.parametrize("reduction", ["none", "sum", "batchmean"])
def test_jitted_kl_div_does_not_retrace(reduction, rng):
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x, t):
    return kl_div(x, t, reduction=reduction)

  try:
    for _ in range(4):
      x, t = sample(rng, (3, 5), dtype=np.float32)
      np.testing.assert_allclose(f(x, t), np_kl_div(x, t, reduction), rtol=2e-6, atol=1e-7)
  finally:
    chex.clear_trace_counter()


def test_closed_over_module_does_not_retrace(rng):
  loss = KLDivLoss(reduction="batchmean")

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x, t):
    return jax.grad(loss)(x, t)

  try:
    for _ in range(3):
      x, t = sample(rng, (3, 5), dtype=np.float32)
      np.testing.assert_allclose(f(x, t), -t / 3, rtol=2e-6)
  finally:
    chex.clear_trace_counter()


# ---------------------------------------------------------------------------
# Derivatives.


@ignore_mean_warning
def test_check_grads_order_2(rng, x64):
  x = jnp.asarray(rng.uniform(-3.0, 0.0, size=(2, 3)))
  t = jnp.asarray(rng.uniform(0.1, 1.0, size=(2, 3)))
  log_t = jnp.asarray(rng.uniform(-3.0, 0.0, size=(2, 3)))

  # Every reduction and both target spaces at once (check_grads takes tuple
  # outputs): check_grads compiles ~17 programs per call, so one call.
  @jax.jit
  def f(a, b, c):
    return tuple(
      kl_div(a, target, reduction=r, log_target=lt)
      for r in REDUCTIONS
      for target, lt in ((b, False), (c, True))
    )

  check_grads(f, (x, t, log_t), order=2, modes=("fwd", "rev"))


@ignore_mean_warning
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize(("x_shape", "t_shape"), [((3, 4), (3, 4)), ((1, 4), (3, 4)), ((), ())])
def test_closed_form_gradients(log_target, x_shape, t_shape, rng, x64):
  x = rng.uniform(-3.0, 0.0, size=x_shape)
  t = rng.uniform(0.1, 1.0, size=t_shape)
  if log_target:
    t = np.log(t)

  @jax.jit
  def derivatives(a, b):
    out = {}
    for r in REDUCTIONS:

      def f(a, b, r=r):
        return jnp.sum(kl_div(a, b, reduction=r, log_target=log_target))

      out[r] = jax.grad(f, argnums=(0, 1))(a, b), jax.hessian(f, argnums=1)(a, b)
    return out

  xb, tb = np.broadcast_arrays(x, t)
  n = int(np.prod(t_shape))
  for reduction, ((gx, gt), h_tt) in derivatives(jnp.asarray(x), jnp.asarray(t)).items():
    s = scale(reduction, x_shape, np.broadcast_shapes(x_shape, t_shape))
    if log_target:
      p = np.exp(tb)
      d_x, d_t, d_tt = -p * s, p * (tb - xb + 1) * s, p * (tb - xb + 2) * s
    else:
      d_x, d_t, d_tt = -tb * s, (np.log(tb) + 1 - xb) * s, s / tb
    # The input's gradient sums over the axes it was broadcast along.
    d_x = d_x.sum(axis=0, keepdims=True) if x_shape != t_shape else d_x
    np.testing.assert_allclose(gx, d_x, rtol=1e-12, err_msg=reduction)
    np.testing.assert_allclose(gt, d_t, rtol=1e-12, err_msg=reduction)
    np.testing.assert_allclose(
      np.reshape(h_tt, (n, n)), np.diag(d_tt.ravel()), rtol=1e-12, err_msg=reduction
    )


@pytest.mark.parametrize("log_target", [False, True])
def test_mixed_second_derivative(log_target, rng, x64):
  # d²/dtdx = -s (log_target: -e^t s), with s = 1/shape[0] for batchmean.
  x = jnp.asarray(rng.uniform(-3.0, 0.0, size=(2, 3)))
  t = jnp.asarray(rng.uniform(0.1, 1.0, size=(2, 3)))
  if log_target:
    t = jnp.log(t)
  loss = KLDivLoss(reduction="batchmean", log_target=log_target)
  h = jax.jit(jax.jacfwd(jax.grad(loss, argnums=0), argnums=1))(x, t).reshape(6, 6)
  d = (-np.exp(t) if log_target else -np.ones((2, 3))) / 2
  np.testing.assert_allclose(h, np.diag(np.ravel(d)), rtol=1e-12)


def test_vmap_equals_batched_call(rng):
  x, t = sample(rng, (4, 2, 5), dtype=np.float32)

  def per_example(a, b):
    return kl_div(a, b, reduction="sum")

  out = jax.vmap(per_example)(x, t)
  np.testing.assert_allclose(out, np_pointwise(x, t).sum(axis=(1, 2)), rtol=2e-6)
  loss = KLDivLoss(reduction="none")
  np.testing.assert_allclose(jax.vmap(loss)(x, t), loss(x, t), rtol=1e-6)
  # batchmean inside vmap divides by the per-example leading dim (2), as torch would.
  bm = jax.vmap(KLDivLoss(reduction="batchmean"))(x, t)
  np.testing.assert_allclose(bm, np_pointwise(x, t).sum(axis=(1, 2)) / 2, rtol=2e-6)


def test_jvp_matches_closed_form(rng, x64):
  x, t = sample(rng, (2, 3))
  dx, dt = rng.normal(size=(2, 3)), rng.normal(size=(2, 3))
  f = functools.partial(kl_div, reduction="batchmean")
  value, tangent = jax.jvp(f, (jnp.asarray(x), jnp.asarray(t)), (jnp.asarray(dx), jnp.asarray(dt)))
  expected = np.sum(-t * dx + (np.log(t) + 1 - x) * dt) / 2
  np.testing.assert_allclose(value, np_pointwise(x, t).sum() / 2, rtol=1e-12)
  np.testing.assert_allclose(tangent, expected, rtol=1e-12)


# ---------------------------------------------------------------------------
# dtypes.


@ignore_mean_warning
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_half_precision_kept_and_computed_in_float32(dtype, reduction, rng):
  x, t = sample(rng, (8, 6))
  x, t = jnp.asarray(x, dtype), jnp.asarray(t, dtype)
  out = kl_div(x, t, reduction=reduction)
  assert out.dtype == dtype
  x64_, t64_ = np.asarray(x, np.float64), np.asarray(t, np.float64)
  expected = np_kl_div(x64_, t64_, reduction)
  # Half an ulp of the output's rounding, plus float32's error on the terms.
  terms = np.abs(t64_ * np.log(t64_)) + np.abs(t64_ * x64_)
  slack = 16 * 2.0**-24 * (terms if reduction == "none" else terms.sum())
  nmant = jnp.finfo(dtype).nmant
  mag = np.maximum(np.abs(expected), float(jnp.finfo(dtype).tiny))
  half_ulp = 2.0 ** (np.floor(np.log2(mag)) - nmant - 1)
  err = np.abs(np.asarray(out.astype(jnp.float32), np.float64) - expected)
  assert np.all(err <= half_ulp + slack)


@pytest.mark.parametrize(
  ("dx", "dt", "expected"),
  [
    (jnp.float16, jnp.float16, jnp.float16),
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    (jnp.bfloat16, jnp.float16, jnp.float32),
    (jnp.float16, jnp.float32, jnp.float32),
    (jnp.float32, jnp.float64, jnp.float64),
  ],
)
@pytest.mark.parametrize("reduction", ["none", "sum", "batchmean"])
def test_type_promotion(dx, dt, expected, reduction, x64):
  out = kl_div(jnp.full((2, 3), -1.0, dx), jnp.full((2, 3), 0.5, dt), reduction=reduction)
  assert out.dtype == expected


# ---------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("bad", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
def test_integral_inputs_raise_type_error(bad):
  good = jnp.ones((2, 3))
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    kl_div(jnp.ones((2, 3), bad), good, reduction="sum")
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    kl_div(good, jnp.ones((2, 3), bad), reduction="sum")
  with pytest.raises(TypeError, match="Integral inputs not supported"):
    KLDivLoss(reduction="sum")(good, jnp.ones((2, 3), bad))


@pytest.mark.parametrize("bad", [jnp.complex64])
def test_complex_inputs_raise_type_error(bad):
  with pytest.raises(TypeError, match="Complex inputs not supported"):
    kl_div(jnp.ones((2, 3), bad), jnp.ones((2, 3)), reduction="sum")
  with pytest.raises(TypeError, match="Complex inputs not supported"):
    kl_div(jnp.ones((2, 3)), jnp.ones((2, 3), bad), reduction="sum")


@pytest.mark.parametrize("bad", ["avg", "BatchMean", None, "elementwise_mean", 1])
def test_invalid_reduction_raises_value_error_naming_it(bad):
  with pytest.raises(ValueError, match=re.escape(repr(bad))):
    kl_div(jnp.ones((2, 3)), jnp.ones((2, 3)), reduction=bad)
  with pytest.raises(ValueError, match=re.escape(repr(bad))):
    KLDivLoss(reduction=bad)


def test_invalid_reduction_raises_at_trace_time():
  f = jax.jit(kl_div, static_argnames="reduction")
  with pytest.raises(ValueError, match="'avg'"):
    f(jnp.ones((2, 3)), jnp.ones((2, 3)), reduction="avg")


@pytest.mark.parametrize(("a", "b"), [((3, 5), (5, 3)), ((2, 3), (4,)), ((2, 1, 3), (4, 2))])
def test_non_broadcastable_shapes_raise_with_both_shapes(a, b):
  pattern = re.escape(str(a)) + ".*" + re.escape(str(b))
  with pytest.raises(ValueError, match=pattern):
    kl_div(jnp.ones(a), jnp.ones(b), reduction="sum")
  with pytest.raises(ValueError, match=pattern):
    jax.jit(KLDivLoss(reduction="sum"))(jnp.ones(a), jnp.ones(b))
