"""kldiv_jax losses inside jitted Optax update steps (the README's pattern).

A linear softmax model is fitted to a known target distribution, so the
optimum is known in closed form: the model's distribution equals the target.
"""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from kldiv_jax import KLDivLoss, kl_divergence

N, D, C = 64, 4, 3


@pytest.fixture
def problem(rng):
  x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
  w_true = rng.normal(size=(D, C))
  b_true = rng.normal(size=(C,))
  p = jax.nn.softmax(x @ jnp.asarray(w_true, jnp.float32) + jnp.asarray(b_true[None], jnp.float32))
  params = {"w": jnp.zeros((D, C)), "b": jnp.zeros((C,))}
  return x, p, params


def log_predictions(params, x):
  return jax.nn.log_softmax(x @ params["w"] + params["b"][None])


def numpy_kl(params, x, p):
  """float64 NumPy KL(p || model), averaged over the batch."""
  z = np.asarray(x, np.float64) @ np.asarray(params["w"], np.float64) + np.asarray(params["b"])
  log_q = z - z.max(-1, keepdims=True)
  log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
  p = np.asarray(p, np.float64)
  return float(np.mean(np.sum(p * (np.log(p) - log_q), axis=-1)))


def train(step, params, opt_state, x, p, steps):
  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state, x, p)
    losses.append(float(loss))
  return params, losses


OPTIMIZER = optax.adam(5e-2)


@functools.partial(jax.jit, static_argnums=0)
@chex.assert_max_traces(n=1)
def module_step(loss_fn, params, opt_state, x, p):
  """One Adam step; ``loss_fn`` (a KLDivLoss) is a static argument."""

  def objective(params):
    return loss_fn(log_predictions(params, x), p)

  loss, grads = jax.value_and_grad(objective)(params)
  updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


@jax.jit
@chex.assert_max_traces(n=1)
def per_example_step(params, opt_state, x, p):
  """One Adam step on the mean of the optax-style per-example loss."""

  def objective(params):
    return kl_divergence(log_predictions(params, x), p).mean()

  loss, grads = jax.value_and_grad(objective)(params)
  updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def check_trained(params, losses, x, p):
  initial = losses[0]
  # The reported loss is the batch-mean KL: at the zero initialisation, float64 NumPy's.
  zeros = {"w": np.zeros((D, C)), "b": np.zeros(C)}
  np.testing.assert_allclose(initial, numpy_kl(zeros, x, p), rtol=1e-5)
  assert losses[49] < 0.1 * initial  # decreases within ~50 steps
  assert all(b <= a + 1e-6 for a, b in itertools.pairwise(losses[:51]))
  # The trained model matches the target distribution.
  assert numpy_kl(params, x, p) < 1e-4
  q = jnp.exp(log_predictions(params, x))
  np.testing.assert_allclose(q, p, atol=5e-3)


def test_adam_with_kldivloss_static_argument(problem):
  x, p, params = problem
  opt_state = OPTIMIZER.init(params)
  try:
    # Equal (but distinct) loss instances hit the same compiled step.
    step = lambda *a: module_step(KLDivLoss(reduction="batchmean"), *a)  # noqa: E731
    params, losses = train(step, params, opt_state, x, p, steps=300)
  finally:
    chex.clear_trace_counter()
  check_trained(params, losses, x, p)


def test_adam_with_closed_over_kldivloss(problem):
  x, p, params = problem
  loss_fn = KLDivLoss(reduction="batchmean", log_target=True)
  log_p = jnp.log(p)

  @jax.jit
  def step(params, opt_state, x, log_p):
    loss, grads = jax.value_and_grad(lambda q: loss_fn(log_predictions(q, x), log_p))(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params, losses = train(step, params, OPTIMIZER.init(params), x, log_p, steps=300)
  check_trained(params, losses, x, p)


def test_adam_with_per_example_kl_divergence(problem):
  x, p, params = problem
  try:
    params, losses = train(per_example_step, params, OPTIMIZER.init(params), x, p, steps=300)
  finally:
    chex.clear_trace_counter()
  check_trained(params, losses, x, p)


def test_lbfgs_finds_the_closed_form_optimum(rng, x64):
  # min_z KL(p || softmax(z)) is attained at softmax(z) = p, i.e. z = log p + const.
  # float64: in float32 the loss's rounding (~1e-7) stops the line search at
  # probability errors ~1e-4, where KL's curvature makes the loss change invisible.
  p = jnp.asarray(rng.dirichlet(np.ones(6) * 2.0, size=4))
  loss_fn = KLDivLoss(reduction="batchmean")

  def value_fn(z):
    return loss_fn(jax.nn.log_softmax(z), p)

  solver = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(value_fn)

  @jax.jit
  def step(z, state):
    value, grad = value_and_grad(z, state=state)
    updates, state = solver.update(grad, state, z, value=value, grad=grad, value_fn=value_fn)
    return optax.apply_updates(z, updates), state

  z = jnp.zeros((4, 6))
  state = solver.init(z)
  initial = float(value_fn(z))
  for _ in range(25):
    z, state = step(z, state)
  assert float(value_fn(z)) < 1e-10 * initial
  np.testing.assert_allclose(jax.nn.softmax(z), p, atol=1e-6)
  # z - log p is constant per row at the optimum.
  shift = np.asarray(z) - np.log(np.asarray(p))
  np.testing.assert_allclose(shift - shift.mean(-1, keepdims=True), 0.0, atol=1e-4)
