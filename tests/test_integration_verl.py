"""policy_loss against verl itself: every policy loss, aggregation, KL estimator, rollout
correction and rejection mode of the installed verl 0.9.1 (``verl.trainer.ppo.core_algos``,
``verl.trainer.ppo.rollout_corr_helper``), run by torch 2.13.0 (CPU) in float64.

verl's functions are called as its actor calls them (``workers/utils/losses.py``, ``ppo_loss``):
``get_policy_loss_fn(loss_mode)(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights)`` with an ``ActorConfig``, then ``agg_loss`` of the
entropy and of ``kl_penalty``; the rollout weights and the rejected tokens from
``compute_rollout_correction_and_rejection_mask``. Value and gradient wrt the log-probs (torch
autograd against ``jax.grad``) and the metrics are compared. Each row of the docs' "From verl"
table is a case here. Runs where verl is installed (``make integration``), skipped elsewhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kldiv_jax import fused_policy_loss, policy_loss, rollout_rejection_mask, token_log_probs

torch = pytest.importorskip("torch")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
rollout_corr = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
actor_config = pytest.importorskip("verl.workers.config.actor")
algorithm_config = pytest.importorskip("verl.trainer.config.algorithm")

B, T = 4, 6
AGGREGATIONS = (
  "token-mean",
  "token-sum",
  "seq-mean-token-sum",
  "seq-mean-token-mean",
  "seq-mean-token-sum-norm",
)
RTOL = 1e-10  # verl's +1e-8 in its per-sequence denominators is left out here: rtol where it bites
FRACTION = 1e-7  # verl's fractions are means of float32 flags (torch's .float())


def batch(seed=0):
  """Float64 log-probs of a batch with an empty row (2) and two short ones, per-token
  advantages constant over each sequence, the sampling engine's and a reference's log-probs."""
  rng = np.random.default_rng(seed)
  logp = np.log(rng.uniform(0.05, 0.95, (B, T)))
  old = np.minimum(logp + 0.3 * rng.normal(size=(B, T)), -0.01)
  adv = np.repeat(rng.normal(size=(B, 1)), T, 1)
  mask = np.ones((B, T), bool)
  mask[1, 4:] = mask[2, :] = mask[3, 2:] = False
  rollout = np.minimum(old + 0.2 * rng.normal(size=(B, T)), -0.01)
  ref = logp + 0.5 * rng.normal(size=(B, T))
  entropy = rng.uniform(0.1, 2.0, (B, T))
  return dict(logp=logp, old=old, adv=adv, mask=mask, rollout=rollout, ref=ref, entropy=entropy)


def config(loss_mode="vanilla", clip_low=0.2, clip_high=0.2, clip_c=3.0, *, actor=None, **loss):
  """The smallest ``ActorConfig`` verl 0.9.1 accepts, with ``policy_loss`` options ``loss``."""
  policy = actor_config.PolicyLossConfig(loss_mode=loss_mode, **loss)
  return actor_config.ActorConfig(
    strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=clip_low,
    clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_c, policy_loss=policy,
    **(actor or {}),
  )  # fmt: skip


def t(x):
  return torch.tensor(np.asarray(x))


def verl_loss(d, loss_mode, mode, cfg, *, w=None, mask=None, extra=None):
  """``(loss, d loss / d logp, metrics)`` of verl's policy loss (plus ``extra(log_prob)``)."""
  lp = t(d["logp"]).requires_grad_(True)
  mask = t(d["mask"] if mask is None else mask)
  fn = core_algos.get_policy_loss_fn(loss_mode)
  loss, metrics = fn(
    old_log_prob=t(d["old"]), log_prob=lp, advantages=t(d["adv"]), response_mask=mask,
    loss_agg_mode=mode, config=cfg, rollout_is_weights=None if w is None else t(w),
  )  # fmt: skip
  if extra is not None:
    loss = loss + extra(lp, mask)
  loss.backward()
  return loss.item(), lp.grad.numpy(), metrics


def ours(d, *, fused=False, **kw):
  """``(loss, d loss / d logp, metrics)`` of policy_loss on ``d``'s batch."""
  kw = {"where": d["mask"], **kw}

  def f(x):
    return policy_loss(x, kw.pop("old_log_probs", d["old"]), d["adv"], **kw)

  (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(d["logp"]))
  return float(loss), np.asarray(grad), metrics


def check(got, want, rtol=RTOL):
  np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=1e-13)
  np.testing.assert_allclose(got[1], want[1], rtol=rtol, atol=1e-13)


# Every entry of verl's POLICY_LOSS_REGISTRY: the verl config and our keywords (the docs'
# "From verl" table). verl's clip_cov chooses its tokens with torch.randperm: patched to
# the identity in the test, which is our choice without cov_key (row-major order).
CLIP = dict(clip_low=0.2, clip_high=0.28)
REGISTRY = {
  "vanilla": (config("vanilla", **CLIP), dict(dual_clip=3.0, clip_low=0.2, clip_high=0.28)),
  "dppo_tv": (config("dppo_tv", 0.1, 0.15, 20.0), dict(surrogate="dppo-tv", clip_low=0.1,
                                                       clip_high=0.15, ratio_cap=20.0)),
  "dppo_kl": (config("dppo_kl", 0.05, 0.02, 1.2), dict(surrogate="dppo-kl", clip_low=0.05,
                                                       clip_high=0.02, ratio_cap=1.2)),
  "gspo": (config("gspo", 3e-4, 4e-4), dict(surrogate="gspo-token", clip_low=3e-4,
                                            clip_high=4e-4)),
  "sapo": (config("sapo", actor=dict(tau_pos=1.0, tau_neg=1.05)),
           dict(surrogate="sapo", sapo_temperatures=(1.0, 1.05), aggregation=None)),
  "gpg": (config("gpg"), dict(surrogate="gpg")),
  "clip_cov": (config("clip_cov", **CLIP, clip_cov_ratio=0.3, clip_cov_lb=0.0, clip_cov_ub=5.0),
               dict(surrogate="clip-cov", **CLIP, cov_fraction=0.3, cov_bounds=(0.0, 5.0))),
  "kl_cov": (config("kl_cov", kl_cov_ratio=0.2, ppo_kl_coef=0.5),
             dict(surrogate="kl-cov", cov_fraction=0.2, cov_kl_coef=0.5)),
  "geo_mean": (config("geo_mean", 0.4, 0.3), dict(surrogate="gmpo", clip_low=0.4, clip_high=0.3,
                                                 aggregation=None)),
  "dro": (config("dro", dro_beta=0.3), dict(surrogate="gpg", beta=0.3, kl_estimator="k2")),
  "cispo": (config("cispo", 0.3, 0.1), dict(surrogate="cispo", clip_low=0.3, clip_high=0.1)),
}  # fmt: skip
# bypass_mode: test_bypass_mode (the registry entry that wraps vanilla and REINFORCE).


@pytest.fixture
def identity_randperm(monkeypatch):
  monkeypatch.setattr(torch, "randperm", lambda n, **kw: torch.arange(n))


def test_the_registry_is_covered():
  assert set(core_algos.POLICY_LOSS_REGISTRY) == {*REGISTRY, "bypass_mode"}


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("loss_mode", list(REGISTRY))
def test_policy_loss_modes(x64, identity_randperm, loss_mode, mode):
  d = batch()
  cfg, kw = REGISTRY[loss_mode]
  kw = {"aggregation": mode, **kw}
  if loss_mode == "dro":
    kw["ref_log_probs"] = d["old"]
  got = ours(d, **kw)
  want = verl_loss(d, loss_mode, mode, cfg)
  check(got, want, 1e-7 if mode == "seq-mean-token-mean" or loss_mode == "geo_mean" else RTOL)
  m, vm = got[2], want[2]
  if "actor/ppo_kl" in vm:  # kl_cov's is the mean |log r|: not a PolicyMetrics field
    kl = (
      np.mean(np.abs((d["logp"] - d["old"])[d["mask"]])) if loss_mode == "kl_cov" else m.approx_kl
    )
    np.testing.assert_allclose(kl, vm["actor/ppo_kl"], rtol=1e-12)
  if loss_mode == "geo_mean":  # verl's pg_clipfrac: the A > 0 side only
    np.testing.assert_allclose(m.clip_high, vm["actor/pg_clipfrac"], rtol=FRACTION)
  elif "actor/pg_clipfrac" in vm and loss_mode != "sapo":  # SAPO reports 0: it has no clip
    np.testing.assert_allclose(m.clip_low + m.clip_high, vm["actor/pg_clipfrac"], rtol=FRACTION)
  if loss_mode in ("vanilla", "dppo_tv", "dppo_kl"):
    np.testing.assert_allclose(m.clip_dual, vm["actor/pg_clipfrac_lower"], rtol=FRACTION)
  if loss_mode == "geo_mean":
    np.testing.assert_allclose(m.clip_low, vm["actor/pg_clipfrac_lower"], rtol=FRACTION)


@pytest.mark.parametrize(
  ("ratio", "bounds", "fused"), [(2e-4, (1.0, 5.0), False), (0.3, (0.0, 5.0), False),
                                 (0.3, (-1.0, 0.5), True), (1.0, (-5.0, 5.0), False)],
)  # fmt: skip
def test_clip_cov_options(x64, identity_randperm, ratio, bounds, fused):
  """clip_cov_ratio, clip_cov_lb/ub; and that the choice bites (some tokens zeroed)."""
  d = batch(1)
  cfg = config("clip_cov", **CLIP, clip_cov_ratio=ratio, clip_cov_lb=bounds[0],
               clip_cov_ub=bounds[1])  # fmt: skip
  kw = dict(surrogate="clip-cov", **CLIP, cov_fraction=ratio, cov_bounds=bounds)
  got = ours(d, **kw)
  want = verl_loss(d, "clip_cov", "token-mean", cfg)
  check(got, want)
  np.testing.assert_allclose(got[2].clip_high, want[2]["actor/pg_clipfrac"], rtol=FRACTION)
  if fused:
    assert fused_equal(d, **kw)


@pytest.mark.parametrize(("ratio", "coef"), [(2e-4, 0.1), (0.2, 1.0), (0.5, 0.5)])
def test_kl_cov_options(x64, ratio, coef):
  d = batch(2)
  cfg = config("kl_cov", kl_cov_ratio=ratio, ppo_kl_coef=coef)
  got = ours(d, surrogate="kl-cov", cov_fraction=ratio, cov_kl_coef=coef)
  check(got, verl_loss(d, "kl_cov", "token-mean", cfg))
  assert int(got[2].clip_high * got[2].tokens + 0.5) == max(1, int(ratio * d["mask"].sum()))


def test_clip_cov_random_choice_counts(x64):
  """With a cov_key the choice is random (verl: torch.randperm): as many tokens as verl's
  ``clip_num`` among the same candidates, and another key another choice."""
  d = batch(1)
  kw = dict(surrogate="clip-cov", **CLIP, cov_fraction=0.2, cov_bounds=(0.0, 5.0))
  chosen = [ours(d, cov_key=jax.random.key(s), **kw)[2].clip_high for s in range(3)]
  clip_num = max(int(0.2 * d["mask"].sum()), 1)
  np.testing.assert_allclose(chosen, clip_num / d["mask"].sum())
  grads = [ours(d, cov_key=jax.random.key(s), **kw)[1] for s in range(4)]
  assert any(not np.array_equal(grads[0], g) for g in grads[1:])


def fused_equal(d, **kw):
  """fused_policy_loss on a head whose log-probs are ``d``'s (a one-hot hidden state per
  token, the head's columns the log-probs), against policy_loss, value and gradient."""
  n, vocab = B * T, 3
  ids = np.zeros((B, T), np.int64)
  # Logits [log p, log(1 - p), -inf]: log-softmax gives log p at id 0 exactly enough.
  p = np.exp(d["logp"])
  z = np.stack([d["logp"], np.log1p(-p), np.full_like(p, -30.0)], -1).reshape(n, vocab)
  hidden = np.eye(n).reshape(B, T, n)
  old = kw.pop("old_log_probs", d["old"])

  def fused(w):
    return fused_policy_loss(hidden, w, ids, old, d["adv"], where=d["mask"], chunk_size=5, **kw)

  def materialised(w):
    lp, ent = token_log_probs(jnp.asarray(hidden) @ w, ids, return_entropy=True)
    return policy_loss(lp, old, d["adv"], where=d["mask"], entropy=ent, **kw)

  (a, ma), ga = jax.value_and_grad(fused, has_aux=True)(jnp.asarray(z))
  (b, mb), gb = jax.value_and_grad(materialised, has_aux=True)(jnp.asarray(z))
  np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
  np.testing.assert_allclose(ga, gb, rtol=1e-9, atol=1e-12)
  for field, x, y in zip(ma._fields, ma, mb, strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-12, err_msg=field)
  return True


# verl's kl_penalty names, each ours too (kl_estimator=); low_var_kl's clamps are kl_clip=20.
KL = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL += tuple(f"{k}+" for k in KL)  # the straight-through forms (k2's gradient)


@pytest.mark.parametrize("kl_type", KL)
def test_kl_loss_and_entropy_loss(x64, kl_type):
  """verl's actor: pg_loss + kl_loss_coef * agg(kl_penalty) - entropy_coeff * agg(entropy),
  each aggregated with loss_agg_mode; the metrics kl_loss and entropy_loss."""
  d = batch(3)
  mode = AGGREGATIONS[KL.index(kl_type) % len(AGGREGATIONS)]
  cfg = config("vanilla", actor=dict(loss_agg_mode=mode, kl_loss_type=kl_type))
  ref, ent = t(d["ref"]), t(d["entropy"])

  def extra(lp, mask):
    kld = core_algos.kl_penalty(logprob=lp, ref_logprob=ref, kl_penalty=cfg.kl_loss_type)
    kl_loss = core_algos.agg_loss(kld, mask, mode)
    entropy_loss = core_algos.agg_loss(ent, mask, mode)
    extra.metrics = kl_loss.item(), entropy_loss.item()
    return 0.04 * kl_loss - 0.01 * entropy_loss

  want = verl_loss(d, "vanilla", mode, cfg, extra=extra)
  clip = 20.0 if kl_type.startswith(("k3", "low_var_kl")) else None
  got = ours(d, dual_clip=3.0, aggregation=mode, ref_log_probs=d["ref"], beta=0.04,
             kl_estimator=kl_type, kl_clip=clip, entropy=d["entropy"], entropy_coef=0.01)  # fmt: skip
  check(got, want, 1e-7 if mode == "seq-mean-token-mean" else RTOL)
  np.testing.assert_allclose((got[2].kl_loss, got[2].entropy_loss), extra.metrics, rtol=1e-7)


def verl_correction(d, **options):
  """verl's rollout weights, rejected mask and metrics (old vs rollout)."""
  proto, mask, metrics = rollout_corr.compute_rollout_correction_and_rejection_mask(
    old_log_prob=t(d["old"]), rollout_log_prob=t(d["rollout"]), response_mask=t(d["mask"]),
    **options,
  )  # fmt: skip
  w = None if proto is None else proto.batch["rollout_is_weights"].numpy()
  return w, mask.numpy().astype(bool), metrics


# rollout_rs: every mode of rollout_corr_helper (SUPPORTED_ROLLOUT_RS_OPTIONS), with bounds
# that reject some tokens (k1: bounds on pi_rollout / pi_old), and two chained.
REJECTION = {
  "token_k1": ("0.85_1.2", (0.85, 1.2)),
  "token_k2": (0.02, 0.02),
  "token_k3": (0.02, 0.02),
  "seq_sum_k1": ("0.9_1.1", (0.9, 1.1)),
  "seq_sum_k2": (0.05, 0.05),
  "seq_sum_k3": (0.05, 0.05),
  "seq_mean_k1": ("1.1", 1.1),  # one number u: (1 / u, u), verl's default
  "seq_mean_k2": (0.015, 0.015),
  "seq_mean_k3": (0.015, 0.015),
  "seq_max_k2": (0.04, 0.04),
  "seq_max_k3": (0.04, 0.04),
}
OURS = {k: k.replace("seq_", "sequence_") for k in REJECTION}


def test_every_rejection_mode_is_covered():
  assert set(REJECTION) == rollout_corr.SUPPORTED_ROLLOUT_RS_OPTIONS


@pytest.mark.parametrize("modes", [*([m] for m in REJECTION), ["token_k1", "seq_mean_k3"]])
def test_rollout_rejection(x64, modes):
  d = batch(4)
  spec = ",".join(str(REJECTION[m][0]) for m in modes)
  _, kept, metrics = verl_correction(d, rollout_is=None, rollout_rs=",".join(modes),
                                     rollout_rs_threshold=spec)  # fmt: skip
  assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1  # the bound bites
  rejection = {OURS[m]: REJECTION[m][1] for m in modes}
  mode = "seq-mean-token-mean"
  got = ours(d, dual_clip=3.0, aggregation=mode, rollout_log_probs=d["rollout"],
             rollout_correction=None, rollout_rejection=rejection)  # fmt: skip
  check(got, verl_loss(d, "vanilla", mode, config(), mask=kept), 1e-7)
  np.testing.assert_allclose(
    got[2].rejected, metrics["rollout_corr/rollout_rs_masked_fraction"], rtol=FRACTION
  )
  np.testing.assert_array_equal(
    rollout_rejection_mask(d["old"], d["rollout"], rejection, where=d["mask"]), kept
  )


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize(
  ("threshold", "kind", "bounds"), [(1.5, "truncate", (None, 1.5)), ("0.9_1.2", "mask", (0.9, 1.2))]
)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights(x64, level, threshold, kind, bounds, normalize):
  """rollout_is (TIS; IcePop with a "lower_upper" threshold), rollout_is_batch_normalize, and
  rejection on top (its weights from the unrejected mask, as verl)."""
  d = batch(5)
  w, kept, _ = verl_correction(
    d, rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize,
    rollout_rs="seq_max_k2", rollout_rs_threshold=0.04,
  )  # fmt: skip
  mode = "token-mean"
  got = ours(d, dual_clip=3.0, aggregation=mode, rollout_log_probs=d["rollout"],
             rollout_correction=f"{level}_{kind}", rollout_bounds=bounds,
             rollout_normalize=normalize, rollout_rejection={"sequence_max_k2": 0.04})  # fmt: skip
  check(got, verl_loss(d, "vanilla", mode, config(), w=w, mask=kept))


@pytest.mark.parametrize(
  ("loss_type", "rollout_is", "rs", "normalize"),
  [("ppo_clip", "token", "seq_mean_k3", False), ("ppo_clip", None, "token_k1", False),
   ("reinforce", "token", None, False), ("reinforce", "sequence", "seq_sum_k2", True),
   ("reinforce", None, "token_k2", False), ("reinforce", "token", "seq_max_k3", True)],
)  # fmt: skip
def test_bypass_mode(x64, loss_type, rollout_is, rs, normalize):
  """verl's bypass_mode: old_log_prob is the rollout's; the rejection (and REINFORCE's
  weights) compare the current policy to it; ppo_kl is mean(log pi_rollout - log pi)."""
  d = batch(6)
  thresholds = {"seq_mean_k3": 0.06, "token_k1": "0.8_1.3", "seq_sum_k2": 0.3, "token_k2": 0.1,
                "seq_max_k3": 0.15}  # fmt: skip
  ours_bounds = {"token_k1": (0.8, 1.3)}
  rc = algorithm_config.RolloutCorrectionConfig(
    rollout_is=rollout_is, rollout_is_threshold=2.0, rollout_is_batch_normalize=normalize,
    rollout_rs=rs, rollout_rs_threshold=thresholds.get(rs), loss_type=loss_type,
  )  # fmt: skip
  cfg = config("bypass_mode", rollout_correction=rc)
  verl_d = d | {"old": d["rollout"]}
  want = verl_loss(verl_d, "bypass_mode", "token-mean", cfg)
  modes = {} if rs is None else {OURS[rs]: ours_bounds.get(rs, thresholds[rs])}
  if rs is not None:
    assert 0 < want[2]["rollout_corr/rollout_rs_masked_fraction"] < 1
  if loss_type == "ppo_clip":  # the rejection from the current policy: a mask
    keep = d["mask"]
    if modes:
      keep = rollout_rejection_mask(d["logp"], d["rollout"], modes, where=d["mask"])
    got = ours(d, old_log_probs=d["rollout"], where=keep, dual_clip=3.0)
    np.testing.assert_allclose(got[2].approx_kl, want[2]["actor/ppo_kl"], rtol=1e-12)
  else:
    kw = dict(surrogate="gpg", rollout_log_probs=d["rollout"], rollout_rejection=modes or None,
              rollout_correction=None if rollout_is is None else f"{rollout_is}_truncate",
              rollout_bounds=(None, 2.0), rollout_normalize=normalize)  # fmt: skip
    got = ours(d, old_log_probs=None, **kw)
    np.testing.assert_allclose(got[2].rollout_kl, want[2]["actor/ppo_kl"], rtol=1e-12)
    if rollout_is is not None:
      assert fused_equal(d, old_log_probs=None, **kw)
  check(got, want)
  if rs is not None and loss_type == "reinforce":
    np.testing.assert_allclose(
      got[2].rejected, want[2]["rollout_corr/rollout_rs_masked_fraction"], rtol=FRACTION
    )
