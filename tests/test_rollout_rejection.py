"""Rollout rejection sampling (``rollout_rejection``, ``rollout_rejection_mask``) and
batch-normalised rollout weights (``rollout_normalize``) against verl 0.9.1's
rollout_corr_helper ported to float64 NumPy (tests/_references.py; live against verl itself:
test_integration_verl.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import (
  central_difference,
  pack,
  packed_segment_ids,
  verl_batch_normalize,
  verl_policy_loss,
  verl_rejection_keep,
  verl_rollout_is_weights,
)

from kldiv_jax import policy_loss, rollout_rejection_mask

B, T = 4, 6
# Each mode of verl's rollout_rs (SUPPORTED_ROLLOUT_RS_OPTIONS) with its bound, verl's name
# -> ours (k1: bounds on pi_rollout / pi_old).
MODES = {
  "token_k1": (0.85, 1.2),
  "token_k2": 0.02,
  "token_k3": 0.02,
  "seq_sum_k1": (0.9, 1.1),
  "seq_sum_k2": 0.05,
  "seq_sum_k3": 0.05,
  "seq_mean_k1": (1 / 1.1, 1.1),
  "seq_mean_k2": 0.015,
  "seq_mean_k3": 0.015,
  "seq_max_k2": 0.04,
  "seq_max_k3": 0.04,
}


def ours_name(mode):
  return mode.replace("seq_", "sequence_")


def batch(rng):
  logp = np.log(rng.uniform(0.05, 0.95, (B, T)))
  old = np.minimum(logp + 0.3 * rng.normal(size=(B, T)), -0.01)
  adv = np.repeat(rng.normal(size=(B, 1)), T, 1)
  mask = np.ones((B, T), bool)
  mask[1, 4:] = mask[2, :] = mask[3, 2:] = False
  rollout = np.minimum(old + 0.2 * rng.normal(size=(B, T)), -0.01)
  return logp, old, adv, mask, rollout


def check(logp, old, adv, kw, ref):
  f = lambda x: policy_loss(x, old, adv, **kw)  # noqa: E731
  (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
  np.testing.assert_allclose(loss, ref(logp), rtol=1e-7, atol=1e-13)  # verl's +1e-8
  np.testing.assert_allclose(grad, central_difference(ref, logp), rtol=1e-6, atol=1e-8)
  return metrics


@pytest.mark.parametrize("modes", [*([m] for m in MODES), ["token_k1", "seq_mean_k3"]])
def test_every_mode_matches_verl(x64, modes):
  logp, old, adv, mask, rollout = batch(np.random.default_rng(4))
  spec = {m: MODES[m] for m in modes}
  kept = verl_rejection_keep(old, rollout, mask, spec)
  assert 0 < kept.sum() < mask.sum()  # the bound bites
  agg = "seq-mean-token-mean"
  kw = dict(where=mask, aggregation=agg, dual_clip=3.0, rollout_log_probs=rollout,
            rollout_correction=None, rollout_rejection={ours_name(m): b for m, b in spec.items()})  # fmt: skip
  m = check(logp, old, adv, kw, lambda x: verl_policy_loss("vanilla", old, x, adv, kept, agg)[0])
  np.testing.assert_allclose(m.rejected, 1 - kept.sum() / mask.sum(), rtol=1e-12)
  assert m.tokens == kept.sum()
  got = rollout_rejection_mask(old, rollout, kw["rollout_rejection"], where=mask)
  np.testing.assert_array_equal(got, kept)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize(("level", "threshold", "kind", "bounds"),
                         [("token", 1.5, "truncate", (None, 1.5)),
                          ("sequence", "0.5_2.0", "mask", (0.5, 2.0))])  # fmt: skip
def test_normalized_weights_and_rejection(x64, level, threshold, kind, bounds, normalize):
  """The weights (normalised or not) from the mask before the rejection, as verl."""
  logp, old, adv, mask, rollout = batch(np.random.default_rng(5))
  w = verl_rollout_is_weights(old, rollout, mask, level, threshold)
  if normalize:
    w = verl_batch_normalize(w, mask, level)
  kept = verl_rejection_keep(old, rollout, mask, {"seq_max_k2": 0.04})
  kw = dict(where=mask, dual_clip=3.0, rollout_log_probs=rollout,
            rollout_correction=f"{level}_{kind}", rollout_bounds=bounds,
            rollout_normalize=normalize, rollout_rejection={"sequence_max_k2": 0.04})  # fmt: skip
  ref = lambda x: verl_policy_loss("vanilla", old, x, adv, kept, "token-mean", rollout_w=w)[0]  # noqa: E731
  check(logp, old, adv, kw, ref)


def test_on_policy_rejection_and_rollout_kl(x64):
  """``old_log_probs=None`` (verl's bypass mode with REINFORCE): the statistics and weights from
  the current policy, without gradient; ``rollout_kl`` is verl's ``ppo_kl`` there."""
  logp, _, adv, mask, rollout = batch(np.random.default_rng(6))
  kept = verl_rejection_keep(logp, rollout, mask, {"token_k2": 0.1})
  w = verl_rollout_is_weights(logp, rollout, mask, "token", 2.0)
  kw = dict(where=mask, surrogate="gpg", rollout_log_probs=rollout, rollout_bounds=(None, 2.0),
            rollout_rejection={"token_k2": 0.1})  # fmt: skip
  m = check(logp, None, adv, kw, lambda x: (-(adv * x * w) * kept).sum() / kept.sum())
  np.testing.assert_allclose(m.rollout_kl, (rollout - logp)[kept].mean(), rtol=1e-12)


def test_packed_sequences_are_their_own(x64):
  """Sequence statistics per (row, segment id): two rows packing the batch's three sequences
  reject what verl rejects in the unpacked batch."""
  _, old, _, mask, rollout = batch(np.random.default_rng(4))
  spec = {"seq_sum_k1": (0.9, 1.1), "seq_max_k3": 0.04}
  kept = verl_rejection_keep(old, rollout, mask, spec)
  packed = [pack(old, mask), pack(rollout, mask)]
  ids, want = packed_segment_ids(mask), pack(kept, mask, fill=False)
  got = rollout_rejection_mask(*packed, {ours_name(m): b for m, b in spec.items()}, segment_ids=ids)
  np.testing.assert_array_equal(got, want)


def test_nan_is_not_rejected():
  """A NaN statistic is not "outside the bounds": the token stays, the loss is NaN."""
  x = np.zeros((1, 3), np.float32)
  rollout = np.array([[0.0, np.nan, 0.0]], np.float32)
  keep = rollout_rejection_mask(x, rollout, {"token_k2": 0.1})
  np.testing.assert_array_equal(keep, [[True, True, True]])
  kw = dict(rollout_log_probs=rollout, rollout_rejection={"token_k2": 0.1})
  assert np.isnan(policy_loss(x, x, np.ones(1), **kw)[0])


def test_jit_vmap_float32(rng):
  logp, old, adv, mask, rollout = (np.asarray(a, np.float32) if a.dtype != bool else a
                                   for a in batch(rng))  # fmt: skip
  kw = dict(where=mask, rollout_log_probs=rollout, rollout_normalize=True,
            rollout_rejection={"sequence_mean_k3": 0.015, "token_k1": 1.3})  # fmt: skip
  eager = policy_loss(logp, old, adv, **kw)
  jitted = jax.jit(lambda x: policy_loss(x, old, adv, **kw))(logp)
  np.testing.assert_allclose(jitted[0], eager[0], rtol=1e-6)
  assert eager[0].dtype == jnp.float32 and 0 < eager[1].rejected < 1
  stacked = jax.vmap(lambda x: policy_loss(x, old, adv, **kw)[0])(np.stack([logp, logp]))
  np.testing.assert_allclose(stacked, [eager[0], eager[0]], rtol=1e-6)


@pytest.mark.parametrize(
  ("kw", "error", "match"),
  [(dict(rollout_rejection={"seq_mean_k3": 0.1}), ValueError, "rollout_rejection modes must be"),
   (dict(rollout_rejection={"token_k2": -1.0}), ValueError, "bounds must be > 0"),
   (dict(rollout_rejection={"token_k1": (2.0, 1.0)}), ValueError, "needs low <= high"),
   (dict(rollout_rejection={"token_k2": jnp.asarray(0.1)}), TypeError, "Python numbers"),
   (dict(rollout_rejection=0.1), TypeError, "must map modes to bounds"),
   (dict(rollout_rejection={}), ValueError, "at least one mode"),
   (dict(rollout_normalize=True, rollout_correction=None), ValueError, "needs a rollout_corr"),
   (dict(rollout_normalize=1), TypeError, "rollout_normalize must be a bool")],
)  # fmt: skip
def test_bad_options_raise(kw, error, match):
  x = np.zeros((B, T), np.float32)
  with pytest.raises(error, match=f"policy_loss: .*{match}"):
    policy_loss(x, x, x[:, 0], rollout_log_probs=x, **kw)
  with pytest.raises(ValueError, match="policy_loss: rollout_rejection and rollout_normalize need"):
    policy_loss(x, x, x[:, 0], rollout_rejection={"token_k2": 0.1})
