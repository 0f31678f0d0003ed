"""policy_loss against verl's and TRL's policy losses ported to float64 NumPy (tests/_references.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import (
  central_difference,
  trl_grpo_loss,
  trl_vllm_is_ratio,
  verl_agg_loss,
  verl_kl_penalty,
  verl_policy_loss,
  verl_rollout_is_weights,
)

from kldiv_jax import policy_loss

B, T = 4, 6


def batch(rng, per_token_adv=False):
  """Float64 inputs: row 2 is empty (verl leaves it out of seq-means, TRL counts it), rows 1, 3 short."""
  logp = np.log(rng.uniform(0.05, 0.95, (B, T)))
  old = np.minimum(logp + 0.3 * rng.normal(size=(B, T)), -0.01)  # probabilities below 1
  adv = rng.normal(size=(B, T)) if per_token_adv else np.repeat(rng.normal(size=(B, 1)), T, 1)
  mask = np.ones((B, T))
  mask[1, 4:] = 0
  mask[2, :] = 0
  mask[3, 2:] = 0
  return logp, old, adv, mask


def ours(logp, old, adv, mask, **kw):
  def f(x):
    loss, metrics = policy_loss(x, old, adv, where=mask > 0, **kw)
    return loss, metrics

  (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(logp)
  return float(loss), metrics, np.asarray(grad)


def check(loss, grad, ref_fn, logp, rtol=1e-7):  # verl's +1e-8 denominators: ~1e-8 relative
  np.testing.assert_allclose(loss, ref_fn(logp), rtol=rtol, atol=1e-12)
  np.testing.assert_allclose(grad, central_difference(ref_fn, logp), rtol=1e-6, atol=1e-8)


VERL = [
  # verl's name, loss_agg_mode, verl kwargs, our kwargs
  ("vanilla", "token-mean", dict(clip_high=0.28), dict(clip_high=0.28, dual_clip=3.0)),
  ("vanilla", "seq-mean-token-mean", {}, dict(dual_clip=3.0)),
  ("vanilla", "seq-mean-token-sum", dict(clip_c=1.5), dict(dual_clip=1.5)),
  ("vanilla", "seq-mean-token-sum-norm", {}, dict(dual_clip=3.0)),
  ("gspo", "token-mean", {}, dict(surrogate="gspo-token")),  # verl: always seq-mean-token-mean
  ("gspo", "token-mean", {}, dict(surrogate="gspo")),  # = the token form (advantages per sequence)
  ("sapo", "token-mean", dict(taus=(1.0, 1.05)), dict(surrogate="sapo")),
  ("gpg", "seq-mean-token-mean", {}, dict(surrogate="gpg")),
  ("cispo", "token-mean", dict(clip_low=0.3, clip_high=0.1), dict(surrogate="cispo", clip_low=0.3, clip_high=0.1)),
  ("geo_mean", "token-mean", dict(clip_low=0.4, clip_high=0.4), dict(surrogate="gmpo", clip_low=0.4)),
  ("dppo_tv", "token-mean", dict(clip_c=20.0, clip_low=0.1, clip_high=0.1), dict(surrogate="dppo-tv", clip_low=0.1)),
  ("dppo_kl", "seq-mean-token-mean", dict(clip_c=1.2, clip_low=0.05, clip_high=0.02),
   dict(surrogate="dppo-kl", clip_low=0.05, clip_high=0.02, ratio_cap=1.2)),
]  # fmt: skip


@pytest.mark.parametrize("verl_name, mode, verl_kw, kw", VERL)
def test_matches_verl_policy_losses(x64, rng, verl_name, mode, verl_kw, kw):
  logp, old, adv, mask = batch(rng)
  default_agg = verl_name in ("gspo", "sapo", "geo_mean")  # verl ignores loss_agg_mode for these
  loss, m, grad = ours(logp, old, adv, mask, **kw, **({} if default_agg else {"aggregation": mode}))

  def ref(x):
    return verl_policy_loss(verl_name, old, x, adv, mask, mode, **verl_kw, logp_sg=logp)[0]

  check(loss, grad, ref, logp)
  _, frac, ppo_kl, frac_lower = verl_policy_loss(verl_name, old, logp, adv, mask, mode, **verl_kw)
  if verl_name not in ("sapo", "gpg"):
    np.testing.assert_allclose(m.approx_kl, ppo_kl, rtol=1e-12)
  if verl_name in ("vanilla", "gspo", "cispo"):
    np.testing.assert_allclose(m.clip_low + m.clip_high, frac, rtol=1e-12)
  if verl_name == "vanilla":
    np.testing.assert_allclose(m.clip_dual, frac_lower, rtol=1e-12)
  if verl_name == "geo_mean":
    np.testing.assert_allclose((m.clip_high, m.clip_low), (frac, frac_lower), rtol=1e-12)
  if verl_name.startswith("dppo"):
    np.testing.assert_allclose((m.clip_high, m.clip_dual), (frac, frac_lower), rtol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_rollout_correction_kl_and_entropy(x64, rng, level):
  """verl's actor: pg_loss (with TIS weights) + kl_coef * agg(kl) - entropy_coeff * agg(entropy)."""
  logp, old, adv, mask = batch(rng)
  rollout = old + 0.2 * rng.normal(size=(B, T))
  ref_lp = logp + 0.5 * rng.normal(size=(B, T))
  ent = rng.uniform(0.1, 2.0, (B, T))
  mode = "seq-mean-token-mean"
  loss, m, grad = ours(
    logp, old, adv, mask, dual_clip=3.0, aggregation=mode, rollout_log_probs=rollout,
    rollout_correction=f"{level}_truncate", rollout_bounds=(None, 1.5), ref_log_probs=ref_lp,
    beta=0.1, kl_estimator="k3", kl_clip=20.0, entropy=ent, entropy_coef=0.01,
  )  # fmt: skip
  w = verl_rollout_is_weights(old, rollout, mask, level, 1.5)

  def ref(x):
    pg = verl_policy_loss("vanilla", old, x, adv, mask, mode, rollout_w=w)[0]
    kl = verl_agg_loss(verl_kl_penalty(x, ref_lp, "low_var_kl"), mask, mode)
    return pg + 0.1 * kl - 0.01 * verl_agg_loss(ent, mask, mode)

  check(loss, grad, ref, logp)
  kl_mean = (verl_kl_penalty(logp, ref_lp, "k3") * mask).sum() / mask.sum()
  np.testing.assert_allclose((m.kl, m.entropy), (kl_mean, (ent * mask).sum() / mask.sum()))


TRL = [
  # TRL's loss_type, TRL kwargs, our kwargs (B = 4 rows, T = max_completion_length = 6)
  ("grpo", {}, dict(aggregation="seq-mean-token-mean", normalizer=4)),
  ("bnpo", dict(eps_high=0.28), dict(aggregation="bnpo", clip_high=0.28)),
  ("dr_grpo", dict(max_completion_length=T), dict(aggregation="seq-mean-token-sum-norm", normalizer=4 * T)),
  ("dapo", dict(num_items_in_batch=20.0, delta=1.3), dict(normalizer=20.0, ratio_cap=1.3)),
  ("cispo", dict(eps_high=1.1, num_items_in_batch=12.0),
   dict(surrogate="cispo-cap", ratio_cap=1.1, normalizer=12.0)),
  ("sapo", dict(temps=(0.9, 1.2)), dict(surrogate="sapo", sapo_temperatures=(0.9, 1.2), normalizer=4)),
  ("luspo", dict(level="sequence"), dict(surrogate="gspo", aggregation="seq-mean-token-sum", normalizer=4)),
  ("grpo", dict(level="sequence", beta=0.04, bias_kl=True),
   dict(surrogate="gspo", aggregation="seq-mean-token-mean", normalizer=4, beta=0.04,
        kl_importance_weighted=True)),
  ("grpo", dict(beta=0.1, bias_kl=True),
   dict(aggregation="seq-mean-token-mean", normalizer=4, beta=0.1, kl_importance_weighted=True)),
  ("dapo", dict(beta=0.1, num_items_in_batch=12.0), dict(normalizer=12.0, beta=0.1)),
]  # fmt: skip


@pytest.mark.parametrize("loss_type, trl_kw, kw", TRL)
def test_matches_trl_grpo_loss(x64, rng, loss_type, trl_kw, kw):
  logp, old, adv, mask = batch(rng)
  ref_lp = logp + 0.5 * rng.normal(size=(B, T))
  if "beta" in trl_kw:
    kw = dict(kw, ref_log_probs=ref_lp)
  loss, m, grad = ours(logp, old, adv[:, 0], mask, **kw)  # advantages one per sequence

  def ref(x):
    return trl_grpo_loss(loss_type, x, old, adv[:, :1], mask, ref=ref_lp, logp_sg=logp, **trl_kw)

  check(loss, grad, ref, logp)
  if loss_type in ("grpo", "bnpo") and "level" not in trl_kw:
    coef = np.exp(logp - old)
    low = ((coef < 0.8) & (adv < 0) & (mask > 0)).sum() / mask.sum()
    high = ((coef > 1 + trl_kw.get("eps_high", 0.2)) & (adv > 0) & (mask > 0)).sum() / mask.sum()
    np.testing.assert_allclose((m.clip_low, m.clip_high), (low, high), rtol=1e-12)


@pytest.mark.parametrize(
  "mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
)
def test_trl_vllm_importance_sampling(x64, rng, mode):
  logp, old, adv, mask = batch(rng)
  sampling = old + 0.3 * rng.normal(size=(B, T))
  bounds = (0.8, 1.25)
  loss, _, grad = ours(
    logp, old, adv, mask, normalizer=10.0, rollout_log_probs=sampling,
    rollout_correction=mode, rollout_bounds=bounds,
  )  # fmt: skip
  ratio = trl_vllm_is_ratio(old, sampling, mask, mode, *bounds)
  assert np.any(ratio == 0) or mode.endswith("truncate")  # the mask masks something

  def ref(x):
    return trl_grpo_loss("dapo", x, old, adv[:, :1], mask, is_ratio=ratio, num_items_in_batch=10.0)

  check(loss, grad, ref, logp)


def test_packed_sequences_do_not_mix(x64, rng):
  """Two rows packing the four sequences of ``batch`` (segment ids 1, 2; 0 is padding) give
  verl's per-sequence losses (and GSPO's sequence ratios) of the unpacked batch."""
  logp, old, adv, mask = batch(rng)
  lengths = mask.sum(-1).astype(int)  # 6, 4, 0, 2
  packed = np.zeros((3, 2, 8))  # logp, old, adv for rows [seq0 | pad], [seq1, seq3 | pad]
  ids = np.zeros((2, 8), np.int32)
  packed[:, 0, :6] = logp[0], old[0], adv[0]
  ids[0, :6] = 1
  for start, seq, sid in ((0, 1, 1), (4, 3, 2)):
    n = lengths[seq]
    packed[:, 1, start : start + n] = logp[seq, :n], old[seq, :n], adv[seq, :n]
    ids[1, start : start + n] = sid
  packed[:, 1, 7] = -np.inf, 0.0, 5.0  # padding: cannot leak
  for kw, verl_name in ((dict(dual_clip=3.0), "vanilla"), (dict(surrogate="gspo-token"), "gspo")):
    expected = verl_policy_loss(verl_name, old, logp, adv, mask, "seq-mean-token-mean")[0]
    got, grads = jax.value_and_grad(
      lambda x, kw=kw: policy_loss(
        x, packed[1], packed[2], segment_ids=ids, aggregation="seq-mean-token-mean", **kw
      )[0]
    )(packed[0])
    np.testing.assert_allclose(got, expected, rtol=1e-7)  # verl's +1e-8
    assert np.all(np.isfinite(grads)) and grads[1, 7] == 0 and grads[0, 6:].sum() == 0


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_add_up_with_a_global_normalizer(x64, rng, aggregation):
  logp, old, adv, mask = batch(rng)
  full, _ = policy_loss(logp, old, adv, where=mask > 0, aggregation=aggregation)
  n = mask.sum() if aggregation == "token-mean" else (mask.sum(-1) > 0).sum()
  parts = [
    policy_loss(logp[s], old[s], adv[s], where=mask[s] > 0, aggregation=aggregation, normalizer=n)[
      0
    ]
    for s in (slice(0, 1), slice(1, 4))
  ]
  np.testing.assert_allclose(sum(parts), full, rtol=1e-12)


def test_metrics_and_kl_out_of_the_loss(x64, rng):
  logp, old, adv, mask = batch(rng)
  ref_lp = logp - 0.3
  with_kl, m = policy_loss(
    logp, old, adv, where=mask > 0, ref_log_probs=ref_lp, beta=0.5, kl_in_loss=False
  )
  without, m0 = policy_loss(logp, old, adv, where=mask > 0)
  r = np.exp(logp - old)[mask > 0]
  assert with_kl == without and m0.kl == 0
  np.testing.assert_allclose(m.kl, np.exp(-0.3) - 1 + 0.3, rtol=1e-12)
  np.testing.assert_allclose((m.ratio_min, m.ratio_max, m.ratio_mean), (r.min(), r.max(), r.mean()))
  assert (m.tokens, m.sequences) == (12, 3)


def test_masked_padding_and_invalid_values(rng):
  logp, old, adv, mask = (np.asarray(a, np.float32) for a in batch(rng))
  logp = np.where(mask > 0, logp, -np.inf)
  loss, grad = jax.value_and_grad(lambda x: policy_loss(x, old, adv, where=mask > 0)[0])(logp)
  assert np.isfinite(loss) and np.all(grad[mask == 0] == 0)

  @jax.jit
  def traced(clip, normalizer):
    return policy_loss(logp, old, adv, where=mask > 0, clip_low=clip, normalizer=normalizer)[0]

  assert np.isfinite(traced(0.2, 10.0))
  assert np.isnan(traced(-0.1, 10.0)) and np.isnan(traced(0.2, 0.0))
  ids = np.full((B, T), T + 1, np.int32)  # out of [0, T]
  assert np.isnan(policy_loss(logp, old, adv, segment_ids=ids)[0])


def test_jit_vmap_bf16(rng):
  logp, old, adv, mask = (np.asarray(a, np.float32) for a in batch(rng))
  f = functools.partial(policy_loss, surrogate="gspo", where=mask > 0)
  loss = f(logp, old, adv)[0]
  np.testing.assert_allclose(jax.jit(lambda *a: f(*a)[0])(logp, old, adv), loss, rtol=1e-6)
  stacked = np.stack([logp, logp + 0.1])
  batched = jax.vmap(lambda x: f(x, old, adv)[0])(stacked)
  np.testing.assert_allclose(batched, [loss, f(logp + 0.1, old, adv)[0]], rtol=1e-6)
  bf = f(jnp.asarray(logp, jnp.bfloat16), jnp.asarray(old, jnp.bfloat16), adv)[0]
  assert bf.dtype == jnp.float32  # adv is float32: the promoted dtype
  bf = policy_loss(*(jnp.asarray(a, jnp.bfloat16) for a in (logp, old, adv)), where=mask > 0)[0]
  assert bf.dtype == jnp.bfloat16
  ref = policy_loss(
    *(np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (logp, old, adv)),
    where=mask > 0,
  )[0]
  np.testing.assert_allclose(float(bf), ref, rtol=1e-2)


@pytest.mark.parametrize(
  "kw, error, match",
  [
    (dict(surrogate="grpo"), ValueError, "surrogate must be one of"),
    (dict(aggregation="seq-mean"), ValueError, "aggregation must be one of"),
    (dict(clip_low=-0.1), ValueError, "clip_low must be a number >= 0"),
    (dict(dual_clip=1.0), ValueError, "dual_clip must be a number > 1"),
    (dict(surrogate="cispo-cap"), ValueError, "surrogate='cispo-cap' needs ratio_cap"),
    (dict(kl_estimator="k4"), ValueError, "kl_estimator must be one of"),
    (dict(rollout_correction="token"), ValueError, "rollout_correction must be one of"),
    (dict(segment_ids=np.ones((B, T))), TypeError, "segment_ids must be an integer array"),
    (
      dict(segment_ids=np.ones((B,), np.int32)),
      ValueError,
      "segment_ids must have the tokens' shape",
    ),
    (dict(kl_in_loss=1), TypeError, "kl_in_loss must be a bool"),
  ],
)
def test_bad_options_raise(kw, error, match):
  x = np.zeros((B, T), np.float32)
  with pytest.raises(error, match=f"policy_loss: {match}"):
    policy_loss(x, x, x, **kw)
