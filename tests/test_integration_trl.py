"""policy_loss against TRL's own GRPOTrainer._compute_loss, live: every loss_type and loss option.

Runs where TRL is installed (``make integration``: trl 1.16.0, torch 2.13.0 CPU), skipped
elsewhere. TRL's installed ``GRPOTrainer._compute_loss`` is called as an unbound method on a
stand-in trainer: a real ``GRPOConfig`` as ``args``, the attributes ``GRPOTrainer.__init__``
derives from it, TRL's own ``get_high_entropy_mask``, ``get_off_policy_mask``,
``get_gamma_weights`` and ``_get_per_token_logps_and_entropies``, a one-process accelerator,
and a stand-in model whose forward returns the test's log-probs and entropies (float64
leaves, so that autograd gives TRL's gradient wrt them). Compared in float64: the loss, its
gradient wrt the log-probs (and the entropies, for the entropy bonus) and the metrics TRL logs.

The mapping under test (``ours_kwargs``) is the table "From TRL" of
docs/policy-optimisation.md, row by row. The one piece not called live: the vLLM
importance-sampling ratio, which TRL computes inside its generation step
(``_generate_and_score_completions``, not callable alone): it comes from the float64 port
``_references.trl_vllm_is_ratio`` and enters TRL's loss as TRL's ``inputs`` would carry it.
"""

import contextlib
import inspect
import re
import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import trl_vllm_is_ratio

from kldiv_jax import policy_loss

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
GRPOConfig = trl.GRPOConfig
GRPOTrainer = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer

B, T, PROMPT = 4, 6, 2
MAX_COMPLETION_LENGTH = 8


class _Accelerator:
  """One process: gathers and reductions are the identity."""

  num_processes = 1
  is_main_process = True
  sync_gradients = True

  def pad_across_processes(self, x, dim=0, pad_index=0):
    return x

  def gather(self, x):
    return x

  gather_for_metrics = gather

  def reduce(self, x, reduction="sum"):
    return x

  def autocast(self):
    return contextlib.nullcontext()


class _Model:
  """The stand-in policy: its forward returns the given log-probs and entropies (the prompt's
  positions zero), as TRL's ``fused_lm_head=True`` forward does."""

  training = True

  def __init__(self, log_probs, entropy):
    pad = torch.zeros(log_probs.shape[0], PROMPT, dtype=torch.float64)
    self.log_probs = torch.cat([pad, log_probs], 1)
    self.entropy = torch.cat([pad, entropy], 1)

  def __call__(self, **inputs):
    assert inputs["fused_lm_head"] and inputs["input_ids"].shape[1] == PROMPT + T
    return types.SimpleNamespace(log_probs=self.log_probs, entropy=self.entropy)


class _Trainer:
  """What ``GRPOTrainer._compute_loss`` reads of its trainer, set as ``GRPOTrainer.__init__`` sets it."""

  _compute_loss = GRPOTrainer._compute_loss
  _get_per_token_logps_and_entropies = GRPOTrainer._get_per_token_logps_and_entropies
  get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask
  get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
  get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)

  def __init__(self, args, model, use_vllm):
    self.args, self.model, self.accelerator = args, model, _Accelerator()
    self.state = types.SimpleNamespace(global_step=0)
    self.loss_type, self.beta = args.loss_type, args.beta
    self.importance_sampling_level = args.importance_sampling_level
    self.off_policy_mask_threshold = args.off_policy_mask_threshold
    self.top_entropy_quantile = args.top_entropy_quantile
    self.epsilon_low = args.epsilon
    self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    self.max_completion_length = args.max_completion_length
    self.use_vllm = use_vllm
    self.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    self.entropy_coef, self.use_adaptive_entropy = args.entropy_coef, args.use_adaptive_entropy
    self._entropy_bonus_enabled = self.entropy_coef != 0.0 or self.use_adaptive_entropy
    self._last_world_entropy, self._entropy_window_stats = float("inf"), None
    self.aux_loss_enabled = False
    self.current_gradient_accumulation_steps = 1
    self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}


def batch(rng, empty_row=True):
  """Float64 log-probs of 4 completions of up to 6 tokens (row 2 empty: a fully truncated
  completion, which TRL's "grpo" counts and "bnpo" does not), both advantage signs."""
  logp = np.log(rng.uniform(0.05, 0.95, (B, T)))
  old = np.minimum(logp + 0.3 * rng.normal(size=(B, T)), -0.01)
  sampling = np.minimum(old + 0.2 * rng.normal(size=(B, T)), -0.01)  # an inference engine's
  ref = logp + 0.3 * rng.normal(size=(B, T))
  # Entropies representable in float32: TRL takes their quantile in float32.
  entropy = rng.uniform(0.0, 2.0, (B, T)).astype(np.float32).astype(np.float64)
  adv = np.array([1.0, -0.6, 0.7, -1.3])
  mask = np.ones((B, T))
  mask[1, 4:] = 0
  mask[3, 2:] = 0
  if empty_row:
    mask[2, :] = 0
  return dict(logp=logp, old=old, sampling=sampling, ref=ref, entropy=entropy, adv=adv, mask=mask)


NUM_ITEMS = 3.0  # num_items_in_batch as a multiple of this micro-batch's tokens


def trl(data, on_policy=False, use_vllm=False, accumulation=1, tool_mask=None, **config):
  """TRL's ``_compute_loss``: ``(loss, d/d log_probs, d/d entropy, logged metrics)``."""
  args = GRPOConfig(
    output_dir="/tmp/kldiv_jax-trl", report_to=[], use_cpu=True,
    max_completion_length=MAX_COMPLETION_LENGTH, **config,
  )  # fmt: skip
  t = lambda a: torch.tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731
  logp, entropy = t(data["logp"]).requires_grad_(True), t(data["entropy"]).requires_grad_(True)
  mask = torch.tensor(data["mask"], dtype=torch.long)
  inputs = {
    "prompt_ids": torch.ones(B, PROMPT, dtype=torch.long),
    "prompt_mask": torch.ones(B, PROMPT, dtype=torch.long),
    "completion_ids": torch.ones(B, T, dtype=torch.long),
    "completion_mask": mask,
    "advantages": t(data["adv"]),
    "num_items_in_batch": t(NUM_ITEMS * data["mask"].sum()),
  }
  if tool_mask is not None:  # TRL's loss mask: completion_mask * tool_mask
    inputs["tool_mask"] = torch.tensor(tool_mask, dtype=torch.long)
  if not on_policy:
    inputs["old_per_token_logps"] = t(data["old"])
  if args.beta != 0.0:
    inputs["ref_per_token_logps"] = t(data["ref"])
  if use_vllm:
    inputs["sampling_per_token_logps"] = t(data["sampling"])
    if args.vllm_importance_sampling_correction:
      ratio = trl_vllm_is_ratio(
        data["old"], data["sampling"], data["mask"], args.vllm_importance_sampling_mode,
        args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max,
      )  # fmt: skip
      inputs["importance_sampling_ratio"] = t(ratio)
  trainer = _Trainer(args, _Model(logp, entropy), use_vllm)
  trainer.current_gradient_accumulation_steps = accumulation
  loss = trainer._compute_loss(trainer.model, inputs)
  loss.backward()
  metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
  grad_entropy = np.zeros((B, T)) if entropy.grad is None else entropy.grad.numpy()
  return loss.item(), logp.grad.numpy(), grad_entropy, metrics


def _f32(*values):
  """TRL's ``torch.where(advantages > 0, pos, neg)`` of two Python floats is float32 (torch's
  default dtype): its SAPO temperatures and VESPO's k and lambda are rounded to float32 (a
  relative 1e-8 at most); the same numbers here, so that float64 agrees to 1e-12."""
  return tuple(float(np.float32(v)) for v in values)


def ours_kwargs(data, on_policy=False, use_vllm=False, **config):
  """The table "From TRL" of docs/policy-optimisation.md: a GRPOConfig as policy_loss keywords."""
  c = GRPOConfig(output_dir="/tmp/kldiv_jax-trl", report_to=[], use_cpu=True,
                 max_completion_length=MAX_COMPLETION_LENGTH, **config)  # fmt: skip
  eps_high = c.epsilon if c.epsilon_high is None else c.epsilon_high
  sequence = c.importance_sampling_level == "sequence"
  kw = {}
  if c.loss_type == "cispo":
    kw |= dict(surrogate="cispo-cap", ratio_cap=eps_high)
  elif c.loss_type == "sapo":
    kw |= dict(
      surrogate="sapo", sapo_temperatures=_f32(c.sapo_temperature_pos, c.sapo_temperature_neg)
    )
  elif c.loss_type == "vespo":
    kw |= dict(surrogate="vespo", vespo_gamma=_f32(
      c.vespo_k_pos, c.vespo_lambda_pos, c.vespo_k_neg, c.vespo_lambda_neg))  # fmt: skip
  else:  # grpo, bnpo, dr_grpo, dapo, luspo
    kw |= dict(surrogate="gspo" if sequence else "ppo", clip_low=c.epsilon, clip_high=eps_high,
               ratio_cap=c.delta)  # fmt: skip
  rows, tokens = data["mask"].shape[0], data["mask"].sum()
  kw |= {
    "grpo": dict(aggregation="seq-mean-token-mean", normalizer=rows),
    "sapo": dict(aggregation="seq-mean-token-mean", normalizer=rows),
    "bnpo": dict(aggregation="token-mean"),
    "dr_grpo": dict(aggregation="seq-mean-token-sum-norm",
                    normalizer=rows * c.max_completion_length),
    "dapo": dict(aggregation="token-mean", normalizer=NUM_ITEMS * tokens),  # num_items_in_batch
    "cispo": dict(aggregation="token-mean", normalizer=NUM_ITEMS * tokens),
    "vespo": dict(aggregation="token-mean", normalizer=NUM_ITEMS * tokens),
    "luspo": dict(aggregation="seq-mean-token-sum", normalizer=rows),
  }[c.loss_type]  # fmt: skip
  if c.beta != 0.0:
    kw |= dict(ref_log_probs=data["ref"], beta=c.beta, kl_estimator="k3",
               kl_importance_weighted=c.use_bias_correction_kl)  # fmt: skip
  if use_vllm and c.vllm_importance_sampling_correction:
    kw |= dict(rollout_log_probs=data["sampling"], rollout_correction=c.vllm_importance_sampling_mode,
               rollout_bounds=(c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max))  # fmt: skip
  elif use_vllm and c.off_policy_mask_threshold is not None:
    kw |= dict(rollout_log_probs=data["sampling"], rollout_correction="token_truncate",
               rollout_bounds=(1.0, 1.0))  # the sampling log-probs for the mask, weights of 1  # fmt: skip
  if c.off_policy_mask_threshold is not None:
    kw["off_policy_threshold"] = c.off_policy_mask_threshold
  if c.top_entropy_quantile < 1.0:
    kw["top_entropy_fraction"] = c.top_entropy_quantile
  if on_policy:
    kw["old_log_probs"] = None
  return kw


def ours(data, entropy_coef=0.0, **kw):
  """policy_loss in float64: ``(loss, d/d log_probs, d/d entropy, metrics)``."""
  old = kw.pop("old_log_probs", data["old"])
  with jax.enable_x64(True):

    def f(logp, entropy):
      return policy_loss(logp, old, data["adv"], where=data["mask"] > 0, entropy=entropy,
                         entropy_coef=entropy_coef, **kw)  # fmt: skip

    (loss, metrics), grads = jax.value_and_grad(f, (0, 1), has_aux=True)(
      jnp.asarray(data["logp"]), jnp.asarray(data["entropy"])
    )
    metrics = jax.tree.map(float, metrics)
  return float(loss), np.asarray(grads[0]), np.asarray(grads[1]), metrics


def assert_close(got, want, err_msg=""):
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14, err_msg=err_msg)


def assert_metric(got, want, err_msg=""):
  """TRL counts the clipped tokens in float32 (``.float()``): float32's precision."""
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=err_msg)


def check(data, config, on_policy=False, use_vllm=False):
  """Loss, gradient and metrics of our mapping of ``config`` equal TRL's; TRL's metrics."""
  want_loss, want_grad, _, logged = trl(data, on_policy, use_vllm, **config)
  kw = ours_kwargs(data, on_policy, use_vllm, **config)
  loss, grad, _, m = ours(data, **kw)
  assert_close(loss, want_loss, "loss")
  assert_close(grad, want_grad, "gradient wrt log_probs")
  check_metrics(m, logged, data, config)
  return m, logged


def check_metrics(m, logged, data, config):
  """TRL's logged metrics from PolicyMetrics, as docs/policy-optimisation.md says."""
  rows = data["mask"].shape[0]
  per_row = m.sequences / rows  # TRL's sequence-level means are over every row
  assert_metric(m.entropy, logged["entropy"], "entropy")
  if config.get("beta", 0.0) != 0.0:
    assert_metric(m.kl, logged["kl"], "kl")
  loss_type = config.get("loss_type", "dapo")
  if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
    if config.get("importance_sampling_level") == "sequence":
      low, high = m.clip_low_seq * per_row, m.clip_high_seq * per_row
    else:
      low, high = m.clip_low, m.clip_high
    assert_metric(low, logged["clip_ratio/low_mean"], "clip_ratio/low_mean")
    assert_metric(high, logged["clip_ratio/high_mean"], "clip_ratio/high_mean")
    assert_metric(low + high, logged["clip_ratio/region_mean"], "clip_ratio/region_mean")
    assert_metric(m.clip_low_seq_min, logged["clip_ratio/low_min"], "clip_ratio/low_min")
    assert_metric(m.clip_high_seq_max, logged["clip_ratio/high_max"], "clip_ratio/high_max")
  elif loss_type == "cispo":
    assert_metric(m.clip_high, logged["cispo_clip_ratio"], "cispo_clip_ratio")
  elif loss_type == "vespo":  # TRL's mean over every row, an empty one with phi(1) = 1
    phi = (m.vespo_phi_seq * m.sequences + (rows - m.sequences)) / rows
    assert_metric(phi, logged["vespo/phi_seq_mean"], "vespo/phi_seq_mean")


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


def test_every_loss_type_is_covered():
  """The loss types the installed TRL lists (its GRPOConfig help) are exactly the ones tested."""
  help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
  listed = re.search(r"Supported values are (.*?)\. ", help_text).group(1)
  assert set(re.findall(r"'(\w+)'", listed)) == set(LOSS_TYPES)


CONFIGS = {
  **{lt: dict(loss_type=lt) for lt in LOSS_TYPES},
  "grpo clip-higher": dict(loss_type="grpo", epsilon=0.2, epsilon_high=0.28),
  # delta above 1 + epsilon_high (INTELLECT-2's 4 with 0.28): TRL flags its clip metric on
  # min(r, delta), equal to ours on r there (a delta below 1 + epsilon_high: never flagged).
  "dapo delta": dict(loss_type="dapo", epsilon_high=0.28, delta=1.5),
  "cispo epsilon_high": dict(loss_type="cispo", epsilon_high=1.1),
  "sapo temperatures": dict(loss_type="sapo", sapo_temperature_pos=0.7, sapo_temperature_neg=1.5),
  "vespo gamma": dict(
    loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.0, vespo_k_neg=4.0, vespo_lambda_neg=0.5
  ),
  "dr_grpo epsilon": dict(loss_type="dr_grpo", epsilon=0.1),
  "luspo token level": dict(loss_type="luspo"),
}
# importance_sampling_level="sequence" (GSPO) for the clipped loss types (TRL's cispo and sapo
# at sequence level have no kldiv_jax surrogate; vespo ignores the level).
CONFIGS |= {
  f"{lt} sequence": dict(loss_type=lt, importance_sampling_level="sequence")
  for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_type(rng, name):
  """Each loss_type and its clip/ratio options: value, gradient and clip metrics."""
  check(batch(rng), CONFIGS[name])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "vespo"])
def test_on_policy(rng, loss_type):
  """No old_per_token_logps (num_iterations 1): TRL's per_token_logps.detach(), ours None."""
  check(batch(rng), dict(loss_type=loss_type), on_policy=True)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type, level", [("grpo", "token"), ("grpo", "sequence"),
                                              ("luspo", "sequence"), ("dapo", "token"),
                                              ("sapo", "token"), ("vespo", "token")])  # fmt: skip
def test_kl_penalty(rng, loss_type, level, bias_correction):
  """beta with TRL's k3 KL, use_bias_correction_kl (TRL 1.16's default True) on and off;
  luspo with beta (its [B, T] KL aggregated as the surrogate since TRL 1.16)."""
  config = dict(loss_type=loss_type, beta=0.04, use_bias_correction_kl=bias_correction,
                importance_sampling_level=level)  # fmt: skip
  check(batch(rng), config)


IS_CASES = [
  ("dapo", "token_truncate", None, 3.0),
  ("dapo", "token_mask", 0.8, 1.25),
  ("grpo", "sequence_truncate", 0.5, 2.0),
  ("grpo", "sequence_mask", None, 3.0),  # TRL's defaults
  ("bnpo", "sequence_mask", 0.5, 1.5),
  ("vespo", "token_truncate", None, 3.0),
  ("vespo", "token_mask", 0.8, 1.25),  # a masked token: log 1e-8 in VESPO's weight
]


@pytest.mark.parametrize("loss_type, mode, clip_min, clip_max", IS_CASES)
def test_vllm_importance_sampling(rng, loss_type, mode, clip_min, clip_max):
  """use_vllm with vllm_importance_sampling_correction, each mode and bounds; VESPO takes the
  token modes into its sequence weight."""
  config = dict(loss_type=loss_type, vllm_importance_sampling_mode=mode,
                vllm_importance_sampling_clip_min=clip_min,
                vllm_importance_sampling_clip_max=clip_max)  # fmt: skip
  check(batch(rng), config, use_vllm=True)


OFF_POLICY = [
  ("grpo", False, True),
  ("dapo", False, True),
  ("vespo", False, True),
  ("grpo", True, True),  # vLLM: the sampling log-probs, with the IS correction
  ("dapo", True, False),  # vLLM's log-probs, no IS correction
  ("luspo", False, True),
]


@pytest.mark.parametrize("loss_type, use_vllm, correction", OFF_POLICY)
@pytest.mark.parametrize("threshold", [0.0, 0.05])
def test_off_policy_mask(rng, loss_type, use_vllm, correction, threshold):
  """off_policy_mask_threshold: the negative-advantage sequences far from the sampling policy
  dropped (some are, at these thresholds), the denominators kept."""
  data = batch(rng)
  config = dict(loss_type=loss_type, off_policy_mask_threshold=threshold,
                vllm_importance_sampling_correction=correction)  # fmt: skip
  if loss_type == "luspo":
    config["importance_sampling_level"] = "sequence"
  check(data, config, use_vllm=use_vllm)
  without = ours(
    data, **ours_kwargs(data, False, use_vllm, **config | {"off_policy_mask_threshold": None})
  )
  with_mask = ours(data, **ours_kwargs(data, False, use_vllm, **config))
  assert with_mask[0] != without[0]  # the mask dropped a sequence


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.85])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "vespo", "sapo"])
def test_top_entropy_quantile(rng, loss_type, quantile):
  """top_entropy_quantile: the surrogate of the highest-entropy tokens only, TRL's
  denominators (the counted tokens, not the kept ones), the KL on every token."""
  data = batch(rng)
  check(data, dict(loss_type=loss_type, top_entropy_quantile=quantile, beta=0.02))


def _token_mean(x, keep):
  return (x * keep).sum() / max(keep.sum(), 1.0)


@pytest.mark.parametrize("loss_type, quantile", [("bnpo", 1.0), ("grpo", 1.0), ("dapo", 0.5),
                                                 ("grpo", 0.5)])  # fmt: skip
def test_entropy_bonus(rng, loss_type, quantile):
  """entropy_coef: TRL subtracts coef times the token mean of the entropy over the tokens the
  surrogate trains on, whatever the loss_type (and logs the loss before it as policy_loss). Equal to policy_loss's entropy_coef for
  "bnpo" (the same token mean); otherwise policy_loss without it, minus that mean."""
  data = batch(rng)
  config = dict(loss_type=loss_type, entropy_coef=0.05, top_entropy_quantile=quantile)
  want_loss, want_grad, want_grad_h, logged = trl(data, **config)
  kw = ours_kwargs(data, **config)
  # TRL's logged policy_loss: the loss before the bonus, policy_loss without entropy_coef.
  assert_close(ours(data, **kw)[0], logged["policy_loss"], "policy_loss")
  if loss_type == "bnpo":
    loss, grad, grad_h, _ = ours(data, entropy_coef=0.05, **kw)
  else:  # the documented recipe: the bonus as its own token mean
    loss, grad, grad_h, _ = ours(data, **kw)
    keep = data["mask"]
    if quantile < 1.0:
      h = data["entropy"][data["mask"] > 0]
      keep = keep * (data["entropy"] >= np.quantile(h, 1 - quantile))
    loss -= 0.05 * _token_mean(data["entropy"], keep)
    grad_h = grad_h - 0.05 * keep / max(keep.sum(), 1.0)
  assert_close(loss, want_loss, "loss")
  assert_close(grad, want_grad, "gradient wrt log_probs")
  assert_close(grad_h, want_grad_h, "gradient wrt entropy")


def test_mask_truncated_completions(rng):
  """mask_truncated_completions is TRL's completion mask with the truncated rows zeroed (in
  its generation step): the same where= for policy_loss; "grpo" still counts the rows."""
  data = batch(rng, empty_row=False)
  truncated = np.array([False, True, False, False])
  data["mask"] = data["mask"] * ~truncated[:, None]
  check(data, dict(loss_type="grpo"))


def test_sequence_level_metrics_without_empty_rows(rng):
  """GSPO's clip fractions per sequence: TRL's over every row equal ours over the sequences
  when no row is empty (no factor needed)."""
  data = batch(rng, empty_row=False)
  config = dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05)
  m, logged = check(data, config)
  assert m.sequences == B
  assert_metric(m.clip_low_seq, logged["clip_ratio/low_mean"])
  assert_metric(m.clip_high_seq, logged["clip_ratio/high_mean"])
  assert logged["clip_ratio/low_mean"] + logged["clip_ratio/high_mean"] > 0  # some clipped


def test_tool_mask(rng):
  """A multi-turn tool_mask: TRL's loss mask completion_mask * tool_mask is the where= mask."""
  data = batch(rng)
  tool_mask = np.ones((B, T))
  tool_mask[0, 2:4] = 0  # tokens a tool wrote
  want_loss, want_grad, _, _ = trl(data, tool_mask=tool_mask, loss_type="grpo", beta=0.04)
  masked = data | {"mask": data["mask"] * tool_mask}
  loss, grad, _, _ = ours(masked, **ours_kwargs(masked, loss_type="grpo", beta=0.04))
  assert_close(loss, want_loss)
  assert_close(grad, want_grad)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "vespo", "dr_grpo"])
def test_gradient_accumulation(rng, loss_type):
  """In training TRL divides "grpo" (and "bnpo", "dr_grpo", "sapo", "luspo") by the
  accumulation steps, and scales "dapo"'s (and "cispo"'s, "vespo"'s) num_items_in_batch by
  gradient_accumulation_steps / steps_per_generation: the normalizer times the same."""
  data = batch(rng)
  steps, generation = 2, 4
  config = dict(loss_type=loss_type, steps_per_generation=generation)
  want_loss, want_grad, _, _ = trl(data, accumulation=steps, **config)
  kw = ours_kwargs(data, **config)
  if loss_type in ("dapo", "vespo"):
    kw["normalizer"] = kw["normalizer"] * steps / generation
  else:
    kw["normalizer"] = kw["normalizer"] * steps
  loss, grad, _, _ = ours(data, **kw)
  assert_close(loss, want_loss)
  assert_close(grad, want_grad)


# What TRL's _compute_loss reads of its config and trainer: each a row of the table (tested
# above) or not a loss option of policy_loss (the reason given).
READ_AND_TESTED = {
  "delta", "sapo_temperature_neg", "sapo_temperature_pos", "steps_per_generation",
  "use_bias_correction_kl", "vespo_k_neg", "vespo_k_pos", "vespo_lambda_neg", "vespo_lambda_pos",
  "beta", "current_gradient_accumulation_steps", "entropy_coef", "epsilon_high", "epsilon_low",
  "importance_sampling_level", "loss_type", "max_completion_length", "off_policy_mask_threshold",
  "top_entropy_quantile", "use_vllm", "vllm_importance_sampling_correction",
}  # fmt: skip
NOT_LOSS_OPTIONS = {
  # the adaptive entropy controller: it sets entropy_coef between steps
  "use_adaptive_entropy", "entropy_coef_delta", "entropy_coef_max", "entropy_coef_min",
  "entropy_target", "_entropy_bonus_enabled", "_entropy_window_stats", "_last_world_entropy",
  # the MoE router's auxiliary loss, the model's own
  "aux_loss_enabled", "router_aux_loss_coef",
  # the trainer's machinery (the stand-ins above)
  "_get_per_token_logps_and_entropies", "_metrics", "accelerator", "model",
  "get_gamma_weights", "get_high_entropy_mask", "get_off_policy_mask",
}  # fmt: skip


def test_every_option_compute_loss_reads_is_accounted_for():
  """A TRL release that reads a new option in its loss fails here until the table has it."""
  source = inspect.getsource(GRPOTrainer._compute_loss)
  read = set(re.findall(r"self\.args\.(\w+)", source)) | set(re.findall(r"self\.(\w+)", source))
  assert read - {"args"} == READ_AND_TESTED | NOT_LOSS_OPTIONS
