"""Hostile arguments to every public function, through the public API only.

Arguments of the wrong kind (a ``TypeError``/``ValueError`` naming the
argument), integer ids that would wrap, degenerate shapes, the caller's strict
dtype promotion, and eager calls that must not compile again.
"""

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _public_calls import PUBLIC_CALLS
from _references import count_compiles

import kldiv_jax as kj

# convex_kl_divergence is optax's deprecated alias: it warns on every call.
pytestmark = pytest.mark.filterwarnings(
  "ignore:The function convex_kl_divergence is deprecated:DeprecationWarning"
)


def _normal(shape, seed):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _log_softmax(z):
  z = z - z.max(axis=-1, keepdims=True)
  return (z - np.log(np.exp(z).sum(axis=-1, keepdims=True))).astype(np.float32)


Z = _normal((2, 3, 5), 0)
Y = _normal((2, 3, 5), 1)
LOGQ, LOGP = _log_softmax(Z), _log_softmax(Y)
P = np.exp(LOGP)
LABELS = np.array([[0, 4, -100], [2, 1, 3]], np.int32)
IDS = np.array([[[0, 3], [1, 2], [4, 0]], [[2, 1], [3, 4], [0, 1]]], np.int32)
TOPK_LP = np.log(np.full((2, 3, 2), 0.3, np.float32))
H, W, B = _normal((2, 3, 4), 2), _normal((4, 5), 3), _normal((5,), 4)
TH, TW, TB = _normal((2, 3, 6), 5), _normal((6, 5), 6), _normal((5,), 7)

# The data of every role of _public_calls.PUBLIC_CALLS, here: token ids without ignore_index.
TOKENS = np.where(LABELS < 0, 3, LABELS).astype(np.int32)
DATA = {
  "s": Z, "t": Y, "log_q": LOGQ, "log_p": LOGP, "p": P, "labels": TOKENS, "idx": IDS,
  "topk_lp": TOPK_LP, "h": H, "w": W, "b": B, "th": TH, "tw": TW, "tb": TB,
  "lp": LOGQ[..., 0], "ref_lp": LOGP[..., 0], "adv": Z[..., 1], "mean": Z, "log_var": Y,
}  # fmt: skip
CALLS = PUBLIC_CALLS
# The options that take arrays (or numbers) and may be None, where a function has them.
ARRAY_OPTIONS = ("where", "clip")


def _takes(name, option):
  return option in inspect.signature(CALLS[name].fn).parameters


def _call(name, **changes):
  return CALLS[name](DATA, **changes)


def _array_args(required_only=False):
  """``(function name, argument name)`` for every array or numeric argument."""
  out = []
  for name, call in CALLS.items():
    numeric = [k for k, v in call.options.items() if type(v) in (int, float)]
    optional = [k for k in ARRAY_OPTIONS if _takes(name, k)]
    for arg in (*call.args, *numeric, *optional):
      if not (required_only and arg in call.optional()):
        out.append((name, arg))
  return out


# 6. Arguments of the wrong kind.

NOT_ARRAYS = [
  "abc",
  b"ab",
  {"a": 1.0},
  [1.0, "a"],
  [[1.0, 2.0], None],
  np.array([1.0, None], dtype=object),
  object(),
]


# A list given as clip is a (low, high) pair of bounds: test_clip_bounds_must_be_numbers.
@pytest.mark.parametrize(
  ("name", "arg", "value"),
  [
    pytest.param(name, arg, value, id=f"{name}-{arg}-{type(value).__name__}")
    for name, arg in _array_args()
    for value in NOT_ARRAYS
    if not (arg == "clip" and isinstance(value, list))
  ],
)
def test_not_an_array_raises_type_error_naming_the_argument(name, arg, value):
  with pytest.raises(TypeError, match=rf"\b{arg}\b"):
    _call(name, **{arg: value})


@pytest.mark.parametrize(("name", "arg"), _array_args(required_only=True))
def test_none_for_a_required_argument_raises_type_error_naming_it(name, arg):
  with pytest.raises(TypeError, match=rf"\b{arg}\b"):
    _call(name, **{arg: None})


@pytest.mark.parametrize(("name", "arg"), _array_args(required_only=True))
def test_ragged_nested_list_raises_naming_the_argument(name, arg):
  with pytest.raises((TypeError, ValueError), match=rf"\b{arg}\b"):
    _call(name, **{arg: [[1.0, 2.0], [3.0]]})


@pytest.mark.parametrize("name", list(CALLS))
def test_nested_lists_of_numbers_are_array_like(name):
  as_lists = {k: v.tolist() for k, v in DATA.items()}
  np.testing.assert_allclose(CALLS[name](as_lists), CALLS[name](DATA), rtol=1e-6)


AXIS_FUNCTIONS = [name for name in CALLS if _takes(name, "axis")]


@pytest.mark.parametrize("axis", [1.0, np.float32(1.0), jnp.array(1)], ids=repr)
@pytest.mark.parametrize("name", AXIS_FUNCTIONS)
def test_axis_of_the_wrong_kind_raises_type_error(name, axis):
  with pytest.raises(TypeError, match="axis must be an int"):
    _call(name, axis=axis)


@pytest.mark.parametrize("value", ["False", "True", 0, 1, 1.0, None], ids=repr)
@pytest.mark.parametrize("name", [name for name in CALLS if _takes(name, "log_target")])
def test_log_target_must_be_a_bool(name, value):
  # torch: "kl_div(): argument 'log_target' must be bool, not str"; a string
  # "False" must never be taken as true.
  with pytest.raises(TypeError, match="log_target must be a bool"):
    _call(name, log_target=value)


@pytest.mark.parametrize("value", ["no", 0, None], ids=repr)
@pytest.mark.parametrize(
  "name", [name for name in CALLS if _takes(name, "scale_by_temperature_squared")]
)
def test_scale_by_temperature_squared_must_be_a_bool(name, value):
  with pytest.raises(TypeError, match="scale_by_temperature_squared must be a bool"):
    _call(name, scale_by_temperature_squared=value)


@pytest.mark.parametrize("value", [None, 1.5, "x", np.float32(2.0), True], ids=repr)
def test_ignore_index_must_be_an_int(value):
  with pytest.raises(TypeError, match="ignore_index must be an int"):
    _call("distillation_loss", ignore_index=value)


@pytest.mark.parametrize("clip", [(None, 1.0), "1", [None, None]], ids=repr)
def test_clip_bounds_must_be_numbers(clip):
  with pytest.raises(TypeError, match=r"\bclip\b"):
    _call("kl_estimate", clip=clip)


# 7. Integer ids that would wrap.


def _distill_labels(labels, jit=False, **kw):
  z, y = Z[0], Y[0]  # [3, 5]
  fn = lambda labels: kj.distillation_loss(z, y, labels, alpha=0.0, **kw)  # noqa: E731
  return (jax.jit(fn) if jit else fn)(labels)


def test_uint32_label_is_not_wrapped_onto_ignore_index():
  # 4294967196 is -100 as an int32: it must be out of range (NaN under jit), not ignored.
  labels = jnp.array([2**32 - 100, 1, 2], jnp.uint32)
  assert np.isnan(_distill_labels(labels, jit=True))
  with pytest.raises(ValueError, match="got 4294967196 at position"):
    _distill_labels(labels)


def test_int64_labels_out_of_int32_range_give_nan(x64):
  for bad in (2**32 + 1, 2**32 - 100, -(2**32) + 1):
    labels = jnp.array([bad, 1, 2], jnp.int64)
    assert labels.dtype == jnp.int64
    assert np.isnan(_distill_labels(labels, jit=True)), bad
    with pytest.raises(ValueError, match=rf"got {bad} at position \(0,\)"):
      _distill_labels(labels)


@pytest.mark.parametrize("bad", [2**32 + 1, 2**32 - 100, 2**40])
def test_numpy_int64_labels_never_alias_a_class(bad):
  # Without x64 JAX keeps int32: a NumPy int64 id must not wrap onto a class (saturated,
  # reported out of range).
  labels = np.array([bad, 1, 2], np.int64)
  with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 5\)"):
    _distill_labels(labels)


# The id contract, one rule on every path that takes ids (PublicCall.ids). The logits and
# heads have 5 classes; a top-k teacher gets one slot per token.
ID_CALLS = {name: call.ids for name, call in CALLS.items() if call.ids}


def _with_ids(name, ids, **kw):
  arg = ID_CALLS[name]
  if arg == "topk_indices":  # one slot: forward KL (the reverse is +inf off that class)
    kw.update(topk_indices=jnp.asarray(ids)[..., None], topk_log_probs=TOPK_LP[..., :1])
    if "divergence" in CALLS[name].options:
      kw["divergence"] = "forward_kl"
  else:
    kw[arg] = ids
  return _call(name, **kw)


@pytest.mark.parametrize("name", sorted(ID_CALLS))
def test_ids_out_of_range_raise_when_known_and_give_nan_under_jit(name):
  """Known ids out of range: ValueError naming the function, the argument, the first bad
  position and the range (NumPy arrays, JAX arrays and lists alike); traced: NaN. A masked
  token's id is not read."""
  arg = ID_CALLS[name]
  call = functools.partial(_with_ids, name)
  ids = np.array([[0, 4, 1], [2, 5, -3]], np.int32)  # 5 and -3 are out of [0, 5)
  for given in (ids, jnp.asarray(ids), ids.tolist()):
    with pytest.raises(
      ValueError, match=rf"^{name}: {arg} must be .*in \[0, 5\).* got 5 at position \(1, 1(, 0)?\)"
    ):
      call(given)
  out = jax.jit(call)(jnp.asarray(ids))
  assert np.isnan(np.asarray(out)).any()
  where = np.array([[True, True, True], [True, False, False]])
  assert np.all(np.isfinite(np.asarray(call(ids, where=where))))


@pytest.mark.parametrize("name", sorted(n for n, arg in ID_CALLS.items() if arg == "token_ids"))
def test_minus_100_without_ignore_index_says_to_set_it(name):
  call = functools.partial(_with_ids, name)
  ids = np.array([[0, 4, 1], [2, -100, 3]], np.int32)
  with pytest.raises(ValueError, match=r"got -100 at position \(1, 1\) \(pass ignore_index=-100"):
    call(ids)
  assert np.all(np.isfinite(np.asarray(call(ids, ignore_index=-100))))
  out = np.asarray(jax.jit(call)(jnp.asarray(ids)))
  assert np.isnan(out[..., 1, 1] if out.ndim >= 2 else out).any()  # the log-prob, not the entropy


def test_ignore_index_outside_the_label_dtype_matches_nothing():
  labels = np.array([0, 1, 2], np.int32)
  expected = _distill_labels(labels)
  np.testing.assert_allclose(_distill_labels(labels, ignore_index=2**40), expected)
  np.testing.assert_allclose(_distill_labels(labels.astype(np.uint8), ignore_index=-100), expected)


def _topk(ids, jit=False):
  """Under jit the ids are unknown (NaN for an id out of range); outside, a ValueError."""
  logits = Z[0]  # [3, 5]
  fn = jax.jit(kj.kl_div_from_topk) if jit else kj.kl_div_from_topk
  return fn(logits, ids, np.log(np.full(ids.shape, 0.5, np.float32)))


def test_int64_topk_ids_out_of_int32_range_give_nan(x64):
  ids = jnp.array([[2**32 + 1, 0], [1, 2], [3, 4]], jnp.int64)
  out = _topk(ids, jit=True)
  assert np.isnan(out[0]) and np.all(np.isfinite(out[1:]))
  with pytest.raises(ValueError, match="got 4294967297 at position"):
    _topk(ids)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_numpy_wide_topk_ids_never_alias_a_class(dtype):
  # Saturated, never wrapped onto a class: reported when the values are known, NaN inside
  # jit (captured there; passed to jax.jit as an argument, JAX itself converts the array to
  # int32 before kldiv_jax sees it).
  ids = np.array([[2**32 + 1, 0], [1, 2], [3, 4]], dtype)
  with pytest.raises(ValueError, match="token ids in"):
    _topk(ids)
  lp = np.log(np.full(ids.shape, 0.5, np.float32))
  out = jax.jit(lambda z: kj.kl_div_from_topk(z, ids, lp))(Z[0])
  assert np.isnan(out[0]) and np.all(np.isfinite(out[1:]))


# 8. Degenerate shapes.


def _fused_value_and_grads(h, w, b, th, tw, **kw):
  def loss(h, w, b):
    return kj.fused_distillation_loss(h, w, th, tw, bias=b, **kw)

  return jax.value_and_grad(loss, argnums=(0, 1, 2))(h, w, b)


def test_fused_with_an_empty_vocabulary_is_zero():
  h, th = _normal((4, 3), 0), _normal((4, 2), 1)
  w, tw = np.zeros((3, 0), np.float32), np.zeros((2, 0), np.float32)
  b = np.zeros(0, np.float32)
  value, grads = _fused_value_and_grads(h, w, b, th, tw)
  assert value == 0.0
  for g, a in zip(grads, (h, w, b)):
    assert g.shape == a.shape and not np.any(g)


def test_fused_with_zero_hidden_units_uses_the_biases():
  # H = 0: the logits are the biases, for every token.
  b, tb = _normal((5,), 2), _normal((5,), 3)
  h, th = np.zeros((4, 0), np.float32), np.zeros((4, 0), np.float32)
  w, tw = np.zeros((0, 5), np.float32), np.zeros((0, 5), np.float32)
  value, grads = _fused_value_and_grads(
    h, w, b, th, tw, target_bias=tb, temperature=2.0, chunk_size=3
  )
  log_q = _log_softmax(b.astype(np.float64) / 2.0)
  log_p = _log_softmax(tb.astype(np.float64) / 2.0)
  expected = 4.0 * np.sum(np.exp(log_p) * (log_p - log_q))  # T**2 KL, mean over tokens
  np.testing.assert_allclose(value, expected, rtol=1e-5)
  assert grads[0].shape == (4, 0) and grads[1].shape == (0, 5)
  np.testing.assert_allclose(grads[2], 2.0 * (np.exp(log_q) - np.exp(log_p)), rtol=1e-4, atol=1e-6)


def test_ids_into_zero_classes_raise_a_vocabulary_error():
  """Ids (labels, sampled tokens, top-k ids) into an empty vocabulary raise at trace time,
  naming the vocabulary (not an id's position), under jit too; without ids the divergence of
  two empty rows is 0."""
  empty = np.zeros((3, 0), np.float32)
  labels = np.array([0, -100, 1])
  vocab = r"the vocabulary is empty \(0 classes"
  with pytest.raises(ValueError, match=f"distillation_loss: {vocab}.*so labels"):
    jax.jit(lambda y: kj.distillation_loss(empty, empty, y))(labels)
  with pytest.raises(ValueError, match=f"distillation_loss: {vocab}"):
    kj.distillation_loss(empty, empty, np.array([-100, -100, -100]))
  with pytest.raises(ValueError, match=f"token_log_probs: {vocab}.*so token_ids"):
    kj.token_log_probs(empty, labels)
  with pytest.raises(ValueError, match=f"fused_policy_loss: {vocab}"):
    kj.fused_policy_loss(np.zeros((3, 2)), np.zeros((2, 0)), labels, None, np.zeros(3))
  student = r"the student's vocabulary is empty \(0 classes"
  with pytest.raises(ValueError, match=f"kl_div_from_topk: {student}"):
    kj.kl_div_from_topk(empty, np.zeros((3, 1), np.int32), np.zeros((3, 1)))
  assert kj.distillation_loss(empty, empty) == 0.0


def test_topk_with_more_entries_than_classes_raises():
  """``k`` above the teacher's vocabulary is a layout error (found at trace time), for the
  top-k losses from logits and from hidden states; ``k == V`` is the full distribution."""
  ids, lp = np.zeros((2, 5), np.int32), np.full((2, 5), -np.inf, np.float32)
  match = r"k = 5 entries per token, more than the teacher's 3 classes; expected k <= 3"
  with pytest.raises(ValueError, match=f"kl_div_from_topk: topk_indices holds {match}"):
    jax.jit(lambda lp: kj.kl_div_from_topk(np.zeros((2, 3), np.float32), ids, lp))(lp)
  with pytest.raises(ValueError, match=f"divergence_from_topk: topk_indices holds {match}"):
    kj.divergence_from_topk(np.zeros((2, 3), np.float32), ids, lp, tail="bucket")
  with pytest.raises(ValueError, match=f"fused_topk_distillation_loss: topk_indices holds {match}"):
    kj.fused_topk_distillation_loss(np.zeros((2, 4)), np.zeros((4, 3)), ids, lp)
  # With a longer teacher vocabulary the teacher's size bounds k.
  got = kj.kl_div_from_topk(np.zeros((2, 3), np.float32), ids, lp, teacher_vocab_size=5)
  assert got.shape == (2,)


# 9. The caller's strict dtype promotion.


def _strict_calls(dtype, traced):
  """``name: (loss of a differentiable array, that array's value)``; other arrays in ``dtype``,
  float options traced (arrays of ``dtype``) when ``traced``.

  Every public call (the first of its ``argnums`` differentiated), and variants that reach
  other options: masks, axes, clip bounds, another direction or divergence."""
  c = (lambda v: jnp.asarray(v, dtype)) if traced else (lambda v: v)  # options
  arr = lambda v: jnp.asarray(v, dtype)  # noqa: E731
  data = {
    k: arr(v) if np.issubdtype(v.dtype, np.floating) else jnp.asarray(v) for k, v in DATA.items()
  }

  def public(call):
    arg, role = call.inputs[call.argnums[0]]
    options = {k: c(v) if type(v) is float else v for k, v in call.options.items()}
    return (lambda a: call(data, **options, **{arg: a})), DATA[role]

  p, logp, y, labels = arr(P), arr(LOGP), arr(Y), jnp.asarray(LABELS)
  calls = {name: public(call) for name, call in CALLS.items()}
  return calls | {
    "kl_divergence where": (lambda a: kj.kl_divergence(a, p, where=P > 0.1), LOGQ),
    "kl_divergence_with_log_targets axes": (
      lambda a: kj.kl_divergence_with_log_targets(a, logp, axis=(1, 2)),
      LOGQ,
    ),
    "kl_estimate clip where": (
      lambda a: kj.kl_estimate(a, logp, clip=(c(-0.5), c(0.4)), where=P > 0.1),
      LOGQ,
    ),
    "kl_div_from_logits reverse": (
      lambda a: kj.kl_div_from_logits(a, y, temperature=c(2.0), direction="reverse"),
      Z,
    ),
    "distillation_loss jsd": (
      lambda a: kj.distillation_loss(
        a, y, labels, temperature=c(2.0), alpha=c(0.3), divergence="jsd", beta=c(0.6)
      ),
      Z,
    ),
    "distillation_loss normalizer": (
      lambda a: kj.distillation_loss(a, y, labels, alpha=c(0.5), normalizer=c(4.0)),
      Z,
    ),
    "distillation_loss label_smoothing z_loss class where": (
      lambda a: kj.distillation_loss(
        a, y, labels, label_smoothing=c(0.1), z_loss=c(0.01), where=np.arange(5) != 3
      ),
      Z,
    ),
  }


# The calls whose options include numbers: they run with those traced too.
STRICT_WITH_OPTIONS = {
  name for name, call in CALLS.items() if any(type(v) is float for v in call.options.values())
} | {
  "kl_estimate clip where",
  "kl_div_from_logits reverse",
  "distillation_loss jsd",
  "distillation_loss normalizer",
  "distillation_loss label_smoothing z_loss class where",
}


@pytest.mark.parametrize(
  ("dtype", "other"),
  [
    (jnp.bfloat16, jnp.bfloat16),  # float16 takes the same casts as bfloat16
    (jnp.float32, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32),
  ],
  ids=lambda d: jnp.dtype(d).name,
)
@pytest.mark.parametrize(
  ("name", "traced"),
  [
    pytest.param(name, traced, id=f"{name}-{'array' if traced else 'python'}_options")
    for name in _strict_calls(jnp.float32, False)
    for traced in (False, True)
    if not traced or name in STRICT_WITH_OPTIONS  # traced: only functions with numeric options
  ],
)
def test_strict_dtype_promotion(name, dtype, other, traced):
  """Under ``jax.numpy_dtype_promotion("strict")`` every call traces (the library promotes
  and casts explicitly), to the very program it is without strict mode: the same values."""
  f, value = _strict_calls(other, traced)[name]
  a = jnp.asarray(value, dtype)

  def value_and_grad(a):  # the loss and its gradient from one trace of f
    out, pullback = jax.vjp(f, a)
    return out, pullback(jnp.ones_like(out))[0]

  program = jax.make_jaxpr(value_and_grad)(a)
  with jax.numpy_dtype_promotion("strict"):
    strict_program = jax.make_jaxpr(value_and_grad)(a)
  out, grad = strict_program.out_avals
  if dtype == other:
    assert out.dtype == dtype
  assert out.dtype == program.out_avals[0].dtype and grad.dtype == dtype
  # The same program: strict mode changes no value (compiled and run, it would give the
  # same numbers bit for bit).
  assert _operations(strict_program) == _operations(program)


def _operations(closed) -> list:
  """A jaxpr's operations in order, each ``(primitive, inputs, output types, parameters)``,
  every sub-jaxpr (a jitted call, a branch, a reduction's combiner) inlined where it is
  used. An input is named by the operation and output that made it (or the argument, or a
  literal's type and value), so the wiring counts, not the names the printer gives. Printed,
  a jaxpr names a sub-jaxpr once per object: one cached by an earlier trace (jnp.where's, a
  kernel's) is printed once for several calls, one traced afresh once per call, and two
  equal programs read differently by what the caches held. Python callables (a combiner, a
  jvp rule) count by kind; addresses are dropped."""
  ops: list = []

  def walk(jaxpr, inputs) -> list:
    env = dict(zip(jaxpr.invars, inputs))
    env.update((v, f"const{k}") for k, v in enumerate(jaxpr.constvars))

    def name(v):
      return f"{v.aval}={v.val!r}" if hasattr(v, "val") else env.get(v, f"free {v.aval}")

    for eqn in jaxpr.eqns:
      ins = [name(v) for v in eqn.invars]
      params = []
      for key, value in sorted(eqn.params.items()):
        parts = value if isinstance(value, (tuple, list)) else (value,)
        subs = [getattr(x, "jaxpr", x) for x in parts if hasattr(x, "eqns") or hasattr(x, "jaxpr")]
        for sub in subs:  # its arguments: the operation's last inputs (a branch's, a call's)
          n = len(sub.invars)
          walk(sub, ins[-n:] if 0 < n <= len(ins) else [f"arg {v.aval}" for v in sub.invars])
        if subs:
          params.append((key, f"{len(subs)} inlined"))
        elif callable(value):
          params.append((key, "callable"))
        else:
          params.append((key, re.sub(r" at 0x[0-9a-f]+>", ">", repr(value))))
      index = len(ops)
      ops.append(
        (str(eqn.primitive), tuple(ins), tuple(str(v.aval) for v in eqn.outvars), tuple(params))
      )
      env.update((v, f"op{index}.{k}") for k, v in enumerate(eqn.outvars))
    return [name(v) for v in jaxpr.outvars]

  outputs = walk(closed.jaxpr, [f"in{k}" for k in range(len(closed.jaxpr.invars))])
  return [*ops, ("outputs", tuple(outputs))]


# 3. Eager calls compile once.


# More rows than one block of the CPU row statistics (the issue's [512, 1000]).
BIG_S, BIG_T = _normal((300, 1000), 8), _normal((300, 1000), 9)
BIG_LABELS = np.random.default_rng(10).integers(0, 1000, 300)


def _eager(name):
  s, t, labels = jnp.asarray(BIG_S), jnp.asarray(BIG_T), jnp.asarray(BIG_LABELS)
  h, w, th, tw = s[:, :64], s[:64, :], t[:, :48], t[:48, :]
  calls = {
    "kl_div_from_logits": lambda: kj.kl_div_from_logits(s, t, temperature=2.0),
    "kl_div_from_logits reverse where": lambda: kj.kl_div_from_logits(
      s, t, direction="reverse", where=t > -2.0
    ),
    "generalized_jsd": lambda: kj.generalized_jsd(s, t, beta=0.3),
    "generalized_jsd traced beta": lambda: kj.generalized_jsd(s, t, beta=jnp.float32(0.3)),
    "distillation_loss": lambda: kj.distillation_loss(s, t, labels, temperature=2.0),
    "distillation_loss jsd": lambda: kj.distillation_loss(
      s, t, labels, divergence="jsd", alpha=jnp.float32(0.4), beta=jnp.float32(0.2)
    ),
    "fused_distillation_loss": lambda: kj.fused_distillation_loss(h, w, th, tw, chunk_size=128),
    "fused_distillation_loss reverse": lambda: kj.fused_distillation_loss(
      h, w, th, tw, divergence="reverse_kl", temperature=jnp.float32(2.0)
    ),
    "value_and_grad kl_div_from_logits": lambda: jax.value_and_grad(
      lambda s: jnp.sum(kj.kl_div_from_logits(s, t))
    )(s),
    "value_and_grad generalized_jsd traced beta": lambda: jax.value_and_grad(
      lambda s: jnp.sum(kj.generalized_jsd(s, t, beta=jnp.float32(0.3)))
    )(s),
    "value_and_grad distillation_loss": lambda: jax.value_and_grad(
      lambda s: kj.distillation_loss(s, t, labels, divergence="reverse_kl")
    )(s),
    "value_and_grad fused_distillation_loss": lambda: jax.value_and_grad(
      lambda w: kj.fused_distillation_loss(h, w, th, tw, divergence="jsd")
    )(w),
  }
  return calls[name]


@pytest.mark.parametrize(
  "name",
  [
    "kl_div_from_logits",
    "kl_div_from_logits reverse where",
    "generalized_jsd",
    "generalized_jsd traced beta",
    "distillation_loss",
    "distillation_loss jsd",
    "fused_distillation_loss",
    "fused_distillation_loss reverse",
    "value_and_grad kl_div_from_logits",
    "value_and_grad generalized_jsd traced beta",
    "value_and_grad distillation_loss",
    "value_and_grad fused_distillation_loss",
  ],
)
def test_eager_calls_compile_only_once(name):
  call = _eager(name)
  first = jax.block_until_ready(call())
  with count_compiles() as compiles:
    for _ in range(2):
      again = jax.block_until_ready(call())
  assert compiles == [], f"{len(compiles)} compilations in two more eager calls"
  jax.tree.map(np.testing.assert_array_equal, again, first)
