"""The label cross entropy's options, label smoothing and the z-loss, on every distillation path.

``distillation_loss`` (its one kernel of both terms, the cross entropy alone, the one-pass
form off CPU), ``fused_distillation_loss`` and ``fused_topk_distillation_loss`` against
float64 references built on other code: optax's ``softmax_cross_entropy`` with
``optax.smooth_labels`` (differentiated by JAX's own autodiff) for the smoothed cross
entropy, and the z-loss ``z_loss * logsumexp(logits)**2`` with its gradient
``2 z_loss lse softmax`` in NumPy. The divergence's part comes from ``np_distillation``
(float64 NumPy). ``axis_name``: ``test_vocab_parallel.py``.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _references import enable_x64, np_distillation
from jax.test_util import check_grads

from kldiv_jax import (
  distillation_loss,
  divergence_from_topk,
  fused_distillation_loss,
  fused_topk_distillation_loss,
)

B, S, V = 2, 3, 7
OPTIONS = [(0.1, 0.0), (0.0, 0.02), (0.25, 0.05)]  # (label_smoothing, z_loss)


def _data(rng, shape=(B, S, V), scale=2.0):
  s = rng.normal(size=shape) * scale
  t = rng.normal(size=shape) * scale
  labels = rng.integers(0, shape[-1], size=shape[:-1])
  labels.flat[[1, labels.size - 2]] = -100
  return s, t, labels


def np_hard(s, labels, eps, z_loss, valid=None, class_mask=None, cap=None):
  """``(sum over valid tokens of the hard term, its gradient wrt s, number of valid tokens)``,
  float64: optax's cross entropy with ``optax.smooth_labels`` (gradient by JAX's autodiff) plus
  ``z_loss * lse**2`` in NumPy (gradient ``2 z_loss lse softmax``, times the cap's slope)."""
  s = np.asarray(s, np.float64)
  labels = np.asarray(labels)
  valid = (labels != -100) if valid is None else (labels != -100) & valid
  safe = np.where(valid, labels, 0)
  where = None if class_mask is None else np.broadcast_to(class_mask, s.shape)

  def capped(x):
    return x if cap is None else cap * jnp.tanh(x / cap)

  def ce_sum(x):
    target = optax.smooth_labels(jax.nn.one_hot(safe, s.shape[-1], dtype=jnp.float64), eps)
    if where is not None:  # the classes the mask keeps: K = their number
      target = optax.smooth_labels(
        jax.nn.one_hot(safe, s.shape[-1], dtype=jnp.float64), eps, where=where
      )
    ce = optax.softmax_cross_entropy(capped(x), target, where=where)
    return jnp.sum(jnp.where(valid, ce, 0.0))

  with enable_x64():
    ce, g_ce = jax.value_and_grad(ce_sum)(jnp.asarray(s))
  u = np.asarray(capped(s)) if cap is not None else s
  kept = np.ones(s.shape, bool) if where is None else where
  m = np.max(np.where(kept, u, -np.inf), -1, keepdims=True)
  e = np.where(kept, np.exp(u - m), 0.0)
  lse = (np.log(e.sum(-1, keepdims=True)) + m)[..., 0]
  p = e / e.sum(-1, keepdims=True)
  slope = 1.0 if cap is None else 1.0 - np.tanh(s / cap) ** 2
  z_value = np.sum(np.where(valid, z_loss * lse**2, 0.0))
  g_z = np.where(valid[..., None], 2.0 * z_loss * lse[..., None] * p * slope, 0.0)
  return float(ce) + z_value, np.asarray(g_ce) + g_z, int(valid.sum())


def reference(s, t, labels, *, alpha, eps, z_loss, temperature, divergence="forward_kl", **kw):
  """The whole loss and its gradient wrt ``s`` (float64): ``np_distillation``'s divergence
  term (``alpha = 1``) plus the hard term of :func:`np_hard`, over the valid tokens."""
  soft, g_soft, _ = np_distillation(
    s, t, labels, temperature=temperature, alpha=1.0, divergence=divergence,
    valid=kw.get("valid"),
  )  # fmt: skip
  hard, g_hard, n = np_hard(s, labels, eps, z_loss, **kw)
  n = max(n, 1)
  return alpha * soft + (1 - alpha) * hard / n, alpha * g_soft + (1 - alpha) * g_hard / n


@functools.partial(jax.jit, static_argnames=("alpha", "divergence"))
def _loss_and_grad(s, t, labels, eps, z_loss, temperature, *, alpha, divergence):
  """Traced options: one compilation serves every value."""
  return jax.value_and_grad(
    lambda s: distillation_loss(
      s, t, labels, alpha=alpha, divergence=divergence, temperature=temperature,
      label_smoothing=eps, z_loss=z_loss,
    )
  )(s)  # fmt: skip


def _close(got, want, rtol=1e-10):
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("alpha", [0.0, 0.4], ids=["hard_only", "with_divergence"])
def test_matches_optax_and_z_loss_formula(x64, rng, alpha):
  """The cross entropy alone (``alpha = 0``) and in one kernel with the divergence; the
  cross entropy stays at temperature 1 while the divergence is at T = 2."""
  s, t, labels = _data(rng)
  kw = {"alpha": alpha, "divergence": "forward_kl"}
  for eps, z_loss in OPTIONS:
    got = _loss_and_grad(s, t, labels, eps, z_loss, 2.0, **kw)
    _close(got, reference(s, t, labels, eps=eps, z_loss=z_loss, temperature=2.0, **kw))
  # Static options: the same numbers.
  static = jax.jit(
    jax.value_and_grad(
      lambda s: distillation_loss(
        s, t, labels, temperature=2.0, label_smoothing=eps, z_loss=z_loss, **kw
      )
    )
  )(s)
  _close(static, got, rtol=1e-13)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_one_pass_accelerator_path(x64, rng, accelerator_branch, divergence):
  """Off CPU the statistics of both terms come from one pass (GPU/TPU code run on CPU)."""
  s, t, labels = _data(rng)
  kw = {"alpha": 0.4, "divergence": divergence}
  got = _loss_and_grad(s, t, labels, 0.25, 0.05, 1.5, **kw)
  _close(got, reference(s, t, labels, eps=0.25, z_loss=0.05, temperature=1.5, **kw))


def test_token_where_class_mask_and_softcap(x64, rng):
  """A token mask leaves tokens out; a class mask leaves classes out of the softmax and of
  the smoothing (``K`` = the kept classes, optax's ``smooth_labels(where=)``); the soft-cap
  comes first (the z-loss of the capped logits' log-sum-exp, as Levanter and MaxText)."""
  s, t, labels = _data(rng)
  token_where = rng.random(labels.shape) > 0.3
  class_mask = rng.random((V,)) > 0.3
  class_mask[labels[labels >= 0]] = True  # labels on kept classes

  @functools.partial(jax.jit, static_argnames="cap")
  def loss(s, alpha, where, cap=None):
    return jax.value_and_grad(
      lambda s: distillation_loss(
        s, t, labels, alpha=alpha, where=where, softcap=cap, label_smoothing=0.2, z_loss=0.03
      )
    )(s)

  _close(loss(s, 0.0, token_where), _hard_mean(s, labels, 0.2, 0.03, valid=token_where))
  _close(loss(s, 0.0, class_mask), _hard_mean(s, labels, 0.2, 0.03, class_mask=class_mask))
  everything = np.ones(V, bool)
  _close(loss(s, 0.0, everything, cap=3.0), _hard_mean(s, labels, 0.2, 0.03, cap=3.0))
  # With the divergence too (its one kernel of both terms): alpha x (the divergence alone,
  # checked elsewhere) + (1 - alpha) x the hard term.
  soft = jax.value_and_grad(
    lambda s: distillation_loss(s, t, labels, alpha=1.0, where=class_mask, softcap=3.0)
  )(s)
  hard = _hard_mean(s, labels, 0.2, 0.03, class_mask=class_mask, cap=3.0)
  want = [0.3 * a + 0.7 * b for a, b in zip(soft, hard)]
  _close(loss(s, 0.3, class_mask, cap=3.0), want)


def _hard_mean(s, labels, eps, z_loss, **kw):
  hard, grad, n = np_hard(s, labels, eps, z_loss, **kw)
  return hard / max(n, 1), grad / max(n, 1)


def test_return_parts_hard_holds_the_smoothed_cross_entropy_and_z_loss(x64, rng):
  s, t, labels = _data(rng)
  loss, parts = distillation_loss(
    s, t, labels, temperature=2.0, alpha=0.4, label_smoothing=0.1, z_loss=0.02, return_parts=True
  )
  hard, _, n = np_hard(s, labels, 0.1, 0.02)
  np.testing.assert_allclose(parts.hard, hard, rtol=1e-12)
  assert int(parts.num_tokens) == n
  np.testing.assert_allclose(loss, (0.4 * parts.soft + 0.6 * parts.hard) / n, rtol=1e-12)


def test_gradients_wrt_the_options_and_second_order(x64, rng):
  s, t, labels = _data(rng, shape=(2, 5))
  labels[1] = 3

  def loss(s, eps, z):
    return distillation_loss(
      s, t, labels, alpha=0.4, temperature=1.5, label_smoothing=eps, z_loss=z
    )

  def ref(eps, z):
    return reference(s, t, labels, alpha=0.4, eps=eps, z_loss=z, temperature=1.5)[0]

  d_eps, d_z = jax.jit(jax.grad(loss, argnums=(1, 2)))(s, 0.2, 0.03)
  h = 1e-6  # the reference is linear in each option: central differences are exact to rounding
  np.testing.assert_allclose(d_eps, (ref(0.2 + h, 0.03) - ref(0.2 - h, 0.03)) / (2 * h), rtol=1e-7)
  np.testing.assert_allclose(d_z, (ref(0.2, 0.03 + h) - ref(0.2, 0.03 - h)) / (2 * h), rtol=1e-7)
  check_grads(jax.jit(loss), (s, 0.2, 0.03), order=2, modes=("rev",))

  def hard_only(s, e, z):
    return distillation_loss(s, t, labels, alpha=0.0, label_smoothing=e, z_loss=z)

  check_grads(jax.jit(hard_only), (s, 0.2, 0.03), order=2, modes=("fwd",))


def test_vmap_and_no_retrace(x64, rng):
  s, t, labels = _data(rng)
  per_sequence = jax.jit(
    jax.vmap(lambda s, t, y: distillation_loss(s, t, y, label_smoothing=0.1, z_loss=0.02))
  )(s, t, labels)
  for i in range(B):
    want = reference(s[i], t[i], labels[i], alpha=0.5, eps=0.1, z_loss=0.02, temperature=1.0)
    np.testing.assert_allclose(per_sequence[i], want[0], rtol=1e-12)
  # A schedule of the options: one trace, and a batch of them under vmap.
  traces = []

  @jax.jit
  def step(eps, z):
    traces.append(1)
    return distillation_loss(s, t, labels, label_smoothing=eps, z_loss=z)

  values = [step(e, z) for e, z in ((0.0, 0.0), (0.1, 0.01), (0.3, 0.1))]
  assert len(traces) == 1
  batched = jax.vmap(step)(jnp.array([0.0, 0.1, 0.3]), jnp.array([0.0, 0.01, 0.3 / 3]))
  np.testing.assert_allclose(batched, values, rtol=1e-12)
  np.testing.assert_allclose(values[0], distillation_loss(s, t, labels), rtol=1e-13)


def test_label_without_mass_gives_inf_as_optax(x64, rng):
  """A ``-inf`` logit is a class of the smoothed target without mass: ``+inf`` (optax's and
  torch's value); a class mask instead leaves the class out."""
  s, t, labels = _data(rng, shape=(3, 5))
  labels[:] = [0, 1, 2]
  s[0, 4] = -np.inf
  loss = jax.jit(
    lambda where: distillation_loss(
      s, t, labels, alpha=0.0, label_smoothing=0.1, where=where, return_parts=True
    )
  )
  ours = loss(np.ones(5, bool))[1]
  target = optax.smooth_labels(jax.nn.one_hot(labels, 5, dtype=jnp.float64), 0.1)
  want = optax.softmax_cross_entropy(jnp.asarray(s), target)
  assert np.isposinf(want[0]) and np.isposinf(ours.hard)
  keep = np.array([True, True, True, True, False])
  np.testing.assert_allclose(
    loss(keep)[0], _hard_mean(s, labels, 0.1, 0.0, class_mask=keep)[0], rtol=1e-12
  )


def test_bf16(rng):
  dtype = jnp.bfloat16
  s, t, labels = _data(rng, shape=(2, 4, 32))
  s16, t16 = jnp.asarray(s, dtype), jnp.asarray(t, dtype)
  out, g = jax.jit(
    jax.value_and_grad(
      lambda s: distillation_loss(s, t16, labels, temperature=2.0, label_smoothing=0.1, z_loss=0.01)
    )
  )(s16)
  assert out.dtype == dtype and g.dtype == dtype
  up = lambda a: np.asarray(a, np.float64)  # noqa: E731
  want = reference(up(s16), up(t16), labels, alpha=0.5, eps=0.1, z_loss=0.01, temperature=2.0)
  np.testing.assert_allclose(up(out), want[0], rtol=1.6e-2)
  np.testing.assert_allclose(up(g), want[1], rtol=1.6e-2, atol=1.6e-2 * np.abs(want[1]).max())


# The option at 0: the program without it.


def _kernel_scalars(jaxpr) -> list[int]:
  """The number of 0-d operands of each call of the cross entropy's kernels in a jaxpr."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "custom_jvp_call":
      name = eqn.params["call_jaxpr"].jaxpr.debug_info.func_name
      if name in ("_kernel", "_kernel_ce"):
        out.append(sum(1 for v in eqn.invars if not v.aval.shape))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          out.extend(_kernel_scalars(sub))
  return out


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_options_at_zero_leave_the_program_unchanged(rng, alpha):
  s, t, labels = (np.float32(a) if a.dtype.kind == "f" else a for a in _data(rng))

  def program(**opts):
    fn = lambda s, t: distillation_loss(s, t, labels, alpha=alpha, **opts)  # noqa: E731
    grad = jax.value_and_grad(fn)
    return jax.make_jaxpr(fn)(s, t), str(jax.make_jaxpr(grad)(s, t)), jax.jit(grad).lower(s, t)

  default = program()
  for zero in (0, 0.0, np.float32(0.0)):
    off = program(label_smoothing=zero, z_loss=zero)
    assert str(off[0]) == str(default[0]) and off[1] == default[1]
    assert off[2].as_text() == default[2].as_text()
  # The kernel takes no option operand with the options off (alpha = 0: the cross entropy's
  # kernel, no scalar; alpha = 0.5: both terms', the temperature), one per option on.
  base = 0 if alpha == 0.0 else 1
  assert _kernel_scalars(default[0].jaxpr) == [base]
  assert _kernel_scalars(program(label_smoothing=0.1, z_loss=0.01)[0].jaxpr) == [base + 2]
  assert _kernel_scalars(program(z_loss=0.01)[0].jaxpr) == [base + 1]


# Bad options.


@pytest.mark.parametrize(
  ("kw", "match"),
  [
    ({"label_smoothing": 1.5}, r"label_smoothing must be a number in \[0, 1\]"),
    ({"label_smoothing": -0.1}, r"label_smoothing must be a number in \[0, 1\]"),
    ({"z_loss": -1e-4}, "z_loss must be a non-negative, finite number"),
    ({"z_loss": float("inf")}, "z_loss must be a non-negative, finite number"),
    ({"z_loss": float("nan")}, "z_loss must be a non-negative, finite number"),
    ({"z_loss": np.ones(2)}, "z_loss must be a scalar"),
  ],
)
@pytest.mark.parametrize("fn", ["distillation_loss", "fused_distillation_loss", "fused_topk"])
def test_bad_options_raise(rng, kw, match, fn):
  with pytest.raises(ValueError, match=f"{_NAMES[fn]}: {match}"):
    _CALLS[fn](rng, labels=True, **kw)


@pytest.mark.parametrize("fn", ["distillation_loss", "fused_distillation_loss", "fused_topk"])
def test_options_without_labels(rng, fn):
  """No labels, no cross entropy: a static option raises; a traced one has no effect."""
  with pytest.raises(ValueError, match="z_loss apply to the label cross entropy; pass labels"):
    _CALLS[fn](rng, labels=False, z_loss=0.01)
  with pytest.raises(ValueError, match="label_smoothing and z_loss apply"):
    _CALLS[fn](rng, labels=False, z_loss=0.01, label_smoothing=0.1)
  plain = _CALLS[fn](rng, labels=False)
  traced = jax.jit(lambda e: _CALLS[fn](rng, labels=False, label_smoothing=e))(0.1)
  np.testing.assert_allclose(traced, plain, rtol=1e-6)


@pytest.mark.parametrize("fn", ["distillation_loss", "fused_distillation_loss", "fused_topk"])
def test_traced_invalid_options_give_nan(rng, fn):
  call = jax.jit(
    lambda e, z: _CALLS[fn](rng, labels=True, return_parts=True, label_smoothing=e, z_loss=z)
  )
  for eps, z_loss in ((1.5, 0.0), (-0.1, 0.0), (0.0, -1.0), (0.0, np.inf), (np.nan, 0.0)):
    loss, parts = call(eps, z_loss)
    assert all(np.isnan(x) for x in (loss, parts.soft, parts.hard))
  for eps, z_loss in ((1.0, 0.0), (0.0, 0.0), (0.5, 1e3)):  # the ends of the ranges are valid
    assert all(np.isfinite(x) for x in jax.tree.leaves(call(eps, z_loss)))


def _student(rng, n=6, h=4, v=V):
  r = np.random.default_rng(0)
  return (
    r.normal(size=(n, h)).astype(np.float32),
    r.normal(size=(h, v)).astype(np.float32),
    r.normal(size=(n, h)).astype(np.float32),
    r.normal(size=(h, v)).astype(np.float32),
    np.array([1, 2, -100, 3, 0, 6]),
  )


def _call_materialised(rng, labels, **kw):
  h, w, th, tw, y = _student(rng)
  return distillation_loss(h @ w, th @ tw, y if labels else None, **kw)


def _call_fused(rng, labels, **kw):
  h, w, th, tw, y = _student(rng)
  return fused_distillation_loss(h, w, th, tw, y if labels else None, chunk_size=4, **kw)


def _topk(th, tw, k=3):
  lp, ids = jax.lax.top_k(jax.nn.log_softmax(jnp.asarray(th @ tw)), k)
  return ids, lp


def _call_topk(rng, labels, **kw):
  h, w, th, tw, y = _student(rng)
  ids, lp = _topk(th, tw)
  return fused_topk_distillation_loss(h, w, ids, lp, y if labels else None, chunk_size=4, **kw)


_CALLS = {
  "distillation_loss": _call_materialised,
  "fused_distillation_loss": _call_fused,
  "fused_topk": _call_topk,
}
_NAMES = {
  "distillation_loss": "distillation_loss",
  "fused_distillation_loss": "fused_distillation_loss",
  "fused_topk": "fused_topk_distillation_loss",
}


# The fused losses: equal to the materialised loss, and the cross entropy to optax.


def _fused_data(rng, n=11, h=5, v=V, bias=True):
  f = lambda *shape: rng.normal(size=shape)  # noqa: E731
  labels = rng.integers(0, v, size=n)
  labels[[2, 7]] = -100
  return f(n, h), f(h, v) / np.sqrt(h) * 2, f(v) * 0.5 if bias else None, f(n, h), f(h, v), labels


def test_fused_matches_materialised_and_optax(x64, rng):
  h, w, b, th, tw, labels = _fused_data(rng)
  where = np.ones(len(labels), bool)
  where[4] = False
  kw = {"temperature": 2.0, "where": where}

  @jax.jit
  @functools.partial(jax.value_and_grad, argnums=(0, 1, 2))
  def fused(h, w, b, alpha, eps, z_loss):
    return fused_distillation_loss(
      h, w, th, tw, labels, bias=b, chunk_size=4, alpha=alpha, label_smoothing=eps,
      z_loss=z_loss, **kw,
    )  # fmt: skip

  @jax.jit
  @functools.partial(jax.value_and_grad, argnums=(0, 1, 2))
  def materialised(h, w, b, alpha, eps, z_loss):
    z = h @ w + b[None]
    return distillation_loss(
      z, th @ tw, labels, alpha=alpha, label_smoothing=eps, z_loss=z_loss, **kw
    )

  for eps, z_loss in OPTIONS:
    for alpha in (0.0, 0.4):
      got = fused(h, w, b, alpha, eps, z_loss)
      want = materialised(h, w, b, alpha, eps, z_loss)
      _close(jax.tree.leaves(got), jax.tree.leaves(want), rtol=1e-12)
    # The cross entropy alone, against optax and the z-loss formula through the head.
    hard, g, n = np_hard(h @ w + b[None], labels, eps, z_loss, valid=where)
    got = fused(h, w, b, 0.0, eps, z_loss)
    g = g / n
    _close([got[0], *got[1]], [hard / n, g @ w.T, h.T @ g, g.sum(0)])


def test_fused_topk_matches_the_topk_divergence_and_optax(x64, rng):
  eps, z_loss = OPTIONS[2]
  h, w, b, th, tw, labels = _fused_data(rng)
  ids, lp = _topk(th, tw)
  opts = {"label_smoothing": eps, "z_loss": z_loss, "temperature": 2.0, "softcap": 4.0}

  def fused(h, w, b):
    return fused_topk_distillation_loss(
      h, w, ids, lp, labels, bias=b, chunk_size=4, alpha=0.3, tail="bucket", **opts
    )

  def want(h, w, b):
    z = h @ w + b[None]
    div = divergence_from_topk(z, ids, lp, tail="bucket", temperature=2.0, softcap=4.0)
    valid = labels != -100
    return 0.3 * 4.0 * jnp.sum(jnp.where(valid, div, 0.0)) / valid.sum()

  got = jax.jit(jax.value_and_grad(fused, argnums=(0, 1, 2)))(h, w, b)
  soft = jax.jit(jax.value_and_grad(want, argnums=(0, 1, 2)))(h, w, b)
  hard, g, n = np_hard(h @ w + b[None], labels, eps, z_loss, cap=4.0)
  g = 0.7 * g / n
  _close(
    jax.tree.leaves(got),
    [soft[0] + 0.7 * hard / n, *(a + b for a, b in zip(soft[1], (g @ w.T, h.T @ g, g.sum(0))))],
  )


def test_fused_bf16_against_float32(rng):
  *floats, labels = _fused_data(rng, n=9, v=40)
  h, w, b, th, tw = (np.asarray(a, np.float32) for a in floats)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
  opts = {"label_smoothing": 0.1, "z_loss": 0.01, "chunk_size": 4}

  def fused(h, w, b, th, tw):
    return fused_distillation_loss(h, w, th, tw, labels, bias=b, **opts)

  vg = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))
  got = vg(bf(h), bf(w), bf(b), bf(th), bf(tw))
  up = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  want = vg(*(up(bf(a)) for a in (h, w, b, th, tw)))
  assert got[0].dtype == jnp.bfloat16
  for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, r = np.asarray(a, np.float32), np.asarray(r)
    np.testing.assert_allclose(a, r, rtol=1.6e-2, atol=1.6e-2 * np.abs(r).max())
