"""Every divergence of the engine on every public path: distillation_loss, the fused head,
axis_name, and the former per-divergence functions.

References: the float64 ports of the authors' code (``_references.REFERENCES``) for the
divergence, a NumPy cross entropy for the hard loss, and JAX autodiff of the ``jnp`` ports
for the gradients; the fused head against ``distillation_loss`` on materialised logits and
against the NumPy port; the vocabulary-parallel calls against the unsharded ones
(``multidevice``: 8 simulated devices).
"""

import _references as refs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import count_compiles
from jax.sharding import PartitionSpec as P

import kldiv_jax as kd
from kldiv_jax import Divergence

# One case per divergence, with parameters other than the defaults where it has some.
CASES = {
  "forward_kl": ("forward_kl", {}),
  "reverse_kl": ("reverse_kl", {}),
  "jsd[0.3]": ("jsd", {"beta": 0.3}),
  "symmetric_kl[0.7]": ("symmetric_kl", {"lam": 0.7}),
  "skew_kl[0.2]": ("skew_kl", {"alpha": 0.2}),
  "skew_reverse_kl[0.3]": ("skew_reverse_kl", {"alpha": 0.3}),
  "tvd": ("tvd", {}),
  "alpha_beta[0.6,0.3]": ("alpha_beta", {"alpha": 0.6, "beta": 0.3}),
}
IDS = list(CASES)


def _data(rng, shape=(2, 5, 9)):
  s = 2.0 * rng.normal(size=shape)
  t = 2.0 * rng.normal(size=shape)
  labels = rng.integers(0, shape[-1], size=shape[:-1])
  labels.flat[[1, labels.size - 2]] = -100
  return s, t, labels


def _reference_loss(name, params, s, t, labels, temperature, alpha, xp=np):
  """``alpha T^2 D + (1 - alpha) CE`` over the labelled tokens, from the authors' formula."""
  div = refs.REFERENCES[name](s, t, temperature, xp=xp, **params) * temperature**2
  valid = labels != -100
  log_q1 = refs.np_log_softmax(s, xp=xp)
  safe = xp.where(valid, labels, 0)
  ce = -xp.take_along_axis(log_q1, safe[..., None], axis=-1)[..., 0]
  per_token = alpha * div + (1 - alpha) * ce
  return xp.sum(xp.where(valid, per_token, 0.0)) / max(int(np.sum(valid)), 1)


@pytest.mark.parametrize("case", IDS)
def test_distillation_loss_every_divergence(x64, rng, case):
  """Value and gradients wrt both logits against the authors' formula plus the cross entropy."""
  name, params = CASES[case]
  s, t, labels = _data(rng)
  spec = Divergence(name, **params)

  def ours(s, t):
    return kd.distillation_loss(s, t, labels, temperature=1.7, alpha=0.4, divergence=spec)

  def ref(s, t):
    return _reference_loss(name, params, s, t, labels, 1.7, 0.4, xp=jnp)

  value, grads = jax.value_and_grad(ours, argnums=(0, 1))(s, t)
  want = _reference_loss(name, params, s, t, labels, 1.7, 0.4)
  np.testing.assert_allclose(value, want, rtol=1e-11)
  for got, exp in zip(grads, jax.grad(ref, argnums=(0, 1))(s, t)):
    np.testing.assert_allclose(got, exp, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("name", ["symmetric_kl", "skew_kl", "skew_reverse_kl", "tvd"])
def test_loss_strings_select_the_default_parameters(rng, name):
  s, t, labels = _data(rng)
  by_name = kd.distillation_loss(s, t, labels, divergence=name, temperature=2.0)
  by_spec = kd.distillation_loss(s, t, labels, divergence=Divergence(name), temperature=2.0)
  np.testing.assert_array_equal(by_name, by_spec)
  want = _reference_loss(
    name,
    dict(zip(Divergence(name).formula.param_names, Divergence(name).formula.defaults or ())),
    s,
    t,
    labels,
    2.0,
    0.5,
  )
  np.testing.assert_allclose(by_name, want, rtol=2e-5)


def test_jsd_string_takes_the_loss_beta(rng):
  """TRL-style ``divergence="jsd", beta=...`` is ``Divergence("jsd", beta=...)``."""
  s, t, labels = _data(rng)
  for beta in (0.0, 0.3, 1.0):
    legacy = kd.distillation_loss(s, t, labels, divergence="jsd", beta=beta)
    spec = kd.distillation_loss(s, t, labels, divergence=Divergence("jsd", beta=beta))
    np.testing.assert_array_equal(legacy, spec)


def test_traced_parameters_in_the_losses_do_not_recompile(rng):
  s, t, labels = _data(rng)
  s, t = s.astype(np.float32), t.astype(np.float32)

  @jax.jit
  def step(s, t, spec):
    return jax.value_and_grad(
      lambda s: kd.distillation_loss(s, t, labels, divergence=spec, temperature=2.0)
    )(s)

  step(s, t, Divergence("skew_kl", alpha=jnp.float32(0.1)))
  with count_compiles() as compiles:
    for a in (0.2, 0.5, 0.9):
      value, _ = step(s, t, Divergence("skew_kl", alpha=jnp.float32(a)))
      want = _reference_loss("skew_kl", {"alpha": a}, s, t, labels, 2.0, 0.5)
      np.testing.assert_allclose(value, want, rtol=2e-5)
  assert compiles == []


def test_invalid_traced_parameter_makes_the_losses_nan(rng):
  s, t, labels = _data(rng)
  bad = Divergence("skew_kl", alpha=jnp.float32(1.5))
  value, grad = jax.value_and_grad(lambda s: kd.distillation_loss(s, t, labels, divergence=bad))(
    s.astype(np.float32)
  )
  assert np.isnan(value) and np.all(np.isnan(grad))
  student, teacher = _head(rng)
  fused = kd.fused_distillation_loss(*student, *teacher, divergence=bad)
  assert np.isnan(fused)


def test_bad_divergence_names_the_loss(rng):
  s, t, labels = _data(rng)
  with pytest.raises(ValueError, match=r"distillation_loss: divergence must be one of .*'tvd'"):
    kd.distillation_loss(s, t, labels, divergence="kl")
  with pytest.raises(TypeError, match="fused_distillation_loss: divergence must be one of"):
    kd.fused_distillation_loss(*_head(rng)[0], *_head(rng)[1], divergence=3)
  with pytest.raises(ValueError, match=r"alpha_beta.*no default"):
    kd.distillation_loss(s, t, labels, divergence="alpha_beta")


# ---------------------------------------------------------------- the fused LM head


def _head(rng, tokens=11, hidden=6, vocab=23):
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
  student = (normal(tokens, hidden), normal(hidden, vocab) / np.float32(np.sqrt(hidden)))
  teacher = (normal(tokens, hidden + 2), normal(hidden + 2, vocab) / np.float32(np.sqrt(hidden)))
  return student, teacher


@pytest.mark.parametrize("case", IDS)
def test_fused_every_divergence(rng, case):
  """Equal to distillation_loss on the materialised logits (value, gradients wrt hidden and
  weight), and to the authors' formula in float64 NumPy."""
  name, params = CASES[case]
  (h, w), (th, tw) = _head(rng)
  spec = Divergence(name, **params)
  where = np.ones(h.shape[0], bool)
  where[[2, 7]] = False

  def fused(h, w):
    return kd.fused_distillation_loss(
      h, w, th, tw, divergence=spec, temperature=1.5, where=where, chunk_size=4
    )

  def materialised(h, w):
    return kd.distillation_loss(h @ w, th @ tw, divergence=spec, temperature=1.5, where=where)

  got = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(h, w)
  want = jax.jit(jax.value_and_grad(materialised, argnums=(0, 1)))(h, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
  z = h.astype(np.float64) @ w.astype(np.float64)
  y = th.astype(np.float64) @ tw.astype(np.float64)
  per_token = refs.REFERENCES[name](z, y, 1.5, **params) * 1.5**2
  np.testing.assert_allclose(got[0], per_token[where].mean(), rtol=2e-5)


def test_fused_traced_parameter_does_not_recompile(rng):
  (h, w), (th, tw) = _head(rng)

  @jax.jit
  def step(h, w, spec):
    return jax.value_and_grad(
      lambda w: kd.fused_distillation_loss(h, w, th, tw, divergence=spec, chunk_size=4)
    )(w)

  step(h, w, Divergence("alpha_beta", alpha=jnp.float32(0.5), beta=jnp.float32(0.5)))
  with count_compiles() as compiles:
    for a, b in ((0.3, 0.9), (1.0, 0.0), (0.5, -0.5)):
      value, _ = step(h, w, Divergence("alpha_beta", alpha=jnp.float32(a), beta=jnp.float32(b)))
      per_token = refs.REFERENCES["alpha_beta"](h @ w, th @ tw, alpha=a, beta=b)
      np.testing.assert_allclose(value, per_token.mean(), rtol=1e-4)
  assert compiles == []


# ---------------------------------------------------------------- vocabulary parallel


@pytest.mark.multidevice
@pytest.mark.parametrize(
  "case", ["reverse_kl", "skew_reverse_kl[0.3]", "tvd", "alpha_beta[0.6,0.3]"]
)
def test_vocab_parallel_losses_every_divergence(cpu_devices, case):
  """distillation_loss (labels, alpha) and the fused head with axis_name == unsharded."""
  name, params = CASES[case]
  spec = Divergence(name, **{k: jnp.float32(v) for k, v in params.items()})
  rng = np.random.default_rng(1)
  s, t, labels = (a.astype(np.float32) if a.dtype == np.float64 else a for a in _data(rng, (4, 16)))
  mesh = jax.sharding.Mesh(np.array(cpu_devices), ("vocab",))

  def distill(s, t, spec, axis_name=None):
    return kd.distillation_loss(
      s, t, labels, divergence=spec, temperature=1.5, alpha=0.3, axis_name=axis_name
    )

  sharded = jax.shard_map(
    lambda s, t, spec: distill(s, t, spec, "vocab"),
    mesh=mesh,
    in_specs=(P(None, "vocab"), P(None, "vocab"), P()),
    out_specs=P(),
  )
  got = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1)))(s, t, spec)
  want = jax.jit(jax.value_and_grad(distill, argnums=(0, 1)))(s, t, spec)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  (h, w), (th, tw) = _head(rng, tokens=6, vocab=32)

  def fused(h, w, axis_name=None):
    return kd.fused_distillation_loss(
      h, w, th, tw, divergence=spec, temperature=1.5, chunk_size=4, axis_name=axis_name
    )

  fused_sharded = jax.shard_map(
    lambda h, w, tw: kd.fused_distillation_loss(
      h, w, th, tw, divergence=spec, temperature=1.5, chunk_size=4, axis_name="vocab"
    ),
    mesh=mesh,
    in_specs=(P(), P(None, "vocab"), P(None, "vocab")),
    out_specs=P(),
  )
  got = jax.jit(jax.value_and_grad(fused_sharded, argnums=(0, 1)))(h, w, tw)
  want = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(h, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the former functions


def test_former_functions_are_the_engine(rng):
  """kl_div_from_logits and generalized_jsd equal divergence_from_logits bit for bit."""
  s, t, _ = _data(rng)
  s, t = s.astype(np.float32), t.astype(np.float32)
  s[0, 0, :3] = -np.inf
  pairs = [
    (kd.kl_div_from_logits(s, t, temperature=2.0), "forward_kl"),
    (kd.kl_div_from_logits(s, t, temperature=2.0, direction="reverse"), "reverse_kl"),
    (kd.generalized_jsd(s, t, temperature=2.0, beta=0.3), Divergence("jsd", beta=0.3)),
  ]
  for got, spec in pairs:
    want = kd.divergence_from_logits(s, t, divergence=spec, temperature=2.0)
    np.testing.assert_array_equal(got, want)
