"""policy_loss against verl's and TRL's policy losses ported to float64 NumPy and, live, to torch (tests/_references.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import (
  central_difference,
  np_verl_kl_penalty,
  pack,
  packed_segment_ids,
  torch_policy_loss_and_grad,
  trl_grpo_loss,
  trl_vllm_is_ratio,
  verl_agg_loss,
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
  ("vanilla", "seq-mean-token-sum-norm", {}, dict(dual_clip=3.0)),  # verl 0.9: / (sequences T)
  ("vanilla", "token-sum", {}, dict(dual_clip=3.0)),  # verl 0.9
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


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_verl_dro_is_gpg_plus_k2_to_the_old_policy(x64, rng, mode):
  """verl 0.9's ``dro`` policy loss, -(A log pi - beta/2 (log pi - log pi_old)^2): GPG's
  surrogate plus beta * k2 to the old policy as the reference."""
  logp, old, adv, mask = batch(rng, per_token_adv=True)
  loss, m, grad = ours(logp, old, adv, mask, surrogate="gpg", aggregation=mode,
                       ref_log_probs=old, beta=0.3, kl_estimator="k2")  # fmt: skip

  def ref(x):
    return verl_policy_loss("dro", old, x, adv, mask, mode, dro_beta=0.3)[0]

  check(loss, grad, ref, logp)
  np.testing.assert_allclose(m.approx_kl, verl_policy_loss("dro", old, logp, adv, mask, mode,
                                                           dro_beta=0.3)[2], rtol=1e-12)  # fmt: skip


@pytest.mark.parametrize(
  ("level", "threshold", "kind", "bounds"),
  [("token", 1.5, "truncate", (None, 1.5)), ("sequence", 1.5, "truncate", (None, 1.5)),
   ("token", "0.9_1.2", "mask", (0.9, 1.2))],  # verl 0.9's IcePop: a "lower_upper" threshold
)  # fmt: skip
def test_verl_rollout_correction_kl_and_entropy(x64, rng, level, threshold, kind, bounds):
  """verl's actor: pg_loss (with TIS or IcePop weights) + kl_coef * agg(kl) - entropy_coeff *
  agg(entropy)."""
  logp, old, adv, mask = batch(rng)
  rollout = old + 0.2 * rng.normal(size=(B, T))
  ref_lp = logp + 0.5 * rng.normal(size=(B, T))
  ent = rng.uniform(0.1, 2.0, (B, T))
  mode = "seq-mean-token-mean"
  loss, m, grad = ours(
    logp, old, adv, mask, dual_clip=3.0, aggregation=mode, rollout_log_probs=rollout,
    rollout_correction=f"{level}_{kind}", rollout_bounds=bounds, ref_log_probs=ref_lp,
    beta=0.1, kl_estimator="k3", kl_clip=20.0, entropy=ent, entropy_coef=0.01,
  )  # fmt: skip
  w = verl_rollout_is_weights(old, rollout, mask, level, threshold)
  assert kind != "mask" or ((w == 0) & (mask > 0)).any()  # IcePop drops some counted tokens

  def ref(x):
    pg = verl_policy_loss("vanilla", old, x, adv, mask, mode, rollout_w=w)[0]
    kl = verl_agg_loss(np_verl_kl_penalty(x, ref_lp, "low_var_kl")[0], mask, mode)
    return pg + 0.1 * kl - 0.01 * verl_agg_loss(ent, mask, mode)

  check(loss, grad, ref, logp)
  kl_mean = (np_verl_kl_penalty(logp, ref_lp, "k3")[0] * mask).sum() / mask.sum()
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


TORCH = [
  # peer, its name, its kwargs, our kwargs, the clip metric that must be > 0 (the clip bites)
  ("verl", "vanilla", dict(clip_high=0.28, clip_c=1.5), dict(clip_high=0.28, dual_clip=1.5), "clip_dual"),
  ("verl", "vanilla", dict(mode="seq-mean-token-mean"), dict(dual_clip=3.0, aggregation="seq-mean-token-mean"), "clip_high"),
  ("verl", "gspo", dict(clip_low=0.02, clip_high=0.02), dict(surrogate="gspo-token", clip_low=0.02), "clip_high"),
  ("verl", "cispo", dict(clip_low=0.3, clip_high=0.1), dict(surrogate="cispo", clip_low=0.3, clip_high=0.1), "clip_high"),
  ("trl", "cispo", dict(eps_high=1.5, num_items_in_batch=12.0), dict(surrogate="cispo-cap", ratio_cap=1.5, normalizer=12.0), "clip_high"),
  ("trl", "grpo", dict(beta=0.1, bias_kl=True),
   dict(aggregation="seq-mean-token-mean", normalizer=4, beta=0.1, kl_importance_weighted=True), "clip_high"),
  ("trl", "dapo", dict(beta=0.04, eps_high=0.28, num_items_in_batch=12.0),
   dict(clip_high=0.28, normalizer=12.0, beta=0.04), "clip_low"),
]  # fmt: skip


@pytest.mark.torch
@pytest.mark.parametrize("peer, name, peer_kw, kw, bites", TORCH)
def test_matches_verl_and_trl_in_torch(torch, x64, rng, peer, name, peer_kw, kw, bites):
  """Live twin of the NumPy ports: verl's and TRL's code run in torch float64, autograd
  gradients; wider ratios than ``batch``'s (so that every clip bites), per-token advantages for
  verl, one per sequence for TRL."""
  logp, _, adv, mask = batch(rng, per_token_adv=peer == "verl")
  old = np.minimum(logp + rng.normal(size=(B, T)), -0.01)
  if "beta" in kw:
    ref_lp = logp + 0.5 * rng.normal(size=(B, T))
    kw, peer_kw = dict(kw, ref_log_probs=ref_lp), dict(peer_kw, ref=ref_lp)
  if peer == "trl":
    adv = adv[:, :1]
  elif name != "gspo":
    kw = {"aggregation": peer_kw.get("mode", "token-mean"), **kw}
  expected, expected_grad = torch_policy_loss_and_grad(peer, name, logp, old, adv, mask, **peer_kw)
  loss, metrics, grad = ours(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss, expected, rtol=1e-7, atol=1e-12)  # verl's +1e-8
  np.testing.assert_allclose(grad, expected_grad, rtol=1e-7, atol=1e-12)
  assert getattr(metrics, bites) > 0


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


PACKED = ((dict(dual_clip=3.0), "vanilla"), (dict(surrogate="gspo-token"), "gspo"))


@jax.jit
def packed_losses_and_grads(logp, old, adv, ids):
  """Both ``PACKED`` configurations' values and gradients, compiled once (a new shape: eager
  dispatch would compile every op anew)."""

  def loss(x, kw):
    return policy_loss(x, old, adv, segment_ids=ids, aggregation="seq-mean-token-mean", **kw)[0]

  return [jax.value_and_grad(loss)(logp, kw) for kw, _ in PACKED]


def test_packed_sequences_do_not_mix(x64, rng):
  """Two rows packing the four sequences of ``batch`` (segment ids 1, 2; 0 is padding) give
  verl's per-sequence losses (and GSPO's sequence ratios) of the unpacked batch."""
  logp, old, adv, mask = batch(rng)
  packed = np.stack([pack(x, mask) for x in (logp, old, adv)])  # [seq0 | pad], [seq1, seq3 | pad]
  ids = packed_segment_ids(mask)
  packed[:, 1, 7] = -np.inf, 0.0, 5.0  # padding: cannot leak
  results = packed_losses_and_grads(*packed, ids)
  for (_, verl_name), (got, grads) in zip(PACKED, results):
    expected = verl_policy_loss(verl_name, old, logp, adv, mask, "seq-mean-token-mean")[0]
    np.testing.assert_allclose(got, expected, rtol=1e-7)  # verl's +1e-8
    assert np.all(np.isfinite(grads)) and grads[1, 7] == 0 and grads[0, 6:].sum() == 0


MICRO_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")  # seq-mean-token-sum: the same N


@jax.jit
def micro_batch_losses(logp, old, adv, mask, normalizers):
  return [
    policy_loss(logp, old, adv, where=mask, aggregation=agg, normalizer=n)[0]
    for agg, n in zip(MICRO_AGGREGATIONS, normalizers)
  ]


def test_micro_batches_add_up_with_a_global_normalizer(x64, rng):
  """Two micro-batches of two rows (one with the empty row) add up to the batch's loss."""
  logp, old, adv, mask = batch(rng)
  normalizers = (mask.sum(), (mask.sum(-1) > 0).sum())  # the global tokens, sequences
  parts = [
    micro_batch_losses(logp[s], old[s], adv[s], mask[s] > 0, normalizers)
    for s in (slice(0, 2), slice(2, 4))
  ]
  for agg, part0, part1 in zip(MICRO_AGGREGATIONS, *parts):
    full = policy_loss(logp, old, adv, where=mask > 0, aggregation=agg)[0]
    np.testing.assert_allclose(part0 + part1, full, rtol=1e-12)


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


@jax.jit
def loss_and_grad_with_traced_options(logp, old, adv, mask, clip, normalizer, ids):
  def loss(x):
    return policy_loss(
      x, old, adv, where=mask, clip_low=clip, normalizer=normalizer, segment_ids=ids
    )[0]

  return jax.value_and_grad(loss)(logp)


def test_masked_padding_and_invalid_values(rng):
  """-inf padding neither leaks into the loss nor its gradient; invalid traced options
  (a negative clip, a zero normalizer, segment ids out of [0, T]) give NaN."""
  logp, old, adv, mask = (np.asarray(a, np.float32) for a in batch(rng))
  logp = np.where(mask > 0, logp, -np.inf)
  ids = np.ones((B, T), np.int32)  # one sequence a row: the rows' own layout
  expected = trl_grpo_loss("dapo", logp, old, adv[:, :1], mask, num_items_in_batch=10.0)
  loss, grad = loss_and_grad_with_traced_options(logp, old, adv, mask > 0, 0.2, 10.0, ids)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  assert np.all(np.isfinite(grad)) and np.all(grad[mask == 0] == 0)
  for clip, normalizer, bad_ids in ((-0.1, 10.0, ids), (0.2, 0.0, ids), (0.2, 10.0, ids + T)):
    loss, _ = loss_and_grad_with_traced_options(logp, old, adv, mask > 0, clip, normalizer, bad_ids)
    assert np.isnan(loss)


def test_jit_vmap_bf16(rng):
  """float32 under jit and vmap, and bf16, against the float64 references (verl's GSPO, TRL's
  DAPO); a bf16/float32 mix computes and returns float32."""
  logp, old, adv, mask = (np.asarray(a, np.float32) for a in batch(rng))
  f = functools.partial(policy_loss, surrogate="gspo", where=mask > 0)
  stacked = np.stack([logp, logp + 0.1])
  batched = jax.jit(jax.vmap(lambda x: f(x, old, adv)[0]))(stacked)
  expected = [verl_policy_loss("gspo", old, x.astype(float), adv, mask)[0] for x in stacked]
  np.testing.assert_allclose(batched, expected, rtol=1e-5)
  bf16 = [jnp.asarray(a, jnp.bfloat16) for a in (logp, old, adv)]
  mixed = jax.eval_shape(lambda x, o: f(x, o, adv)[0], *bf16[:2])
  assert mixed.dtype == jnp.float32  # adv is float32: the promoted dtype
  bf = jax.jit(lambda *a: policy_loss(*a, where=mask > 0)[0])(*bf16)
  assert bf.dtype == jnp.bfloat16
  rounded = [np.asarray(a, np.float64) for a in bf16]
  expected = trl_grpo_loss(
    "dapo", rounded[0], rounded[1], rounded[2][:, :1], mask, num_items_in_batch=mask.sum()
  )
  np.testing.assert_allclose(float(bf), expected, rtol=1e-2)


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
    (dict(beta=-0.1), ValueError, "beta must be a finite number >= 0"),
    (dict(beta=np.inf), ValueError, "beta must be a finite number >= 0"),
  ],
)
def test_bad_options_raise(kw, error, match):
  x = np.zeros((B, T), np.float32)
  with pytest.raises(error, match=f"policy_loss: {match}"):
    policy_loss(x, x, x, **kw)


def test_a_negative_traced_beta_is_nan():
  """``beta`` is a KL coefficient (>= 0), not JSD's [0, 1]: 2.0 is valid, a traced -0.1 NaN."""
  x = jnp.zeros((B, T))
  ref = x - 0.5
  loss = jax.jit(lambda b: policy_loss(x, x, x, ref_log_probs=ref, beta=b)[0])
  assert np.isfinite(loss(2.0)) and np.isnan(loss(-0.1))


def test_advantages_shapes_have_one_meaning(rng):
  """``[B]`` and ``[B, 1]`` are per sequence, ``[B, T]`` per token; a ``[T]`` row (per token
  for ``B != T``, but per sequence for ``B == T``) raises, naming the shapes."""
  logp, old, _, mask = batch(rng)
  adv = rng.normal(size=B)
  f = functools.partial(policy_loss, logp, old, where=mask > 0)
  want = f(np.repeat(adv[:, None], T, 1))[0]
  np.testing.assert_allclose(f(adv)[0], want, rtol=1e-6)
  np.testing.assert_allclose(f(adv[:, None])[0], want, rtol=1e-6)
  with pytest.raises(ValueError, match=r"advantages must have shape \(4,\) .* got \(6,\)"):
    f(rng.normal(size=T))
  with pytest.raises(ValueError, match=r"advantages must have shape"):
    f(rng.normal(size=(1, B, T)))
  square = np.zeros((3, 3))  # B == T: [3] is per sequence
  per_seq = np.array([1.0, -1.0, 2.0])
  got = policy_loss(square - 0.1, square - 0.2, per_seq, aggregation="token-sum")[0]
  want = policy_loss(square - 0.1, square - 0.2, np.repeat(per_seq[:, None], 3, 1),
                     aggregation="token-sum")[0]  # fmt: skip
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_entropy_metric_is_nan_when_not_given(rng):
  """No ``entropy``: the metric is NaN (nothing measured), not a 0 that looks measured."""
  logp, old, adv, mask = batch(rng)
  _, m = policy_loss(logp, old, adv, where=mask > 0)
  assert np.isnan(m.entropy)
  _, m = policy_loss(logp, old, adv, where=mask > 0, entropy=np.full((B, T), 0.5))
  np.testing.assert_allclose(m.entropy, 0.5, rtol=1e-6)
