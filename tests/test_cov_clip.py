"""policy_loss's "clip-cov" and "kl-cov" against verl 0.9.1's clip_cov and kl_cov ported to
float64 NumPy (tests/_references.py; live against verl itself: test_integration_verl.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import (
  central_difference,
  pack,
  packed_segment_ids,
  verl_agg_loss,
  verl_cov_losses,
)

from kldiv_jax import policy_loss

B, T = 4, 6
AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")  # fmt: skip


def batch(rng):
  logp = np.log(rng.uniform(0.05, 0.95, (B, T)))
  old = np.minimum(logp + 0.3 * rng.normal(size=(B, T)), -0.01)
  adv = rng.normal(size=(B, T))  # per token: the covariance ranks tokens, not sequences
  mask = np.ones((B, T), bool)
  mask[1, 4:] = mask[2, :] = mask[3, 2:] = False
  return logp, old, adv, mask


def value_and_grad(logp, old, adv, **kw):
  f = lambda x: policy_loss(x, old, adv, **kw)  # noqa: E731
  (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
  return loss, grad, metrics


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize(
  ("name", "kw", "ref_kw"),
  [("clip_cov", dict(cov_fraction=0.3, cov_bounds=(0.0, 5.0), clip_high=0.28),
    dict(ratio=0.3, bounds=(0.0, 5.0), clip_high=0.28)),
   ("clip_cov", dict(cov_fraction=1.0, cov_bounds=(-1.0, 1.0)), dict(ratio=1.0, bounds=(-1.0, 1.0))),
   ("kl_cov", dict(cov_fraction=0.2, cov_kl_coef=0.5), dict(ratio=0.2, coef=0.5)),
   ("kl_cov", {}, dict(ratio=2e-4))],  # verl's defaults: one token, coefficient 0.1
)  # fmt: skip
def test_matches_verl(x64, rng, name, kw, ref_kw, mode):
  logp, old, adv, mask = batch(rng)
  surrogate = name.replace("_", "-")
  loss, grad, m = value_and_grad(logp, old, adv, surrogate=surrogate, aggregation=mode,
                                 where=mask, **kw)  # fmt: skip
  selected, losses = verl_cov_losses(name, old, logp, adv, mask, **ref_kw)
  assert selected.any()
  ref = lambda x: verl_agg_loss(losses(x), mask, mode)  # noqa: E731
  np.testing.assert_allclose(loss, ref(logp), rtol=1e-7, atol=1e-13)  # verl's +1e-8
  np.testing.assert_allclose(grad, central_difference(ref, logp), rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(m.clip_high, selected.sum() / mask.sum(), rtol=1e-12)
  assert m.clip_low == 0


def test_clip_cov_key_is_a_random_choice_among_the_candidates(x64, rng):
  """With ``cov_key`` the choice follows ``jax.random.permutation(key, tokens)``: the same
  key, the same choice (as verl's with that order); another key, another choice."""
  logp, old, adv, mask = batch(rng)
  kw = dict(surrogate="clip-cov", cov_fraction=0.2, cov_bounds=(0.0, 5.0), where=mask)
  grads = []
  for seed in range(4):
    key = jax.random.key(seed)
    loss, grad, _ = value_and_grad(logp, old, adv, cov_key=key, **kw)
    priority = np.asarray(jax.random.permutation(key, B * T))  # each token's rank
    _, losses = verl_cov_losses("clip_cov", old, logp, adv, mask, ratio=0.2, bounds=(0.0, 5.0),
                                order=np.argsort(priority))  # fmt: skip
    np.testing.assert_allclose(loss, verl_agg_loss(losses(logp), mask, "token-mean"), rtol=1e-12)
    grads.append(grad)
  assert any(not np.array_equal(grads[0], g) for g in grads[1:])


def test_kl_cov_packed_equals_unpacked(x64, rng):
  """KL-Cov's top-k does not depend on where the tokens sit: two rows packing the batch's
  three sequences (segment_ids) give the unpacked loss and its gradient."""
  logp, old, adv, mask = batch(rng)
  packed = np.stack([pack(x, mask) for x in (logp, old, adv)])
  ids = packed_segment_ids(mask)
  packed[:, 1, 7] = -np.inf, 0.0, 5.0  # padding: cannot leak
  kw = dict(surrogate="kl-cov", cov_fraction=0.3, aggregation="seq-mean-token-mean")
  want, want_grad, _ = value_and_grad(logp, old, adv, where=mask, **kw)
  got, grad, _ = value_and_grad(*packed, segment_ids=ids, **kw)
  np.testing.assert_allclose(got, want, rtol=1e-12)
  np.testing.assert_allclose(grad[0, :6], want_grad[0], rtol=1e-12)
  np.testing.assert_allclose(grad[1, 4:6], want_grad[3, :2], rtol=1e-12)
  assert grad[1, 7] == 0 and np.isfinite(grad).all()


@pytest.mark.parametrize("surrogate", ["clip-cov", "kl-cov"])
def test_jit_vmap_float32_bf16(rng, surrogate):
  logp, old, adv, mask = (np.asarray(x, np.float32) if x.dtype != bool else x for x in batch(rng))
  kw = dict(surrogate=surrogate, cov_fraction=0.3, cov_bounds=(0.0, 5.0), where=mask)
  eager = policy_loss(logp, old, adv, **kw)[0]
  np.testing.assert_allclose(jax.jit(lambda x: policy_loss(x, old, adv, **kw)[0])(logp), eager,
                             rtol=1e-6)  # fmt: skip
  stacked = jax.vmap(lambda x: policy_loss(x, old, adv, **kw)[0])(np.stack([logp, logp - 0.1]))
  np.testing.assert_allclose(stacked[0], eager, rtol=1e-6)
  bf16 = policy_loss(jnp.asarray(logp, jnp.bfloat16), old, adv, **kw)[0]
  assert bf16.dtype == jnp.float32 and np.isfinite(bf16)  # promoted with the float32 old
  low = policy_loss(*(jnp.asarray(x, jnp.bfloat16) for x in (logp, old, adv)), **kw)[0]
  assert low.dtype == jnp.bfloat16 and np.isfinite(low)


@pytest.mark.parametrize(
  ("kw", "error", "match"),
  [(dict(cov_fraction=0.0), ValueError, "cov_fraction must be > 0"),
   (dict(cov_fraction=jnp.asarray(0.1)), TypeError, "cov_fraction must be a Python number"),
   (dict(cov_bounds=1.0), TypeError, "cov_bounds must be a pair"),
   (dict(cov_kl_coef=np.inf), ValueError, "cov_kl_coef must be finite"),
   (dict(cov_key=3), TypeError, "cov_key must be a jax.random key")],
)  # fmt: skip
def test_bad_options_raise(kw, error, match):
  x = np.zeros((B, T), np.float32)
  with pytest.raises(error, match=f"policy_loss: {match}"):
    policy_loss(x, x, x, surrogate="clip-cov", **kw)
