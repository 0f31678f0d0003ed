"""kldiv_jax inside Tunix: the glue of docs/tunix.md, checked against Tunix's own losses.

Runs where google-tunix is installed (``make integration``), skipped elsewhere. The glue is
the page's code, run here block by block, so the page and the test cannot drift apart; the
expected values are Tunix's own (its ``"grpo"`` policy loss, its ``LogitStrategy``), called
the way Tunix's learner and trainer call them, on Tunix's own data structures.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kldiv_jax

# Tunix and its own dependency flax: skipped where the integration environment is not.
nnx = pytest.importorskip("flax.nnx")
distillation_trainer = pytest.importorskip("tunix.distillation.distillation_trainer")
logit = pytest.importorskip("tunix.distillation.strategies.logit")
algo_core = pytest.importorskip("tunix.rl.algo_core")
common = pytest.importorskip("tunix.rl.common")
function_registry = pytest.importorskip("tunix.rl.function_registry")
rl_trainer = pytest.importorskip("tunix.rl.trainer")
GRPOConfig = pytest.importorskip("tunix.rl.grpo.grpo_learner").GRPOConfig
peft_trainer = pytest.importorskip("tunix.sft.peft_trainer")

PAGE = Path(__file__).resolve().parent.parent / "docs" / "tunix.md"
PAD, EOS, VOCAB = 0, 1, 11


@pytest.fixture(scope="module")
def glue():
  """The page's code blocks, run in order in one namespace (the illustrations left out)."""
  blocks = re.findall(r"(<!-- skip: next -->\n)?```python\n(.*?)```", PAGE.read_text(), re.S)
  namespace = {"__name__": "docs_tunix"}
  for illustration, code in blocks:
    if not illustration:
      exec(compile(code, str(PAGE), "exec"), namespace)
  assert {"kldiv_jax_policy_loss", "PolicyLossConfig", "KLDivStrategy"} <= set(namespace)
  return namespace


class TinyLM(nnx.Module):
  """A causal toy LM with Tunix's model interface: ``(logits, cache) = model(tokens, ...)``."""

  def __init__(self, seed=0, vocab=VOCAB, hidden=8):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(vocab, hidden, rngs=rngs)
    self.head = nnx.Linear(hidden, vocab, rngs=rngs)

  def __call__(self, tokens, positions=None, cache=None, attention_mask=None):
    h = jnp.cumsum(self.embed(tokens), axis=1) / jnp.arange(1, tokens.shape[1] + 1)[None, :, None]
    return 3.0 * self.head(jnp.tanh(h)), cache


def _example(model, *, seed=0, per_token_advantages=False, packed=False):
  """A Tunix TrainExample: old and reference log-probs off the model's, so ratios clip."""
  rng = np.random.default_rng(seed)
  if packed:  # one row, three sequences and padding, as tunix.rl.utils.pack_sequences lays it
    lengths, total = [5, 7, 4], 20
    segment_ids = np.zeros((1, total), np.int32)
    positions = np.zeros((1, total), np.int32)
    start = 0
    for i, n in enumerate(lengths, start=1):
      segment_ids[0, start : start + n], positions[0, start : start + n] = i, np.arange(n)
      start += n
    completion = np.where(segment_ids > 0, rng.integers(2, VOCAB, (1, total)), PAD)
    mask = (segment_ids > 0) & (positions >= 2)  # the first two tokens: the prompt
    prompt = np.zeros((1, 0), np.int32)
    advantages = np.where(mask, rng.normal(size=(1, total)), 0.0)
    extra = {"segment_ids": jnp.asarray(segment_ids), "segment_positions": jnp.asarray(positions)}
  else:
    batch, length = 5, 7
    prompt = rng.integers(2, VOCAB, (batch, 4))
    prompt[:, 0] = PAD  # left padding
    lengths = np.array([7, 3, 0, 5, 1])  # an empty completion too
    mask = np.arange(length) < lengths[:, None]
    completion = np.where(mask, rng.integers(2, VOCAB, (batch, length)), PAD)
    shape = (batch, length) if per_token_advantages else (batch,)
    advantages = rng.normal(size=shape)
    extra = {}
  graphdef, state = nnx.split(model)
  logp = common.compute_per_token_logps(
    graphdef, state, jnp.asarray(prompt), jnp.asarray(completion), PAD, EOS, **extra
  )
  old = logp + 0.7 * rng.normal(size=logp.shape)
  ref = logp + 0.4 * rng.normal(size=logp.shape)
  return common.TrainExample(
    prompt_ids=jnp.asarray(prompt),
    prompt_mask=jnp.asarray(prompt != PAD),
    completion_ids=jnp.asarray(completion),
    completion_mask=jnp.asarray(mask, jnp.int32),
    advantages=jnp.asarray(advantages, jnp.float32),
    ref_per_token_logps=jnp.asarray(ref, jnp.float32),
    old_per_token_logps=jnp.asarray(old, jnp.float32),
    **extra,
  )


def _config(cls, **options):
  temperature = options.pop("temperature", 0.8)
  extra = {k: options.pop(k) for k in ("epsilon_high", "epsilon_c") if k in options}
  config = cls(num_generations=2, **options)
  config.temperature = temperature  # what GRPOLearner sets from the rollout configuration
  for k, v in extra.items():
    setattr(config, k, v)
  return config


def _learner_call(name, model, example, config):
  """Value and gradient of the registered loss, called as GRPOLearner's loss_fn calls it."""
  policy_loss_fn = function_registry.get_policy_loss_fn(name)
  loss_fn = lambda model, train_example, algo_config: policy_loss_fn(  # noqa: E731
    model, train_example, algo_config=config, pad_id=PAD, eos_id=EOS
  )
  return nnx.value_and_grad(lambda m: loss_fn(m, example, config), has_aux=True)(model)


def _close(actual, expected, rtol=2e-5, atol=1e-6):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def _grads_close(actual, expected):
  jax.tree.map(_close, nnx.to_pure_dict(actual), nnx.to_pure_dict(expected))


@pytest.mark.parametrize(
  ("loss_agg_mode", "kl_loss_mode", "loss_algo", "options"),
  [
    ("token-mean", "kl", "grpo", {"epsilon_high": 0.28, "epsilon_c": 1.2}),
    ("sequence-mean-token-mean", "low_var_kl", "grpo", {}),
    ("seq-mean-token-sum", "mse_kl", "grpo", {"epsilon_c": 1.2}),
    ("sequence-mean-token-sum-norm", "low_var_kl", "grpo", {}),
    ("sequence-mean-token-scale", "kl", "grpo", {"epsilon_high": 0.3}),
    ("token-mean", "low_var_kl", "gspo-token", {}),
  ],
)
def test_registered_loss_equals_tunix_grpo_and_policy_loss(
  glue, loss_agg_mode, kl_loss_mode, loss_algo, options
):
  model = TinyLM()
  example = _example(model, per_token_advantages=loss_algo == "grpo" and bool(options))
  kwargs = dict(beta=0.04, kl_loss_mode=kl_loss_mode, loss_agg_mode=loss_agg_mode)
  kwargs |= dict(loss_algo=loss_algo, epsilon=0.2, **options)
  (loss, aux), grads = _learner_call(
    "kldiv_jax", model, example, _config(glue["PolicyLossConfig"], **kwargs)
  )
  (t_loss, t_aux), t_grads = _learner_call("grpo", model, example, _config(GRPOConfig, **kwargs))
  assert abs(float(loss)) > 1e-3
  _close(loss, t_loss)
  _grads_close(grads, t_grads)
  for key in (
    "pg_loss",
    "pg_clipfrac",
    "ppo_kl",
    "kl",
    "is_ratio/mean",
    "is_ratio/max",
    "is_ratio/min",
  ):
    _close(aux[key], t_aux[key])
  if loss_agg_mode == "token-mean":
    _close(aux["pg_clipfrac_lower"], t_aux["pg_clipfrac_lower"])
    _close(aux["entropy"], t_aux["entropy"])
  if loss_algo == "grpo":
    assert float(aux["pg_clipfrac"]) > 0  # the clip is exercised
  if "epsilon_c" in options:
    assert float(aux["pg_clipfrac_lower"]) > 0  # and the dual clip

  # policy_loss itself, from log-probs of the model's logits computed here.
  logits, _ = model(jnp.concatenate([example.prompt_ids, example.completion_ids], axis=1))
  length = example.completion_ids.shape[1]
  logits = logits[:, -length - 1 : -1] / 0.8
  logp = jnp.take_along_axis(
    jax.nn.log_softmax(logits), example.completion_ids[..., None], axis=-1
  )[..., 0]
  mask = example.completion_mask.astype(bool)
  sequences = int(mask.any(-1).sum())
  expected, _ = kldiv_jax.policy_loss(
    logp,
    example.old_per_token_logps,
    example.advantages,
    surrogate={"grpo": "ppo"}.get(loss_algo, loss_algo),
    clip_low=0.2,
    clip_high=options.get("epsilon_high", 0.2),
    dual_clip=options.get("epsilon_c"),
    aggregation=glue["AGGREGATIONS"][loss_agg_mode],
    normalizer=sequences * length if loss_agg_mode == "sequence-mean-token-scale" else None,
    where=mask,
    ref_log_probs=example.ref_per_token_logps,
    beta=0.04,
    kl_estimator={"kl": "k1", "mse_kl": "k2", "low_var_kl": "k3"}[kl_loss_mode],
  )
  _close(loss, expected)


def test_policy_loss_options_reach_policy_loss(glue):
  """A surrogate Tunix lacks (verl's CISPO) and an entropy bonus, through the configuration."""
  model = TinyLM(seed=1)
  example = _example(model, seed=1)
  config = _config(
    glue["PolicyLossConfig"], beta=0.0, loss_agg_mode="token-mean", epsilon=0.2,
    surrogate="cispo", policy_loss_options={"clip_high": 4.0, "entropy_coef": 0.01},
  )  # fmt: skip
  (loss, _), _ = _learner_call("kldiv_jax", model, example, config)
  graphdef, state = nnx.split(model)
  logp, logits = common.compute_per_token_logps(
    graphdef, state, example.prompt_ids, example.completion_ids, PAD, EOS,
    return_logits=True, temperature=0.8,
  )  # fmt: skip
  entropy = algo_core.compute_entropy_from_logits(logits)
  expected, _ = kldiv_jax.policy_loss(
    logp, example.old_per_token_logps, example.advantages, surrogate="cispo", clip_low=0.2,
    clip_high=4.0, where=example.completion_mask.astype(bool), entropy=entropy,
    entropy_coef=0.01,
  )  # fmt: skip
  _close(loss, expected)
  t_loss, _ = function_registry.get_policy_loss_fn("grpo")(
    model, example, algo_config=_config(GRPOConfig, beta=0.0, loss_agg_mode="token-mean"),
    pad_id=PAD, eos_id=EOS,
  )  # fmt: skip
  assert abs(float(loss) - float(t_loss)) > 1e-4  # not Tunix's PPO surrogate


def test_sampler_importance_weights(glue):
  """Tunix's precomputed TIS weights equal policy_loss's token_truncate rollout correction."""
  model = TinyLM(seed=2)
  example = _example(model, seed=2)
  rng = np.random.default_rng(3)
  mask = example.completion_mask.astype(bool)
  sampler = example.old_per_token_logps + 0.5 * rng.normal(size=mask.shape)
  # As Tunix's agentic GRPO learner computes them (sampler_is == "token").
  log_ratio = jnp.clip(example.old_per_token_logps - sampler, -20.0, 20.0)
  weights = jnp.minimum(jnp.exp(log_ratio), 1.5) * mask
  example = example.replace(sampler_is_weights=weights)
  kwargs = dict(beta=0.04, loss_agg_mode="sequence-mean-token-mean", epsilon=0.2)
  (loss, _), grads = _learner_call(
    "kldiv_jax", model, example, _config(glue["PolicyLossConfig"], **kwargs)
  )
  (t_loss, _), t_grads = _learner_call("grpo", model, example, _config(GRPOConfig, **kwargs))
  _close(loss, t_loss)
  _grads_close(grads, t_grads)
  graphdef, state = nnx.split(model)
  logp = common.compute_per_token_logps(
    graphdef, state, example.prompt_ids, example.completion_ids, PAD, EOS, temperature=0.8
  )
  expected, _ = kldiv_jax.policy_loss(
    logp, example.old_per_token_logps, example.advantages, where=mask,
    aggregation="seq-mean-token-mean", ref_log_probs=example.ref_per_token_logps, beta=0.04,
    kl_estimator="k1", rollout_log_probs=sampler, rollout_bounds=(None, 1.5),
  )  # fmt: skip
  _close(loss, expected)
  assert float(jnp.max(jnp.where(mask, weights, 0.0))) == 1.5  # the threshold is exercised


def test_packed_rows(glue):
  """Packed rows: per-sequence means here, per-row means (sequences mixed) in Tunix."""
  model = TinyLM(seed=3)
  example = _example(model, seed=3, packed=True)
  graphdef, state = nnx.split(model)
  logp = common.compute_per_token_logps(
    graphdef, state, example.prompt_ids, example.completion_ids, PAD, EOS,
    segment_ids=example.segment_ids, segment_positions=example.segment_positions,
    temperature=0.8,
  )  # fmt: skip
  mask = example.completion_mask.astype(bool)
  for mode, aggregation in [
    ("token-mean", "token-mean"),
    ("sequence-mean-token-mean", "seq-mean-token-mean"),
  ]:
    kwargs = dict(beta=0.04, loss_agg_mode=mode, epsilon=0.2)
    (loss, _), _ = _learner_call(
      "kldiv_jax", model, example, _config(glue["PolicyLossConfig"], **kwargs)
    )
    (t_loss, _), _ = _learner_call("grpo", model, example, _config(GRPOConfig, **kwargs))
    common_args = (logp, example.old_per_token_logps, example.advantages)
    common_kw = dict(
      where=mask,
      aggregation=aggregation,
      ref_log_probs=example.ref_per_token_logps,
      beta=0.04,
      kl_estimator="k1",
    )
    per_sequence, _ = kldiv_jax.policy_loss(
      *common_args, segment_ids=example.segment_ids, **common_kw
    )
    per_row, _ = kldiv_jax.policy_loss(*common_args, **common_kw)
    _close(loss, per_sequence)
    _close(t_loss, per_row)
    if mode == "token-mean":
      _close(loss, t_loss)
    else:
      assert abs(float(loss) - float(t_loss)) > 1e-4


def test_kl_clamp_value_is_refused(glue):
  model = TinyLM()
  config = _config(glue["PolicyLossConfig"], beta=0.04, kl_clamp_value=10.0)
  with pytest.raises(ValueError, match="kl_clip"):
    _learner_call("kldiv_jax", model, _example(model), config)


# Distillation -----------------------------------------------------------------------------


class TinyClassifier(nnx.Module):
  def __init__(self, seed, vocab=VOCAB, hidden=6):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(vocab, hidden, rngs=rngs)
    self.head = nnx.Linear(hidden, vocab, rngs=rngs)

  def __call__(self, tokens):
    return 2.0 * self.head(jnp.tanh(self.embed(tokens)))


def _forward(model, input_tokens, input_mask):
  return model(input_tokens)


def _labels(input_tokens, input_mask):
  return jnp.roll(input_tokens, -1, axis=-1)


def _mask(input_tokens, input_mask):
  return jnp.roll(input_mask.astype(bool), -1, axis=-1).at[:, -1].set(False)


def _distillation_inputs(seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.array([9, 4, 6, 1])
  mask = np.arange(9) < lengths[:, None]
  tokens = np.where(mask, rng.integers(2, VOCAB, (4, 9)), PAD)
  return {"input_tokens": jnp.asarray(tokens), "input_mask": jnp.asarray(mask)}


def test_strategy_is_distillation_loss_with_the_mask(glue):
  student, teacher = TinyClassifier(0), TinyClassifier(1)
  options = dict(temperature=2.0, alpha=0.3)
  strategy = glue["KLDivStrategy"](_forward, _forward, _labels, _mask, **options)
  inputs = _distillation_inputs()
  teacher_output = strategy.get_teacher_outputs(teacher, inputs)
  loss, metrics = strategy.get_train_loss(student, teacher_output, inputs)
  s, t = student(inputs["input_tokens"]), teacher(inputs["input_tokens"])
  labels, mask = _labels(**inputs), _mask(**inputs)
  _close(loss, kldiv_jax.distillation_loss(s, t, labels, where=mask, **options))
  _close(metrics["distill/soft_loss"], kldiv_jax.distillation_loss(s, t, where=mask, **options))

  # Tunix's LogitStrategy: equal with every token kept ...
  tunix = logit.LogitStrategy(_forward, _forward, _labels, **options)
  one_hot = jax.nn.one_hot(labels, VOCAB)
  t_full, _ = tunix.compute_loss(s, t, one_hot)
  ours_full, _ = strategy.compute_loss(s, t, labels)
  _close(ours_full, t_full)
  # ... and with padding, off by exactly the padded tokens' loss, which it averages in.
  pad = ~mask
  t_pad, _ = tunix.compute_loss(s[pad], t[pad], one_hot[pad])
  _close(t_full * mask.size, loss * mask.sum() + t_pad * pad.sum())
  assert abs(float(t_full) - float(loss)) > 1e-3

  eval_loss, _ = strategy.get_eval_loss(student, inputs)
  ce = optax.softmax_cross_entropy_with_integer_labels(s, labels)
  _close(eval_loss, ce[mask].mean())


# Tunix 0.1.7's trainer calls APIs that jax 0.10 and optax 0.2.8 deprecate.
@pytest.mark.filterwarnings("ignore:jax.interpreters.pxla.thread_resources:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated:DeprecationWarning")
def test_distillation_trainer_trains(glue):
  """Two real steps of Tunix's DistillationTrainer with the strategy: the loss goes down."""
  student, teacher = TinyClassifier(0), TinyClassifier(1)
  strategy = glue["KLDivStrategy"](_forward, _forward, _labels, _mask, temperature=2.0)
  config = distillation_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=3)
  trainer = distillation_trainer.DistillationTrainer(
    student, teacher, strategy, optax.sgd(0.5), config
  )
  inputs = _distillation_inputs()
  batch = distillation_trainer.TrainingInput(**inputs)
  before, _ = strategy.get_train_loss(
    student, strategy.get_teacher_outputs(teacher, inputs), inputs
  )
  trainer.train([batch] * 3)
  trainer.close()
  after, _ = strategy.get_train_loss(
    trainer.model, strategy.get_teacher_outputs(teacher, inputs), inputs
  )
  assert float(after) < float(before)


@pytest.mark.filterwarnings("ignore:jax.interpreters.pxla.thread_resources:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated:DeprecationWarning")
def test_grpo_actor_trainer_steps(glue):
  """Two real steps of Tunix's RL actor trainer, wired as GRPOLearner wires it, with the
  registered loss and with Tunix's "grpo": the same parameters after both."""
  example = _example(TinyLM(seed=4), seed=4)
  kwargs = dict(beta=0.04, loss_agg_mode="token-mean", epsilon=0.2, kl_loss_mode="low_var_kl")
  params = {}
  for name, cls in [("kldiv_jax", glue["PolicyLossConfig"]), ("grpo", GRPOConfig)]:
    config = _config(cls, policy_loss_fn=name, **kwargs)
    model = TinyLM(seed=4)
    trainer = rl_trainer.Trainer(
      model,
      optax.sgd(0.3),
      peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=2),
      custom_checkpoint_metadata_fn=dict,
    )
    policy_loss_fn = function_registry.get_policy_loss_fn(config.policy_loss_fn)
    trainer.with_loss_fn(
      lambda model, train_example, algo_config, fn=policy_loss_fn, config=config: fn(
        model, train_example, algo_config=config, pad_id=PAD, eos_id=EOS
      ),
      has_aux=True,
    )
    trainer.with_gen_model_input_fn(
      lambda x, config=config: {"train_example": x, "algo_config": config}
    )
    trainer.with_rl_metrics_to_log({"kl": np.mean, "pg_clipfrac": np.mean})
    trainer.train([example, example])
    trainer.close()
    params[name] = nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))
  jax.tree.map(_close, params["kldiv_jax"], params["grpo"])
  moved = jax.tree.map(
    lambda a, b: float(jnp.max(jnp.abs(a - b))),
    params["grpo"],
    nnx.to_pure_dict(nnx.state(TinyLM(seed=4), nnx.Param)),
  )
  assert max(jax.tree.leaves(moved)) > 1e-3
