"""Hostile and careless values: NaN, invalid traced options, top-k edge cases,
``jax.debug_nans`` and rounding below zero.

The contract pinned here, through the public API only:

* NaN in any input (either side, logits, probabilities, hidden states, a
  traced option) makes the affected value NaN, never a finite number.
* A traced option outside its range (temperature not positive and finite,
  ``alpha``/``beta`` outside ``[0, 1]``, a normalizer not positive and finite,
  clip bounds with ``low > high``) makes every output NaN, value and gradients;
  the same value as a Python number raises ``ValueError``.
* A divergence is never below 0; where the clamp acts the gradient is the
  exact one.
* With ``jax.debug_nans(True)`` a finite result raises nothing.

Expected values come from the float64 references (``_references.py``: softmax, KL, JSD)
and a top-k KL written here.
"""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _public_calls import PUBLIC_CALLS
from _public_calls import inputs as public_inputs
from _references import np_log_softmax, ref_forward_kl, ref_jsd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kldiv_jax as kd

NAN, INF = float("nan"), float("inf")
INVALID_TEMPERATURES = (-2.0, -INF, 0.0, INF, NAN)

# --- float64 references -------------------------------------------------------


def _kl(log_p, log_q):
  """sum p (log p - log q) per row; p = 0 terms are 0 (float64)."""
  p = np.exp(log_p)
  with np.errstate(invalid="ignore"):
    terms = np.where(p > 0, p * (log_p - np.where(p > 0, log_q, 0.0)), 0.0)
  return terms.sum(axis=-1)


def ref_topk(logits, ids, log_probs, temperature):
  """KL(top-k teacher renormalised over its slots with mass || student) per row."""
  log_q = np_log_softmax(np.asarray(logits, np.float64) / temperature)
  out = []
  for row_q, row_ids, row_lp in zip(log_q, np.asarray(ids), np.asarray(log_probs, np.float64)):
    keep = np.isfinite(row_lp)
    log_p = np_log_softmax(row_lp[keep] / temperature)
    out.append(_kl(log_p, row_q[row_ids[keep]]))
  return np.array(out)


def _nearly_equal(shape=(512, 1000), seed=0):
  """Student and teacher logits that differ by about 1e-3 (float32)."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=shape).astype(np.float32)
  b = (a + 1e-3 * rng.normal(size=shape)).astype(np.float32)
  return a, b


def _vocab_parallel(fn, num_args=2):
  """``fn`` inside ``jax.shard_map`` with the class axis on a 1-device mesh axis "vocab".

  The vocabulary-parallel kernels run (collectives over one device); the
  inputs are placed with the matching sharding, so the call also works eagerly.
  """
  mesh = jax.make_mesh((1,), ("vocab",))
  spec = P(None, "vocab")
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * num_args, out_specs=P())
  sharding = NamedSharding(mesh, spec)
  return lambda *args: mapped(*(jax.device_put(jnp.asarray(a), sharding) for a in args))


Z = np.array([[1.0, 2.0, 3.0]], np.float32)
Y = np.array([[3.0, 2.0, 1.0]], np.float32)
NAN_ROW = np.array([[NAN, 0.0, 0.0]], np.float32)


# --- 1. NaN propagates ----------------------------------------------------------


WEIGHTING_SIDE_NAN = {
  "kl_forward": (lambda s, t: kd.kl_div_from_logits(s, t), Z, NAN_ROW),
  "kl_reverse": (lambda s, t: kd.kl_div_from_logits(s, t, direction="reverse"), NAN_ROW, Y),
  "jsd_beta0": (lambda s, t: kd.generalized_jsd(s, t, beta=0.0), Z, NAN_ROW),
  "jsd_beta1": (lambda s, t: kd.generalized_jsd(s, t, beta=1.0), NAN_ROW, Y),
  "distill": (lambda s, t: kd.distillation_loss(s, t), Z, NAN_ROW),
  "distill_labels": (lambda s, t: kd.distillation_loss(s, t, jnp.array([0])), Z, NAN_ROW),
  "distill_reverse": (
    lambda s, t: kd.distillation_loss(s, t, divergence="reverse_kl"),
    NAN_ROW,
    Y,
  ),
}


@pytest.mark.parametrize("name", list(WEIGHTING_SIDE_NAN))
def test_nan_on_the_weighting_side_is_nan_not_zero(name):
  loss, student, teacher = WEIGHTING_SIDE_NAN[name]
  value, grad = jax.value_and_grad(lambda s: jnp.sum(loss(s, teacher)))(student)
  assert np.isnan(value), name
  assert np.isnan(grad).all(), name


def test_nan_row_poisons_only_its_example_and_masked_nan_stays_out():
  student = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [0.5, 0.0, -1.0]], np.float32)
  teacher = np.array([[NAN, 0.0, 0.0], [3.0, 2.0, 1.0], [NAN, 1.0, 0.0]], np.float32)
  for direction, (s, t) in {"forward": (student, teacher), "reverse": (teacher, student)}.items():
    keep = np.array([True, True, False])
    out = np.asarray(kd.kl_div_from_logits(s, t, direction=direction, where=keep))
    expected = ref_forward_kl(student[1:2], teacher[1:2])[0]
    assert np.isnan(out[0]), direction
    np.testing.assert_allclose(out[1], expected, rtol=1e-5)
    assert out[2] == 0.0, direction  # a masked example: its NaN is selected away


# Every public call (_public_calls), and variants: other directions, divergences and targets.
NAN_VARIANTS = {
  "kl_div log_target": dataclasses.replace(
    PUBLIC_CALLS["kl_div"], inputs=(("input", "log_q"), ("target", "log_p")),
    options={"reduction": "sum", "log_target": True},
  ),
  "kl_div_from_logits reverse": dataclasses.replace(
    PUBLIC_CALLS["kl_div_from_logits"], options={"direction": "reverse"}
  ),
  "generalized_jsd beta=0": dataclasses.replace(
    PUBLIC_CALLS["generalized_jsd"], options={"beta": 0.0}
  ),
  "generalized_jsd beta=1": dataclasses.replace(
    PUBLIC_CALLS["generalized_jsd"], options={"beta": 1.0}
  ),
  "distillation_loss reverse_kl": dataclasses.replace(
    PUBLIC_CALLS["distillation_loss"], options={"divergence": "reverse_kl"}
  ),
  "distillation_loss jsd": dataclasses.replace(
    PUBLIC_CALLS["distillation_loss"], options={"divergence": "jsd"}
  ),
  "fused_distillation_loss reverse_kl": dataclasses.replace(
    PUBLIC_CALLS["fused_distillation_loss"], options={"divergence": "reverse_kl"}
  ),
  "gaussian_kl prior arrays": dataclasses.replace(
    PUBLIC_CALLS["gaussian_kl"],
    inputs=(("mean", "s"), ("log_var", "t"), ("prior_mean", "t"), ("prior_log_var", "s")),
    options={},
  ),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore:The function convex_kl_divergence is deprecated")
def test_nan_in_any_input_gives_nan():
  """Every public function, a NaN in each float argument: the affected value is NaN."""
  data = public_inputs(2, 5, 3, 2, seed=0)
  finite = []
  for name, call in {**PUBLIC_CALLS, **NAN_VARIANTS}.items():
    for arg, role in call.inputs:
      if not np.issubdtype(data[role].dtype, np.floating):
        continue
      bad = np.array(data[role])
      bad.flat[0] = NAN
      out = np.asarray(call(data, **{arg: bad}))
      if not np.isnan(out.flat[0]):
        finite.append(f"{name} with NaN in {arg}: {out}")
  assert not finite, "\n".join(finite)


def test_nan_in_teacher_hidden_states_fused_is_nan():
  rng = np.random.default_rng(1)
  h, th = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)
  w, tw = rng.normal(size=(3, 6)).astype(np.float32), rng.normal(size=(2, 6)).astype(np.float32)
  th[2, 0] = NAN
  for divergence in ("forward_kl", "jsd"):

    def loss(h, divergence=divergence):
      return kd.fused_distillation_loss(h, w, th, tw, divergence=divergence, chunk_size=2)

    value, grad = jax.value_and_grad(loss)(h)
    assert np.isnan(value), divergence
    assert np.isnan(grad).any(), divergence


def test_nan_teacher_vocab_parallel_is_nan():
  teacher = np.array([[NAN, 0.0, 0.0, 1.0], [1.0, 0.0, 2.0, 1.0]], np.float32)
  student = np.array([[1.0, 2.0, 3.0, 0.0], [0.0, 1.0, 2.0, 3.0]], np.float32)
  losses = {
    "kl": lambda s, t: kd.kl_div_from_logits(s, t, axis_name="vocab"),
    "jsd_beta0": lambda s, t: kd.generalized_jsd(s, t, beta=0.0, axis_name="vocab"),
    "distill": lambda s, t: kd.distillation_loss(s, t, axis_name="vocab")[None],
  }
  for name, loss in losses.items():
    out = np.asarray(jax.jit(_vocab_parallel(loss))(student, teacher))
    assert np.isnan(out[0]), (name, out)
  kl = np.asarray(jax.jit(_vocab_parallel(losses["kl"]))(student, teacher))
  np.testing.assert_allclose(kl[1], ref_forward_kl(student[1:], teacher[1:])[0], rtol=1e-5)


# --- 1b. ... at the sizes XLA:CPU runs as one fused kernel ---------------------------
# From about 4096 elements on, XLA:CPU runs an elementwise-then-sum computation as one
# fused (YNNPACK) kernel whose max/min return their second operand when either is NaN,
# and XLA moves a constant operand to the right: `max(x, 0)` then turns a NaN `x` into
# 0 (`_numerics.at_least`). Every public call, jitted, at 4096 rows (the per-row values
# summed: 4096 elements) of 4 classes (16384 elements), NaN planted mid-array.

FUSED_ROWS = 4096

FUSED_VARIANTS = {
  "kl_div log_target": NAN_VARIANTS["kl_div log_target"],
  "kl_div_from_logits reverse": NAN_VARIANTS["kl_div_from_logits reverse"],
  "generalized_jsd beta=0": NAN_VARIANTS["generalized_jsd beta=0"],
  "distillation_loss tvd": dataclasses.replace(
    PUBLIC_CALLS["distillation_loss"], options={"divergence": "tvd"}
  ),
  "divergence_from_logits alpha_beta": dataclasses.replace(
    PUBLIC_CALLS["divergence_from_logits"],
    options={"divergence": kd.Divergence("alpha_beta", alpha=0.5, beta=0.3)},
  ),
  "distillation_advantages sampling": dataclasses.replace(
    PUBLIC_CALLS["distillation_advantages"],
    inputs=(*PUBLIC_CALLS["distillation_advantages"].inputs, ("sampling_log_probs", "adv")),
  ),
  **{
    f"policy_loss {name}": dataclasses.replace(PUBLIC_CALLS["policy_loss"], options=options)
    for name, options in {
      "dppo-tv": {"surrogate": "dppo-tv"},
      "dppo-kl": {"surrogate": "dppo-kl"},
      "cispo-cap": {"surrogate": "cispo-cap", "ratio_cap": 4.0},
      "ppo ratio_cap": {"ratio_cap": 4.0},
      "gspo": {"surrogate": "gspo"},
      "vespo": {"surrogate": "vespo"},
      "off-policy mask": {"off_policy_threshold": 0.1},
    }.items()
  },
  "policy_loss rollout token_mask": dataclasses.replace(
    PUBLIC_CALLS["policy_loss"],
    inputs=(*PUBLIC_CALLS["policy_loss"].inputs[:3], ("rollout_log_probs", "lp")),
    options={"rollout_correction": "token_mask", "rollout_bounds": (0.5, 2.0)},
  ),
}


@pytest.fixture(scope="module")
def fused_data():
  return public_inputs(FUSED_ROWS, 4, 3, 4, seed=4)  # a top-k over every class: finite


@pytest.mark.filterwarnings("ignore:The function convex_kl_divergence is deprecated")
@pytest.mark.parametrize("name", [*PUBLIC_CALLS, *FUSED_VARIANTS])
def test_nan_in_any_input_gives_nan_at_fused_sizes(name, fused_data):
  """NaN in each float argument (and a negative probability): the jitted sum is NaN, and
  so is its gradient wrt the float arguments (somewhere: d/dx of t (log t - x) is -t even
  for a NaN x, and a NaN token's derivative of a linear or stop-gradient loss is exact)."""
  call = {**PUBLIC_CALLS, **FUSED_VARIANTS}[name]
  floats = [i for i, r in enumerate(call.roles) if fused_data[r].dtype == np.float32]
  argnums = call.argnums if call.reverse_only else tuple(floats)
  exact_gradient = name in ("sequence_sum", "sequence_mean") or "advantages" in name
  f = call.positional()
  value_and_grad = jax.jit(
    jax.value_and_grad(lambda *a: jnp.sum(jnp.asarray(f(*a), jnp.float32)), argnums)
  )
  clean = [fused_data[r] for r in call.roles]
  value, _ = value_and_grad(*clean)
  assert np.isfinite(value), (name, value)
  finite = []
  for i in floats:
    for bad_value in (NAN, -0.25) if call.roles[i] == "p" else (NAN,):
      arrays = [a.copy() for a in clean]
      arrays[i].flat[arrays[i].size // 2] = bad_value
      value, grads = value_and_grad(*arrays)
      grads_nan = any(np.isnan(g).any() for g in grads)
      if not np.isnan(value) or not (grads_nan or exact_gradient or bad_value == -0.25):
        finite.append(f"{bad_value} in {call.args[i]}: value {value}, NaN gradient {grads_nan}")
  assert not finite, f"{name}: " + "; ".join(finite)


def test_masked_nan_stays_out_at_fused_sizes(fused_data):
  """The other side of the contract: a NaN selected away by a mask cannot leak."""
  s, t = fused_data["s"].copy(), fused_data["t"].copy()
  keep = np.ones(FUSED_ROWS, bool)
  keep[FUSED_ROWS // 2] = False
  s[FUSED_ROWS // 2, 1] = t[FUSED_ROWS // 2, 2] = NAN
  loss = jax.jit(lambda s, t: jnp.sum(kd.kl_div_from_logits(s, t, where=keep)))
  value, grad = jax.value_and_grad(loss)(s, t)
  expected = ref_forward_kl(s[keep], t[keep]).sum()
  np.testing.assert_allclose(value, expected, rtol=1e-4)
  assert np.isfinite(grad).all()


# --- 2. invalid traced options give NaN -----------------------------------------

_H = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
_W = np.random.default_rng(3).normal(size=(4, 5)).astype(np.float32)
_IDS = np.array([[2, 1]], np.int32)
_LP = np.log(np.array([[0.6, 0.3]], np.float32))


def _temperature_call(call):
  """``loss(x, t)``: ``call`` at temperature ``t`` on small data, ``x`` its first
  differentiated input (a scalar factor of it for the LM heads' hidden states)."""
  data = public_inputs(1, 3, 4, 3, seed=2)  # a top-k teacher over every class: finite reverse KL
  arg, role = call.inputs[call.argnums[0]]
  scale = role in ("h", "w")

  def loss(x, t):
    value = data[role] * jnp.sum(x) if scale else x
    return call(data, temperature=t, **{arg: value})

  return loss


# Every public call that takes a temperature (_public_calls), and variants: the other
# direction, a JSD endpoint, labels, vocabulary parallelism.
TEMPERATURE_LOSSES = {
  name: _temperature_call(call)
  for name, call in PUBLIC_CALLS.items()
  if "temperature" in inspect.signature(call.fn).parameters
} | {
  "kl_div_from_logits_reverse": lambda s, t: kd.kl_div_from_logits(
    s, Y, temperature=t, direction="reverse"
  ),
  "generalized_jsd_beta0": lambda s, t: kd.generalized_jsd(s, Y, beta=0.0, temperature=t),
  "distillation_loss_labels": lambda s, t: kd.distillation_loss(
    s, Y, jnp.array([1]), temperature=t
  ),
  "kl_div_from_logits_vocab_parallel": lambda s, t: _vocab_parallel(
    lambda a, b: kd.kl_div_from_logits(a, b, temperature=t, axis_name="vocab")
  )(s, Y),
}


@pytest.mark.parametrize(
  "name",
  list(TEMPERATURE_LOSSES),
)
def test_invalid_traced_temperature_gives_nan(name):
  loss = TEMPERATURE_LOSSES[name]
  vg = jax.jit(jax.value_and_grad(lambda s, t: jnp.sum(loss(s, t))))
  for temperature in INVALID_TEMPERATURES:
    value, grad = vg(Z, jnp.float32(temperature))
    assert np.isnan(value), (name, temperature, value)
    assert np.isnan(grad).all(), (name, temperature, grad)
  value, grad = vg(Z, jnp.float32(2.0))  # a valid traced temperature is untouched
  assert np.isfinite(value) and np.isfinite(grad).all()


def test_invalid_traced_temperature_reaches_masked_examples():
  student = np.array([[1.0, 2.0, 3.0], [0.0, 1.0, 0.0]], np.float32)
  keep = np.array([True, False])
  out = jax.jit(lambda t: kd.kl_div_from_logits(student, student[::-1], temperature=t, where=keep))
  assert np.isnan(out(jnp.float32(-1.0))).all()
  np.testing.assert_allclose(
    out(jnp.float32(2.0)), [ref_forward_kl(student[:1], student[1:], 2.0)[0], 0.0], rtol=1e-5
  )


OPTION_LOSSES = {
  "distillation_loss alpha": (
    lambda a: kd.distillation_loss(Z, Y, jnp.array([1]), alpha=a),
    (2.0, -0.5, NAN),
  ),
  "distillation_loss alpha without labels": (
    lambda a: kd.distillation_loss(Z, Y, alpha=a),
    (2.0, -0.5, NAN),
  ),
  "distillation_loss beta, forward_kl": (
    lambda b: kd.distillation_loss(Z, Y, jnp.array([1]), beta=b),
    (2.0, -0.5, NAN),
  ),
  "distillation_loss normalizer": (
    lambda n: kd.distillation_loss(Z, Y, normalizer=n),
    (-1.0, 0.0, INF, NAN),
  ),
  "fused_distillation_loss beta, forward_kl": (
    lambda b: kd.fused_distillation_loss(_H, _W, _H[::-1], _W, beta=b),
    (2.0, -0.5, NAN),
  ),
  "fused_distillation_loss normalizer": (
    lambda n: kd.fused_distillation_loss(_H, _W, _H[::-1], _W, normalizer=n),
    (-1.0, 0.0, INF, NAN),
  ),
  "kl_estimate clip": (
    lambda c: kd.kl_estimate(jnp.array([0.0, -3.0]), jnp.array([1.0, -1.0]), clip=c),
    (-1.0, -INF, NAN),
  ),
  "kl_estimate clip pair": (
    lambda c: kd.kl_estimate(jnp.array([0.0, -3.0]), jnp.array([1.0, -1.0]), clip=(c, -c)),
    (1.0, INF, NAN),
  ),
}


@pytest.mark.parametrize("name", list(OPTION_LOSSES))
def test_invalid_traced_option_gives_nan(name):
  loss, invalid = OPTION_LOSSES[name]
  fn = jax.jit(loss)
  for value in invalid:
    out = np.asarray(fn(jnp.float32(value)))
    assert np.isnan(out).all(), (name, value, out)


def test_invalid_traced_alpha_gives_nan_gradient():
  grad = jax.jit(jax.grad(lambda s, a: kd.distillation_loss(s, Y, jnp.array([1]), alpha=a)))
  assert np.isnan(grad(Z, jnp.float32(2.0))).all()
  assert np.isfinite(grad(Z, jnp.float32(0.5))).all()


def test_static_normalizer_must_be_positive_and_finite():
  for normalizer in (INF, 0.0, -1.0, NAN):
    with pytest.raises(ValueError, match="normalizer"):
      kd.distillation_loss(Z, Y, normalizer=normalizer)
    with pytest.raises(ValueError, match="normalizer"):
      kd.fused_distillation_loss(_H, _W, _H, _W, normalizer=normalizer)


# --- 4. top-k edge cases --------------------------------------------------------


def test_topk_padded_slot_temperature_gradient_is_finite():
  logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
  padded_ids = np.array([[0, 2, -1]], np.int32)
  log_probs = np.array([[np.log(0.6), np.log(0.2), -INF]], np.float32)

  def f(t):
    return kd.kl_div_from_topk(logits, padded_ids, log_probs, temperature=t)[0]

  temperature, h = 1.5, 1e-5
  expected = (
    ref_topk(logits, padded_ids, log_probs, temperature + h)[0]
    - ref_topk(logits, padded_ids, log_probs, temperature - h)[0]
  ) / (2 * h)
  value, grad = jax.value_and_grad(f)(jnp.float32(temperature))
  np.testing.assert_allclose(value, ref_topk(logits, padded_ids, log_probs, temperature)[0], 1e-5)
  np.testing.assert_allclose(grad, expected, rtol=1e-4)
  grad_logits = jax.grad(lambda z: kd.kl_div_from_topk(z, padded_ids, log_probs)[0])(logits)
  assert np.isfinite(grad_logits).all()


def test_topk_all_inf_student_row_is_inf():
  logits = np.array([[-INF, -INF, -INF, -INF], [2.0, 1.0, 0.0, -1.0]], np.float32)
  ids = np.array([[0, 2], [0, 2]], np.int32)
  log_probs = np.log(np.array([[0.6, 0.2], [0.6, 0.2]], np.float32))
  out = kd.kl_div_from_topk(logits, ids, log_probs)
  expected_dense = kd.kl_div_from_logits(logits[:1], np.array([[0.0, -INF, 0.0, -INF]]))
  assert out[0] == INF and expected_dense[0] == INF
  np.testing.assert_allclose(out[1], ref_topk(logits[1:], ids[1:], log_probs[1:], 1.0)[0], 1e-5)
  grad = jax.grad(lambda z: jnp.sum(kd.kl_div_from_topk(z, ids, log_probs)[1:]))(logits)
  assert np.isfinite(grad).all()


def test_topk_repeated_ids_count_once():
  # A repeated id is the same token: its first slot counts (lists padded by repetition).
  logits = np.array([[2.0, 1.0, 3.0, -1.0]], np.float32)
  log_probs = np.log(np.array([[0.5, 0.5]], np.float32))
  out = kd.kl_div_from_topk(logits, np.array([[2, 2]], np.int32), log_probs)
  np.testing.assert_allclose(
    out, ref_topk(logits, np.array([[2]]), log_probs[:, :1], 1.0), rtol=1e-6
  )
  # Repeats among slots without mass are padding: fine.
  ids = np.array([[2, 0, 0, 0]], np.int32)
  lp = np.array([[np.log(0.7), np.log(0.3), -INF, -INF]], np.float32)
  np.testing.assert_allclose(
    kd.kl_div_from_topk(logits, ids, lp), ref_topk(logits, ids, lp, 1.0), rtol=1e-5
  )
  slot_mask = np.array([[True, True, False, False]])
  lp_finite = np.log(np.array([[0.7, 0.3, 0.1, 0.1]], np.float32))
  np.testing.assert_allclose(
    kd.kl_div_from_topk(logits, ids, lp_finite, where=slot_mask),
    ref_topk(logits, ids[:, :2], lp_finite[:, :2], 1.0),
    rtol=1e-6,
  )


# --- 5. jax.debug_nans: no false alarm ------------------------------------------

_MASKED_S = np.array([[1.0, 2.0, -INF, 0.0], [0.0, 1.0, -INF, 1.0]], np.float32)
_MASKED_T = np.array([[3.0, 0.5, -INF, 1.0], [1.0, 0.0, -INF, 2.0]], np.float32)

DEBUG_NANS_CASES = {
  "kl_forward": lambda s, t: jnp.sum(kd.kl_div_from_logits(s, t, temperature=2.0)),
  "kl_reverse": lambda s, t: jnp.sum(kd.kl_div_from_logits(s, t, direction="reverse")),
  "kl_traced_temperature": lambda s, t: jnp.sum(
    kd.kl_div_from_logits(s, t, temperature=jnp.float32(2.0))
  ),
  "jsd_beta0": lambda s, t: jnp.sum(kd.generalized_jsd(s, t, beta=0.0)),
  "distillation_loss": lambda s, t: kd.distillation_loss(s, t, jnp.array([0, 3])),
  "kl_vocab_parallel": _vocab_parallel(
    lambda s, t: jnp.sum(kd.kl_div_from_logits(s, t, axis_name="vocab"))
  ),
  "distillation_vocab_parallel": _vocab_parallel(
    lambda s, t: kd.distillation_loss(s, t, jnp.array([0, 3]), axis_name="vocab")
  ),
}


@pytest.mark.parametrize("name", list(DEBUG_NANS_CASES))
def test_debug_nans_silent_on_masked_logits(name):
  loss = DEBUG_NANS_CASES[name]
  with jax.debug_nans(True):
    value, grads = jax.value_and_grad(loss, argnums=(0, 1))(_MASKED_S, _MASKED_T)
  assert np.isfinite(value)
  assert all(np.isfinite(g).all() for g in grads)


def test_debug_nans_silent_on_kl_value_and_hessian():
  with jax.debug_nans(True):
    kl = kd.kl_div_from_logits(_MASKED_S, _MASKED_T, temperature=2.0)
    hessian = jax.hessian(lambda s: jnp.sum(kd.kl_div_from_logits(s, _MASKED_T)))(_MASKED_S)
  np.testing.assert_allclose(kl, ref_forward_kl(_MASKED_S, _MASKED_T, 2.0), rtol=1e-5)
  assert np.isfinite(hessian).all()


def test_debug_nans_silent_on_topk_padding():
  logits = np.array([[2.0, 1.0, -INF, -1.0], [0.0, 1.0, 2.0, 3.0]], np.float32)
  ids = np.array([[0, -1], [3, -100]], np.int32)
  log_probs = np.array([[0.0, -INF], [-0.1, -2.0]], np.float32)
  slots = np.array([[True, True], [True, False]])

  def loss(z, t):
    return jnp.sum(kd.kl_div_from_topk(z, ids, log_probs, temperature=t, where=slots))

  with jax.debug_nans(True):
    value, (grad_z, grad_t) = jax.value_and_grad(loss, argnums=(0, 1))(logits, jnp.float32(2.0))
    masked_example = kd.kl_div_from_topk(logits, ids, log_probs, where=np.array([True, False]))
  expected = (
    ref_topk(logits[:1], ids[:1, :1], log_probs[:1, :1], 2.0)[0]
    + ref_topk(logits[1:], ids[1:, :1], log_probs[1:, :1], 2.0)[0]
  )
  np.testing.assert_allclose(value, expected, rtol=1e-5)
  assert np.isfinite(grad_z).all() and np.isfinite(grad_t)
  assert masked_example[1] == 0.0


# --- 10. never below zero ---------------------------------------------------------


def test_generalized_jsd_nearly_equal_is_nonnegative():
  a, b = _nearly_equal()
  truth = ref_jsd(a, b, 10.0, beta=0.5)
  assert truth.min() > 0
  out = np.asarray(kd.generalized_jsd(a, b, temperature=10.0))
  assert out.min() >= 0.0, (out < 0).sum()
  assert np.isfinite(np.sqrt(out)).all()
  np.testing.assert_allclose(out, truth, atol=1e-6)


def test_kl_nearly_equal_is_nonnegative_with_exact_gradient():
  a, b = _nearly_equal(seed=1)
  temperature = 10.0
  out, vjp = jax.vjp(lambda s: kd.kl_div_from_logits(s, b, temperature=temperature), a)
  out = np.asarray(out)
  assert out.min() >= 0.0, (out < 0).sum()
  np.testing.assert_allclose(out, ref_forward_kl(a, b, temperature), atol=1e-6)
  # The gradient is the exact (q - p) / T, clamped rows included.
  (grad,) = vjp(jnp.ones_like(out))
  q = np.exp(np_log_softmax(a / temperature))
  p = np.exp(np_log_softmax(np.asarray(b, np.float64) / temperature))
  np.testing.assert_allclose(grad, (q - p) / temperature, atol=1e-8)


def test_kl_vocab_parallel_nearly_equal_is_nonnegative():
  a, b = _nearly_equal(shape=(256, 512), seed=2)
  kl = _vocab_parallel(
    lambda s, t: kd.kl_div_from_logits(s, t, temperature=10.0, axis_name="vocab")
  )
  out = np.asarray(jax.jit(kl)(a, b))
  assert out.min() >= 0.0, (out < 0).sum()


def test_distillation_per_token_nearly_equal_is_nonnegative():
  a, b = _nearly_equal(shape=(64, 1000), seed=0)
  per_token = jax.jit(
    jax.vmap(lambda s, t: kd.distillation_loss(s[None], t[None], temperature=10.0))
  )(a, b)
  truth = 100.0 * ref_forward_kl(a, b, 10.0)
  assert np.asarray(per_token).min() >= 0.0
  np.testing.assert_allclose(per_token, truth, atol=1e-4)
  fused = jax.jit(
    jax.vmap(
      lambda s, t: kd.fused_distillation_loss(s[None], jnp.eye(1000), t[None], jnp.eye(1000))
    )
  )(a, b)
  assert np.asarray(fused).min() >= 0.0


def test_topk_full_vocabulary_nearly_equal_is_nonnegative():
  a, b = _nearly_equal(shape=(256, 1000), seed=3)
  ids = np.tile(np.arange(1000, dtype=np.int32), (256, 1))
  log_probs = np_log_softmax(b).astype(np.float32)
  out = np.asarray(kd.kl_div_from_topk(a, ids, log_probs, temperature=10.0))
  assert out.min() >= 0.0, (out < 0).sum()
  # The top-k path sums p * (log p - log q) over float32 log-probabilities of magnitude
  # about log V, each rounded to about eps * log V: a few of those is the error to expect
  # (jax 0.7 and 0.10 round differently, up to 1.0e-6 measured at this seed).
  atol = 4 * np.finfo(np.float32).eps * np.log(1000)
  np.testing.assert_allclose(out, ref_forward_kl(a, b, 10.0), atol=atol)


def test_generalized_kl_divergence_nearly_equal_is_nonnegative():
  rng = np.random.default_rng(4)
  log_q = np_log_softmax(rng.normal(size=(512, 1000))).astype(np.float32)
  p = (np.exp(log_q) * (1 + 1e-6 * rng.normal(size=log_q.shape))).astype(np.float32)
  out = np.asarray(kd.generalized_kl_divergence(log_q, p))
  assert out.min() >= 0.0, (out < 0).sum()
