"""policy_loss's VESPO surrogate, off-policy sequence mask, top-entropy selection and sequence
clip metrics against float64 NumPy written from their definitions (TRL 1.16's
``GRPOTrainer``: ``get_gamma_weights``, ``get_off_policy_mask``, ``get_high_entropy_mask``).

Every aggregation, masks and ``segment_ids`` (a sequence is a (row, id) pair), with per-sequence
and per-token advantages; value, gradient (central differences, or VESPO's closed form: its
weight carries no gradient), metrics; jit, vmap, float32 and bf16, x64 on and off; errors.
The live comparison with TRL's installed code: tests/test_integration_trl.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import central_difference

from kldiv_jax import fused_policy_loss, policy_loss, rollout_rejection_mask, token_log_probs

B, T = 4, 6
SEGMENTS = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0], [0] * T, [1, 2, 2, 3, 3, 3]])
AGGREGATIONS = [
  "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
  "seq-mean-token-sum-norm", "bnpo",
]  # fmt: skip


def batch(rng, per_token_adv=False):
  """Float64 inputs: row 2 empty, rows 1 and 3 short."""
  logp = np.log(rng.uniform(0.05, 0.95, (B, T)))
  old = np.minimum(logp + 0.3 * rng.normal(size=(B, T)), -0.01)
  rollout = np.minimum(old + 0.3 * rng.normal(size=(B, T)), -0.01)
  entropy = rng.uniform(0.0, 2.0, (B, T))
  adv = rng.normal(size=(B, T)) if per_token_adv else np.array([1.0, -0.6, 0.7, -1.3])
  mask = np.ones((B, T))
  mask[1, 4:] = 0
  mask[2, :] = 0
  mask[3, 2:] = 0
  return dict(logp=logp, old=old, rollout=rollout, entropy=entropy, adv=adv, mask=mask)


def sequences(mask, segment_ids=None):
  """``[S, B, T]`` 0/1 indicators of each sequence's counted tokens (rows, or (row, id) pairs)."""
  if segment_ids is None:
    out = [np.where(np.arange(B)[:, None] == i, mask, 0.0) for i in range(B)]
  else:
    out = [
      np.where((np.arange(B)[:, None] == i) & (segment_ids == s), mask, 0.0)
      for i in range(B) for s in range(1, T + 1)
    ]  # fmt: skip
  return np.array([s for s in out if s.sum() > 0])


def aggregate(x, mask, seqs, aggregation):
  """Our aggregations in NumPy (checked against verl and TRL in test_policy.py); the counted
  tokens are those of the sequences (segment id 0 is padding)."""
  n_seq, mask = len(seqs), seqs.sum(0)
  if aggregation in ("token-mean", "bnpo"):
    return (x * mask).sum() / max(mask.sum(), 1.0)
  if aggregation == "token-sum":
    return (x * mask).sum()
  if aggregation == "seq-mean-token-mean":
    return sum((x * s).sum() / s.sum() for s in seqs) / max(n_seq, 1)
  if aggregation == "seq-mean-token-sum":
    return (x * mask).sum() / max(n_seq, 1)
  return (x * mask).sum() / max(n_seq * T, 1)  # seq-mean-token-sum-norm


def np_phi(log_w, adv, gamma):
  """TRL's get_gamma_weights after its sequence sum: phi(w) = e^lam w^k e^(-lam w)."""
  k_pos, lam_pos, k_neg, lam_neg = gamma
  log_w = np.clip(log_w, np.log(1e-8), 20.0)
  k = np.where(adv >= 0, k_pos, k_neg)
  lam = np.maximum(np.where(adv >= 0, lam_pos, lam_neg), 1e-4)
  phi = np.exp(lam + k * log_w - lam * np.exp(log_w))
  return np.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def np_rollout(old, rollout, mode, bounds):
  r = np.exp(np.clip(old - rollout, -20, 20))
  lo, hi = bounds
  if mode == "token_truncate":
    return np.clip(r, lo, hi)
  return np.where(
    (r < (-np.inf if lo is None else lo)) | (r > (np.inf if hi is None else hi)), 0.0, r
  )


def np_vespo(d, seqs, gamma, rollout=None):
  """VESPO's per-token weight phi(w_i) * (its token's) and nothing else: ``[B, T]``."""
  log_r = np.clip(d["logp"] - d["old"], -20, 20)
  if rollout is not None:
    with np.errstate(divide="ignore"):  # a masked token's weight 0: log 1e-8
      log_r = log_r + np.clip(np.log(rollout), np.log(1e-8), 20)
  log_w = sum(s * (log_r * s).sum() for s in seqs)  # each token's sequence's sum
  return np_phi(log_w, np.broadcast_to(d["adv"], (B, T)) if np.ndim(d["adv"]) == 2
                else d["adv"][:, None] * np.ones((1, T)), gamma)  # fmt: skip


def ours(d, **kw):
  """``(loss, metrics, d loss / d log_probs)`` in float64."""
  seg = kw.get("segment_ids")

  def f(x):
    return policy_loss(x, d["old"], d["adv"], where=d["mask"] > 0, **kw)

  (loss, m), g = jax.value_and_grad(f, has_aux=True)(d["logp"])
  assert seg is None or seg.shape == (B, T)
  return float(loss), m, np.asarray(g)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rollout_mode", [None, "token_truncate", "token_mask"])
def test_vespo(x64, rng, aggregation, packed, rollout_mode):
  """-sg(phi(w_i)) A log pi: phi of the sequence's summed (clamped) log-ratio plus its tokens'
  log rollout weights (not multiplied in), TRL's (k, lambda) by the sign of A >= 0."""
  d = batch(rng, per_token_adv=packed)
  gamma = (1.5, 2.0, 3.0, 0.0)  # lambda_neg 0: TRL's clamp to 1e-4
  seg = SEGMENTS if packed else None
  seqs = sequences(d["mask"], seg)
  kw = dict(surrogate="vespo", vespo_gamma=gamma, aggregation=aggregation, segment_ids=seg)
  rollout = None
  if rollout_mode is not None:
    bounds = (None, 1.2) if rollout_mode == "token_truncate" else (0.8, 1.25)
    rollout = np_rollout(d["old"], d["rollout"], rollout_mode, bounds)
    kw |= dict(rollout_log_probs=d["rollout"], rollout_correction=rollout_mode,
               rollout_bounds=bounds)  # fmt: skip
    assert rollout_mode == "token_truncate" or ((rollout == 0) & (d["mask"] > 0)).any()
  loss, m, grad = ours(d, **kw)
  phi = np_vespo(d, seqs, gamma, rollout)
  adv = d["adv"] if packed else d["adv"][:, None]
  want = aggregate(-phi * adv * d["logp"], d["mask"], seqs, aggregation)
  np.testing.assert_allclose(loss, want, rtol=1e-12)
  # The gradient: phi is a constant of the step (no gradient through w).
  want_grad = central_difference(
    lambda x: aggregate(-phi * adv * x, d["mask"], seqs, aggregation), d["logp"]
  )
  np.testing.assert_allclose(grad, want_grad, rtol=1e-7, atol=1e-10)
  phi_seq = np.mean([(phi * s).sum() / s.sum() for s in seqs])
  np.testing.assert_allclose(m.vespo_phi_seq, phi_seq, rtol=1e-12)
  assert not np.allclose(phi[d["mask"] > 0], 1.0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_rollout", [False, True])
def test_off_policy_threshold(x64, rng, aggregation, packed, with_rollout):
  """The surrogate of a token with A < 0 dropped when its sequence's mean
  log pi_sampling - log pi exceeds the threshold; the denominators and the KL kept."""
  d = batch(rng, per_token_adv=packed)
  seg = SEGMENTS if packed else None
  seqs = sequences(d["mask"], seg)
  sampling = d["rollout"] if with_rollout else d["old"]
  kl_mean = sum(s * ((sampling - d["logp"]) * s).sum() / s.sum() for s in seqs)
  adv = d["adv"] if packed else d["adv"][:, None] * np.ones((1, T))
  threshold = float(np.median(kl_mean[d["mask"] > 0]))
  keep = (adv >= 0) | (kl_mean <= threshold)
  assert not keep[d["mask"] > 0].all()  # some dropped
  ref = d["logp"] + 0.4 * rng.normal(size=(B, T))
  kw = dict(aggregation=aggregation, segment_ids=seg, off_policy_threshold=threshold,
            ref_log_probs=ref, beta=0.05, clip_high=0.28)  # fmt: skip
  rollout = np.ones((B, T))
  if with_rollout:
    kw |= dict(rollout_log_probs=d["rollout"], rollout_correction="token_truncate",
               rollout_bounds=(None, 1.5))  # fmt: skip
    rollout = np_rollout(d["old"], d["rollout"], "token_truncate", (None, 1.5))
  loss, _, grad = ours(d, **kw)

  def ref_fn(x):
    r = np.exp(x - d["old"])
    pg = -np.minimum(r * adv, np.clip(r, 0.8, 1.28) * adv)
    k3 = np.exp(ref - x) - (ref - x) - 1
    return aggregate(pg * keep * rollout + 0.05 * k3, d["mask"], seqs, aggregation)

  np.testing.assert_allclose(loss, ref_fn(d["logp"]), rtol=1e-12)
  np.testing.assert_allclose(grad, central_difference(ref_fn, d["logp"]), rtol=1e-6, atol=1e-9)
  unmasked, _, _ = ours(d, **(kw | {"off_policy_threshold": None}))
  assert unmasked != loss


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.8])
def test_top_entropy_fraction(x64, rng, aggregation, packed, fraction):
  """The surrogate on the tokens with entropy >= the (1 - fraction) quantile of the call's
  counted tokens (linear interpolation); the denominators of all counted tokens."""
  d = batch(rng)
  seg = SEGMENTS if packed else None
  seqs = sequences(d["mask"], seg)
  counted = seqs.sum(0) > 0
  keep = counted & (d["entropy"] >= np.quantile(d["entropy"][counted], 1 - fraction))
  assert 0 < keep.sum() < counted.sum()
  kw = dict(aggregation=aggregation, segment_ids=seg, top_entropy_fraction=fraction,
            entropy=d["entropy"], entropy_coef=0.01)  # fmt: skip
  loss, _, grad = ours(d, **kw)
  adv = d["adv"][:, None]

  def ref_fn(x):
    r = np.exp(x - d["old"])
    pg = -np.minimum(r * adv, np.clip(r, 0.8, 1.2) * adv)
    return aggregate(pg * keep - 0.01 * d["entropy"], d["mask"], seqs, aggregation)

  np.testing.assert_allclose(loss, ref_fn(d["logp"]), rtol=1e-12)
  np.testing.assert_allclose(grad, central_difference(ref_fn, d["logp"]), rtol=1e-6, atol=1e-9)
  # A where= mask of the same tokens is another loss (its denominators change).
  if aggregation != "token-sum":
    other, _ = policy_loss(d["logp"], d["old"], d["adv"], where=keep, aggregation=aggregation,
                           segment_ids=seg, entropy=d["entropy"], entropy_coef=0.01)  # fmt: skip
    assert not np.isclose(float(other), loss)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("surrogate", ["ppo", "gspo", "cispo"])
def test_sequence_clip_metrics(x64, rng, packed, surrogate):
  """clip_low_seq/clip_high_seq: each sequence's fraction of clipped tokens, averaged over the
  sequences; clip_low_seq_min/clip_high_seq_max: their extremes (TRL's clip_ratio/low_min and
  high_max); for GSPO each sequence's one flag."""
  d = batch(rng, per_token_adv=packed)
  seg = SEGMENTS if packed else None
  seqs = sequences(d["mask"], seg)
  _, m, _ = ours(d, surrogate=surrogate, segment_ids=seg, clip_low=0.05, clip_high=0.1)
  adv = d["adv"] if packed else d["adv"][:, None] * np.ones((1, T))
  log_r = d["logp"] - d["old"]
  if surrogate == "gspo":
    log_r = sum(s * (log_r * s).sum() / s.sum() for s in seqs)
  r = np.exp(log_r)
  low, high = (r < 0.95) & (adv < 0), (r > 1.1) & (adv > 0)
  if surrogate == "cispo":
    low, high = r < 0.95, r > 1.1
  frac_low = np.array([(low * s).sum() / s.sum() for s in seqs])
  frac_high = np.array([(high * s).sum() / s.sum() for s in seqs])
  got = (m.clip_low_seq, m.clip_high_seq, m.clip_low_seq_min, m.clip_high_seq_max)
  want = (frac_low.mean(), frac_high.mean(), frac_low.min(), frac_high.max())
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
  assert frac_low.max() + frac_high.max() > 0  # something clipped
  if surrogate == "gspo" and not packed:
    assert set(frac_low) | set(frac_high) <= {0.0, 1.0}


def test_vespo_with_rejection_only(x64, rng):
  """VESPO beside verl's rollout rejection without weights (``rollout_correction=None``): the
  loss of VESPO on the tokens :func:`rollout_rejection_mask` keeps (no weights to fold in)."""
  d = batch(rng)
  modes = {"token_k1": (0.9, 1.1)}
  keep = rollout_rejection_mask(d["old"], d["rollout"], modes, where=d["mask"] > 0)
  assert 0 < int(keep.sum()) < int((d["mask"] > 0).sum())
  got, _ = policy_loss(
    d["logp"], d["old"], d["adv"], where=d["mask"] > 0, surrogate="vespo",
    rollout_log_probs=d["rollout"], rollout_correction=None, rollout_rejection=modes,
  )  # fmt: skip
  want, _ = policy_loss(d["logp"], d["old"], d["adv"], where=keep, surrogate="vespo")
  np.testing.assert_allclose(got, want, rtol=1e-13)


def test_metrics_without_tokens_are_zero(x64, rng):
  d = batch(rng)
  _, m = policy_loss(d["logp"], d["old"], d["adv"], where=np.zeros((B, T), bool), surrogate="vespo")
  assert (m.clip_low_seq_min, m.clip_high_seq_max, m.vespo_phi_seq, m.clip_low_seq) == (0, 0, 0, 0)


def test_vespo_phi_is_one_on_policy(x64, rng):
  """phi(1) = 1: on-policy VESPO is REINFORCE, -A log pi (GPG)."""
  d = batch(rng)
  vespo, m = policy_loss(d["logp"], None, d["adv"], where=d["mask"] > 0, surrogate="vespo")
  gpg, _ = policy_loss(d["logp"], None, d["adv"], where=d["mask"] > 0, surrogate="gpg")
  np.testing.assert_allclose(vespo, gpg, rtol=1e-14)
  np.testing.assert_allclose(m.vespo_phi_seq, 1.0, rtol=1e-14)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dtypes_jit_vmap_without_x64(rng, dtype):
  """float32/bf16 inputs, x64 off: the input's dtype out, jit and vmap equal to the batch."""
  d = batch(rng)
  kw = dict(surrogate="vespo", off_policy_threshold=0.0, top_entropy_fraction=0.5)
  args = [jnp.asarray(d[k], dtype) for k in ("logp", "old", "adv", "entropy")]
  where = jnp.asarray(d["mask"] > 0)

  def f(lp, old, adv, ent, where):
    return policy_loss(lp, old, adv, where=where, entropy=ent, **kw)[0]

  loss = jax.jit(f)(*args, where)
  assert loss.dtype == dtype and np.isfinite(float(loss))
  # The float32 loss of the inputs rounded to the dtype.
  want = f(*(a.astype(jnp.float32) for a in args), where)
  tol = 1.6e-2 if dtype == jnp.bfloat16 else 1e-6
  np.testing.assert_allclose(float(loss), float(want), rtol=tol, atol=tol)
  # vmap over a leading axis of two batches: each one's loss (the quantile per batch).
  stacked = [jnp.stack([a, a[::-1]]) for a in args]
  got = jax.vmap(f)(*stacked, jnp.stack([where, where[::-1]]))
  np.testing.assert_allclose(got[0], loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got[1], f(*(a[::-1] for a in args), where[::-1]), rtol=1e-5, atol=1e-7)
  g = jax.grad(f)(*args, where)
  assert g.dtype == dtype and np.isfinite(np.asarray(g, np.float32)).all()


def test_traced_threshold(x64, rng):
  d = batch(rng)
  f = jax.jit(lambda t: policy_loss(d["logp"], d["old"], d["adv"], where=d["mask"] > 0,
                                    off_policy_threshold=t)[0])  # fmt: skip
  for t in (-0.1, 0.0, 0.2):
    want, _ = policy_loss(
      d["logp"], d["old"], d["adv"], where=d["mask"] > 0, off_policy_threshold=t
    )
    np.testing.assert_allclose(f(t), want, rtol=1e-14)


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(surrogate="vespo", rollout_correction="sequence_mask"), "token_truncate"),
    (dict(vespo_gamma=(1.0, 2.0, 3.0)), "vespo_gamma must be four"),
    (dict(vespo_gamma=(1.0, -2.0, 3.0, 1.0)), "lambdas >= 0"),
    (dict(vespo_gamma=(1.0, float("nan"), 3.0, 1.0)), "finite"),
    (dict(top_entropy_fraction=1.5), r"top_entropy_fraction must be a number in \[0, 1\]"),
    (dict(top_entropy_fraction=jnp.array(0.5)), "static Python float"),
    (dict(top_entropy_fraction=0.5), "needs the per-token entropy"),
    (dict(off_policy_threshold="high"), "off_policy_threshold"),
  ],
)
def test_bad_options_raise(rng, kw, match):
  d = batch(rng)
  with pytest.raises((ValueError, TypeError), match=match):
    policy_loss(d["logp"], d["old"], d["adv"], **kw)


def test_fused_raises_as_policy_loss(rng):
  h, w = rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 5))
  ids = np.zeros((2, 3), int)
  with pytest.raises(ValueError, match="fused_policy_loss: surrogate='vespo' takes"):
    fused_policy_loss(h, w, ids, None, np.ones(2), surrogate="vespo",
                      rollout_correction="sequence_truncate")  # fmt: skip


def test_fused_top_entropy_uses_the_measured_entropy(rng):
  """fused_policy_loss's top_entropy_fraction selects on the entropy of its own logits."""
  h = rng.normal(size=(3, 5, 4)).astype(np.float32)
  w = rng.normal(size=(4, 7)).astype(np.float32)
  ids = rng.integers(0, 7, (3, 5))
  old, adv = np.full((3, 5), -2.0, np.float32), np.array([1.0, -1.0, 0.5], np.float32)
  got, _ = fused_policy_loss(h, w, ids, old, adv, top_entropy_fraction=0.4, chunk_size=4)
  lp, ent = token_log_probs(h @ w, ids, return_entropy=True)
  want, _ = policy_loss(lp, old, adv, entropy=ent, top_entropy_fraction=0.4)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  everything, _ = policy_loss(lp, old, adv, entropy=ent)
  assert not np.isclose(float(got), float(everything))
